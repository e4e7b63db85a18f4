"""One SQLite writer per engine at a time, waiting in line instead of in SQLite's busy handler.

SQLite lets one connection write at a time; the others wait in its busy handler, which sleeps
between tries (up to 100 ms each) and is not first come, first served: under a burst of
writers in one process (an API process's 40 threads submitting jobs) some wait many times the
time the writes take, and past a short lock limit get a 503. So the connections of one engine
take a gate (:class:`WriteGate`, a lock) before their transaction's first write and give it
back when the transaction ends: threads of one process queue on the gate, and only the gate's
holder meets writers of other processes in the busy handler.

The gate's wait is bounded by the same lock limit as the busy handler; past it the write fails
as SQLite's own would (``database is locked``: a transient fault, a 503 ``busy`` in the API, a
retry in a worker). A thread that already holds the gate through another connection does not
wait for itself.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

#: Statements that make SQLite's implicit transaction take the write lock (the ``sqlite3``
#: module begins a transaction before these: Python 3.11's legacy transaction control).
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class WriteGate:
    """The gate of one engine: a lock with an owner, taken for at most ``timeout`` seconds of
    waiting."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self) -> bool:
        """Take the gate; False if it did not come free within :attr:`timeout`, or if this
        thread holds it already (through another connection: it must not wait for itself)."""
        if self.owner == threading.get_ident():
            return False
        if not self._lock.acquire(timeout=self.timeout):
            raise sqlite3.OperationalError(
                f"database is locked (another writer of this process held it for more than "
                f"{self.timeout:g} s)"
            )
        self.owner = threading.get_ident()
        return True

    def release(self) -> None:
        self.owner = None
        self._lock.release()


def _is_write(sql: Any) -> bool:
    return isinstance(sql, str) and sql.lstrip()[:7].upper().startswith(_WRITES)


class _GatedCursor(sqlite3.Cursor):
    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        self.connection._enter(sql)  # type: ignore[attr-defined]
        return super().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> Any:
        self.connection._enter(sql)  # type: ignore[attr-defined]
        return super().executemany(sql, parameters)


class GatedConnection(sqlite3.Connection):
    """A ``sqlite3`` connection that holds its engine's :class:`WriteGate` from the first write
    of a transaction to its end (commit, rollback or close). ``gate`` is set right after
    connecting (:func:`gated_factory`)."""

    gate: WriteGate | None = None
    _holds = False

    def cursor(self, factory: Any = _GatedCursor) -> Any:  # type: ignore[override]
        return super().cursor(factory)

    def _enter(self, sql: str) -> None:
        if self.gate is not None and not self._holds and _is_write(sql):
            self._holds = self.gate.acquire()

    def _leave(self) -> None:
        if self._holds:
            self._holds = False
            assert self.gate is not None
            self.gate.release()

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self._leave()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self._leave()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._leave()


def gated_factory(gate: WriteGate) -> type[GatedConnection]:
    """A :class:`GatedConnection` class whose connections share ``gate`` (``sqlite3.connect``'s
    ``factory``)."""
    return type("GatedConnection", (GatedConnection,), {"gate": gate})
