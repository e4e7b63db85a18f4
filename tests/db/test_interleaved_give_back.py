"""A worker holding several jobs at once that is interrupted, or whose runner fails with an
interrupt of its own, gives back every job it holds at once (issue 35): also one whose runner
is stuck in a measurement nothing can stop. Each job is left claimable now (its lease ended,
no reservation left) with its stored trials, and another worker resumes it from them."""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from typing import Any

import pytest
from fleet_helpers import queue_recordings
from kato.db import queries
from kato.db.models import RESERVED, utcnow
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner import worker as worker_module
from kato.tuner.factories import ReplayBackends, find_recordings
from kato.tuner.worker import Worker, stop_on_signals
from paths import SPACES

BUDGET = 8

#: A safety bound on each event a test waits for (each comes within milliseconds): only a
#: broken worker ever waits it out.
WAIT_S = 60.0


class Fatal(BaseException):
    """An interrupt raised inside one runner (not an ``Exception``: nothing absorbs it)."""


def two_groups() -> list[Any]:
    """One H200 recording of each of two (operator, dtype) groups, at current versions (a
    worker holds jobs of two groups at once)."""
    chosen: dict[tuple[str, str], Any] = {}
    for r in find_recordings(SPACES):
        p = r.problem
        if p.gpu_model == "H200" and p.operator_version == get_operator(p.operator).version:
            chosen.setdefault((p.operator, p.dtype), r)
    assert len(chosen) >= 2
    return [chosen[g] for g in sorted(chosen)[:2]]


class StuckReplay(ReplayBackends):
    """Replay backends measuring in this process, ordered by events only (no wall clock).
    Each job measures two configs and then waits on the compile of its next one (outside any
    GPU turn), its two results stored by then (written at once: no write-behind):

    - the second job's compile never ends until ``release`` is set (a hung nvcc: nothing
      interrupts it); it waits once the first job waits too, and sets ``stuck``;
    - the first job's wait ends at ``stuck``: with ``first_does == "fatal"`` it raises
      :class:`Fatal`, else it lasts until its backend is interrupted (as an isolated one's
      does), so that the job cannot end before the worker stops it."""

    def __init__(self, recordings: list[Any], first_does: str) -> None:
        super().__init__(recordings)
        self.first = recordings[0].problem.shape_key, recordings[0].problem.operator
        self.first_does = first_does
        self.first_waits = threading.Event()
        self.release = threading.Event()
        self.stuck = threading.Event()
        self.stuck_thread: threading.Thread | None = None

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        evaluate, outer = backend.evaluate, self
        measured = [0]
        first = (job.shape_key, job.operator) == self.first
        interrupted = threading.Event()

        def counted(config: dict[str, Any]):  # type: ignore[no-untyped-def]
            measured[0] += 1
            return evaluate(config)

        def is_compiled(config: dict[str, Any]) -> bool:
            done = interrupted if first else outer.release
            return measured[0] < 2 or done.is_set()

        def wait_compiled(configs: Any) -> None:
            if is_compiled(configs[0]):
                return
            if first:
                outer.first_waits.set()
                assert outer.stuck.wait(WAIT_S), "the second job never got stuck"
                if outer.first_does == "fatal":
                    raise Fatal("a runner's own interrupt")
                assert interrupted.wait(WAIT_S), "the first job's runner was never interrupted"
            else:
                assert outer.first_waits.wait(WAIT_S), "the first job never waited"
                outer.stuck_thread = threading.current_thread()
                outer.stuck.set()
                outer.release.wait(WAIT_S)

        backend.measures_out_of_process = False  # its results stored before the next config
        backend.evaluate = counted  # type: ignore[method-assign]
        backend.is_compiled, backend.wait_compiled = is_compiled, wait_compiled  # type: ignore[attr-defined]
        backend.hint = lambda configs: None  # type: ignore[attr-defined]
        backend.interrupt = interrupted.set  # type: ignore[attr-defined]
        return backend


