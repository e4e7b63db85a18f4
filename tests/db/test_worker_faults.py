"""A real ``kato worker`` process against faults of its own process and database (issue 29):
SIGTERM at random moments (idle, inside its database calls, and mid-job) always stops it
within a bound, giving its job back; a persistent database fault is logged once, not on every
poll, with a line when it clears, and the polls back off meanwhile. Soaks are ``slow``."""

from __future__ import annotations

import logging
import random
import re
import signal
import sqlite3
import subprocess
import threading
import time
from datetime import timedelta

import pytest
from fleet_helpers import job, sessions_for, start_worker, stop, submit, wait_for
from kato.db import fleet, queries
from kato.db.ledger import JobLedger
from kato.db.models import RESERVED, utcnow
from kato.db.session import init_db, session_factory
from kato.tuner.factories import replay_backend_factory
from kato.tuner.worker import Worker
from paths import RECORDED
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import OperationalError

#: The worker's log channel (tuner/worker.py, tuner/job_runner.py).
WORKER_LOG = "kato.tuner.worker"

#: How long a worker may take from SIGTERM to its exit (it starts in about 3 s on 2 busy cores;
#: a stop takes well under a second: anything near this bound is a worker that did not stop).
EXIT_BOUND_S = 10.0


def _row(sessions, worker_id: str):
    with sessions() as s:
        return next((w for w in fleet.list_workers(s) if w.id == worker_id), None)


def _terminate_at_random(procs, rng: random.Random, spread: float) -> list[float]:
    """SIGTERM each of ``procs`` at a random moment within ``spread`` seconds; the seconds each
    took to exit (``inf``: it did not exit within :data:`EXIT_BOUND_S`)."""
    order = list(procs)
    rng.shuffle(order)
    sent: dict[int, float] = {}
    for p in order:
        time.sleep(rng.uniform(0, spread / len(order)))
        p.send_signal(signal.SIGTERM)
        sent[p.pid] = time.monotonic()
    took = []
    for p in procs:
        try:
            p.wait(max(EXIT_BOUND_S - (time.monotonic() - sent[p.pid]), 0.1))
            took.append(time.monotonic() - sent[p.pid])
        except subprocess.TimeoutExpired:
            took.append(float("inf"))
    return took


def _sigterm_idle_workers(
    db_url, tmp_path, rounds: int, per_round: int, seed: int, worker_url: str | None = None
) -> None:
    """Idle workers polling without pause (``--poll-seconds 0``: most of their time is in
    database calls), each sent SIGTERM at a random moment: every one exits within the bound
    with status 0 and marks itself stopped. ``worker_url``: the workers' way to the database
    (default ``db_url``)."""
    sessions = sessions_for(db_url)
    rng = random.Random(seed)
    for r in range(rounds):
        ids = [f"idle-{seed}-{r}-{i}" for i in range(per_round)]
        logs = [tmp_path / f"{w}.log" for w in ids]
        procs = [
            start_worker(worker_url or db_url, log, poll=0.0, extra=("--worker-id", w))
            for w, log in zip(ids, logs, strict=True)
        ]
        try:
            for w in ids:
                wait_for(lambda w=w: _row(sessions, w) is not None, 60, f"{w} polling", logs=logs)
            time.sleep(rng.uniform(0.1, 0.6))
            took = _terminate_at_random(procs, rng, spread=1.0)
        finally:
            stop(procs)
        for w, log, p, seconds in zip(ids, logs, procs, took, strict=True):
            output = log.read_text()
            assert seconds <= EXIT_BOUND_S, f"{w} ignored SIGTERM:\n{output[-4000:]}"
            assert p.returncode == 0, output[-4000:]
            assert _row(sessions, w).status == "stopped", output[-4000:]
            assert "claim failed" not in output and "poll failed" not in output, output[-4000:]


def test_sigterm_at_random_moments_stops_an_idle_worker_every_time(db_url, tmp_path):
    _sigterm_idle_workers(db_url, tmp_path, rounds=1, per_round=4, seed=5)


