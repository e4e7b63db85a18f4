"""The client's on-disk cache: lookup answers that survive restarts and serve offline.

One SQLite file (``lookups.sqlite3`` in the cache directory) in WAL mode with a busy timeout, so
threads and processes (one per rank) read and write it at once. A row is one lookup's answer
for one server: ``(server, key) -> (answer JSON, fetched_at)``. A write never replaces a newer
answer. A lock held by another process is waited for (the busy timeout; opening a new file, where
SQLite does not wait, is retried); past that one access is skipped. Any other SQLite error (a
read-only or full disk, a broken file) is logged once and the cache then behaves as empty: the
disk cache is an optimisation, never a reason for a lookup to fail.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from kato import env
from kato.shared.sqlite import is_busy, switch_to_wal

log = logging.getLogger("kato_client")

FILENAME = "lookups.sqlite3"
BUSY_TIMEOUT_MS = 10_000


_SCHEMA = """
CREATE TABLE IF NOT EXISTS lookups (
    server TEXT NOT NULL,
    key TEXT NOT NULL,
    operator TEXT NOT NULL,
    dtype TEXT NOT NULL,
    gpu TEXT NOT NULL,
    answer TEXT NOT NULL,
    fetched_at REAL NOT NULL,
    PRIMARY KEY (server, key)
)
"""


def default_cache_dir() -> Path:
    """``KATO_CACHE_DIR``, else the platform's user cache directory for ``kato``."""
    where = (env.get("KATO_CACHE_DIR") or "").strip()
    if where:
        return Path(where).expanduser()
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # pragma: no cover - platformdirs is everywhere pip is
        return Path("~/.cache/kato").expanduser()
    return Path(user_cache_dir("kato"))


class DiskCache:
    """Lookup answers on disk, shared by every thread and process that opens the same directory.

    Thread-safe: one connection per instance, used under a lock (only cache misses come here).
    """

    def __init__(self, directory: str | Path, server: str) -> None:
        self.path = Path(directory).expanduser() / FILENAME
        self.server = server
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._broken = False

    def _connect(self) -> sqlite3.Connection | None:
        if self._conn is not None or self._broken:
            return self._conn
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                timeout=BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,  # autocommit: every statement is its own transaction
                check_same_thread=False,
            )
        except (sqlite3.Error, OSError) as exc:
            self._fail(exc)
            return None
        try:
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            switch_to_wal(conn, BUSY_TIMEOUT_MS / 1000)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SCHEMA)
        except sqlite3.Error as exc:
            conn.close()
            self._fail(exc)
            return None
        self._conn = conn
        return conn

    def _fail(self, exc: Exception) -> None:
        """Give the disk cache up for this instance, unless ``exc`` is only a busy lock (then
        this one read or write is skipped)."""
        if is_busy(exc) and self._conn is not None:
            log.info("kato client: disk cache %s busy, skipping one access: %s", self.path, exc)
            return
        if not self._broken:
            log.warning(
                "kato client: disk cache %s unusable, continuing without it: %s", self.path, exc
            )
        self._broken = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def get(self, key: str) -> tuple[dict[str, Any], float] | None:
        """``(answer, fetched_at)`` stored for ``key``, or ``None``."""
        with self._lock:
            conn = self._connect()
            if conn is None:
                return None
            try:
                row = conn.execute(
                    "SELECT answer, fetched_at FROM lookups WHERE server = ? AND key = ?",
                    (self.server, key),
                ).fetchone()
            except sqlite3.Error as exc:
                self._fail(exc)
                return None
        if row is None:
            return None
        try:
            return json.loads(row[0]), float(row[1])
        except ValueError:
            return None

    def put(self, key: str, answer: dict[str, Any], fetched_at: float) -> None:
        """Store ``answer`` for ``key`` unless a newer answer is stored already."""
        payload = json.dumps(answer, separators=(",", ":"))
        with self._lock:
            conn = self._connect()
            if conn is None:
                return
            try:
                conn.execute(
                    "INSERT INTO lookups (server, key, operator, dtype, gpu, answer, fetched_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (server, key) DO UPDATE SET "
                    "answer = excluded.answer, fetched_at = excluded.fetched_at "
                    "WHERE excluded.fetched_at >= lookups.fetched_at",
                    (
                        self.server,
                        key,
                        str(answer.get("operator", "")),
                        str(answer.get("dtype", "")),
                        str(answer.get("gpu", "")),
                        payload,
                        fetched_at,
                    ),
                )
            except sqlite3.Error as exc:
                self._fail(exc)

    def forget(self, operator: str, dtype: str, gpu: str) -> None:
        """Drop every answer for this operator, dtype and GPU (e.g. after a tuning job)."""
        with self._lock:
            conn = self._connect()
            if conn is None:
                return
            try:
                conn.execute(
                    "DELETE FROM lookups WHERE server = ? AND operator = ? AND dtype = ? "
                    "AND gpu = ?",
                    (self.server, operator, dtype, gpu),
                )
            except sqlite3.Error as exc:
                self._fail(exc)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
