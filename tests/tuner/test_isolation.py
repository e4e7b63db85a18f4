"""Fault isolation with real child processes: planted faults (abort, silent exit, hang, backend
bug, dead CUDA context) in a replay backend measured through IsolatedBackend. The job completes,
the faulty configs are failed trials with their errors, the best valid config wins, and the
worker (this process) carries on."""

from __future__ import annotations

import os
import time

import pytest
from fault_backend import FaultyReplay
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner.backends.base import TrialStatus
from kato.tuner.backends.isolated import (
    BackendSpec,
    ChildStartError,
    IsolatedBackend,
    TrialInterrupted,
)
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.worker import Worker
from paths import RECORDED

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
MODES = ("abort", "exit", "hang", "raise", "poison")
EXPECTED = {
    "abort": (TrialStatus.CRASHED, "SIGABRT"),
    "exit": (TrialStatus.CRASHED, "exit code 3"),
    "hang": (TrialStatus.TIMEOUT, "no result within"),
    "raise": (TrialStatus.CRASHED, "planted backend bug"),
    "poison": (TrialStatus.LAUNCH_ERROR, "illegal memory access"),
}


@pytest.fixture(scope="module")
def replay() -> ReplayBackend:
    return ReplayBackend(RECORDING)


def planted(replay: ReplayBackend) -> dict[str, str]:
    """Faults on the recording's fastest config and four others."""
    space = replay.space()
    best_key = replay.cache.best()[0]
    others = [space.key(c) for c in space.valid_configs() if space.key(c) != best_key]
    return dict(zip([best_key, *others[10:14]], MODES, strict=True))


def faulty_spec(faults: dict[str, str]) -> BackendSpec:
    return BackendSpec(
        kind="fault_backend:make", replay_file=str(RECORDING), options=(("faults", faults),)
    )


def test_each_fault_is_a_failed_result_and_the_child_is_replaced(replay):
    faults = planted(replay)
    backend = IsolatedBackend(faulty_spec(faults), trial_timeout_s=1.5)
    try:
        by_key = {replay.space().key(c): c for c in replay.space().valid_configs()}
        for key, mode in faults.items():
            result = backend.evaluate(by_key[key])
            status, text = EXPECTED[mode]
            assert result.status is status and text in result.error, (mode, result)
            ok = next(c for k, c in by_key.items() if k not in faults)
            after = backend.evaluate(ok)  # the next config runs in a working child
            assert after.ok and after.time_ms == pytest.approx(replay.evaluate(ok).time_ms)
        # abort, exit, hang and the dead context replace the child; a raising backend does not
        assert backend.restarts == 4 and len(set(backend.child_pids)) == 5
        assert backend.space().valid_configs() == replay.space().valid_configs()
        assert backend.device() == replay.device()
    finally:
        backend.close()
    assert all(not p for p in [backend._process])


def test_interrupt_kills_a_running_measurement_at_once(replay):
    config = replay.space().valid_configs()[0]
    backend = IsolatedBackend(faulty_spec({replay.space().key(config): "hang"}))
    try:
        import threading

        threading.Timer(0.3, backend.interrupt).start()
        start = time.monotonic()
        with pytest.raises(TrialInterrupted):
            backend.evaluate(config)  # would hang for the default 60 s
        assert time.monotonic() - start < 3
        with pytest.raises(TrialInterrupted):
            backend.evaluate(config)
    finally:
        backend.close()


def test_a_child_that_cannot_start_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(ChildStartError, match="could not start"):
        IsolatedBackend(BackendSpec(kind="replay", replay_file=str(tmp_path / "missing.json")))


