"""A database that keeps the API waiting is answered within seconds, never with a hang (issue 29):
a PostgreSQL server that accepts TCP and never answers (a loopback proxy turned black hole,
:meth:`tcp_proxy.TcpProxy.hang`), and a SQLite write lock held by another process, give a 503
with ``Retry-After`` after the API's limits (``db_connect_timeout_seconds``,
``db_statement_timeout_seconds``, ``db_lock_timeout_seconds``), not after the 30 s a worker waits.

Each request runs in a thread with a bound, so that the old behaviour (a hang) fails the test
instead of hanging the suite.
"""

from __future__ import annotations

import concurrent.futures
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kato.db.session import make_engine
from kato.service.app import create_app
from kato.service.settings import Settings
from pydantic import ValidationError
from sqlalchemy import Engine
from tcp_proxy import TcpProxy
from test_database_faults import (
    JOB,
    _app_with_token,
    _pg_url,
    assert_unavailable,
    bearer,
    pg_schema,  # noqa: F401 - a fixture
    postgres_admin,  # noqa: F401 - a fixture
)

#: Seconds a request may take against a hung database under the limits the tests set (1-2 s
#: each): a connect, a ping and a statement at most, with room for 2 busy cores.
BOUND_S = 12.0


def timed(pool: concurrent.futures.ThreadPoolExecutor, call: Any, *args: Any, **kwargs: Any):
    """``call(*args, **kwargs)`` in ``pool``, and the seconds it took; fails past the bound."""
    start = time.monotonic()
    future = pool.submit(call, *args, **kwargs)
    try:
        result = future.result(timeout=BOUND_S * 2)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{args} hung for more than {BOUND_S * 2:.0f} s against a hung database")
    return result, time.monotonic() - start


@pytest.mark.postgres
def test_a_postgres_server_that_never_answers_gives_503_within_seconds(
    postgres_admin: Engine,  # noqa: F811
    pg_schema: str,  # noqa: F811
) -> None:
    target = (postgres_admin.url.host or "127.0.0.1", postgres_admin.url.port or 5432)
    proxy = TcpProxy(target)
    url = _pg_url(postgres_admin, pg_schema, port=proxy.port)
    setup, secret, job_id = _app_with_token(url)
    setup.state.engine.dispose()
    settings = Settings(
        db_url=url,
        db_connect_timeout_seconds=1.5,
        db_statement_timeout_seconds=1.5,
        db_lock_timeout_seconds=1,
    )
    app = create_app(settings)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200  # a pooled connection
            proxy.hang()
            for method, path, kwargs in [
                ("GET", f"/v1/jobs/{job_id}", {}),  # the pooled connection's ping hangs
                ("POST", "/v1/jobs", {"json": JOB}),  # a new connection hangs at its startup
                ("GET", "/v1/jobs", {}),
            ]:
                response, seconds = timed(pool, client.request, method, path, **kwargs)
                body = assert_unavailable(response, "unreachable")
                assert "in time" in body["detail"], body
                assert seconds < BOUND_S, (path, seconds)
            health, seconds = timed(pool, client.get, "/healthz")
            assert health.status_code == 503 and seconds < BOUND_S, (health.text, seconds)
            proxy.resume()
            proxy.stop()  # what the hung connections held is stale: start over
            proxy.start()
            response, _ = timed(pool, client.get, f"/v1/jobs/{job_id}")
            assert response.status_code == 200, response.text
            assert client.get("/healthz").json() == {"status": "ok", "db": "ok"}
    finally:
        proxy.stop()
        app.state.engine.dispose()
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.postgres
def test_a_postgres_statement_past_the_api_limit_gives_503_busy(
    postgres_admin: Engine,  # noqa: F811
    pg_schema: str,  # noqa: F811
) -> None:
    """A live server that is slow to answer (here: a row lock another transaction holds) cancels
    the statement at the API's limit: 503 busy, and the connection stays usable."""
    url = _pg_url(postgres_admin, pg_schema)
    setup, secret, job_id = _app_with_token(url)
    setup.state.engine.dispose()
    app = create_app(Settings(db_url=url, db_lock_timeout_seconds=1))
    holder = make_engine(url)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            with holder.connect() as locking:
                locking.exec_driver_sql(f"SELECT * FROM kato_jobs WHERE id = '{job_id}' FOR UPDATE")
                response, seconds = timed(pool, client.delete, f"/v1/jobs/{job_id}")
                assert_unavailable(response, "busy")
                assert 0.8 < seconds < 6, seconds
                locking.rollback()
            assert client.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    finally:
        holder.dispose()
        app.state.engine.dispose()
        pool.shutdown(wait=False, cancel_futures=True)


def test_an_api_write_meets_a_held_sqlite_lock_with_503_after_the_lock_setting(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kato.db"
    setup, secret, job_id = _app_with_token(f"sqlite:///{path}")
    setup.state.engine.dispose()
    app = create_app(Settings(db_url=str(path), db_lock_timeout_seconds=1))
    holder = sqlite3.connect(path, isolation_level=None)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            holder.execute("BEGIN IMMEDIATE")  # another process writing, for longer than 1 s
            for method, path_, kwargs in [
                ("POST", "/v1/jobs", {"json": JOB}),
                ("DELETE", f"/v1/jobs/{job_id}", {}),
            ]:
                response, seconds = timed(pool, client.request, method, path_, **kwargs)
                assert_unavailable(response, "busy")
                assert 0.8 < seconds < 6, (path_, seconds)  # the setting's 1 s, not 30 s
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200  # WAL: reads go on
            holder.execute("ROLLBACK")
            assert client.post("/v1/jobs", json=JOB).status_code == 202
    finally:
        holder.close()
        app.state.engine.dispose()
        pool.shutdown(wait=False, cancel_futures=True)


def test_the_api_waits_a_few_seconds_by_default_and_a_worker_much_longer(tmp_path: Path) -> None:
    """The defaults: an API request waits at most 5 s for a lock (a 503 then), a worker's
    engine keeps SQLite's 30 s busy timeout (and retries after it)."""
    api = create_app(Settings(db_url=str(tmp_path / "kato.db")))
    worker = make_engine(f"sqlite:///{tmp_path / 'kato.db'}")
    try:
        with api.state.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
        with worker.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        api.state.engine.dispose()
        worker.dispose()


@pytest.mark.parametrize(
    "field",
    ["db_connect_timeout_seconds", "db_statement_timeout_seconds", "db_lock_timeout_seconds"],
)
@pytest.mark.parametrize("bad", [0, -1, "inf", "nan", "soon"])
def test_database_limits_must_be_positive_seconds(field: str, bad: Any, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(db_url=str(tmp_path / "kato.db"), **{field: bad})
