"""torch.sort(x, stable=True) of one long 1-D tensor: sorted keys and their indices (argsort),
what sort_1d_pairs computes with the indices as values."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

CASES = [((2**24,), "float32"), ((2**24,), "int32")]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = 4 * shape[0] * tdtype.itemsize  # keys and indices in, keys and indices out

    def inputs():
        if tdtype.is_floating_point:
            return torch.randn(*shape, device="cuda", dtype=tdtype)
        return torch.randint(-(2**31), 2**31 - 1, shape, device="cuda", dtype=tdtype)

    return rotating(inputs, lambda x: torch.sort(x, stable=True), nbytes)
