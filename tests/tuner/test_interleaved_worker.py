"""A worker holding several jobs at once on one GPU (issue 35): each job's trials, budget and
winner are exactly those of the same batch tuned one job at a time; only the order of GPU work
changes, one measurement at a time; every job's GPU busy time is stored."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import queue_recordings
from kato.db import queries
from kato.db.models import RESERVED
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner.backends.base import TrialResult
from kato.tuner.factories import Recording, ReplayBackends, find_recordings
from kato.tuner.gpu_gate import GpuGate
from kato.tuner.worker import Worker
from paths import RECORDED, SPACES


def recordings_by_group(per_group: int, groups: int) -> list[Recording]:
    """H200 recordings at their operator's current version: ``per_group`` shapes of each of
    ``groups`` (operator, dtype) groups, so that jobs of one group warm-start each other."""
    by_group: dict[tuple[str, str], list[Recording]] = {}
    seen: set[tuple[Any, ...]] = set()
    for r in find_recordings(SPACES) + find_recordings(RECORDED):
        p = r.problem
        if p.gpu_model != "H200" or p.operator_version != get_operator(p.operator).version:
            continue
        if r.key in seen:
            continue
        seen.add(r.key)
        by_group.setdefault((p.operator, p.dtype), []).append(r)
    chosen = [g for g in sorted(by_group) if len(by_group[g]) >= per_group][:groups]
    assert len(chosen) == groups, sorted((g, len(v)) for g, v in by_group.items())
    return [r for g in chosen for r in by_group[g][:per_group]]


class SlowReplay(ReplayBackends):
    """Replay whose every measurement takes ``delay_s``, and that records which jobs' measurements
    overlap (they must not: one GPU measures one config at a time)."""

    def __init__(self, recordings: list[Recording], delay_s: float) -> None:
        super().__init__(recordings)
        self.delay = delay_s
        self.lock = threading.Lock()
        self.measuring = 0
        self.overlaps = 0
        self.jobs_alive: set[str] = set()
        self.most_jobs_alive = 0

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        outer = self
        evaluate, close = backend.evaluate, backend.close

        def timed(config: dict[str, Any]) -> TrialResult:
            with outer.lock:
                outer.measuring += 1
                outer.overlaps += outer.measuring > 1
            try:
                time.sleep(outer.delay)
                return evaluate(config)
            finally:
                with outer.lock:
                    outer.measuring -= 1

        def closed() -> None:
            with outer.lock:
                outer.jobs_alive.discard(job.id)
            close()

        backend.evaluate, backend.close = timed, closed  # type: ignore[method-assign]
        with self.lock:
            self.jobs_alive.add(job.id)
            self.most_jobs_alive = max(self.most_jobs_alive, len(self.jobs_alive))
        return backend


def tune(tmp_path: Path, name: str, recordings: list[Recording], budget: int, at_once: int):
    """Queue ``recordings`` as one batch, tune it with one worker holding ``at_once`` jobs;
    per key: (config keys in trial order, trial times, winner time), and the backends."""
    url = f"sqlite:///{tmp_path / name}"
    sessions = session_factory(init_db(url))
    ids = queue_recordings(sessions, recordings, budget, seeded=True)
    backends = SlowReplay(recordings, delay_s=0.002)
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id=f"w-{name}", poll_seconds=0.01,
        lease_seconds=30, jobs_at_once=at_once,
    )  # fmt: skip
    done = worker.run_forever(max_jobs=len(ids))
    assert done == len(ids)
    per_key: dict[tuple[str, str, str], Any] = {}
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            assert job is not None and job.status == "done", job
            trials = queries.job_trials(s, job_id)
            assert job.trials_done == budget and len(trials) == budget
            assert len({t.config_key for t in trials}) == budget  # nothing measured twice
            assert not [t for t in trials if t.status == RESERVED]
            assert job.gpu_busy_s is not None and job.gpu_busy_s > 0
            assert job.gpu_busy_fraction is not None and 0 < job.gpu_busy_fraction <= 1.0
            per_key[(job.operator, job.shape_key, job.dtype)] = (
                [t.config_key for t in sorted(trials, key=lambda t: t.number)],
                [t.time_ms for t in sorted(trials, key=lambda t: t.number)],
                job.best_time_ms,
                job.best_config,
            )
    return per_key, backends


def test_interleaved_jobs_measure_exactly_what_serial_jobs_do(tmp_path):
    recordings = recordings_by_group(per_group=3, groups=3)
    serial, alone = tune(tmp_path, "serial.db", recordings, budget=8, at_once=1)
    mixed, shared = tune(tmp_path, "interleaved.db", recordings, budget=8, at_once=3)
    assert alone.most_jobs_alive == 1
    assert shared.most_jobs_alive >= 2  # the jobs did run at once
    assert shared.overlaps == 0 and alone.overlaps == 0  # one measurement at a time
    assert mixed.keys() == serial.keys() and len(mixed) == len(recordings)
    for key in serial:
        assert mixed[key] == serial[key], key  # same trials, same order, same winner


def test_a_worker_never_holds_two_jobs_of_one_group(tmp_path):
    """Jobs of one (operator, dtype) warm-start each other: an interleaving worker runs them
    one after the other, so a job with a single group left runs alone."""
    recordings = recordings_by_group(per_group=4, groups=1)
    _, shared = tune(tmp_path, "one-group.db", recordings, budget=5, at_once=3)
    assert shared.most_jobs_alive == 1


def test_jobs_at_once_must_be_positive(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    with pytest.raises(ValueError, match="jobs_at_once"):
        Worker(session_factory(init_db(url)), url, ["H200"], lambda job: None, jobs_at_once=0)


def test_the_group_exclusion_claims_the_oldest_job_of_another_group(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    sessions = session_factory(init_db(url))
    fields = dict(operator="softmax", operator_version="v", gpu_model="H200", budget_configs=3)
    with sessions() as s:
        a1, a2, b1 = queries.create_jobs(
            s,
            [
                {**fields, "shape": [64, 64], "dtype": "float16"},
                {**fields, "shape": [128, 64], "dtype": "float16"},
                {**fields, "shape": [64, 64], "dtype": "float32"},
            ],
        )
        scope = queries.JobScope(
            exclude_job_ids=frozenset({a1.id}),
            exclude_groups=frozenset({("softmax", "float16", "H200")}),
        )
        got = queries.claim_next_job(
            s, gpu_models=["H200"], worker_id="w", lease_seconds=30, scope=scope, resume_own=True
        )
        assert got is not None and got.id == b1.id
        assert Counter(j.status for j in queries.list_jobs(s)) == {"queued": 2, "running": 1}


class CompilingReplay(ReplayBackends):
    """Replay backends that compile ahead (a compile takes ``compile_s``, started by a hint):
    each evaluation records whether its config's compile had finished when the GPU turn began,
    and the seconds the GPU was held while another job's compile ran."""

    def __init__(self, recordings: list[Recording], compile_s: float) -> None:
        super().__init__(recordings)
        self.compile_s = compile_s
        self.lock = threading.Lock()
        self.evaluated_uncompiled = 0
        self.evaluations = 0

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        outer, done, started = self, set(), {}
        key = backend.space().key
        evaluate = backend.evaluate

        def hint(configs) -> None:
            for c in configs:
                k = key(c)
                if k not in started:
                    timer = threading.Timer(outer.compile_s, done.add, args=(k,))
                    started[k] = timer
                    timer.start()

        def is_compiled(config) -> bool:
            return key(config) in done

        def wait_compiled(configs) -> None:
            while not any(key(c) in done for c in configs if key(c) in started):
                if not any(key(c) in started for c in configs):
                    return
                time.sleep(0.001)

        def timed(config):
            with outer.lock:
                outer.evaluations += 1
                outer.evaluated_uncompiled += key(config) not in done
            return evaluate(config)

        backend.hint, backend.is_compiled = hint, is_compiled  # type: ignore[attr-defined]
        backend.wait_compiled, backend.evaluate = wait_compiled, timed  # type: ignore[attr-defined]
        return backend


