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
#: Most input copies a benchmark rotates over.
MAX_COPIES = 8


def input_copies(bytes_per_call: int, max_copies: int = MAX_COPIES) -> int:
    """How many input copies to rotate over so that one pass streams >= 2x the L2
    (:func:`tuner.torch_ops.input_copies`, the framework baseline's rule)."""
    from kato.tuner import torch_ops

    return torch_ops.input_copies(bytes_per_call, L2_BYTES, max_copies)


def rotating(
    make_inputs: Callable[[], Any], run: Callable[[Any], object], bytes_per_call: int
) -> Callable[[], object]:
    """A zero-argument function calling ``run`` on the next of several input copies
    (:func:`tuner.torch_ops.rotating`)."""
    from kato.tuner import torch_ops

    return torch_ops.rotating(
        make_inputs, run, bytes_per_call, l2_bytes=L2_BYTES, max_copies=MAX_COPIES
    )


def modules() -> dict[str, ModuleType]:
    """Operator name -> its torch-equivalent module."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found[info.name] = importlib.import_module(f"{__name__}.{info.name}")
    return found
