"""Kato's Kernel Tuner-compatible front door: ``import kato`` and call
``kato.tune_kernel(...)`` where you called ``kernel_tuner.tune_kernel(...)``; the tuned config
is then a lookup (``kato.lookup``). See docs/user_kernels.md.

:class:`KatoError` is the root of every error Kato raises (:mod:`kato.errors`). Importing this
package is cheap and imports nothing else of the project: ``kato.errors`` is a leaf every layer
imports, so the front door's functions are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from kato.errors import KatoError, ServiceError

__all__ = ["KatoError", "ServiceError", "lookup", "tune_kernel"]

#: Names loaded on first use, from the module that defines them.
_LAZY = {"lookup": "kato.tune", "tune_kernel": "kato.tune"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # found once; later reads skip this hook
        return value
    raise AttributeError(f"module 'kato' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