def test_a_shared_gpu_turn_starts_only_once_the_configs_compile_is_done(tmp_path):
    """With several jobs on the GPU, a job waits for its config's compile before its turn, so
    the GPU measures another job meanwhile instead of waiting on nvcc."""
    recordings = recordings_by_group(per_group=1, groups=2)
    url = f"sqlite:///{tmp_path / 'k.db'}"
    sessions = session_factory(init_db(url))
    queue_recordings(sessions, recordings, 5)
    backends = CompilingReplay(recordings, compile_s=0.05)
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id="w", poll_seconds=0.01, jobs_at_once=2
    )
    assert worker.run_forever(max_jobs=2) == 2
    assert backends.evaluations == 10 and backends.evaluated_uncompiled == 0


class TrackingGate(GpuGate):
    """A GPU gate that knows whether the calling thread holds it."""

    made: list[TrackingGate] = []

    def __init__(self) -> None:
        super().__init__()
        self._here = threading.local()
        TrackingGate.made.append(self)

    @contextlib.contextmanager
    def hold(self, holder: str, *, counted: bool = True):  # type: ignore[override]
        with super().hold(holder, counted=counted):
            self._here.held = True
            try:
                yield
            finally:
                self._here.held = False

    def held_here(self) -> bool:
        return getattr(self._here, "held", False)


