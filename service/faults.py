"""Database faults as HTTP answers: 503 with ``Retry-After`` and a JSON body, one log line.

A request that runs into a fault of the database, not of the request (the connection refused
or lost, a lock not taken in time, no pooled connection free, a read-only or full database:
:func:`db.retry.is_transient`, the worker's classification too), is answered by every route
with 503, a ``Retry-After`` and an :class:`service.schemas.UnavailablePublic` body naming the
fault. The log gets a line when requests meet a fault and at most one a minute while it lasts
(:class:`RequestFaults`), and one when the health check or the lookup cache's watcher sees the
database fail or recover (:class:`db.retry.FaultLog`), never a traceback per request. The
service recovers by itself (PostgreSQL connections are pre-pinged out of the pool).

Any other database error is a bug or a broken deployment: a 500 (JSON, traceback in the log).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from kato.db import retry
from kato.service.schemas import FaultKind
from sqlalchemy import exc as sa_exc

READ_ONLY = (
    "the database is read-only (a SQLite file or folder this process cannot write, "
    "or a PostgreSQL standby or read-only role)"
)
#: What each fault says, and the seconds to wait before retrying it.
_FAULTS: dict[FaultKind, tuple[str, int]] = {
    "unreachable": (
        "the database cannot be reached (connection refused, lost, not accepted or not "
        "answered in time)",
        5,
    ),
    "busy": ("the database is busy (another writer holds its lock, or transactions conflicted)", 2),
    "pool_exhausted": ("no database connection came free in time: the service is overloaded", 2),
    "read_only": (f"{READ_ONLY}: reads are answered, writes are not until it is writable", 60),
    "disk_full": ("the database's disk is full", 60),
}
#: SQLite's primary result codes by fault (any other fault code: unreachable).
_SQLITE_KINDS: dict[int, FaultKind] = {
    5: "busy",
    6: "busy",
    15: "busy",
    8: "read_only",
    13: "disk_full",
}


@dataclass(frozen=True)
class DatabaseFault:
    """A fault of the database: its kind, what to tell the client, when to retry."""

    kind: FaultKind
    detail: str
    retry_after: int

    def response(self) -> JSONResponse:
        """The 503 every route answers it with."""
        return JSONResponse(
            {
                "detail": f"{self.detail}; the request was not served, retry in "
                f"{self.retry_after} s",
                "fault": self.kind,
                "retryable": True,
            },
            status_code=503,
            headers={"Retry-After": str(self.retry_after)},
        )


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors behind it (SQLAlchemy's ``orig``, ``__cause__``)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if id(e) not in seen:
            seen.add(id(e))
            yield e
            todo.extend(b for b in (getattr(e, "orig", None), e.__cause__) if b is not None)


def _sqlstate(error: BaseException) -> str | None:
    return next(
        (s for e in _chain(error) if isinstance(s := getattr(e, "sqlstate", None), str) and s),
        None,
    )


def _kind(error: BaseException) -> FaultKind:
    """Which fault a database error is (it is one: :func:`database_fault` checked)."""
    for e in _chain(error):
        if isinstance(e, sa_exc.TimeoutError):
            return "pool_exhausted"
        if isinstance(e, sqlite3.Error):
            code = getattr(e, "sqlite_errorcode", None)
            if isinstance(code, int):
                return _SQLITE_KINDS.get(code & 0xFF, "unreachable")
            text = str(e).lower()  # raised by Kato itself (db.write_gate): by its message
            if "locked" in text or "busy" in text:
                return "busy"
    state = _sqlstate(error) or ""
    if state == "25006":
        return "read_only"
    if state == "53100":
        return "disk_full"
    # 57014: a statement cancelled by statement_timeout (a lock or an overloaded server).
    if state[:2] == "40" or state in ("55P03", "53300", "57014"):
        return "busy"
    return "unreachable"


def database_fault(error: BaseException) -> DatabaseFault | None:
    """The fault ``error`` is, or ``None`` for an error of the request or a bug."""
    if not retry.is_transient(error):
        return None
    kind = _kind(error)
    detail, retry_after = _FAULTS[kind]
    return DatabaseFault(kind, detail, retry_after)


class RequestFaults:
    """The log of the faults requests run into: a line when a fault (its description) is first
    met or changes, then at most one a minute while it goes on, counting the 503s answered.

    Requests cannot tell when a fault clears (a read may work while writes fail): the health
    check and the lookup cache's watcher log that (``app.state.db_faults``). Thread-safe."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0):
        self.logger, self.interval = logger, interval
        self._lock = threading.Lock()
        self._current: str | None = None
        self._logged_at = 0.0
        self._count = 0

    def failed(self, error: BaseException, fault: DatabaseFault) -> None:
        text = retry.describe(error)
        now = time.monotonic()
        with self._lock:
            self._count += 1
            if text == self._current and now - self._logged_at < self.interval:
                return
            count, self._count = self._count, 0
            self._current, self._logged_at = text, now
        self.logger.warning(
            "requests meet a database fault (%s), answered 503 with Retry-After %d s: %s%s",
            fault.kind,
            fault.retry_after,
            text,
            f" ({count} since the last line)" if count > 1 else "",
        )


async def database_error(request: Request, error: Exception) -> JSONResponse:
    """Exception handler for ``SQLAlchemyError``: a fault's 503, logged once by the app's
    :class:`RequestFaults` (``app.state.request_faults``); any other error is raised on (a
    500)."""
    fault = database_fault(error)
    if fault is None:
        raise error
    request.app.state.request_faults.failed(error, fault)
    return fault.response()


async def server_error(request: Request, error: Exception) -> JSONResponse:
    """The 500 of an unexpected error, as JSON like every other answer (Starlette logs the
    traceback)."""
    return JSONResponse({"detail": "internal server error; see the service's log"}, 500)
