"""Softmax's backward as autograd runs it: ``torch._softmax_backward_data(dy, y, -1, dtype)``
(reads dy and y, writes dx), replayed from CUDA graphs (:mod:`benchmarks.torch_ops._graphs`).
50257 columns: a GPT-2 vocabulary, odd."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

_SHAPES = [(8192, 4096), (8192, 50257)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = 3 * rows * cols * tdtype.itemsize

    def inputs():
        y = torch.softmax(torch.randn(rows, cols, device="cuda", dtype=tdtype), dim=-1)
        return y, torch.randn_like(y)

    return graphed(inputs, lambda s: torch._softmax_backward_data(s[1], s[0], -1, tdtype), nbytes)