def test_an_interrupt_that_comes_back_as_a_database_error_stops_the_worker(db_url):
    """The shape a SIGTERM in SQLAlchemy's connection check takes (1 in about 24 on the old
    code): psycopg, handling the KeyboardInterrupt, raises its own ProgrammingError, which
    SQLAlchemy wraps. The worker must stop, not log 'claim failed' and poll on."""
    engine = init_db(db_url)
    sessions = session_factory(engine)
    statements = []

    def interrupted(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)
        if len(statements) == 3:  # inside the first poll
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise engine.dialect.loaded_dbapi.ProgrammingError(  # noqa: B904
                    "can't change 'autocommit' now: connection in transaction status ACTIVE"
                )

    event.listen(engine, "before_cursor_execute", interrupted)
    factory = replay_backend_factory(RECORDED)
    worker = Worker(sessions, db_url, ["H200"], factory, worker_id="w-int", poll_seconds=0.01)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    thread.join(10)
    stopped = not thread.is_alive()
    worker.stop()
    thread.join(10)
    engine.dispose()
    assert stopped, "the worker went on polling after the interrupt"
    assert len(statements) < 10
    assert _row(sessions, "w-int").status == "stopped"


@pytest.mark.parametrize("jobs_at_once", [1, 2])
@pytest.mark.parametrize("failing", [1, 2], ids=["claims-load", "runs-load"])
def test_a_job_whose_load_fails_after_its_claim_is_given_back_at_once(
    db_url, monkeypatch, caplog, jobs_at_once, failing
):
    """A claimed job whose row then cannot be read (the worker's ``failing``-th load of it: the
    claim's, or its run's) is given back at once: another worker takes it now, not after the
    120 s lease, and the worker that failed logs the fault and goes on polling."""
    sessions = session_factory(init_db(db_url))
    job_id = submit(sessions, 3)
    load, loads = JobLedger.load, []
    failed = threading.Event()

    def flaky(ledger):  # type: ignore[no-untyped-def]
        if ledger.worker_id == "w-load":
            loads.append(ledger.job_id)
            if len(loads) == failing:
                failed.set()
                raise OperationalError("SELECT", {}, sqlite3.OperationalError("database is locked"))
        return load(ledger)

    monkeypatch.setattr(JobLedger, "load", flaky)
    caplog.set_level(logging.INFO, logger="kato.tuner.worker")
    factory = replay_backend_factory(RECORDED)
    worker = Worker(
        sessions, db_url, ["H200"], factory, worker_id="w-load", poll_seconds=60,
        lease_seconds=120, jobs_at_once=jobs_at_once,
    )  # fmt: skip
    # max_jobs=1: holding the job, it polls no more until the job ends and its backoff has
    # passed (else it may retake the job it gave back before the other worker does).
    thread = threading.Thread(target=worker.run_forever, kwargs={"max_jobs": 1}, daemon=True)
    thread.start()
    try:
        # The worker's first warning or error comes after its give-back (or without one).
        wait_for(
            lambda: failed.is_set()
            and any(r.levelno >= logging.WARNING for r in caplog.records if r.name == WORKER_LOG),
            60, "the fault logged",
        )  # fmt: skip
        other = Worker(sessions, db_url, ["H200"], factory, worker_id="w-other")
        outcome = other.run_once()
        alive = thread.is_alive()
    finally:
        worker.stop()
        thread.join(10)
    assert outcome is not None and (outcome.job_id, outcome.status) == (job_id, "done")
    assert alive and not thread.is_alive()
    assert loads == [job_id] * failing
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = "worker w-load: poll failed" if failing == 1 else f"job {job_id}: given back"
    assert any(said in w and "database is locked" in w for w in warnings), warnings
    assert _row(sessions, "w-load").status == "stopped"


@pytest.mark.slow
def test_soak_sigterm_stops_an_idle_worker_every_time(db_url, tmp_path):
    _sigterm_idle_workers(db_url, tmp_path, rounds=12, per_round=3, seed=26)


