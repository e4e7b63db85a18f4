"""x.sum() over all elements of a 1-D tensor."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

CASES = [((2**28,), d) for d in ("float32", "float16")]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = shape[0] * tdtype.itemsize
    return rotating(
        lambda: torch.randn(*shape, device="cuda", dtype=tdtype),
        lambda x: x.sum(),
        nbytes,
    )
