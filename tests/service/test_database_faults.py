"""A database fault behind a running server: every route answers 503 with ``Retry-After`` and a
JSON body saying what is wrong, the log gets a line (not a traceback per request), and the
service recovers by itself when the database returns. A read-only database: ``/healthz`` says
so, reads are answered, writes get a 503 saying the database is read-only.

Faults are real: PostgreSQL behind a loopback proxy that is cut and restored
(:class:`tcp_proxy.TcpProxy`) or opened read-only, a SQLite file opened read-only or locked by
another connection, a connection pool with no connection free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import tokens
from kato.db.session import init_db, make_engine
from kato.service.app import create_app
from kato.service.settings import Settings
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from tcp_proxy import TcpProxy

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
LOOKUP = "/v1/configs/softmax?shape=4096x4096&dtype=float16&gpu=H200"


def routes(job_id: str) -> list[tuple[str, str, dict[str, Any], int]]:
    """Every route that reads or writes the database: (method, path, request kwargs, status
    when the database answers)."""
    return [
        ("GET", "/v1/jobs", {}, 200),
        ("GET", f"/v1/jobs/{job_id}", {}, 200),
        ("GET", f"/v1/jobs/{job_id}/trials", {}, 200),
        ("POST", "/v1/jobs", {"json": JOB}, 202),
        ("POST", "/v1/jobs/batch", {"json": {"jobs": [JOB]}}, 202),
        ("DELETE", f"/v1/jobs/{uuid.uuid4().hex}", {}, 404),
        ("GET", "/v1/workers", {}, 200),
        # no-cache: from the database, not from the lookup cache
        ("GET", LOOKUP, {"headers": {"Cache-Control": "no-cache"}}, 200),
        ("POST", "/v1/configs/batch", {"json": {"lookups": [JOB]}}, 200),
    ]


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def assert_unavailable(response: Any, fault: str) -> dict[str, Any]:
    """A 503 with a Retry-After in seconds and the JSON body of a database fault."""
    assert response.status_code == 503, (response.request.url, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["retry-after"]) >= 1
    body = response.json()
    assert body["fault"] == fault and body["retryable"] is True, body
    assert "database" in body["detail"] and "retry" in body["detail"].lower(), body
    return body


def fault_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The warnings and errors logged meanwhile (SQLAlchemy's, Starlette's, uvicorn's, ours)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- PostgreSQL -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def postgres_admin() -> Iterator[Engine]:
    """An autocommit engine on the test server, or a skip when there is none."""
    url = make_url(os.environ.get("KATO_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL))
    engine = create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        pytest.skip(f"no PostgreSQL server at {url.render_as_string()}: {exc.orig}")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_schema(postgres_admin: Engine) -> Iterator[str]:
    """A fresh schema on the test server, migrated; its name."""
    schema = f"kato_test_{uuid.uuid4().hex[:12]}"
    with postgres_admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    init_db(_pg_url(postgres_admin, schema)).dispose()
    yield schema
    with postgres_admin.connect() as connection:
        connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def _pg_url(admin: Engine, schema: str, *, port: int | None = None, options: str = "") -> str:
    url = admin.url.update_query_dict({"options": f"-csearch_path={schema} {options}".strip()})
    if port is not None:
        url = url.set(host="127.0.0.1", port=port)
    return url.render_as_string(hide_password=False)


def _app_with_token(url: str) -> tuple[FastAPI, str, str]:
    """The app on ``url``, a token's secret and a job's id."""
    app = create_app(Settings(db_url=url))
    with app.state.session_factory() as session:
        secret = tokens.create_token(session, "tests")[1]
    with TestClient(app, headers=bearer(secret)) as client:
        job_id = client.post("/v1/jobs", json=JOB).json()["id"]
    return app, secret, job_id


@pytest.mark.postgres
def test_postgres_going_away_gives_503s_and_recovery(
    postgres_admin: Engine, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    target = (postgres_admin.url.host or "127.0.0.1", postgres_admin.url.port or 5432)
    proxy = TcpProxy(target)
    app, secret, job_id = _app_with_token(_pg_url(postgres_admin, pg_schema, port=proxy.port))
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            for method, path, kwargs, ok in routes(job_id):
                assert client.request(method, path, **kwargs).status_code == ok, path

            proxy.stop()
            caplog.clear()
            with caplog.at_level(logging.INFO):
                health = client.get("/healthz")
                assert health.status_code == 503 and health.json()["status"] == "error"
                assert health.json()["db"].startswith("unreachable"), health.json()
                for _ in range(3):  # repeated requests do not log a line each
                    for method, path, kwargs, _ok in routes(job_id):
                        body = assert_unavailable(
                            client.request(method, path, **kwargs), "unreachable"
                        )
                        assert str(proxy.port) not in body["detail"]  # no host or port shown
                time.sleep(1.2)  # the lookup cache's watcher polls the database meanwhile
            records = fault_records(caplog)
            assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
            assert len(records) <= 4, [r.getMessage() for r in records]

            proxy.start()
            for method, path, kwargs, ok in routes(job_id):
                response = client.request(method, path, **kwargs)
                assert response.status_code == ok, (path, response.text[:200])
            assert client.get("/healthz").json() == {"status": "ok", "db": "ok"}
    finally:
        proxy.stop()
        app.state.engine.dispose()


@pytest.mark.postgres
def test_a_read_only_postgres_database_answers_reads_and_refuses_writes(
    postgres_admin: Engine, pg_schema: str
) -> None:
    app, secret, job_id = _app_with_token(_pg_url(postgres_admin, pg_schema))
    app.state.engine.dispose()
    # As a standby, or with default_transaction_read_only set: every transaction is read-only.
    read_only = _pg_url(postgres_admin, pg_schema, options="-cdefault_transaction_read_only=on")
    _check_read_only(create_app(Settings(db_url=read_only)), secret, job_id)


# --- SQLite -----------------------------------------------------------------------------------


def _check_read_only(app: FastAPI, secret: str, job_id: str) -> None:
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            health = client.get("/healthz")
            assert health.status_code == 200, health.text
            assert health.json()["status"] == "degraded" and health.json()["db"] == "read-only"
            assert "read-only" in health.json()["detail"]
            for method, path, kwargs, ok in routes(job_id):
                response = client.request(method, path, **kwargs)
                if method == "POST" and path.startswith("/v1/jobs"):
                    body = assert_unavailable(response, "read_only")
                    assert "read-only" in body["detail"]
                else:  # reads, lookups, and a cancel of no job (nothing to write)
                    assert response.status_code == ok, (path, response.text[:200])
            assert_unavailable(client.delete(f"/v1/jobs/{job_id}"), "read_only")
            assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    finally:
        app.state.engine.dispose()


@pytest.fixture
def sqlite_job(tmp_path: Path) -> tuple[Path, str, str]:
    """A migrated SQLite file holding a token and a queued job: (path, secret, job id)."""
    path = tmp_path / "kato.db"
    app, secret, job_id = _app_with_token(f"sqlite:///{path}")
    app.state.engine.dispose()
    return path, secret, job_id


def test_a_sqlite_file_opened_read_only_answers_reads_and_refuses_writes(
    sqlite_job: tuple[Path, str, str],
) -> None:
    path, secret, job_id = sqlite_job
    url = f"sqlite:///file:{path}?mode=ro&uri=true"  # what SQLite does with a file it cannot write
    _check_read_only(create_app(Settings(db_url=url)), secret, job_id)


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """``path`` made a file this process cannot write: mode 0444, or for root (who writes a
    file whatever its mode) the immutable attribute; a skip where neither can be set."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i (CAP_LINUX_IMMUTABLE) on this filesystem")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


