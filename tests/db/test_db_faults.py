"""Database faults under a running job (issue 29): connections cut by the server, a SQLite
write lock held longer than the busy timeout. A job ends ``done`` with every trial stored once;
a step retried after its commit landed is recognised as done. The soaks are ``slow``."""

from __future__ import annotations

import logging
import random
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from fleet_helpers import job, sessions_for, start_worker, stop, submit, wait_for
from kato.db import queries, retry
from kato.db.ledger import RESERVED, Ledger
from kato.db.models import Trial
from kato.db.session import DbTimeouts, init_db, make_engine, session_factory
from kato.tuner.factories import replay_backend_factory
from kato.tuner.worker import Worker
from paths import RECORDED
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)


def assert_stored_once(sessions, job_id: str) -> list[Trial]:
    """Done, every budget unit one distinct recorded trial numbered 0..n-1, none reserved."""
    with sessions() as s:
        found = queries.get_job(s, job_id)
        trials = queries.job_trials(s, job_id)
    assert found.status == "done", (found.status, found.error)
    keys = Counter(t.config_key for t in trials)
    assert max(keys.values()) == 1, "a config was stored twice"
    assert all(t.status != RESERVED for t in trials), "a reservation was left behind"
    assert found.trials_done == len(trials) == found.budget_configs
    assert sorted(t.number for t in trials) == list(range(len(trials))), "numbers repeat or skip"
    assert found.best_time_ms == min(t.time_ms for t in trials if t.status == "ok")
    return trials


def _error(run) -> BaseException:
    try:
        run()
    except BaseException as exc:  # noqa: BLE001 - the error is what the test looks at
        return exc
    raise AssertionError("no error raised")


# --- which errors are transient ---------------------------------------------------------------


def test_sqlite_faults_of_the_database_are_transient_and_the_statements_own_are_not(tmp_path):
    path = tmp_path / "kato.db"
    init_db(f"sqlite:///{path}").dispose()
    holder = sqlite3.connect(path)
    holder.execute("BEGIN IMMEDIATE")  # another process's write lock
    quick = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    try:
        with quick.connect() as c:
            locked = _error(lambda: c.execute(text("UPDATE kato_jobs SET seed = 1")))
    finally:
        holder.rollback()
        holder.close()
        quick.dispose()
    read_only = create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
    with read_only.connect() as c:
        readonly = _error(lambda: c.execute(text("DELETE FROM kato_jobs")))
        missing = _error(lambda: c.execute(text("SELECT * FROM no_such_table")))
    read_only.dispose()
    writer = create_engine(f"sqlite:///{path}")
    with writer.connect() as c:
        c.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY)"))
        c.execute(text("INSERT INTO t VALUES (1)"))
        duplicate = _error(lambda: c.execute(text("INSERT INTO t VALUES (1)")))
    writer.dispose()
    assert retry.is_transient(locked), locked
    assert retry.describe(locked) == "OperationalError: database is locked"
    assert retry.is_transient(readonly), readonly
    assert "readonly database" in retry.describe(readonly)
    assert not retry.is_transient(missing)
    assert not retry.is_transient(duplicate)


@pytest.mark.postgres
def test_a_postgres_connection_the_server_terminated_is_transient(postgres_admin):
    import optuna

    engine = create_engine(postgres_admin.url.render_as_string(hide_password=False))
    try:
        with engine.connect() as c:
            pid = c.execute(text("SELECT pg_backend_pid()")).scalar()
            with postgres_admin.connect() as admin:
                admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            cut = _error(lambda: c.execute(text("SELECT 1")))
        with engine.connect() as c:  # the pool reconnects
            assert c.execute(text("SELECT 1")).scalar() == 1
            bad = _error(lambda: c.execute(text("SELECT * FROM no_such_table_here")))
    finally:
        engine.dispose()
    assert retry.is_transient(cut), cut
    assert (
        retry.describe(cut) == "AdminShutdown: terminating connection due to administrator command"
    )
    assert not retry.is_transient(bad)
    # Optuna wraps the driver's error in its own (``raise ... from e``): still transient.
    try:
        raise optuna.exceptions.StorageInternalError("commit failed") from cut
    except optuna.exceptions.StorageInternalError as wrapped:
        assert retry.is_transient(wrapped)


