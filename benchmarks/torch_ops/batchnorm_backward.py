"""The backward pass of torch.nn.functional.batch_norm(training=True) (float32 weight and bias,
eps 1e-5) as autograd runs it in training: dx, dweight and dbias from what the forward saved
(its mean and invstd, as Kato's batchnorm saves them), for a given dy (``torch.autograd.grad``
on a retained graph), replayed from CUDA graphs (:mod:`benchmarks.torch_ops._graphs`: the
autograd engine's host time is not the GPU's)."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed
from benchmarks.torch_ops.batchnorm import CASES

__all__ = ["CASES", "make"]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    n, c, h, w = shape
    nbytes = 3 * n * c * h * w * tdtype.itemsize

    def inputs():
        x = torch.randn(n, c, h, w, device="cuda", dtype=tdtype, requires_grad=True)
        weight = (torch.rand(c, device="cuda") + 0.5).requires_grad_()
        bias = (torch.rand(c, device="cuda") - 0.5).requires_grad_()
        y = torch.nn.functional.batch_norm(
            x, torch.zeros(c, device="cuda"), torch.ones(c, device="cuda"), weight, bias,
            training=True, momentum=0.1, eps=1e-5,
        )  # fmt: skip
        return x, weight, bias, y, torch.randn_like(y)

    def backward(state):
        x, weight, bias, y, dy = state
        return torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True)

    return graphed(inputs, backward, nbytes)
