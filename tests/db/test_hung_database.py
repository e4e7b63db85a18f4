"""A PostgreSQL server that stops answering, and connections it dropped, seen by a worker's
engines (issue 29): every wait is bounded (:class:`db.session.DbTimeouts`), the error is a
transient fault that :func:`db.retry.call` retries, a job rides out a hung server and ends
``done``, and the Optuna storage reconnects like Kato's own engine.

The hung server is a loopback proxy that accepts and reads but forwards nothing
(:meth:`tcp_proxy.TcpProxy.hang`), as a stopped or wedged server does.
"""

from __future__ import annotations

import logging
import threading
import time

import optuna
import pytest
from fleet_helpers import job, submit, wait_for
from kato.db import retry
from kato.db.session import DbTimeouts, init_db, make_engine, session_factory, unlimited
from kato.tuner.factories import replay_backend_factory
from kato.tuner.study import optuna_storage
from kato.tuner.worker import Worker
from paths import RECORDED
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from tcp_proxy import TcpProxy
from test_db_faults import assert_stored_once

pytestmark = pytest.mark.postgres
QUICK = DbTimeouts(connect=1.5, statement=1.0, lock=1.0)


def _through(proxy: TcpProxy, url: str) -> str:
    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(False)


@pytest.fixture
def proxy(postgres_admin: Engine):
    target = (postgres_admin.url.host or "127.0.0.1", postgres_admin.url.port or 5432)
    proxy = TcpProxy(target)
    yield proxy
    proxy.stop()


def _elapsed_error(engine: Engine) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(Exception) as caught, engine.connect() as connection:
        connection.execute(text("SELECT 1"))
    return caught.value, time.monotonic() - start


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_every_wait_on_a_hung_server_is_bounded_and_transient(db_url, proxy) -> None:
    init_db(db_url).dispose()
    engine = make_engine(_through(proxy, db_url), timeouts=QUICK)
    try:
        with engine.connect() as connection:  # one pooled connection, live
            assert connection.execute(text("SHOW statement_timeout")).scalar() == "1s"
            assert connection.execute(text("SHOW lock_timeout")).scalar() == "1s"
            open_connection = engine.connect()
            open_connection.execute(text("SELECT 1"))  # in a transaction when the server hangs
        proxy.hang()
        # A statement on an open connection: the client gives up at statement + 2 s.
        start = time.monotonic()
        with pytest.raises(Exception) as caught:
            open_connection.execute(text("SELECT 2"))
        assert 2.5 < time.monotonic() - start < 8
        assert retry.is_transient(caught.value), caught.value
        open_connection.close()
        # A checkout: the pooled connection's ping, then a new connection, each bounded.
        error, seconds = _elapsed_error(engine)
        assert retry.is_transient(error) and seconds < 8, (error, seconds)
        error, seconds = _elapsed_error(engine)
        assert retry.is_transient(error) and seconds < 5, (error, seconds)
        proxy.resume()
        proxy.stop()
        proxy.start()
        with engine.connect() as connection:
            assert connection.execute(text("SELECT 3")).scalar() == 3
    finally:
        engine.dispose()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_statement_the_server_cancels_at_its_limit_leaves_the_connection_usable(
    db_url,
) -> None:
    engine = init_db(make_engine(db_url, timeouts=QUICK))
    try:
        with engine.connect() as connection:
            with pytest.raises(Exception) as caught:
                connection.execute(text("SELECT pg_sleep(5)"))
            assert retry.is_transient(caught.value) and "statement timeout" in str(caught.value)
            connection.rollback()
            assert connection.execute(text("SELECT 4")).scalar() == 4
    finally:
        engine.dispose()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_migrations_run_without_the_statement_limits(db_url) -> None:
    """A long migration is not cut by the limits meant for requests: inside ``unlimited`` (the
    migrations and their lock) the server's limits are off and the client waits as long as it
    takes; after it the connection has its limits again."""
    engine = init_db(make_engine(db_url, timeouts=QUICK))
    try:
        with engine.connect() as connection:
            with unlimited(connection):
                assert connection.execute(text("SHOW statement_timeout")).scalar() == "0"
                assert connection.execute(text("SHOW lock_timeout")).scalar() == "0"
                assert connection.execute(text("SELECT pg_sleep(3.5)")).all()  # > 1 s + 2 s
            connection.commit()
            assert connection.execute(text("SHOW statement_timeout")).scalar() == "1s"
            with pytest.raises(Exception, match="statement timeout"):
                connection.execute(text("SELECT pg_sleep(3)"))
    finally:
        engine.dispose()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_job_rides_out_a_server_that_stops_answering(
    db_url, proxy, caplog: pytest.LogCaptureFixture
) -> None:
    sessions = session_factory(init_db(db_url))
    worker_url = _through(proxy, db_url)
    worker_sessions = session_factory(make_engine(worker_url, timeouts=QUICK))
    job_id = submit(sessions, 24)
    factory = replay_backend_factory(RECORDED, delay_s=0.05)
    worker = Worker(
        worker_sessions, worker_url, ["H200"], factory, lease_seconds=30, poll_seconds=0.05
    )
    outcome: list[int] = []
    thread = threading.Thread(target=lambda: outcome.append(worker.run_forever(max_jobs=1)))
    with caplog.at_level(logging.WARNING):
        thread.start()
        try:
            wait_for(lambda: job(sessions, job_id).trials_done >= 4, 60, "progress")
            proxy.hang()
            time.sleep(6)  # several of the worker's limits
            assert job(sessions, job_id).status == "running"
            proxy.resume()
            proxy.stop()  # the hung connections hold stale bytes: cut them, as a restart does
            proxy.start()
            thread.join(120)
        finally:
            worker.stop()
            thread.join(10)
    assert outcome == [1], outcome
    assert job(sessions, job_id).status == "done"
    assert_stored_once(sessions, job_id)
    messages = [r.getMessage() for r in caplog.records]
    assert any("did not answer" in m or "timeout" in m for m in messages), messages
    assert any("recovered after" in m for m in messages), messages


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_the_optuna_storage_replaces_connections_the_server_dropped(
    db_url, postgres_admin: Engine
) -> None:
    init_db(db_url).dispose()
    name = f"kato-optuna-{time.monotonic_ns()}"
    url = make_url(db_url).update_query_dict({"application_name": name})
    storage = optuna_storage(url.render_as_string(hide_password=False))
    try:
        study = optuna.create_study(study_name="s", storage=storage)
        study.add_trial(optuna.trial.create_trial(value=1.0))
        with postgres_admin.connect() as admin:
            cut = admin.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :n"
                ),
                {"n": name},
            ).all()
        assert cut, "the storage held no connection to cut"
        time.sleep(0.2)
        # The first use after the cut: a fresh connection, not an error.
        assert [t.value for t in optuna.load_study(study_name="s", storage=storage).trials] == [1.0]
    finally:
        storage.engine.dispose()