def test_an_interrupt_a_library_turned_into_its_own_error_is_an_interrupt_and_not_retried():
    """What psycopg does with a SIGTERM inside SQLAlchemy's connection check: the interrupt
    is the context of the driver error raised while it was handled."""

    def ping():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise sqlite3.OperationalError("database is locked")  # noqa: B904

    wrapped = _error(ping)
    assert retry.is_interrupt(wrapped) and not retry.is_transient(wrapped)
    tries = []

    def step():
        tries.append(1)
        raise wrapped

    with pytest.raises(sqlite3.OperationalError):
        retry.call(step, what="step", logger=log, policy=retry.RetryPolicy(max_seconds=60))
    assert len(tries) == 1


def test_a_transient_fault_is_retried_with_growing_waits_until_the_bound(caplog):
    tries: list[float] = []

    def step():
        tries.append(time.monotonic())
        raise sqlite3.OperationalError("database is locked")

    policy = retry.RetryPolicy(max_seconds=0.6, first_delay=0.02, max_delay=0.2)
    with caplog.at_level(logging.DEBUG), pytest.raises(sqlite3.OperationalError):
        retry.call(step, what="reserve", logger=log, policy=policy)
    waits = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    # The bound (0.6 s) plus at most one last wait (0.2 s); slack for a loaded 2-core runner,
    # where a sleep can overshoot by tenths of a second.
    assert 0.55 <= tries[-1] - tries[0] <= 1.6
    assert 4 <= len(tries) <= 12  # doubling waits, not a busy loop
    # Growing: the last wait is cut to what is left before the bound, so compare the others.
    assert max(waits[:-1]) > waits[0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        warnings[0].getMessage(),
        "reserve: giving up: OperationalError: database is locked",
    ]
    assert "reserve failed: OperationalError: database is locked" in warnings[0].getMessage()


def test_the_retry_bound_is_configurable_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("KATO_DB_RETRY_SECONDS", "42")
    assert retry.RetryPolicy.from_env().max_seconds == 42
    monkeypatch.delenv("KATO_DB_RETRY_SECONDS")
    assert retry.RetryPolicy.from_env().max_seconds == retry.DEFAULT_RETRY_SECONDS >= 120
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv("KATO_DB_RETRY_SECONDS", bad)
        with pytest.raises(ValueError, match="KATO_DB_RETRY_SECONDS"):
            retry.RetryPolicy.from_env()


# --- steps made again after their commit landed ------------------------------------------------


def _running_job(sessions, budget: int = 5) -> str:
    job_id = submit(sessions, budget)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="w1", lease_seconds=60)
    return job_id


def _ledger(sessions, worker_id: str, job_id: str):
    return Ledger(sessions, worker_id, retry_policy=retry.RetryPolicy(max_seconds=0)).job(job_id)


def test_a_reservation_made_again_by_its_worker_is_its_own(db_url):
    sessions = sessions_for(db_url)
    job_id = _running_job(sessions, budget=1)
    first = _ledger(sessions, "w1", job_id).reserve({"a": 1}, "k")
    # The answer of the first was lost: the worker (a new ledger, knowing nothing) asks again.
    again = _ledger(sessions, "w1", job_id).reserve({"a": 1}, "k")
    other = _ledger(sessions, "w2", job_id).reserve({"a": 1}, "k")
    assert (first, again, other) == ("reserved", "reserved", "taken")
    with sessions() as s:
        assert len(queries.job_trials(s, job_id)) == 1
        assert queries.get_job(s, job_id).trials_done == 1