def queue(sessions, recordings) -> list[str]:
    return queue_recordings(sessions, recordings, BUDGET, seeded=True)


def assert_given_back(sessions, ids: list[str]) -> dict[str, set[str]]:
    """Each job claimable now with its stored trials and no reservation; its trials' keys."""
    stored = {}
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            trials = queries.job_trials(s, job_id)
            assert job is not None and job.status == "running", (job.status, job.error)
            assert job.lease_expires_at <= utcnow() + timedelta(seconds=1), "lease kept"
            assert not [t for t in trials if t.status == RESERVED], "reservation left"
            assert job.trials_done == len(trials) >= 1
            stored[job_id] = {t.config_key for t in trials}
    return stored


def assert_still_stuck(backends: StuckReplay) -> None:
    """The worker returned without waiting for the stuck runner: it is still stuck (its wait
    ends only at ``release``, or after :data:`WAIT_S`), no clock involved."""
    assert backends.stuck_thread is not None and backends.stuck_thread.is_alive()
    assert not backends.release.is_set()


def resume_and_check(url, sessions, recordings, ids, stored, backends: StuckReplay) -> None:
    """Let the stuck runner go, then another worker resumes both jobs from their trials."""
    backends.release.set()
    for thread in threading.enumerate():
        if thread.name.startswith("kato-job-"):
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a runner thread never ended"
    other = Worker(
        sessions, url, ["H200"], ReplayBackends(recordings), worker_id="other", poll_seconds=0.01
    )
    assert other.run_forever(max_jobs=2) == 2
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            trials = queries.job_trials(s, job_id)
            assert job is not None and job.status == "done", (job.status, job.error)
            keys = [t.config_key for t in trials]
            assert len(keys) == len(set(keys)) == BUDGET  # nothing measured twice
            assert stored[job_id] <= set(keys)  # the stored trials were kept


@pytest.fixture
def quick_grace(monkeypatch):
    """How long the worker waits for its runners' threads after giving their jobs back,
    short: the stuck one never ends in time."""
    monkeypatch.setattr(worker_module, "STOP_GRACE_SECONDS", 0.5)


def test_a_runners_fatal_error_gives_back_every_job_the_worker_holds(db_url, quick_grace):
    recordings = two_groups()
    sessions = session_factory(init_db(db_url))
    ids = queue(sessions, recordings)
    backends = StuckReplay(recordings, first_does="fatal")
    worker = Worker(
        sessions, db_url, ["H200"], backends, worker_id="w", poll_seconds=0.01,
        lease_seconds=120, jobs_at_once=2,
    )  # fmt: skip
    with pytest.raises(Fatal):
        worker.run_forever(max_jobs=2)
    assert_still_stuck(backends)
    stored = assert_given_back(sessions, ids)
    resume_and_check(db_url, sessions, recordings, ids, stored, backends)


def test_an_interrupted_worker_gives_back_every_job_at_once(db_url, quick_grace):
    """SIGTERM, then its grace over (KeyboardInterrupt in the main thread, as
    :func:`stop_on_signals` raises it): the runner that can stop gives its job back itself,
    the stuck one's is given back by the worker, which returns without waiting for it."""
    recordings = two_groups()
    sessions = session_factory(init_db(db_url))
    ids = queue(sessions, recordings)
    backends = StuckReplay(recordings, first_does="measure")
    worker = Worker(
        sessions, db_url, ["H200"], backends, worker_id="w", poll_seconds=0.01,
        lease_seconds=120, jobs_at_once=2,
    )  # fmt: skip

    def terminate() -> None:
        if backends.stuck.wait(WAIT_S):
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate, daemon=True)
    killer.start()
    with stop_on_signals(worker, grace_seconds=0.2):
        worker.run_forever(max_jobs=2)
    killer.join(WAIT_S)
    assert_still_stuck(backends)
    stored = assert_given_back(sessions, ids)
    resume_and_check(db_url, sessions, recordings, ids, stored, backends)