class DrainingReplay(ReplayBackends):
    """Replay backends with compiles still running at the end of a job, as a GPU backend that
    compiles ahead has: they are drained by ``close_compiles`` or else by ``close``. Records,
    per drain, whether the draining thread held the GPU gate."""

    def __init__(self, recordings: list[Recording], drain_s: float) -> None:
        super().__init__(recordings)
        self.drain_s = drain_s
        self.drains_holding_gate: list[bool] = []

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        outer, close, drained = self, backend.close, []

        def drain() -> None:
            if not drained:
                drained.append(True)
                outer.drains_holding_gate.append(TrackingGate.made[-1].held_here())
                time.sleep(outer.drain_s)  # nvcc finishing the compiles in flight

        def closed() -> None:
            drain()
            close()

        backend.close_compiles, backend.close = drain, closed  # type: ignore[attr-defined]
        return backend


def test_a_job_ending_waits_on_its_compiles_outside_the_gpu_turn(tmp_path, monkeypatch):
    """Closing a backend waits for the nvcc runs in flight: that wait must not hold the GPU,
    which another job could measure on meanwhile (nvcc never holds the GPU)."""
    from kato.tuner import worker as worker_module

    monkeypatch.setattr(worker_module, "GpuGate", TrackingGate)
    recordings = recordings_by_group(per_group=1, groups=2)
    url = f"sqlite:///{tmp_path / 'k.db'}"
    sessions = session_factory(init_db(url))
    queue_recordings(sessions, recordings, 3)
    backends = DrainingReplay(recordings, drain_s=0.05)
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id="w", poll_seconds=0.01, jobs_at_once=2
    )
    assert worker.run_forever(max_jobs=2) == 2
    assert backends.drains_holding_gate == [False, False]


class ReleasingReplay(ReplayBackends):
    """Replay backends that release the device apart from their close, as an isolated
    backend's child does (``ReleasesDevice``); records, per call, whether it held the gate."""

    def __init__(self, recordings: list[Recording]) -> None:
        super().__init__(recordings)
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        outer, close = self, backend.close

        def release() -> None:
            outer.calls.append(("release", TrackingGate.made[-1].held_here()))

        def closed() -> None:
            outer.calls.append(("close", TrackingGate.made[-1].held_here()))
            close()

        backend.release_device, backend.close = release, closed  # type: ignore[attr-defined]
        return backend


def test_a_job_ending_holds_the_gpu_only_while_its_backend_releases_the_device(
    tmp_path, monkeypatch
):
    """The GPU turn that ends a job covers the backend's release of the device (a child's
    CUDA context), not the rest of its close (the child's exit), which another job's
    measurement need not wait for."""
    from kato.tuner import worker as worker_module

    monkeypatch.setattr(worker_module, "GpuGate", TrackingGate)
    recordings = recordings_by_group(per_group=1, groups=2)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    sessions = session_factory(init_db(url))
    queue_recordings(sessions, recordings, 3)
    backends = ReleasingReplay(recordings)
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id="w", poll_seconds=0.01, jobs_at_once=2
    )
    assert worker.run_forever(max_jobs=2) == 2
    releases = [held for what, held in backends.calls if what == "release"]
    closes = [held for what, held in backends.calls if what == "close"]
    assert releases and all(releases)  # each in a GPU turn
    assert closes and not any(closes)  # each after it
    assert Counter(what for what, _ in backends.calls)["release"] >= 2


