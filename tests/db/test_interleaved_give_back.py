"""A worker holding several jobs at once that is interrupted, or whose runner fails with an
interrupt of its own, gives back every job it holds at once (issue 35): also one whose runner
is stuck in a measurement nothing can stop. Each job is left claimable now (its lease ended,
no reservation left) with its stored trials, and another worker resumes it from them."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from fleet_helpers import queue_recordings
from kato.db import queries
from kato.db.models import RESERVED, utcnow
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner import worker as worker_module
from kato.tuner.worker import ReplayBackends, Worker, find_recordings, stop_on_signals
from paths import SPACES

BUDGET = 8


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
    """Replay backends measuring in this process: the second job's gets stuck after two
    measurements, waiting on a compile that never ends until ``release`` is set (a hung nvcc;
    nothing interrupts it, and it holds no GPU turn); the first job's backend, with
    ``first_does == "fatal"``, then raises :class:`Fatal` at its next measurement."""

    def __init__(self, recordings: list[Any], first_does: str) -> None:
        super().__init__(recordings)
        self.first = recordings[0].problem.shape_key, recordings[0].problem.operator
        self.first_does = first_does
        self.release = threading.Event()
        self.stuck = threading.Event()

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        evaluate, outer = backend.evaluate, self
        measured = [0]

        if (job.shape_key, job.operator) == self.first:

            def first(config: dict[str, Any]):  # type: ignore[no-untyped-def]
                # A short wait each turn: the other job's turns come between.
                if outer.stuck.wait(0.05) and outer.first_does == "fatal":
                    raise Fatal("a runner's own interrupt")
                return evaluate(config)

            backend.evaluate = first  # type: ignore[method-assign]
            return backend

        def second(config: dict[str, Any]):  # type: ignore[no-untyped-def]
            measured[0] += 1
            return evaluate(config)

        def is_compiled(config: dict[str, Any]) -> bool:
            return measured[0] < 2 or outer.release.is_set()

        def wait_compiled(configs: Any) -> None:
            if not is_compiled(configs[0]):
                outer.stuck.set()
                outer.release.wait(30)

        backend.evaluate = second  # type: ignore[method-assign]
        backend.is_compiled, backend.wait_compiled = is_compiled, wait_compiled  # type: ignore[attr-defined]
        backend.hint = lambda configs: None  # type: ignore[attr-defined]
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


def resume_and_check(url, sessions, recordings, ids, stored, backends: StuckReplay) -> None:
    """Let the stuck runner go, then another worker resumes both jobs from their trials."""
    backends.release.set()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("kato-job-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a runner thread never ended"
        time.sleep(0.05)
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
    """The grace runners have to stop by themselves, short: a test waits it out."""
    monkeypatch.setattr(worker_module, "STOP_GRACE_SECONDS", 0.5)


# Wall-clock races (a signal or a fatal error while one runner is stuck mid-measurement, grace
# deadlines of a fraction of a second): they pass alone and failed under a loaded full run, so
# they run with -m slow until the give-back waits on events rather than on time.
@pytest.mark.slow
def test_a_runners_fatal_error_gives_back_every_job_the_worker_holds(db_url, quick_grace):
    recordings = two_groups()
    sessions = session_factory(init_db(db_url))
    ids = queue(sessions, recordings)
    backends = StuckReplay(recordings, first_does="fatal")
    worker = Worker(
        sessions, db_url, ["H200"], backends, worker_id="w", poll_seconds=0.01,
        lease_seconds=120, jobs_at_once=2,
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(Fatal):
        worker.run_forever(max_jobs=2)
    assert time.monotonic() - t0 < 8
    assert backends.stuck.is_set()  # the second job's runner was still measuring
    stored = assert_given_back(sessions, ids)
    resume_and_check(db_url, sessions, recordings, ids, stored, backends)


@pytest.mark.slow
def test_an_interrupted_worker_gives_back_every_job_at_once(db_url, quick_grace):
    """SIGTERM, then its grace over (KeyboardInterrupt in the main thread, as
    :func:`stop_on_signals` raises it): the runner that can stop gives its job back itself,
    the stuck one's is given back by the worker; it returns within about a second."""
    recordings = two_groups()
    sessions = session_factory(init_db(db_url))
    ids = queue(sessions, recordings)
    backends = StuckReplay(recordings, first_does="measure")
    worker = Worker(
        sessions, db_url, ["H200"], backends, worker_id="w", poll_seconds=0.01,
        lease_seconds=120, jobs_at_once=2,
    )  # fmt: skip

    def terminate() -> None:
        if backends.stuck.wait(30):
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate, daemon=True)
    killer.start()
    with stop_on_signals(worker, grace_seconds=0.2):
        t0 = time.monotonic()
        worker.run_forever(max_jobs=2)
        took = time.monotonic() - t0
    killer.join(1)
    assert backends.stuck.is_set() and not backends.release.is_set()
    assert took < 8
    stored = assert_given_back(sessions, ids)
    resume_and_check(db_url, sessions, recordings, ids, stored, backends)
