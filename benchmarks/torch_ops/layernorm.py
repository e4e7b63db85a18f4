"""torch.nn.functional.layer_norm over the last dim, with weight and bias (eps 1e-5).

Kato's layernorm also writes per-row mean and rstd (float32); torch's forward computes them
internally (``torch.native_layer_norm`` returns them too, at the same cost).
"""

from __future__ import annotations

from benchmarks.torch_ops import rotating

_SHAPES = [(4096, 4096), (32768, 4096), (65536, 1024), (8192, 32768), (1048576, 128)]
CASES = [(s, d) for d in ("float32", "float16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = 2 * rows * cols * tdtype.itemsize
    weight = torch.rand(cols, device="cuda", dtype=tdtype) + 0.5
    bias = torch.rand(cols, device="cuda", dtype=tdtype) - 0.5
    return rotating(
        lambda: torch.randn(rows, cols, device="cuda", dtype=tdtype),
        lambda x: torch.native_layer_norm(x, (cols,), weight, bias, 1e-5),
        nbytes,
    )
