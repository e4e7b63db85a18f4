"""x.t().contiguous(): PyTorch's transpose of a 2-D tensor."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

_SHAPES = [(8192, 8192), (32768, 4096)]
CASES = [(s, d) for d in ("float32", "float16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = 2 * shape[0] * shape[1] * tdtype.itemsize
    return rotating(
        lambda: torch.randn(*shape, device="cuda", dtype=tdtype),
        lambda x: x.t().contiguous(),
        nbytes,
    )
