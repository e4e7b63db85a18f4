"""Probes of a database beyond "it answers": whether it takes writes.

A SQLite file that the process cannot write (its mode, a read-only mount, ``mode=ro``) is opened
read-only without a word, and so is a PostgreSQL standby or a role with
``default_transaction_read_only``: every read works and every write fails. :func:`read_only`
finds that out without writing anything.
"""

from __future__ import annotations

from kato.db.session import VERSION_TABLE
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

#: SQLite's primary result codes for "another connection holds the lock" and "read-only".
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY = 5, 6, 8
_SQLITE_WRITE_REFUSED = frozenset({_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY})


def read_only(session: Session) -> bool:
    """Whether the database behind ``session`` refuses writes. Ends with a rollback.

    PostgreSQL: ``transaction_read_only`` (a standby, or read-only by default). SQLite: a
    write that changes nothing (``DELETE ... WHERE 0`` on the migrations' version table),
    rolled back, without waiting for the lock: read-only if SQLite refuses it as such; a lock
    held by another writer means the file is writable. Other databases: ``False``.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database does not answer.
    """
    backend = session.get_bind().dialect.name
    if backend == "postgresql":
        value = session.execute(text("SHOW transaction_read_only")).scalar()
        session.rollback()
        return value == "on"
    if backend != "sqlite":
        return False
    # One transaction, so one connection, from the first statement to the rollback: the
    # connection goes back to the pool with its own busy timeout.
    timeout = int(session.execute(text("PRAGMA busy_timeout")).scalar() or 0)
    session.execute(text("PRAGMA busy_timeout=0"))  # a lock held elsewhere: answer at once
    try:
        session.execute(text(f"DELETE FROM {VERSION_TABLE} WHERE 0"))
    except OperationalError as exc:
        code = getattr(exc.orig, "sqlite_errorcode", None)
        if not isinstance(code, int) or code & 0xFF not in _SQLITE_WRITE_REFUSED:
            raise
        return code & 0xFF == _SQLITE_READONLY
    finally:
        session.execute(text(f"PRAGMA busy_timeout={timeout}"))
        session.rollback()
    return False
