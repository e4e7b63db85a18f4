"""tuner.compile_queue: bounded background compiles, hinted configs first, each compiled once."""

from __future__ import annotations

import threading
import time

import pytest
from kato.tuner.compile_queue import CompileQueue


class FakeCompiler:
    """Records the order compiles start and the most running at once; ``gate`` holds every
    compile until it is set; config ``bad`` raises."""

    def __init__(self, gate: bool = False):
        self.started: list[int] = []
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        self.gate = threading.Event()
        if not gate:
            self.gate.set()

    def __call__(self, config):
        with self.lock:
            self.started.append(config["n"])
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.gate.wait(10)
            time.sleep(0.01)
            if config.get("bad"):
                raise ValueError(f"cannot compile {config['n']}")
            return f"cubin-{config['n']}"
        finally:
            with self.lock:
                self.running -= 1


def key(config) -> str:
    return str(config["n"])


def configs(*ns):
    return [{"n": n} for n in ns]


def test_each_config_is_compiled_once_and_taken_from_the_background():
    fake = FakeCompiler()
    queue = CompileQueue(fake, key, workers=3)
    queue.add(configs(*range(12)))
    queue.add(configs(0, 1, 2))  # known already: not queued twice
    assert [queue.take({"n": n}) for n in range(12)] == [f"cubin-{n}" for n in range(12)]
    assert sorted(fake.started) == list(range(12))
    assert 1 <= fake.most <= 3
    assert queue.stats.ahead + queue.stats.inline == 12 and queue.stats.ahead >= 3
    queue.close()


def test_at_most_workers_run_and_hints_start_before_the_bulk():
    fake = FakeCompiler(gate=True)
    queue = CompileQueue(fake, key, workers=2)
    queue.add(configs(0, 1, 2, 3, 4, 5))
    time.sleep(0.05)
    assert sorted(fake.started) == [0, 1]  # two slots, taken from the front
    queue.hint(configs(5, 9))  # 5 is queued, 9 is new: both jump the queue, 5 first
    queue.hint(configs(4))  # the latest hint first
    fake.gate.set()
    deadline = time.monotonic() + 10
    while (queue.pending() or fake.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.most == 2
    assert fake.started == [0, 1, 4, 5, 9, 2, 3]
    assert queue.take({"n": 3}) == "cubin-3" and queue.stats.ahead == 1
    queue.close()


def test_take_compiles_a_queued_config_now_instead_of_queueing_behind_the_others():
    fake = FakeCompiler(gate=True)
    queue = CompileQueue(fake, key, workers=1)
    queue.add(configs(0, 1, 2))
    time.sleep(0.05)
    fake.gate.set()
    assert queue.take({"n": 2}) == "cubin-2"  # not started: compiled in this thread
    assert queue.stats.inline == 1
    assert queue.take({"n": 7}) == "cubin-7"  # never queued: compiled now
    queue.close()
    assert fake.started.count(2) == 1 and fake.started.count(7) == 1


def test_errors_reach_take_and_wait_swallows_them():
    fake = FakeCompiler()
    queue = CompileQueue(fake, key, workers=2)
    queue.add([{"n": 1, "bad": True}, {"n": 2, "bad": True}])
    time.sleep(0.1)
    with pytest.raises(ValueError, match="cannot compile 1"):
        queue.take({"n": 1})
    assert queue.wait({"n": 2}) is True  # started: waited for, its error left to the caller
    assert queue.wait({"n": 3}) is False  # unknown: nothing to wait for
    queue.close()


def test_close_drops_what_has_not_started():
    fake = FakeCompiler(gate=True)
    queue = CompileQueue(fake, key, workers=1)
    queue.add(configs(0, 1, 2, 3))
    time.sleep(0.05)
    assert queue.pending() == 3
    fake.gate.set()
    queue.close()
    assert fake.started == [0] and queue.pending() == 0


def test_is_done_only_once_the_background_compile_has_finished():
    compiler = FakeCompiler(gate=True)
    queue = CompileQueue(compiler, key, workers=1)
    try:
        queue.add(configs(1, 2))
        assert not queue.is_done({"n": 1})  # running, held by the gate
        assert not queue.is_done({"n": 2})  # queued, not started
        assert not queue.is_done({"n": 3})  # unknown
        compiler.gate.set()
        assert queue.take({"n": 1}) == "cubin-1"
        deadline = time.monotonic() + 5
        while not queue.is_done({"n": 2}) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert queue.is_done({"n": 2})
        assert queue.take({"n": 2}) == "cubin-2"
        assert not queue.is_done({"n": 2})  # taken: out of the queue
    finally:
        queue.close()


def test_wait_any_returns_when_one_compile_finishes_and_not_for_unstarted_ones():
    compiler = FakeCompiler(gate=True)
    queue = CompileQueue(compiler, key, workers=1)
    try:
        queue.add(configs(1, 2))  # 1 runs (held by the gate), 2 waits for the worker
        assert queue.wait_any(configs(2, 3)) is False  # neither has started: no wait
        assert queue.wait_any(configs(1, 2), timeout=0.1) is False  # 1 still held
        threading.Timer(0.2, compiler.gate.set).start()
        started = time.monotonic()
        assert queue.wait_any(configs(2, 1), timeout=10) is True
        assert time.monotonic() - started >= 0.15
        assert queue.is_done({"n": 1})
        assert queue.stats.wait_s >= 0.25  # both waits counted
    finally:
        queue.close()


def test_a_stop_event_ends_waits_on_a_running_compile():
    """A cancel (the isolated backend's interrupt event) must not wait for a slow nvcc."""
    compiler = FakeCompiler(gate=True)
    queue = CompileQueue(compiler, key, workers=1)
    stop = threading.Event()
    try:
        queue.add(configs(1))
        deadline = time.monotonic() + 5
        while not compiler.started and time.monotonic() < deadline:
            time.sleep(0.01)  # 1 is compiling (held by the gate)
        threading.Timer(0.2, stop.set).start()
        started = time.monotonic()
        assert queue.wait_any(configs(1), stop=stop) is False
        assert queue.wait(configs(1)[0], stop=stop) is True  # started: waited on, until stop
        assert 0.15 <= time.monotonic() - started < 2
        assert not queue.is_done({"n": 1})
    finally:
        compiler.gate.set()
        queue.close()
