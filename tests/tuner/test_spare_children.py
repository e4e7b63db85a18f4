"""Warm spare measuring children (issue 35, :class:`tuner.backends.isolated.SpareChildren`): a
job's backend starts from a child that was started before it, the spare is replaced, a dead or
stale spare is never handed out, nothing outlives the pool or the worker, and a batch measures
exactly what it measures with fresh children."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import queue_recordings
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.tuner.backends.base import TrialStatus
from kato.tuner.backends.isolated import (
    BackendSpec,
    ChildStartError,
    IsolatedBackend,
    SpareChildren,
)
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.factories import ReplayBackends, find_recordings
from kato.tuner.worker import Worker
from paths import RECORDED

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
SPEC = BackendSpec(kind="replay", replay_file=str(RECORDING))
WARM_S = 60  # a spare's interpreter and imports, on a loaded 2-core machine


@pytest.fixture(scope="module")
def replay() -> ReplayBackend:
    return ReplayBackend(RECORDING)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for(predicate, timeout: float = WARM_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def pool():
    spares = SpareChildren("replay")
    yield spares
    spares.close()
    assert all(gone(pid) for pid in spares.started), spares.started


def test_a_backend_starts_from_the_spare_and_the_spare_is_replaced(pool, replay):
    pool.start()
    assert pool.wait_warm(WARM_S)
    spare = pool.idle_pid()
    assert spare is not None and not gone(spare)
    backend = IsolatedBackend(SPEC, spares=pool)
    try:
        assert backend.child_pids == [spare] and backend.spares_taken == 1
        assert pool.taken == 1
        config = replay.space().valid_configs()[0]
        result = backend.evaluate(config)
        assert result.ok and result.time_ms == pytest.approx(replay.evaluate(config).time_ms)
        assert backend.device() == replay.device()
        # the next spare, started in the background when this one was taken
        assert wait_for(lambda: pool.idle_pid() not in (None, spare))
        assert pool.started == [spare, pool.idle_pid()]
    finally:
        backend.close()
    assert gone(spare)  # a spare taken is its backend's child: closed with it
    assert not gone(pool.idle_pid())


def test_without_a_started_pool_or_for_another_kind_the_child_is_fresh(pool):
    backend = IsolatedBackend(SPEC, spares=pool)  # not started: nothing to take
    try:
        assert backend.spares_taken == 0 and pool.started == []
    finally:
        backend.close()
    pool.start()
    other = BackendSpec(kind="fault_backend:make", replay_file=str(RECORDING))
    backend = IsolatedBackend(other, spares=pool)
    try:
        assert backend.spares_taken == 0 and pool.taken == 0
        assert backend.child_pids[0] not in pool.started
    finally:
        backend.close()


def test_a_crashed_childs_replacement_starts_from_the_spare(replay):
    config = replay.space().valid_configs()[0]
    ok = replay.space().valid_configs()[1]
    spec = BackendSpec(
        kind="fault_backend:make",
        replay_file=str(RECORDING),
        options=(("faults", {replay.space().key(config): "abort"}),),
    )
    pool = SpareChildren(spec.kind)
    pool.start()
    backend = IsolatedBackend(spec, spares=pool)
    try:
        assert wait_for(lambda: pool.idle_pid() is not None)
        spare = pool.idle_pid()
        assert backend.evaluate(config).status is TrialStatus.CRASHED
        assert backend.evaluate(ok).ok
        assert backend.restarts == 1
        assert backend.child_pids[1] == spare and backend.spares_taken == 2
    finally:
        backend.close()
        pool.close()
    assert all(gone(pid) for pid in [*pool.started, *backend.child_pids])


def test_a_dead_spare_is_replaced_transparently(pool, replay):
    pool.start()
    assert pool.wait_warm(WARM_S)
    dead = pool.idle_pid()
    os.kill(dead, signal.SIGKILL)
    assert wait_for(lambda: gone(dead) or _zombie(dead))
    backend = IsolatedBackend(SPEC, spares=pool)
    try:
        # Found dead when taken (discarded), or, where its death was not yet seen, when the
        # job was sent to it or its answer awaited (a fresh child then): either way the
        # backend's child is a live one that is not the dead spare.
        assert pool.discarded + backend.spares_taken <= 1, (pool.discarded, backend.child_pids)
        assert backend.child_pids[-1] != dead and gone(dead)
        assert backend.evaluate(replay.space().valid_configs()[0]).ok
        assert wait_for(lambda: pool.idle_pid() not in (None, dead))  # replaced
    finally:
        backend.close()


def _zombie(pid: int) -> bool:
    try:
        return " Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    except OSError:
        return True


def test_a_spare_that_dies_with_its_job_is_followed_by_a_fresh_child(tmp_path, replay):
    """The spare takes the job and dies before announcing its device, without a word: the
    backend starts a fresh child once (a fresh child dying so is an error, as before)."""
    spec = BackendSpec(
        kind="fault_backend:make_dying_once",
        replay_file=str(RECORDING),
        options=(("marker", str(tmp_path / "died")),),
    )
    pool = SpareChildren(spec.kind)
    pool.start()
    try:
        spare = pool.idle_pid()
        backend = IsolatedBackend(spec, spares=pool)
        try:
            assert backend.child_pids[0] == spare and len(backend.child_pids) == 2
            assert (tmp_path / "died").read_text() == str(spare)
            assert backend.restarts == 0
            assert backend.evaluate(replay.space().valid_configs()[0]).ok
        finally:
            backend.close()
    finally:
        pool.close()
    other = BackendSpec(kind=spec.kind, replay_file=str(RECORDING),
                        options=(("marker", str(tmp_path / "again")),))  # fmt: skip
    with pytest.raises(ChildStartError, match="measuring process (died|did not start)"):
        IsolatedBackend(other)


def test_a_spare_started_with_another_environment_is_not_handed_out(pool, monkeypatch):
    pool.start()
    stale = pool.idle_pid()
    monkeypatch.setenv("KATO_TEST_SPARE_ENV", "changed")  # a variable a backend may read
    backend = IsolatedBackend(SPEC, spares=pool)
    try:
        assert stale not in backend.child_pids and pool.discarded == 1 and gone(stale)
    finally:
        backend.close()
    assert wait_for(lambda: pool.idle_pid() not in (None, stale))
    backend = IsolatedBackend(SPEC, spares=pool)  # the replacement has the new environment
    try:
        assert backend.spares_taken == 1 and pool.discarded == 1
    finally:
        backend.close()


def test_close_kills_the_idle_spare_and_one_being_started(replay):
    pool = SpareChildren("replay")
    pool.start()
    backend = IsolatedBackend(SPEC, spares=pool)  # takes the spare: a replacement starts
    pool.close()
    try:
        assert pool.started and all(
            gone(pid) for pid in pool.started if pid != backend.child_pids[0]
        )
        assert backend.evaluate(replay.space().valid_configs()[0]).ok  # its own child lives on
    finally:
        backend.close()
    assert all(gone(pid) for pid in pool.started)
    assert pool.take(SPEC) is None  # closed: fresh children only


class RecordingBackends(ReplayBackends):
    """Replay backends through isolated children that keep each backend and the pid of the
    spare idle when it was asked for."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.built: list[tuple[IsolatedBackend, int | None]] = []

    def __call__(self, job):
        idle = self.spares.idle_pid() if self.spares is not None else None
        backend = super().__call__(job)
        self.built.append((backend, idle))
        return backend


