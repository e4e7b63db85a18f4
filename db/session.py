"""Engines, sessions and schema migration.

``init_db(url)`` is the one entry point the service, the worker and the CLI call: it makes the
engine and upgrades the schema to the newest Alembic revision (a no-op when already there), so
a fresh SQLite file or an empty PostgreSQL database is ready to use.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from db.models import Base
from kato_client.disk import switch_to_wal

#: Alembic scripts shipped inside the package (found from any working directory).
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
#: Our own version table: Optuna, sharing the database, uses Alembic's default name.
VERSION_TABLE = "kato_alembic_version"
#: Default SQLite file when ``KATO_DB_URL`` is not set.
DEFAULT_DB_PATH = Path("~/.local/share/kato/kato.db")

SQLITE_BUSY_TIMEOUT_MS = 30_000


def normalize_db_url(value: str) -> str:
    """A SQLAlchemy URL as is, or a plain file path as a SQLite URL (absolute, ``~`` expanded).

    The parent directory of a SQLite file is created.
    """
    value = value.strip()
    if "://" not in value:
        value = f"sqlite:///{Path(value).expanduser().resolve()}"
    _ensure_sqlite_parent(value)
    return value


def default_db_url() -> str:
    """The database URL from ``KATO_DB_URL``, else a SQLite file under ``~/.local/share/kato``.

    ``KATO_DB_URL`` may be a SQLAlchemy URL (``postgresql+psycopg://...``) or a plain file path
    (taken as a SQLite file). The parent directory of a SQLite file is created.
    """
    return normalize_db_url(os.environ.get("KATO_DB_URL", "").strip() or str(DEFAULT_DB_PATH))


def _sqlite_file(url: str) -> Path | None:
    """The file of a file-backed SQLite URL, else ``None`` (other databases, in-memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def _ensure_sqlite_parent(url: str) -> None:
    path = _sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)


def _configure_sqlite_connection(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    # WAL lets readers (the API) run while a writer (a worker) commits; busy_timeout makes a
    # second writer wait for the lock instead of failing at once.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        switch_to_wal(cursor, SQLITE_BUSY_TIMEOUT_MS / 1000)
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL, far fewer fsyncs
    finally:
        cursor.close()


def make_engine(url: str, *, connections: int | None = None) -> Engine:
    """An engine for ``url`` with Kato's connection settings.

    SQLite: WAL journal, foreign keys on, 30 s busy timeout, usable from several threads
    (``check_same_thread=False``); the parent directory of the file is created; an in-memory
    database uses a single shared connection. PostgreSQL and others: ``pool_pre_ping``.

    ``connections``: the most connections the pool holds, opened as needed and then kept (no
    overflow beyond it); an API process passes one per request thread plus headroom
    (``Settings.api_db_connections``). ``None`` (workers, the CLI): SQLAlchemy's small
    default pool (5, plus 10 overflow). Ignored for an in-memory SQLite database.
    """
    pool: dict[str, Any] = {}
    if connections is not None:
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        pool = {"pool_size": connections, "max_overflow": 0}
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        _ensure_sqlite_parent(url)
        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False}}
        if _sqlite_file(url) is None:
            kwargs["poolclass"] = StaticPool  # one in-memory database, not one per connection
        else:
            kwargs.update(pool)
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _configure_sqlite_connection)
        return engine
    return create_engine(url, pool_pre_ping=True, **pool)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """A session factory bound to ``engine``. Objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic ``include_name`` hook: reflect only our own tables, never Optuna's (or others')."""
    if type_ == "table":
        return name in Base.metadata.tables
    return True


def alembic_config() -> AlembicConfig:
    """Alembic configuration pointing at the packaged migrations (no ini file, no logging)."""
    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return config


def head_revision() -> str | None:
    """The newest revision among the packaged migrations."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (``None`` for an empty database)."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """Serialise concurrent migrations (a service and a worker starting together).

    PostgreSQL: a session-level advisory lock. SQLite file: an exclusive ``flock`` on a lock file
    beside the database. Otherwise (in-memory, platforms without ``fcntl``): no lock needed.
    """
    backend = engine.url.get_backend_name()
    if backend == "postgresql":
        key = int.from_bytes(hashlib.sha256(b"kato-migrations").digest()[:8], "big", signed=True)
        with engine.connect() as connection:
            connection.exec_driver_sql(f"SELECT pg_advisory_lock({key})")
            try:
                yield
            finally:
                connection.exec_driver_sql(f"SELECT pg_advisory_unlock({key})")
                connection.commit()
        return
    path = _sqlite_file(engine.url.render_as_string(hide_password=False))
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None  # type: ignore[assignment]
    if path is None or fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def upgrade_to_head(engine: Engine) -> None:
    """Run the Alembic migrations on ``engine`` up to head (no-op when already at head)."""
    head = head_revision()
    if current_revision(engine) == head:
        return
    with _migration_lock(engine), engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection  # env.py migrates on this connection
        command.upgrade(config, "head")


def init_db(url: str | Engine) -> Engine:
    """Make an engine for ``url`` (or take a ready engine) and migrate its schema to head."""
    engine = make_engine(url) if isinstance(url, str) else url
    upgrade_to_head(engine)
    return engine