def test_a_worker_of_several_gpu_models_never_holds_two_jobs_of_one_operator_and_dtype(
    tmp_path,
):
    """A job's warm start reads its operator and dtype on every GPU model, so two jobs of one
    (operator, dtype) for two models must not run at once either: the second would start
    without the first's results, which a serial run gives it."""
    import dataclasses

    first, second = recordings_by_group(per_group=2, groups=1)
    second = dataclasses.replace(
        second, problem=dataclasses.replace(second.problem, gpu_model="H100")
    )
    url = f"sqlite:///{tmp_path / 'k.db'}"
    sessions = session_factory(init_db(url))
    queue_recordings(sessions, [first, second], 4, gpu_model=None)
    backends = SlowReplay([first, second], delay_s=0.02)
    worker = Worker(
        sessions, url, ["H200", "H100"], backends, worker_id="w", poll_seconds=0.01,
        jobs_at_once=2,
    )  # fmt: skip
    assert worker.run_forever(max_jobs=2) == 2
    assert backends.most_jobs_alive == 1


GiB = 1 << 30


class SimulatedDevice:
    """A GPU's memory as the test backends see it: ``total`` bytes, ``other`` of them held by
    another process; each job's set-up takes its need until its backend closes, and a set-up
    that does not fit fails as ``cudaMalloc`` would."""

    def __init__(self, total: int, other: int) -> None:
        self.total, self.other = total, other
        self.lock = threading.Lock()
        self.used: dict[str, int] = {}
        self.peak = 0
        self.most_set_up = 0
        self.together: list[frozenset[str]] = []  # the jobs set up, after each set-up

    def allocate(self, job_id: str, need: int) -> None:
        with self.lock:
            if self.other + sum(self.used.values()) + need > self.total:
                raise RuntimeError(f"out of memory setting up job {job_id}")
            self.used[job_id] = need
            self.peak = max(self.peak, self.other + sum(self.used.values()))
            self.most_set_up = max(self.most_set_up, len(self.used))
            self.together.append(frozenset(self.used))

    def free(self, job_id: str) -> None:
        with self.lock:
            self.used.pop(job_id, None)

    def free_bytes(self) -> int:
        with self.lock:
            return self.total - self.other - sum(self.used.values())


class MemoryReplay(ReplayBackends):
    """Replay backends on a :class:`SimulatedDevice`: each reports the device's memory
    (``memory``), sets its job up by taking ``need[(operator, shape_key, dtype)]`` bytes
    (``prepare``) and gives them back on ``close``; the factory estimates each job's need
    exactly (``device_bytes``)."""

    def __init__(self, recordings, device: SimulatedDevice, need: dict[tuple, int]) -> None:
        super().__init__(recordings)
        self.device, self.need = device, need

    def device_bytes(self, job) -> int:  # type: ignore[no-untyped-def]
        return self.need[(job.operator, job.shape_key, job.dtype)]

    def __call__(self, job):  # type: ignore[no-untyped-def]
        from kato.tuner.backends.base import DeviceMemory

        backend = super().__call__(job)
        device, need, close = self.device, self.device_bytes(job), backend.close

        def memory() -> DeviceMemory:
            return DeviceMemory(device.free_bytes(), device.total)

        def closed() -> None:
            device.free(job.id)
            close()

        backend.memory = memory  # type: ignore[attr-defined]
        backend.prepare = lambda: device.allocate(job.id, need)  # type: ignore[attr-defined]
        backend.close = closed  # type: ignore[method-assign]
        return backend


def test_held_jobs_are_admitted_only_when_they_fit_the_gpus_memory_together(tmp_path):
    """Jobs of two big groups (6 GiB each) never share a 10 GiB GPU (1 GiB of it another
    process's): each waits for the other to end instead of failing its set-up; a small group's
    jobs (1 GiB) are held beside either. Every job ends done with its exact budget, its trials
    those of a serial run."""
    recordings = recordings_by_group(per_group=2, groups=3)
    groups = sorted({(r.problem.operator, r.problem.dtype) for r in recordings})
    size = {groups[0]: 6 * GiB, groups[1]: 6 * GiB, groups[2]: 1 * GiB}
    need = {
        (r.problem.operator, r.problem.shape_key, r.problem.dtype): size[
            (r.problem.operator, r.problem.dtype)
        ]
        for r in recordings
    }
    device = SimulatedDevice(total=10 * GiB, other=1 * GiB)
    assert 6 * GiB + 6 * GiB > device.total - device.other  # the two big ones cannot share it
    serial, _ = tune(tmp_path, "serial.db", recordings, budget=4, at_once=1)

    url = f"sqlite:///{tmp_path / 'memory.db'}"
    sessions = session_factory(init_db(url))
    ids = queue_recordings(sessions, recordings, 4, seeded=True)
    worker = Worker(
        sessions, url, ["H200"], MemoryReplay(recordings, device, need), worker_id="w",
        poll_seconds=0.01, jobs_at_once=3,
    )  # fmt: skip
    assert worker.run_forever(max_jobs=len(ids)) == len(ids)
    assert device.peak <= device.total
    kinds = [(r.problem.operator, r.problem.dtype) for r in recordings]
    big = {job_id for job_id, kind in zip(ids, kinds, strict=True) if size[kind] > GiB}
    assert all(len(set_up & big) <= 1 for set_up in device.together)
    assert device.most_set_up >= 2  # a small job was held beside a big one
    assert worker.admission is not None and worker.admission.held_bytes() == 0
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            assert job is not None and job.status == "done", (job.status, job.error)
            trials = sorted(queries.job_trials(s, job_id), key=lambda t: t.number)
            key = (job.operator, job.shape_key, job.dtype)
            assert [t.config_key for t in trials] == serial[key][0]
            assert job.best_time_ms == serial[key][2]


