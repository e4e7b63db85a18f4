"""Reads behind a token (``auth_reads``) on a database that takes no writes (issue 29): the
token's ``last_used_at`` is recorded as a best effort, so every read is still answered on a
read-only database (a SQLite file this process cannot write, a read-only PostgreSQL role) and
without waiting for a write lock another process holds; writes still get their 503."""

from __future__ import annotations

import sqlite3
import time
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import tokens
from kato.db.models import ApiToken, utcnow
from kato.service.app import create_app
from kato.service.settings import Settings
from sqlalchemy import Engine, update
from test_database_faults import (
    JOB,
    LOOKUP,
    _app_with_token,
    _pg_url,
    assert_unavailable,
    bearer,
    pg_schema,  # noqa: F401 - a fixture
    postgres_admin,  # noqa: F401 - a fixture
    unwritable,
)

READS = ["/v1/jobs", "/v1/operators", "/v1/workers", LOOKUP]


def _token_last_used_long_ago(app: FastAPI, secret: str) -> str:
    """The token's id, its ``last_used_at`` set two hours back (so a read would record it)."""
    with app.state.session_factory() as session:
        token = tokens.find_token(session, secret)
        assert token is not None
        session.execute(
            update(ApiToken)
            .where(ApiToken.id == token.id)
            .values(last_used_at=utcnow() - timedelta(hours=2))
        )
        session.commit()
        return token.id


def _prepared(url: str) -> tuple[str, str, str]:
    """A migrated database at ``url`` with a token last used long ago and a queued job."""
    app, secret, job_id = _app_with_token(url)
    try:
        token_id = _token_last_used_long_ago(app, secret)
    finally:
        app.state.engine.dispose()
    return secret, job_id, token_id


def _check_reads_answered(app: FastAPI, secret: str, job_id: str) -> None:
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            for _ in range(2):
                for path in [*READS, f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/trials"]:
                    response = client.get(path)
                    assert response.status_code == 200, (path, response.text[:300])
            assert client.get("/v1/jobs", headers=bearer("kato_nope")).status_code == 401
            assert TestClient(app).get("/v1/jobs").status_code == 401  # still needs a token
            assert_unavailable(client.post("/v1/jobs", json=JOB), "read_only")
    finally:
        app.state.engine.dispose()


def test_authenticated_reads_work_on_a_sqlite_file_this_process_cannot_write(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kato.db"
    secret, job_id, _ = _prepared(f"sqlite:///{path}")
    with unwritable(path):
        _check_reads_answered(
            create_app(Settings(db_url=str(path), auth_reads=True)), secret, job_id
        )


def test_authenticated_reads_work_on_a_sqlite_file_opened_read_only(tmp_path: Path) -> None:
    path = tmp_path / "kato.db"
    secret, job_id, _ = _prepared(f"sqlite:///{path}")
    url = f"sqlite:///file:{path}?mode=ro&uri=true"
    _check_reads_answered(create_app(Settings(db_url=url, auth_reads=True)), secret, job_id)


@pytest.mark.postgres
def test_authenticated_reads_work_on_a_read_only_postgres_database(
    postgres_admin: Engine,  # noqa: F811
    pg_schema: str,  # noqa: F811
) -> None:
    secret, job_id, _ = _prepared(_pg_url(postgres_admin, pg_schema))
    url = _pg_url(postgres_admin, pg_schema, options="-cdefault_transaction_read_only=on")
    _check_reads_answered(create_app(Settings(db_url=url, auth_reads=True)), secret, job_id)


def test_an_authenticated_read_does_not_wait_for_a_write_lock_held_elsewhere(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kato.db"
    secret, job_id, token_id = _prepared(f"sqlite:///{path}")
    app = create_app(Settings(db_url=str(path), auth_reads=True, db_lock_timeout_seconds=3))
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            holder.execute("BEGIN IMMEDIATE")  # a worker writing
            start = time.monotonic()
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200
            assert time.monotonic() - start < 1.5  # not the 3 s lock limit
            holder.execute("ROLLBACK")
    finally:
        holder.close()
        app.state.engine.dispose()


def test_a_read_records_the_tokens_last_use_once_a_minute(tmp_path: Path) -> None:
    path = tmp_path / "kato.db"
    secret, job_id, token_id = _prepared(f"sqlite:///{path}")
    app = create_app(Settings(db_url=str(path), auth_reads=True))
    try:

        def last_used():
            with app.state.session_factory() as session:
                return session.get(ApiToken, token_id).last_used_at

        before = last_used()
        with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200
            first = last_used()
            assert first is not None and first - before > timedelta(hours=1)
            assert client.get(f"/v1/jobs/{job_id}").status_code == 200
            assert last_used() == first  # within the minute: not written again
    finally:
        app.state.engine.dispose()
