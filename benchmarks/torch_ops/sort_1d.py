"""torch.sort(x) of one long 1-D tensor (values and indices: PyTorch computes both)."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

CASES = [((2**24,), "float32"), ((2**24,), "int32")]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = 2 * shape[0] * tdtype.itemsize

    def inputs():
        if tdtype.is_floating_point:
            return torch.randn(*shape, device="cuda", dtype=tdtype)
        return torch.randint(-(2**31), 2**31 - 1, shape, device="cuda", dtype=tdtype)

    return rotating(inputs, lambda x: torch.sort(x).values, nbytes)
