"""torch.nn.functional.rms_norm over the last dim with a weight (eps 1e-6), replayed from CUDA
graphs (:mod:`benchmarks.torch_ops._graphs`: a few microseconds per call at 8192 x 768).

Kato's rmsnorm also writes the per-row rstd (float32) the backward pass reads; torch's fused
forward computes it too (``torch._fused_rms_norm`` returns it)."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

_SHAPES = [(8192, 768), (8192, 4096)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = 2 * rows * cols * tdtype.itemsize
    weight = torch.rand(cols, device="cuda", dtype=tdtype) + 0.5
    return graphed(
        lambda: torch.randn(rows, cols, device="cuda", dtype=tdtype),
        lambda x: torch.nn.functional.rms_norm(x, (cols,), weight, 1e-6),
        nbytes,
    )
