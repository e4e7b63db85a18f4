"""Database fixtures: every test runs once on a SQLite file and once on PostgreSQL.

The PostgreSQL variant connects to ``KATO_TEST_POSTGRES_URL`` (default: the local ``test``
database), migrates a fresh schema per test through ``init_db`` and drops it afterwards; it skips
only when no server answers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kato.db.session import init_db, session_factory
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def postgres_url() -> str:
    return os.environ.get("KATO_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    """An autocommit engine on the test server, or a skip when there is none."""
    url = make_url(postgres_url())
    engine = create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        pytest.skip(f"no PostgreSQL server at {url.render_as_string()}: {reason}")
    yield engine
    engine.dispose()


def _sqlite_url(tmp_path: Path) -> Iterator[str]:
    yield f"sqlite:///{tmp_path / 'kato.db'}"


def _postgres_schema_url(request: pytest.FixtureRequest) -> Iterator[str]:
    admin: Engine = request.getfixturevalue("postgres_admin")
    schema = f"kato_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(postgres_url()).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (SQLite file in ``tmp_path``, or a fresh PostgreSQL schema)."""
    if request.param == "sqlite":
        yield from _sqlite_url(tmp_path)
    else:
        yield from _postgres_schema_url(request)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """``init_db`` on the empty database: the migrations run for every test."""
    engine = init_db(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def factory(engine: Engine) -> sessionmaker[Session]:
    return session_factory(engine)


@pytest.fixture
def session(factory: sessionmaker[Session]) -> Iterator[Session]:
    with factory() as session:
        yield session
