"""Engines, sessions and schema migration.

``init_db(url)`` is the one entry point the service, the worker and the CLI call: it makes the
engine and upgrades the schema to the newest Alembic revision (a no-op when already there), so
a fresh SQLite file or an empty PostgreSQL database is ready to use.

Every engine bounds how long the database may keep a caller waiting (:class:`DbTimeouts`): a
server that accepts TCP and never answers, a lock held elsewhere or a statement that never ends
becomes an error within the limit (a transient fault to :mod:`db.retry`: the API answers it
with 503 and ``Retry-After``, a worker retries), never a hang. Workers and the CLI wait
patiently (:data:`WORKER_TIMEOUTS`), the API briefly (``Settings.db_timeouts``).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from kato.db.models import Base
from kato.db.write_gate import WriteGate, gated_factory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from kato import env
from kato.shared.sqlite import switch_to_wal

#: Alembic scripts shipped inside the package (found from any working directory).
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
#: Our own version table: Optuna, sharing the database, uses Alembic's default name.
VERSION_TABLE = "kato_alembic_version"
#: Default SQLite file when ``KATO_DB_URL`` is not set.
DEFAULT_DB_PATH = Path("~/.local/share/kato/kato.db")


@dataclass(frozen=True)
class DbTimeouts:
    """How long the database may keep one caller waiting, in seconds.

    - ``connect``: opening a PostgreSQL connection (libpq's ``connect_timeout``; a URL's own
      ``connect_timeout`` wins). A server that accepts TCP and never answers fails after it.
    - ``statement``: one PostgreSQL statement (the server's ``statement_timeout``), and, a little
      longer (:data:`CLIENT_GRACE`), every wait of the client for the server (a statement, a
      commit, a rollback, the pool's liveness ping): a server that stopped answering on an open
      connection cannot cancel anything, so the client closes the connection itself. ``None``:
      no limit. SQLite: unused (a statement there runs in this process).
    - ``lock``: waiting for a lock another transaction holds: SQLite's busy timeout (its write
      lock), PostgreSQL's ``lock_timeout`` (a row or table lock). Its error is "busy".

    Migrations run without the statement and lock limits (a large schema change takes longer).
    """

    connect: float = 10.0
    statement: float | None = 60.0
    lock: float = 30.0

    def __post_init__(self) -> None:
        for name in ("connect", "statement", "lock"):
            value = getattr(self, name)
            if value is None and name == "statement":
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"DbTimeouts.{name} must be a positive number of seconds")


#: Workers and the CLI: patient (a worker retries a fault anyway; an import may write long).
WORKER_TIMEOUTS = DbTimeouts()
#: Seconds the client waits beyond ``statement_timeout`` before it gives up on the server (the
#: server's own cancel, when it still runs, arrives first and leaves the connection usable).
CLIENT_GRACE = 2.0


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
    return normalize_db_url((env.get("KATO_DB_URL") or "").strip() or str(DEFAULT_DB_PATH))


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


def _configure_sqlite_connection(
    dbapi_connection: sqlite3.Connection, _record: Any, busy_timeout_ms: int
) -> None:
    # WAL lets readers (the API) run while a writer (a worker) commits; busy_timeout makes a
    # second writer wait for the lock instead of failing at once.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        switch_to_wal(cursor, busy_timeout_ms / 1000)
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL, far fewer fsyncs
    finally:
        cursor.close()


def configure_sqlite(engine: Engine, timeouts: DbTimeouts = WORKER_TIMEOUTS) -> None:
    """Give every new SQLite connection of ``engine`` Kato's settings: WAL, foreign keys,
    ``synchronous=NORMAL`` and ``timeouts.lock`` as its busy timeout."""
    busy_ms = int(timeouts.lock * 1000)

    def configure(dbapi_connection: sqlite3.Connection, record: Any) -> None:
        _configure_sqlite_connection(dbapi_connection, record, busy_ms)

    event.listen(engine, "connect", configure)


def _deadline_connection_class() -> type | None:
    """A ``psycopg.Connection`` whose every wait for the server ends after ``io_timeout``
    seconds (closing the connection: the protocol is mid-message), or ``None`` where psycopg
    is missing or too old to bound a wait (``Connection.wait(timeout=)``, psycopg 3.2.4+)."""
    try:
        import psycopg
        from psycopg import errors
    except ImportError:
        return None
    wait_timeout = getattr(errors, "_WaitTimeout", None)
    if (
        wait_timeout is None
        or "timeout" not in inspect.signature(psycopg.Connection.wait).parameters
    ):
        return None

    class DeadlineConnection(psycopg.Connection):  # type: ignore[type-arg]
        io_timeout: float | None = None

        def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
            limit = self.io_timeout if timeout is None else timeout
            try:
                return super().wait(gen, interval=interval, timeout=limit)
            except wait_timeout:
                self.pgconn.finish()  # closed: SQLAlchemy sees a disconnect and drops it
                raise psycopg.OperationalError(
                    f"the database did not answer within {limit:g} s (connection closed)"
                ) from None

    return DeadlineConnection


_DEADLINE_CONNECTION: type | None | bool = False  # not looked up yet


def _deadline_connection() -> type | None:
    global _DEADLINE_CONNECTION
    if _DEADLINE_CONNECTION is False:
        _DEADLINE_CONNECTION = _deadline_connection_class()
    return _DEADLINE_CONNECTION  # type: ignore[return-value]


def configure_postgres(engine: Engine, timeouts: DbTimeouts = WORKER_TIMEOUTS) -> None:
    """Bound every wait of ``engine``'s PostgreSQL connections by ``timeouts`` (see
    :class:`DbTimeouts`): ``connect_timeout`` unless the URL sets one; ``statement_timeout``
    and ``lock_timeout`` set on each new connection; with the ``psycopg`` driver, a client-side
    limit on each wait for the server. Other drivers get the server-side limits only (and
    ``connect_timeout`` only where libpq takes it: psycopg, psycopg2)."""
    connection_class = _deadline_connection() if engine.dialect.driver == "psycopg" else None
    io_timeout = None if timeouts.statement is None else timeouts.statement + CLIENT_GRACE

    libpq = engine.dialect.driver in ("psycopg", "psycopg2")  # drivers that take connect_timeout

    @event.listens_for(engine, "do_connect")
    def connect(dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        if libpq:  # libpq counts whole seconds, at least 2
            cparams.setdefault("connect_timeout", max(2, math.ceil(timeouts.connect)))
        if connection_class is None:
            return None  # the dialect connects as usual
        connection = connection_class.connect(*cargs, **cparams)
        connection.io_timeout = io_timeout
        return connection

    # The pool's liveness ping (pool_pre_ping) is as quick as a connect: a server that does not
    # answer it within ``connect`` seconds is taken for gone, and a new connection is tried.
    default_ping = engine.dialect.do_ping

    def do_ping(dbapi_connection: Any) -> bool:
        saved = getattr(dbapi_connection, "io_timeout", None)
        if saved is None:
            return default_ping(dbapi_connection)
        dbapi_connection.io_timeout = min(saved, timeouts.connect)
        try:
            return default_ping(dbapi_connection)
        finally:
            dbapi_connection.io_timeout = saved

    engine.dialect.do_ping = do_ping  # type: ignore[method-assign]

    statement_ms = 0 if timeouts.statement is None else int(timeouts.statement * 1000)
    lock_ms = int(timeouts.lock * 1000)

    @event.listens_for(engine, "connect")
    def limits(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"SET statement_timeout = {statement_ms}")
            cursor.execute(f"SET lock_timeout = {lock_ms}")
        finally:
            cursor.close()
        dbapi_connection.commit()


@contextlib.contextmanager
def unlimited(connection: Connection) -> Iterator[Connection]:
    """``connection`` without the statement and lock limits of :class:`DbTimeouts` inside
    the block (migrations, the migration lock), on PostgreSQL; SQLite keeps its busy timeout.
    Starts the connection's transaction; the limits come back when it ends."""
    if connection.dialect.name != "postgresql":
        yield connection
        return
    connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
    connection.exec_driver_sql("SET LOCAL lock_timeout = 0")
    dbapi = connection.connection.dbapi_connection
    saved = getattr(dbapi, "io_timeout", None)
    if saved is not None:
        dbapi.io_timeout = None  # type: ignore[union-attr]
    try:
        yield connection
    finally:
        if saved is not None:
            dbapi.io_timeout = saved  # type: ignore[union-attr]


