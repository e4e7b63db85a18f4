"""The backward pass of torch.nn.functional.layer_norm (weight and bias, eps 1e-5) as autograd
runs it in training: dx, dweight and dbias from the saved forward (torch saves mean and rstd,
as Kato's layernorm does), for a given dy (``torch.autograd.grad`` on a retained graph),
replayed from CUDA graphs (:mod:`benchmarks.torch_ops._graphs`: the autograd engine's host time
is not the GPU's)."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

_SHAPES = [(8192, 768), (8192, 4096)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = 3 * rows * cols * tdtype.itemsize

    def inputs():
        x = torch.randn(rows, cols, device="cuda", dtype=tdtype, requires_grad=True)
        weight = (torch.rand(cols, device="cuda", dtype=tdtype) + 0.5).requires_grad_()
        bias = (torch.rand(cols, device="cuda", dtype=tdtype) - 0.5).requires_grad_()
        y = torch.nn.functional.layer_norm(x, (cols,), weight, bias, 1e-5)
        return x, weight, bias, y, torch.randn_like(y)

    def backward(state):
        x, weight, bias, y, dy = state
        return torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True)

    return graphed(inputs, backward, nbytes)
