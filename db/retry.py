"""Transient database faults: which errors they are, how long to retry them, and how to log them.

One place decides what a *transient* database error is (:func:`is_transient`): the connection
was lost or refused (PostgreSQL restarted, ``pg_terminate_backend``, a network blip), the server
asked for a retry (serialization failure, deadlock, lock not available, too many connections,
a standby during a failover) or SQLite could not take its lock in time (``database is locked``),
could not write (read-only file, full disk, I/O error). Such an error says nothing about the
work that ran into it: the same step, run again once the database answers, succeeds. Anything
else (a constraint, a missing table, bad data) is the caller's to handle.

The worker (:mod:`tuner.worker`) retries idempotent steps with :func:`call` under a
:class:`RetryPolicy` (exponential backoff with jitter, for up to ``KATO_DB_RETRY_SECONDS``,
default 300: long enough for a database restart) and logs a persistent fault once
(:class:`FaultLog`). The service may use :func:`is_transient` to answer such a fault with 503.

Errors are looked through: SQLAlchemy's wrapper (``orig``), Optuna's ``StorageInternalError``
(``__cause__``) and an error raised while another was handled (``__context__``). The same walk
finds an interrupt (``KeyboardInterrupt``, ``SystemExit``) that a library caught and wrapped in
an ordinary exception (:func:`is_interrupt`): it must stop the process, not be retried.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import exc as sa_exc

from kato import env

T = TypeVar("T")

#: Default of ``KATO_DB_RETRY_SECONDS``: how long a step is retried before its error is raised.
DEFAULT_RETRY_SECONDS = 300.0

#: PostgreSQL SQLSTATE classes and codes that ask for a retry: connection exception (08),
#: transaction rollback (40: serialization failure, deadlock), insufficient resources (53),
#: operator intervention (57: admin shutdown, cannot connect now, query cancelled), system
#: error (58), lock not available (55P03), read-only transaction (25006: a standby that is
#: being promoted).
_PG_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})
_PG_TRANSIENT_CODES = frozenset({"55P03", "25006"})

#: SQLite primary result codes of a fault of the database, not of the statement: BUSY,
#: LOCKED, READONLY, INTERRUPT, IOERR, FULL, CANTOPEN, PROTOCOL.
_SQLITE_TRANSIENT_CODES = frozenset({5, 6, 8, 9, 10, 13, 14, 15})
_SQLITE_TRANSIENT_TEXT = (
    "database is locked",
    "database table is locked",
    "database is busy",
    "readonly database",
    "disk i/o error",
    "unable to open database file",
    "database or disk is full",
    "interrupted",
)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception behind it (``orig``, ``__cause__``, ``__context__``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        behind = (getattr(e, "orig", None), e.__cause__, e.__context__)
        todo.extend(b for b in behind if isinstance(b, BaseException))


def is_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is, or wraps, a ``KeyboardInterrupt`` or ``SystemExit`` (a signal that
    landed inside a library call comes back wrapped in the library's own error)."""
    return any(isinstance(e, KeyboardInterrupt | SystemExit) for e in _chain(error))


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
        return True  # SQLAlchemy saw a disconnect and dropped the connection
    if isinstance(e, sa_exc.TimeoutError | sa_exc.DisconnectionError):
        return True  # no pooled connection came free in time; a connection found dead
    if isinstance(e, sa_exc.SQLAlchemyError):
        return False  # its ``orig`` (the driver's error) decides
    sqlstate = getattr(e, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:  # a PostgreSQL driver's error
        return sqlstate[:2] in _PG_TRANSIENT_CLASSES or sqlstate in _PG_TRANSIENT_CODES
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF in _SQLITE_TRANSIENT_CODES
        text = str(e).lower()
        return any(t in text for t in _SQLITE_TRANSIENT_TEXT)
    # A driver's OperationalError (or a subclass: psycopg's ConnectionTimeout) without a
    # SQLSTATE: the connection failed, timed out or was lost (refused, closed by the server,
    # reset, no answer) before the server could say why.
    return any(
        c.__name__ == "OperationalError" and c.__module__.startswith("psycopg")
        for c in type(e).__mro__
    )


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is (or wraps) a transient database fault (see the module docstring):
    the same step may succeed when run again. Never for an interrupt."""
    if is_interrupt(error):
        return False
    return any(_transient_one(e) for e in _chain(error))


def describe(error: BaseException) -> str:
    """One line naming a database fault: the driver's error type and the first line of its
    message (``OperationalError: database is locked``), else ``error``'s own."""
    inner = next((e for e in _chain(error) if _transient_one(e)), error)
    inner = getattr(inner, "orig", None) or inner
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else '-'}"[:300]


