"""torch.sort(x, dim=-1) of every row (values and indices: PyTorch computes both)."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

CASES = [((4096, 4096), "float32")]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = 2 * shape[0] * shape[1] * tdtype.itemsize

    def inputs():
        if tdtype.is_floating_point:
            return torch.randn(*shape, device="cuda", dtype=tdtype)
        return torch.randint(-(2**31), 2**31 - 1, shape, device="cuda", dtype=tdtype)

    return rotating(inputs, lambda x: torch.sort(x, dim=-1).values, nbytes)
