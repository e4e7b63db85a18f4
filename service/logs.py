"""Logging of the ``kato`` command line, set up once by its callback before any command runs.

Kato's own loggers log at ``KATO_LOG_LEVEL`` (``INFO`` by default: a job started, a worker's
line per trial). The libraries' ``INFO`` lines (Alembic's migration steps on every start, httpx's
request lines) say nothing a person at the terminal needs: they show only with ``--verbose`` or
``KATO_LOG_LEVEL=DEBUG``; their warnings and errors always show. Every record goes to stderr, so
that stdout holds a command's answer alone (``--json`` output stays parseable).

A process whose root logger already has handlers (an application embedding the CLI, pytest) keeps
its own set-up: nothing is changed there.
"""

from __future__ import annotations

import logging
import sys

#: What ``KATO_LOG_LEVEL`` may be (any case).
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Libraries whose records below WARNING are kept from the terminal unless asked for.
QUIET_LIBRARIES = ("alembic", "httpx", "httpcore")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_level(text: str | None) -> int:
    """The level ``KATO_LOG_LEVEL`` names (unset or blank: ``INFO``); ``ValueError`` saying what
    it may be otherwise."""
    name = (text or "").strip().upper() or "INFO"
    if name not in LEVELS:
        raise ValueError(f"KATO_LOG_LEVEL must be one of {', '.join(LEVELS)}; got {text!r}")
    return logging.getLevelName(name)


class _QuietLibraries(logging.Filter):
    """Pass a record unless it is a quiet library's, below WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not any(
            record.name == lib or record.name.startswith(lib + ".") for lib in QUIET_LIBRARIES
        )


def configure(level: int, *, verbose: bool = False) -> bool:
    """Send log records to stderr at ``level`` (``verbose``: at most ``INFO``, the libraries'
    lines too). Returns whether it set anything up (``False``: the root logger had handlers)."""
    root = logging.getLogger()
    if root.handlers:
        return False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    if not verbose and level > logging.DEBUG:
        handler.addFilter(_QuietLibraries())
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO) if verbose else level)
    return True