def test_a_gpu_workers_estimate_of_a_jobs_device_memory():
    """What a GPU worker counts for a job it may hold beside others: every argument copy the
    set-up times over, the pristine set, float32 references (twice a 16-bit argument's bytes
    at most) and, measuring in a child, the child's context."""
    from types import SimpleNamespace

    from kato.tuner.factories import CHILD_CONTEXT_BYTES, pycuda_backend_factory

    from kato.shared.gpus import find_gpu

    softmax = get_operator("softmax")
    big = SimpleNamespace(
        operator="softmax", shape=[32768, 4096], dtype="float16", gpu_model="H200"
    )
    args = softmax.buffer_bytes((32768, 4096), "float16")
    assert softmax.bytes_moved((32768, 4096), "float16") > 2 * find_gpu("H200").l2_bytes
    isolated, in_process = pycuda_backend_factory(isolate=True), pycuda_backend_factory()
    assert in_process.device_bytes(big) == (1 + 1) * args + 2 * args
    assert isolated.device_bytes(big) == in_process.device_bytes(big) + CHILD_CONTEXT_BYTES
    small = SimpleNamespace(operator="softmax", shape=[64, 64], dtype="float32", gpu_model="H200")
    copies = -(-2 * find_gpu("H200").l2_bytes // softmax.bytes_moved((64, 64), "float32"))
    per_set = softmax.buffer_bytes((64, 64), "float32")
    assert in_process.device_bytes(small) == (min(copies, 200) + 1) * per_set + per_set


class ClosingRace(MemoryReplay):
    """:class:`MemoryReplay` where the second job's set-up reads the device right after the
    first job's backend closed (its memory is free), before the first job's run has ended:
    the first job's last database write (its GPU busy time) waits until that reading is
    taken. The second job measures slowly, so a third is looked at while it runs."""

    def __init__(self, recordings, device, need, first: str, second: str) -> None:
        super().__init__(recordings, device, need)
        self.first, self.second = first, second
        self.first_closed = threading.Event()
        self.second_read = threading.Event()

    def __call__(self, job):  # type: ignore[no-untyped-def]
        key = (job.operator, job.shape_key, job.dtype)
        if key == self.second:
            assert self.first_closed.wait(10), "the first job never ended"
        backend = super().__call__(job)
        if key == self.first:
            close = backend.close

            def closed() -> None:
                close()
                self.first_closed.set()

            backend.close = closed  # type: ignore[method-assign]
        elif key == self.second:
            memory, evaluate = backend.memory, backend.evaluate

            def read():  # type: ignore[no-untyped-def]
                try:
                    return memory()
                finally:
                    self.second_read.set()

            def slow(config):  # type: ignore[no-untyped-def]
                time.sleep(0.05)
                return evaluate(config)

            backend.memory, backend.evaluate = read, slow  # type: ignore[attr-defined]
        return backend


def test_a_reading_taken_after_a_held_job_closed_does_not_count_its_memory_twice(tmp_path):
    """Job A (5 GiB) ends while job B (1 GiB) waits to set up: B's reading, taken once A's
    backend closed, already has A's memory free. Job C (8.5 GiB) does not fit beside B on a
    10 GiB GPU (1 GiB of it another process's) and must wait for B to end: admitted with A
    counted as still held, its set-up runs out of memory."""
    from sqlalchemy import event

    recordings = recordings_by_group(per_group=1, groups=3)
    keys = [(r.problem.operator, r.problem.shape_key, r.problem.dtype) for r in recordings]
    need = dict(zip(keys, [5 * GiB, 1 * GiB, int(8.5 * GiB)], strict=True))
    device = SimulatedDevice(total=10 * GiB, other=1 * GiB)
    backends = ClosingRace(recordings, device, need, first=keys[0], second=keys[1])
    url = f"sqlite:///{tmp_path / 'race.db'}"
    engine = init_db(url)
    sessions = session_factory(engine)

    @event.listens_for(engine, "before_cursor_execute")
    def hold_busy_time(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        update = statement.lstrip().upper().startswith("UPDATE")
        if update and "gpu_busy_s" in statement and backends.first_closed.is_set():
            backends.second_read.wait(10)

    ids = queue_recordings(sessions, recordings, 4)
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id="w", poll_seconds=0.01, jobs_at_once=2
    )
    assert worker.run_forever(max_jobs=3) == 3
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            assert job is not None and job.status == "done", (job.status, job.error)
    assert device.peak <= device.total


class BaselineReplay(MemoryReplay):
    """:class:`MemoryReplay` whose factory also times the framework's op for a finished job
    (:class:`tuner.backends.abilities.MeasuresFramework`), as a torch child would: in a GPU
    turn, taking the job's memory again. The first job's baseline starts once another job has
    set up since it closed, or after a second; baselines that ran out of memory are counted.
    The second job measures slowly: it is still held then."""

    def __init__(self, recordings, device, need, first, second) -> None:  # type: ignore[no-untyped-def]
        super().__init__(recordings, device, need)
        self.first, self.second = first, second
        self.set_up_later = threading.Event()
        self.first_closed = threading.Event()
        self.out_of_memory: list[str] = []

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        key = (job.operator, job.shape_key, job.dtype)
        prepare, close = backend.prepare, backend.close

        def prepared() -> None:
            prepare()
            if self.first_closed.is_set():
                self.set_up_later.set()

        def closed() -> None:
            close()
            if key == self.first:
                self.first_closed.set()

        backend.prepare, backend.close = prepared, closed  # type: ignore[attr-defined]
        if key == self.second:
            evaluate = backend.evaluate

            def slow(config):  # type: ignore[no-untyped-def]
                time.sleep(0.05)
                return evaluate(config)

            backend.evaluate = slow  # type: ignore[method-assign]
        return backend

    def measure_framework(self, job, device, stop, turn=None):  # type: ignore[no-untyped-def]
        from kato.tuner.framework import FrameworkResult

        if (job.operator, job.shape_key, job.dtype) == self.first:
            self.set_up_later.wait(1.0)
        with turn():
            try:
                self.device.allocate(f"baseline-{job.id}", self.device_bytes(job))
            except RuntimeError as exc:
                self.out_of_memory.append(str(exc))
                return FrameworkResult("failed", detail=str(exc))
            self.device.free(f"baseline-{job.id}")
        return FrameworkResult("ok", "torch", "op", (1.0,))


def test_a_finished_jobs_memory_stays_held_for_its_framework_baseline(tmp_path):
    """Job A (5 GiB) closes its backend, then times PyTorch's op (about as much memory again);
    meanwhile job C (3.5 GiB) must not take A's room beside job B (1 GiB) on a 10 GiB GPU
    (1 GiB of it another process's): every baseline runs without running out of memory."""
    recordings = recordings_by_group(per_group=1, groups=3)
    keys = [(r.problem.operator, r.problem.shape_key, r.problem.dtype) for r in recordings]
    need = dict(zip(keys, [5 * GiB, 1 * GiB, int(3.5 * GiB)], strict=True))
    device = SimulatedDevice(total=10 * GiB, other=1 * GiB)
    backends = BaselineReplay(recordings, device, need, first=keys[0], second=keys[1])
    url = f"sqlite:///{tmp_path / 'baseline.db'}"
    sessions = session_factory(init_db(url))
    queue_recordings(sessions, recordings, [3, 12, 3])
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id="w", poll_seconds=0.01, jobs_at_once=3
    )
    assert worker.run_forever(max_jobs=3) == 3
    assert backends.out_of_memory == []
    assert device.peak <= device.total