def test_a_job_with_planted_faults_completes_and_finds_the_best_valid_config(tmp_path, replay):
    faults = planted(replay)
    url = f"sqlite:///{tmp_path}/kato.db"
    sessions = session_factory(init_db(url))
    space = replay.space()
    budget = len(space.valid_configs())  # exhaustive: every planted config is measured
    with sessions() as s:
        job_id = queries.create_job(
            s,
            operator="softmax",
            operator_version=get_operator("softmax").version,
            shape=[4096, 4096],
            dtype="float16",
            gpu_model="H200",
            budget_configs=budget,
            strategy="grid",
        ).id
    backends: list[IsolatedBackend] = []

    def factory(job):
        backends.append(IsolatedBackend(faulty_spec(faults), trial_timeout_s=1.5))
        return backends[-1]

    worker = Worker(sessions, url, ["H200"], factory, poll_seconds=0.01)
    outcome = worker.run_once()
    assert outcome is not None and outcome.status == "done", outcome
    assert worker.run_once() is None  # the worker carries on: nothing left to do

    with sessions() as s:
        job = queries.get_job(s, job_id)
        trials = {t.config_key: t for t in queries.job_trials(s, job_id)}
    assert job.status == "done" and job.trials_done == budget == len(trials)
    for key, mode in faults.items():
        status, text = EXPECTED[mode]
        assert trials[key].status == status.value and text in trials[key].error, mode
    healthy = FaultyReplay(str(RECORDING), {})
    best = min(
        (healthy.evaluate(c) for c in space.valid_configs() if space.key(c) not in faults),
        key=lambda r: r.time_ms if r.ok else float("inf"),
    )
    assert job.best_config == best.config and job.best_time_ms == best.time_ms
    assert backends[0].restarts == 4


def slow_spec(**options) -> BackendSpec:
    return BackendSpec(
        kind="fault_backend:make_slow",
        replay_file=str(RECORDING),
        options=tuple(options.items()),
    )


def test_the_child_prepares_after_announcing_its_device_outside_the_trial_limit(replay):
    # The preparation takes 4 s: a device announced after it would come later than that, while a
    # child's start (spawn, imports) leaves a wide margin below it on a loaded machine (1.8 s
    # against a 2 s preparation failed under load).
    started = time.monotonic()
    backend = IsolatedBackend(slow_spec(prepare_s=4.0), trial_timeout_s=1.0)
    try:
        assert time.monotonic() - started < 4.0  # the device is known before the inputs
        assert backend.device() == replay.device()
        config = replay.space().valid_configs()[0]
        result = backend.evaluate(config)  # waits for the preparation, not a trial timeout
        assert result.ok and result.time_ms == pytest.approx(replay.evaluate(config).time_ms)
        assert time.monotonic() - started >= 4.0
        assert backend.restarts == 0
    finally:
        backend.close()


def test_a_child_that_cannot_prepare_fails_the_evaluation_with_its_reason(replay):
    backend = IsolatedBackend(slow_spec(prepare_error="out of device memory for the inputs"))
    try:
        with pytest.raises(ChildStartError, match="out of device memory for the inputs"):
            backend.evaluate(replay.space().valid_configs()[0])
    finally:
        backend.close()


@pytest.mark.parametrize("defer", [False, True])
def test_a_deferred_child_makes_its_inputs_at_once_and_its_device_part_at_its_turn(
    replay, tmp_path, defer
):
    """A worker sharing its GPU among jobs (issue 35): the child builds the host inputs while
    another job measures, and touches the device only when its job's first measurement has
    the GPU; undeferred, it sets everything up at once, as before."""
    log = tmp_path / "prepare.log"
    spec = BackendSpec(
        kind="fault_backend:make_staged", replay_file=str(RECORDING), options=(("log", str(log)),)
    )
    backend = IsolatedBackend(spec, defer_prepare=defer)
    try:
        deadline = time.monotonic() + 60
        want = ["inputs"] if defer else ["device"]
        while time.monotonic() < deadline:
            if log.exists() and [ln.split()[0] for ln in log.read_text().splitlines()] == want:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # a device part that wrongly follows would be logged by now
        assert [ln.split()[0] for ln in log.read_text().splitlines()] == want
        config = replay.space().valid_configs()[0]
        assert backend.evaluate(config).ok
        steps = [ln.split()[0] for ln in log.read_text().splitlines()]
        assert steps == (["inputs", "device"] if defer else ["device"])
    finally:
        backend.close()