def _sigterm_busy_workers(db_url, tmp_path, rounds: int, seed: int) -> None:
    """Workers each running a long job, sent SIGTERM at random moments: each exits within the
    bound with status 0, leaves no reservation behind, and gives its job back (still
    ``running``, not failed, its lease ended) with every stored trial stored once."""
    sessions = sessions_for(db_url)
    rng = random.Random(seed)
    for r in range(rounds):
        jobs = [submit(sessions, 100) for _ in range(2)]  # the recordings' whole spaces
        ids = [f"busy-{seed}-{r}-{i}" for i in range(2)]
        logs = [tmp_path / f"{w}.log" for w in ids]
        procs = [
            start_worker(db_url, log, delay=0.05, lease=120.0, extra=("--worker-id", w))
            for w, log in zip(ids, logs, strict=True)
        ]
        try:
            for j in jobs:
                wait_for(lambda j=j: job(sessions, j).trials_done >= 2, 60, "progress", logs=logs)
            took = _terminate_at_random(procs, rng, spread=1.5)
        finally:
            stop(procs)
        for w, log, p, seconds in zip(ids, logs, procs, took, strict=True):
            output = log.read_text()
            assert seconds <= EXIT_BOUND_S, f"{w} ignored SIGTERM:\n{output[-4000:]}"
            assert p.returncode == 0, output[-4000:]
            assert _row(sessions, w).status == "stopped"
        for j in jobs:
            with sessions() as s:
                found = queries.get_job(s, j)
                trials = queries.job_trials(s, j)
            assert found.status == "running", (found.status, found.error)
            # Given back: claimable at once, not after its 120 s lease.
            assert found.lease_expires_at <= utcnow() + timedelta(seconds=1), "lease kept"
            assert not [t for t in trials if t.status == RESERVED], "reservation left"
            assert found.trials_done == len(trials)
            assert sorted(t.number for t in trials) == list(range(len(trials)))
            assert len({t.config_key for t in trials}) == len(trials)
            with sessions() as s:  # out of the next round's way (its workers would resume it)
                queries.finish_job(s, j, status="cancelled")


def test_sigterm_mid_job_stops_the_worker_and_gives_the_job_back(db_url, tmp_path):
    _sigterm_busy_workers(db_url, tmp_path, rounds=1, seed=7)


@pytest.mark.slow
def test_soak_sigterm_mid_job_always_stops_the_worker(db_url, tmp_path):
    _sigterm_busy_workers(db_url, tmp_path, rounds=10, seed=27)


def _poll_lines(output: str) -> tuple[int, int, int, int]:
    """(warnings that a poll failed, tracebacks, repeats logged at debug, recovered lines)."""
    return (
        len(re.findall(r"WARNING kato\.tuner\.worker: worker \S+: poll failed:", output)),
        len(re.findall(r"\n\d{4}-\d\d-\d\d [^\n]*\nTraceback", output)),  # chained: one
        len(re.findall(r"poll failed again", output)),
        len(re.findall(r"poll recovered after", output)),
    )


def test_an_idle_worker_on_a_read_only_database_logs_the_fault_once_and_backs_off(tmp_path):
    path = tmp_path / "kato.db"
    init_db(f"sqlite:///{path}").dispose()
    log = tmp_path / "worker.log"
    worker = start_worker(
        f"sqlite:///file:{path}?mode=ro&uri=true", log, poll=0.05,
        env={"KATO_LOG_LEVEL": "DEBUG"},
    )  # fmt: skip
    try:
        wait_for(lambda: "poll failed" in log.read_text(), 60, "a failed poll", logs=[log])
        time.sleep(4)
    finally:
        stop([worker])
    output = log.read_text()
    warned, tracebacks, repeats, _ = _poll_lines(output)
    assert "poll failed: OperationalError: attempt to write a readonly database" in output
    assert (warned, tracebacks) == (1, 0), output[-4000:]
    # Waits doubling from 0.05 s: about 7 polls in 4 s, where polling at 0.05 s made 80.
    assert 2 <= repeats <= 12, output[-4000:]


def test_a_fault_that_clears_is_logged_once_with_its_traceback_and_then_recovered(db_url, tmp_path):
    """A fault that is not a transient database error (a table gone: a bug or a broken
    migration) is logged with its traceback, once; its end with a ``recovered`` line."""
    sessions = sessions_for(db_url)
    log = tmp_path / "worker.log"
    worker = start_worker(db_url, log, poll=0.05, extra=("--worker-id", "w-fault"))
    engine = create_engine(db_url)
    try:
        wait_for(lambda: _row(sessions, "w-fault") is not None, 60, "polling", logs=[log])
        with engine.begin() as c:
            c.execute(text("ALTER TABLE kato_workers RENAME TO kato_workers_away"))
        wait_for(lambda: "poll failed" in log.read_text(), 30, "a failed poll", logs=[log])
        time.sleep(2)
        with engine.begin() as c:
            c.execute(text("ALTER TABLE kato_workers_away RENAME TO kato_workers"))
        wait_for(lambda: "recovered" in log.read_text(), 30, "the recovery", logs=[log])
        time.sleep(0.5)
    finally:
        stop([worker])
        engine.dispose()
    output = log.read_text()
    assert _poll_lines(output) == (1, 1, 0, 1), output[-4000:]
