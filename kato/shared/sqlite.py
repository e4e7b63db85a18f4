"""SQLite's WAL switch and lock test, shared by the client's disk cache and the service's engine."""

from __future__ import annotations

import random
import sqlite3
import time


def is_busy(exc: Exception) -> bool:
    """A lock held by another connection: transient, unlike a broken or read-only file."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def switch_to_wal(conn: sqlite3.Connection | sqlite3.Cursor, timeout_s: float) -> None:
    """``PRAGMA journal_mode=WAL`` on ``conn``, retried while another connection holds the lock.

    Connections opening a new file at once (processes of one job, a service and its workers)
    race for the switch, and SQLite answers the losers "database is locked" at once, without
    waiting on the busy timeout: retry with backoff until ``timeout_s`` instead. Shared by the
    client's disk cache (``kato_client.disk``) and the service's engine (``db.session``).
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if not is_busy(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay * (1 + random.random()))
        delay = min(delay * 2, 0.25)
