"""A residual add followed by torch.nn.functional.layer_norm with weight and bias (eps 1e-5), as a
pre-norm transformer block runs it: ``s = x + residual; y = layer_norm(s)``, both outputs kept,
replayed from CUDA graphs (:mod:`benchmarks.torch_ops._graphs`: two kernels of a few
microseconds each at 8192 x 768).

Kato's add_layernorm also writes the per-row mean and rstd (float32) the backward pass reads;
torch's forward computes them too. The bytes counted are Kato's: x and the residual read, s and y
written."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

_SHAPES = [(8192, 768), (8192, 4096)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = 4 * rows * cols * tdtype.itemsize
    weight = torch.rand(cols, device="cuda", dtype=tdtype) + 0.5
    bias = torch.rand(cols, device="cuda", dtype=tdtype) - 0.5

    def inputs():
        return (
            torch.randn(rows, cols, device="cuda", dtype=tdtype),
            torch.randn(rows, cols, device="cuda", dtype=tdtype),
        )

    def run(state):
        x, residual = state
        s = x + residual
        return s, torch.nn.functional.layer_norm(s, (cols,), weight, bias, 1e-5)

    return graphed(inputs, run, nbytes)
