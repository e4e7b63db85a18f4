"""Kato's Kernel Tuner-compatible front door: ``import kato`` and call
``kato.tune_kernel(...)`` where you called ``kernel_tuner.tune_kernel(...)``; the tuned config
is then a lookup (``kato.lookup``). See docs/user_kernels.md.

:class:`KatoError` is the root of every error Kato raises (:mod:`kato.errors`). Importing this
package is cheap and imports nothing else of the project: ``kato.errors`` is a leaf every layer
imports, so the front door's functions are loaded on first use.

One public surface, :data:`__all__`: the client (:class:`KatoClient`), ``tune_kernel`` and
``lookup``, and the errors. The service's and the tuner's modules are ``kato.kernels``,
``kato.db``, ``kato.tuner`` and ``kato.service`` (the repository's kernels/, db/, tuner/ and
service/ folders).
"""

from __future__ import annotations

import os
from typing import Any

from kato.errors import InvalidInput, KatoError, ServiceError

# A source checkout keeps db/, kernels/, service/ and tuner/ beside this folder, where an
# installed Kato has them inside it (setup.py's package_dir): look for them there too.
_HERE = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_HERE, "db")) and os.path.isfile(
    os.path.join(os.path.dirname(_HERE), "db", "__init__.py")
):
    __path__.append(os.path.dirname(_HERE))

__all__ = [
    "GpuNotDetected",
    "InvalidInput",
    "KatoClient",
    "KatoError",
    "KatoUnavailable",
    "ServiceError",
    "lookup",
    "tune_kernel",
]

#: Names loaded on first use, from the module that defines them.
_LAZY = {
    "GpuNotDetected": "kato_client",
    "KatoClient": "kato_client",
    "KatoUnavailable": "kato_client",
    "lookup": "kato.tune",
    "tune_kernel": "kato.tune",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # found once; later reads skip this hook
        return value
    raise AttributeError(f"module 'kato' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
