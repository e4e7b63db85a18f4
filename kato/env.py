"""Every environment variable Kato reads outside the service's settings, declared once with
the module that uses it and what it means, and the one function that reads them.

Two kinds of settings read the environment, both through a declaration:

- the service's and the workers' settings, :class:`service.settings.Settings` (pydantic, the
  ``KATO_`` prefix and its field names: ``KATO_PORT``, ``KATO_LEASE_SECONDS``, ...), read once
  at an entry point (the CLI, the app factory) and handed down as values;
- the variables below: read by layers under the service, which may not import it (the
  database, the tuner), and by the client packages, which must not need the service's
  dependencies. They are read here, by :func:`get`, at the moment they are used, so a
  variable set by a test or a parent process is seen as it is then.

This module is a leaf (it imports nothing of the project). Besides ``Settings``, no module of
the packages reads ``os.environ`` (``tests/test_settings_one_place.py`` holds that); a new
variable is declared in :data:`VARIABLES` first, and :func:`get` refuses one that is not, so a
misspelt name is an error rather than a setting silently never read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["VARIABLES", "Variable", "get", "inherited", "set_for_children"]


@dataclass(frozen=True)
class Variable:
    """A declared environment variable: who reads it (``reader``), what it means and its
    default (``meaning``, one sentence)."""

    name: str
    reader: str
    meaning: str


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "KATO_DB_URL",
            "kato.db.session.default_db_url, kato.service.settings, the CLI's messages",
            "SQLAlchemy URL or SQLite file path of the results database (default: a SQLite "
            "file under ~/.local/share/kato); also a field of Settings (db_url)",
        ),
        Variable(
            "KATO_DB_RETRY_SECONDS",
            "kato.db.retry.RetryPolicy.from_env",
            "how long a running job retries a transient database fault (default 300 s)",
        ),
        Variable(
            "KATO_LOG_LEVEL",
            "kato.service.cli.root (kato.service.logs.parse_level)",
            "level of the CLI's log lines on stderr (default INFO)",
        ),
        Variable(
            "KATO_COMPILE_CACHE",
            "kato.shared.paths.compile_cache_dir",
            "directory of the on-disk cubin cache (default ~/.cache/kato/cubin)",
        ),
        Variable(
            "KATO_HELPER_GRACE_SECONDS",
            "kato.tuner.job_runner",
            "how long a job's owner waits beyond a lease for its helpers' last measurements "
            "(default: the per-trial limit's default, 60 s)",
        ),
        Variable(
            "KATO_FRAMEWORK_BASELINE",
            "kato.tuner.framework.enabled",
            "false: workers do not time PyTorch's own op after a job (default true); "
            "documented in Settings as framework_baseline",
        ),
        Variable(
            "KATO_FRAMEWORK_COMPILED",
            "kato.tuner.framework.compiled_enabled",
            "false: workers do not time PyTorch's op compiled by torch.compile after a job "
            "(default true); documented in Settings as framework_compiled",
        ),
        Variable(
            "KATO_URL",
            "kato_client.KatoClient",
            "the service the client asks (default http://127.0.0.1:8000)",
        ),
        Variable(
            "KATO_TOKEN",
            "kato_client.KatoClient",
            "the API token the client sends with writes (default: none)",
        ),
        Variable(
            "KATO_CACHE_DIR",
            "kato_client.disk.default_cache_dir",
            "directory of the client's on-disk answer cache (default: the user cache dir)",
        ),
        Variable(
            "KATO_GPU",
            "kato_client.device",
            "the GPU model of lookups that name none, instead of detecting the device",
        ),
        Variable(
            "CUDA_VISIBLE_DEVICES",
            "kato_client.device",
            "CUDA's own: which devices the process sees (read to name the first one; empty: none)",
        ),
    )
}


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of the declared variable ``name`` as set (not stripped), or None when unset;
    read from ``environ`` where given (a test's mapping), else the process environment.

    Raises:
        KeyError: ``name`` is not declared in :data:`VARIABLES`.
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared environment variable (kato.env.VARIABLES)")
    return (os.environ if environ is None else environ).get(name)


def set_for_children(name: str, value: str) -> None:
    """Set the declared variable ``name`` in this process's environment, for the processes it
    starts (``kato serve --api-workers``: each builds its settings from the environment).

    Raises:
        KeyError: ``name`` is not declared in :data:`VARIABLES`.
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared environment variable (kato.env.VARIABLES)")
    os.environ[name] = value


def inherited() -> tuple[tuple[str, str], ...]:
    """The whole environment as it is now, sorted: what a child process started now inherits.
    For telling whether it changed since a child started (a spare measuring child,
    :class:`tuner.backends.isolated.SpareChildren`), not for reading a setting (:func:`get`)."""
    return tuple(sorted(os.environ.items()))