def test_a_completion_made_again_is_stored_once_and_answers_stored(db_url):
    sessions = sessions_for(db_url)
    job_id = _running_job(sessions)
    result = {"config": {"a": 1}, "status": "ok", "time_ms": 1.5, "times_ms": [1.4, 1.5, 1.6]}
    mine = _ledger(sessions, "w1", job_id)
    assert mine.reserve({"a": 1}, "k") == "reserved"
    # The second: a retry after the first one's answer was lost.
    answers = [mine.record("k", result) for _ in range(2)]
    other = {**result, "time_ms": 9.0, "times_ms": [9.0]}
    # Another worker's measurement of the same config is not taken for this one.
    assert not _ledger(sessions, "w2", job_id).record("k", other)
    assert answers == [True, True]
    with sessions() as s:
        (row,) = queries.job_trials(s, job_id)
        found = queries.get_job(s, job_id)
    assert (row.status, row.time_ms, row.times_ms) == ("ok", 1.5, [1.4, 1.5, 1.6])
    assert (found.trials_done, found.best_time_ms) == (1, 1.5)


def test_a_claim_made_again_takes_the_job_the_worker_already_holds(db_url):
    sessions = sessions_for(db_url)
    first_id, second_id = submit(sessions, 5), submit(sessions, 5)
    claims = []
    for _ in range(2):  # the second: a retry after the first claim's answer was lost
        with sessions() as s:
            claimed = queries.claim_next_job(
                s, gpu_models=["H200"], worker_id="w1", lease_seconds=60, resume_own=True
            )
            claims.append(claimed.id)
    assert claims == [first_id, first_id]
    with sessions() as s:
        assert queries.get_job(s, second_id).status == "queued"
        assert queries.release_lease(s, first_id, "w1")
        other = queries.claim_next_job(s, gpu_models=["H200"], worker_id="w2", lease_seconds=60)
    assert other.id == first_id  # a released lease is claimable at once, by any worker


# --- a whole job under faults -------------------------------------------------------------------


def _cut_connections(admin, application_name: str, stop_event, every: tuple[float, float]):
    """Terminate the backends of ``application_name`` every ``every`` seconds (uniform);
    returns the list of how many were cut each time (filled in as it runs)."""
    cuts: list[int] = []
    rng = random.Random(29)

    def run():
        while not stop_event.wait(rng.uniform(*every)):
            with admin.connect() as c:
                cuts.append(
                    len(
                        c.execute(
                            text(
                                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name = :n"
                            ),
                            {"n": application_name},
                        ).all()
                    )
                )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return cuts, thread


