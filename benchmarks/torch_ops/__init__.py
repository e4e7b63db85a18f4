"""PyTorch equivalents of Kato's operators, for ``benchmarks/operators.py`` (needs torch + CUDA).

One module per operator (``softmax.py``, ``layernorm.py``, ...), each defining:

- ``CASES``: the benchmark cases, a list of ``(shape, dtype)``;
- ``make(shape, dtype) -> Callable[[], object]``: a zero-argument function running the PyTorch
  equivalent of one Kato call (forward + backward for a pair) on fresh random inputs, rotating
  over :func:`input_copies` copies so that neither side times the L2 cache.

``benchmarks/operators.py`` discovers the modules by operator name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: L2 of the largest supported GPU (H200: 60 MiB); inputs rotate over at least twice that.
L2_BYTES = 60 * 2**20


def input_copies(bytes_per_call: int, max_copies: int = 8) -> int:
    """How many input copies to rotate over so that one pass streams >= 2x the L2."""
    return max(1, min(max_copies, (2 * L2_BYTES) // max(bytes_per_call, 1) + 1))


def rotating(
    make_inputs: Callable[[], Any], run: Callable[[Any], object], bytes_per_call: int
) -> Callable[[], object]:
    """A zero-argument function calling ``run`` on the next of several input copies."""
    copies = [make_inputs() for _ in range(input_copies(bytes_per_call))]
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(copies)
        return run(copies[state["i"]])

    return call


def modules() -> dict[str, ModuleType]:
    """Operator name -> its torch-equivalent module."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found[info.name] = importlib.import_module(f"{__name__}.{info.name}")
    return found