def test_a_deferred_child_of_a_backend_without_a_set_up_measures_every_config(replay):
    """``defer_prepare`` on a backend with no ``prepare`` (a replay): the parent's word to set
    up, sent at the first measurement, is not mistaken for a config to measure."""
    backend = IsolatedBackend(
        BackendSpec(kind="replay", replay_file=str(RECORDING)), defer_prepare=True
    )
    try:
        for config in replay.space().valid_configs()[:3]:
            result = backend.evaluate(config)
            assert result.ok, result.error
        assert backend.restarts == 0
    finally:
        backend.close()


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-once"])
def test_the_child_reports_the_devices_memory_before_and_after_its_set_up(replay, tmp_path, defer):
    """A worker holding several jobs reads the device's memory through a job's child right
    before the child's device set-up, then has it set up (``prepare``): the two readings
    differ by what the set-up took; a child that set up at once answers all the same."""
    from kato.tuner.backends.base import DeviceMemory

    spec = BackendSpec(
        kind="fault_backend:make_staged",
        replay_file=str(RECORDING),
        options=(("log", str(tmp_path / "prepare.log")),),
    )
    backend = IsolatedBackend(spec, defer_prepare=defer)
    try:
        before = backend.memory()
        backend.prepare()
        after = backend.memory()
        assert before == DeviceMemory(600 if not defer else 1000, 1000)
        assert after == DeviceMemory(600, 1000)
        assert backend.evaluate(replay.space().valid_configs()[0]).ok
        assert backend.restarts == 0
    finally:
        backend.close()


def test_releasing_the_device_waits_for_the_childs_close_not_for_its_exit(tmp_path):
    """A worker sharing its GPU holds its turn while a finished job's child closes its backend
    (its CUDA context), not while the child's process exits: ``release_device`` returns once
    the child has closed, ``close`` then waits for the exit (issue 35)."""
    log = tmp_path / "close.log"
    spec = BackendSpec(
        kind="fault_backend:make_slow_exit",
        replay_file=str(RECORDING),
        options=(("log", str(log)), ("exit_s", 3.0)),
    )
    backend = IsolatedBackend(spec)
    pid = backend.child_pids[-1]
    try:
        t0 = time.monotonic()
        backend.release_device()
        released = time.monotonic() - t0
        assert _closes(log, pid) == 1  # the child's backend has closed
        assert released < 2.0
        backend.release_device()  # twice is harmless: the child is not told again
        t1 = time.monotonic()
        backend.close()
        assert time.monotonic() - t1 >= 1.0  # close is what waits on the exit
        assert _closes(log, pid) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        backend.close()


def _closes(log, pid: int) -> int:
    """How many times the process ``pid`` closed its backend (the log of ``SlowToExit``)."""
    return sum(ln.split()[2] == str(pid) for ln in log.read_text().splitlines())


def test_a_child_that_never_says_it_closed_is_killed_by_the_release(monkeypatch):
    """The release holds the GPU turn until the device is free: a child whose close hangs is
    killed (its end frees the device) once ``CLOSE_WAIT_S`` has passed, not left running."""
    from kato.tuner.backends import isolated

    monkeypatch.setattr(isolated, "CLOSE_WAIT_S", 1.0)
    backend = IsolatedBackend(
        BackendSpec(kind="fault_backend:make_hanging_close", replay_file=str(RECORDING))
    )
    pid = backend.child_pids[-1]
    try:
        t0 = time.monotonic()
        backend.release_device()
        assert 0.9 < time.monotonic() - t0 < 5.0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        backend.close()


def test_a_child_closed_without_a_release_first_closes_its_backend_once(tmp_path):
    log = tmp_path / "close.log"
    spec = BackendSpec(
        kind="fault_backend:make_slow_exit",
        replay_file=str(RECORDING),
        options=(("log", str(log)),),
    )
    backend = IsolatedBackend(spec)
    backend.close()
    backend.close()
    assert _closes(log, backend.child_pids[-1]) == 1
