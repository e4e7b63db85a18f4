"""Torch equivalents replayed from CUDA graphs: what PyTorch's kernels cost on the GPU alone.

``benchmarks/operators.py`` times a torch equivalent by CUDA events around batches of eager
calls. For an op of a few microseconds (rmsnorm at 8192 x 768) or one that runs through the
autograd engine (a backward pass), eager calls measure the host's launch rate, not the GPU:
:func:`graphed` captures one call per input copy into a CUDA graph and replays them in turn, so
the events see PyTorch's kernels back to back, as Kato's timing (behind a spin kernel) sees its.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.torch_ops import L2_BYTES, MAX_COPIES


def graphed(
    make_inputs: Callable[[], Any], run: Callable[[Any], object], bytes_per_call: int
) -> Callable[[], object]:
    """A zero-argument function replaying the captured ``run`` of the next input copy (as
    :func:`benchmarks.torch_ops.rotating`, one graph per copy; outputs live in the graphs'
    memory pool): :func:`tuner.torch_ops.graphed`."""
    from kato.tuner import torch_ops

    return torch_ops.graphed(
        make_inputs, run, bytes_per_call, l2_bytes=L2_BYTES, max_copies=MAX_COPIES
    )