def _job_under_cuts(
    db_url, postgres_admin, tmp_path, *, budget, strategy, every, timeout, extra, delay=0.05
):
    name = f"kato-fault-{random.randrange(1 << 30)}"
    worker_url = (
        make_url(db_url)
        .update_query_dict({"application_name": name})
        .render_as_string(hide_password=False)
    )
    sessions = sessions_for(db_url)
    job_id = submit(sessions, budget, strategy=strategy)
    log_file = tmp_path / "worker.log"
    stop_event = threading.Event()
    worker = start_worker(worker_url, log_file, delay=delay, lease=5.0, extra=extra)
    try:
        wait_for(lambda: job(sessions, job_id).status == "running", 60, "a claim", logs=[log_file])
        cuts, killer = _cut_connections(postgres_admin, name, stop_event, every)
        wait_for(
            lambda: job(sessions, job_id).status != "running", timeout, "the job", logs=[log_file]
        )
        stop_event.set()
        killer.join(10)
        assert worker.poll() is None, log_file.read_text()[-3000:]
    finally:
        stop_event.set()
        stop([worker])
    output = log_file.read_text()
    assert sum(cuts) >= 3, f"the connections were cut {cuts}: too few to test anything"
    assert "Traceback" not in output, output[-5000:]
    trials = assert_stored_once(sessions, job_id)
    return trials, cuts, output


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("forest", ("--isolate",)), ("tpe", ())],
    ids=["forest-isolated", "tpe"],
)
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_job_whose_connections_are_cut_every_few_tenths_ends_done_storing_each_trial_once(
    db_url, postgres_admin, tmp_path, strategy, extra
):
    _, cuts, output = _job_under_cuts(
        db_url, postgres_admin, tmp_path,
        budget=30, strategy=strategy, every=(0.3, 0.9), timeout=120, extra=extra,
    )  # fmt: skip
    # Whether a cut lands mid-statement (an error met and retried, "recovered after" in the
    # log) or on an idle pooled connection (replaced on checkout by pool_pre_ping, no error)
    # is timing: either variant met no mid-statement cut in some runs under load, so the test
    # is the invariants _job_under_cuts checks: at least 3 cuts of the worker's connections
    # during the job, the job done, each trial stored once, no traceback. The retry of an
    # error met mid-statement has its own tests above (retry.call, the SQLite lock).
    assert sum(cuts) >= 3 and "Traceback" not in output


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize("every", [(4.0, 6.0), (1.0, 2.0)], ids=["4-6s", "1-2s"])
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_soak_a_long_job_whose_connections_are_cut_ends_done(
    db_url, postgres_admin, tmp_path, every
):
    _job_under_cuts(
        db_url, postgres_admin, tmp_path,
        budget=100, strategy="forest", every=every, timeout=900, extra=("--isolate",),
        delay=0.3,  # the recording's whole space, measured over 30 s or more
    )  # fmt: skip


_LOCK_HOLDER = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("COMMIT")
"""


def _hold_write_lock(path, seconds: float) -> subprocess.Popen:
    """Another process that takes the SQLite file's write lock and holds it ``seconds``."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(path), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_job_outlasts_a_write_lock_held_longer_than_the_busy_timeout(tmp_path):
    """The issue's 45 s lock against a 30 s busy timeout, scaled down: 0.2 s and 2.5 s."""
    path = tmp_path / "kato.db"
    url = f"sqlite:///{path}"
    sessions = session_factory(init_db(make_engine(url, timeouts=DbTimeouts(lock=0.2))))
    job_id = submit(sessions, 24)
    factory = replay_backend_factory(RECORDED, delay_s=0.02)
    worker = Worker(sessions, url, ["H200"], factory, lease_seconds=30, poll_seconds=0.05)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(worker.run_forever(max_jobs=1)))
    thread.start()
    try:
        wait_for(lambda: job(sessions, job_id).trials_done >= 4, 60, "progress")
        holder = _hold_write_lock(path, 2.5)
        time.sleep(0.5)
        assert job(sessions, job_id).status == "running"  # waiting on the lock
        assert holder.wait(10) == 0
        thread.join(60)
    finally:
        worker.stop()
        thread.join(10)
    assert outcome == [1]
    assert_stored_once(sessions, job_id)


@pytest.mark.slow
def test_soak_a_worker_outlasts_a_45_s_write_lock(tmp_path):
    """The issue's case as it is: `kato worker`, the 30 s busy timeout, a 45 s lock."""
    path = tmp_path / "kato.db"
    url = f"sqlite:///{path}"
    sessions = session_factory(init_db(url))
    job_id = submit(sessions, 40)
    log_file = tmp_path / "worker.log"
    worker = start_worker(url, log_file, delay=0.05, lease=60.0)
    try:
        wait_for(lambda: job(sessions, job_id).trials_done >= 4, 60, "progress", logs=[log_file])
        holder = _hold_write_lock(path, 45)
        assert holder.wait(60) == 0
        wait_for(lambda: job(sessions, job_id).status != "running", 120, "the job", logs=[log_file])
    finally:
        stop([worker])
    assert_stored_once(sessions, job_id)
    assert "database is locked" in log_file.read_text()