def test_a_sqlite_file_this_process_cannot_write_refuses_writes(
    sqlite_job: tuple[Path, str, str],
) -> None:
    path, secret, job_id = sqlite_job
    with unwritable(path):
        _check_read_only(create_app(Settings(db_url=str(path))), secret, job_id)


def test_a_sqlite_write_lock_held_elsewhere_gives_503_busy(
    sqlite_job: tuple[Path, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    path, secret, job_id = sqlite_job
    engine = make_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def short_busy_timeout(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout=200")  # not 30 s: a quick test

    app = create_app(Settings(db_url=f"sqlite:///{path}"), engine=engine)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            holder.execute("BEGIN IMMEDIATE")  # another process writing, for longer than 200 ms
            with caplog.at_level(logging.INFO):
                for _ in range(3):
                    assert_unavailable(client.post("/v1/jobs", json=JOB), "busy")
                    assert_unavailable(client.delete(f"/v1/jobs/{job_id}"), "busy")
                    assert client.get("/v1/jobs").status_code == 200  # WAL: reads go on
                assert client.get("/healthz").json()["status"] == "ok"
            records = fault_records(caplog)
            assert not [r for r in records if r.exc_info] and len(records) <= 2, [
                r.getMessage() for r in records
            ]
            holder.execute("ROLLBACK")
            assert client.post("/v1/jobs", json=JOB).status_code == 202
            assert client.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    finally:
        holder.close()
        app.state.engine.dispose()


def test_no_free_connection_in_the_pool_gives_503(sqlite_job: tuple[Path, str, str]) -> None:
    path, secret, job_id = sqlite_job
    engine = create_engine(
        f"sqlite:///{path}",
        pool_size=1,
        max_overflow=0,
        pool_timeout=0.2,
        connect_args={"check_same_thread": False},
    )
    app = create_app(Settings(db_url=f"sqlite:///{path}"), engine=engine)
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            with engine.connect():  # the pool's one connection, held
                assert_unavailable(client.get(f"/v1/jobs/{job_id}"), "pool_exhausted")
                assert_unavailable(client.post("/v1/jobs", json=JOB), "pool_exhausted")
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200
    finally:
        engine.dispose()


def test_an_error_of_the_database_that_is_not_a_fault_stays_a_500(
    sqlite_job: tuple[Path, str, str],
) -> None:
    # A missing table is a broken deployment, not a passing fault: no Retry-After invites retries.
    path, secret, _ = sqlite_job
    app = create_app(Settings(db_url=f"sqlite:///{path}"))
    try:
        with app.state.engine.begin() as connection:
            connection.execute(text("DROP TABLE kato_workers"))
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            response = client.get("/v1/workers")
            assert response.status_code == 500 and "retry-after" not in response.headers
            assert response.json() == {"detail": "internal server error; see the service's log"}
    finally:
        app.state.engine.dispose()


def test_every_operation_documents_the_503(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "503" not in paths["/v1/ping"]["get"]["responses"]  # the one route without a database
    for path, item in paths.items():
        for method, operation in item.items():
            if path == "/v1/ping":
                continue
            response = operation["responses"].get("503")
            assert response is not None, (method, path)
            schema = response["content"]["application/json"]["schema"]["$ref"]
            expected = "HealthPublic" if path == "/healthz" else "UnavailablePublic"
            assert schema.endswith(f"/{expected}"), (method, path, schema)