def make_engine(
    url: str, *, connections: int | None = None, timeouts: DbTimeouts = WORKER_TIMEOUTS
) -> Engine:
    """An engine for ``url`` with Kato's connection settings.

    SQLite: WAL journal, foreign keys on, ``timeouts.lock`` as busy timeout (30 s for workers),
    usable from several threads (``check_same_thread=False``), the engine's writers queued on
    one gate (:mod:`db.write_gate`, waiting at most ``timeouts.lock`` too); the parent
    directory of the file is created; an in-memory database uses a single shared connection.
    PostgreSQL and others: ``pool_pre_ping`` (a connection the server dropped is replaced,
    not handed out), and on PostgreSQL the limits of ``timeouts`` (:func:`configure_postgres`).

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
            # Writers of this engine queue on a gate, not in SQLite's unfair busy handler.
            gate = WriteGate(timeouts.lock)
            kwargs["connect_args"]["factory"] = gated_factory(gate)
        engine = create_engine(url, **kwargs)
        configure_sqlite(engine, timeouts)
        return engine
    engine = create_engine(url, pool_pre_ping=True, **pool)
    if engine.dialect.name == "postgresql":
        configure_postgres(engine, timeouts)
    return engine


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
        with engine.connect() as connection, unlimited(connection):
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
    with _migration_lock(engine), engine.begin() as connection, unlimited(connection):
        config = alembic_config()
        config.attributes["connection"] = connection  # env.py migrates on this connection
        command.upgrade(config, "head")


def init_db(url: str | Engine) -> Engine:
    """Make an engine for ``url`` (or take a ready engine) and migrate its schema to head."""
    engine = make_engine(url) if isinstance(url, str) else url
    upgrade_to_head(engine)
    return engine