def tune(tmp_path: Path, name: str, spares: bool, at_once: int):
    recordings = [r for r in find_recordings(RECORDED) if r.problem.gpu_model == "H200"][:3]
    url = f"sqlite:///{tmp_path / name}"
    sessions = session_factory(init_db(url))
    ids = queue_recordings(sessions, recordings, 6, seeded=True)
    backends = RecordingBackends(recordings, isolate=True, spares=spares)
    worker = Worker(
        sessions, url, ["H200"], backends, worker_id=f"w-{name}", poll_seconds=0.01,
        lease_seconds=30, jobs_at_once=at_once,
    )  # fmt: skip
    assert worker.run_forever(max_jobs=len(ids)) == len(ids)
    results = {}
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            assert job is not None and job.status == "done", job
            trials = sorted(queries.job_trials(s, job_id), key=lambda t: t.number)
            results[(job.operator, job.shape_key, job.dtype)] = (
                [(t.config_key, t.status, t.time_ms) for t in trials],
                job.best_config,
                job.best_time_ms,
            )
    return results, backends


@pytest.mark.parametrize("at_once", [1, 2])
def test_a_workers_jobs_start_from_spares_and_measure_what_fresh_children_do(tmp_path, at_once):
    warm, backends = tune(tmp_path, "warm.db", spares=True, at_once=at_once)
    pool = backends.spares
    assert pool is not None and len(backends.built) == 3
    # The later jobs' children are spares started before their backends were asked for.
    later = backends.built[1:] if at_once == 1 else backends.built[2:]
    for backend, idle in later:
        assert idle is not None and backend.child_pids == [idle] and backend.spares_taken == 1
    assert pool.taken >= len(later)
    children = [pid for backend, _ in backends.built for pid in backend.child_pids]
    assert all(gone(pid) for pid in [*pool.started, *children])  # the loop's end left none
    assert pool.idle_pid() is None and pool.take(SPEC) is None

    cold, fresh = tune(tmp_path, "cold.db", spares=False, at_once=at_once)
    assert fresh.spares is None
    assert all(backend.spares_taken == 0 for backend, _ in fresh.built)
    assert warm == cold  # same trials, same order, same times, same winners