@dataclass(frozen=True)
class RetryPolicy:
    """How a transient fault is retried: waits grow from ``first_delay`` by doubling up to
    ``max_delay`` (each drawn from its upper half, so that workers cut off together do not
    come back together), for up to ``max_seconds`` after the first failure."""

    max_seconds: float = DEFAULT_RETRY_SECONDS
    first_delay: float = 0.1
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if not (self.max_seconds >= 0 and 0 < self.first_delay <= self.max_delay):
            raise ValueError(
                "a retry policy needs max_seconds >= 0 and 0 < first_delay <= max_delay"
            )

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy, ``max_seconds`` from ``KATO_DB_RETRY_SECONDS``.

        Raises:
            ValueError: the variable is not a number of seconds >= 0.
        """
        raw = (env.get("KATO_DB_RETRY_SECONDS") or "").strip()
        if not raw:
            return cls()
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"KATO_DB_RETRY_SECONDS must be a number of seconds >= 0, got {raw!r}")
        return cls(max_seconds=seconds)

    def backoff(self) -> Backoff:
        return Backoff(self.first_delay, self.max_delay)


class Backoff:
    """Bounded exponential waits with jitter: :meth:`next` gives the next wait, :meth:`reset`
    starts over (after a success)."""

    def __init__(self, first: float, maximum: float, *, rng: random.Random | None = None):
        self.first, self.maximum = first, maximum
        self._rng = rng or random.Random()
        self._n = 0

    def next(self) -> float:
        ceiling = min(self.maximum, self.first * 2**self._n)
        self._n = min(self._n + 1, 62)
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._n = 0


class FaultLog:
    """Logs a persistent fault once instead of on every try: a warning when it starts (with
    the traceback of an error that is not a transient database fault: a bug to look at), again
    only when its description changes, and one ``recovered`` line when it clears.

    Thread-safe; ``what`` names the failing activity in each line (``worker w1: claim``)."""

    def __init__(self, logger: logging.Logger, what: str):
        self.logger, self.what = logger, what
        self._lock = threading.Lock()
        self._current: str | None = None
        self._since = 0.0
        self._count = 0

    @property
    def failing(self) -> bool:
        return self._current is not None

    def failed(self, error: BaseException, *, retry_in: float | None = None) -> None:
        """Record a failure of the activity (logged if it is a new fault)."""
        text = describe(error)
        with self._lock:
            self._count += 1
            if text == self._current:
                self.logger.debug("%s failed again: %s", self.what, text)
                return
            first = self._current is None
            if first:
                self._since = time.monotonic()
            self._current = text
        again = f"; retrying in {retry_in:.2f} s, backing off" if retry_in is not None else ""
        self.logger.warning(
            "%s failed: %s%s%s",
            self.what,
            text,
            again,
            "" if first else " (the fault changed)",
            exc_info=None if is_transient(error) else error,
        )

    def ok(self) -> None:
        """Record a success: a ``recovered`` line if the activity was failing."""
        with self._lock:
            if self._current is None:
                return
            seconds, count = time.monotonic() - self._since, self._count
            self._current, self._count = None, 0
        self.logger.warning(
            "%s recovered after %.1f s (%d failed attempt(s))", self.what, seconds, count
        )


def call(
    step: Callable[[], T],
    *,
    what: str,
    logger: logging.Logger,
    policy: RetryPolicy | None = None,
    stop: threading.Event | None = None,
) -> T:
    """``step()``, run again after each transient database fault (:func:`is_transient`) with
    ``policy``'s backoff until it succeeds or ``policy.max_seconds`` have passed since the first
    failure; any other error, and the last fault, is raised. ``step`` must be safe to run
    again after a failure (idempotent, or one transaction that rolled back: a commit whose
    answer was lost may have landed). With ``stop`` set, no further try is made (the last fault
    is raised): a process shutting down does not wait out a database restart.

    The first fault is logged as a warning, further ones at debug, a recovery as one line.
    """
    policy = policy or RetryPolicy.from_env()
    backoff = policy.backoff()
    faults = FaultLog(logger, what)
    deadline: float | None = None
    while True:
        try:
            result = step()
        except Exception as error:
            if not is_transient(error):
                raise
            now = time.monotonic()
            deadline = now + policy.max_seconds if deadline is None else deadline
            wait = min(backoff.next(), max(deadline - now, 0.0))
            if now >= deadline or (stop is not None and stop.is_set()):
                if faults.failing:
                    logger.warning("%s: giving up: %s", what, describe(error))
                raise
            faults.failed(error, retry_in=wait)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
            continue
        faults.ok()
        return result
