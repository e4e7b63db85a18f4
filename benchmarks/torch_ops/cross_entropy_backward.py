"""The backward pass of torch.nn.functional.cross_entropy(reduction='none') as autograd runs it in
training: dlogits from the saved forward for a given per-row dloss (``torch.autograd.grad`` on
a retained graph: nll_loss_backward, then the log-softmax backward), replayed from CUDA graphs
(:mod:`benchmarks.torch_ops._graphs`: the autograd engine's host time is not the GPU's)."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

_SHAPES = [(8192, 50257), (4096, 128256), (16, 128256)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = 2 * rows * cols * tdtype.itemsize

    def inputs():
        x = torch.randn(rows, cols, device="cuda", dtype=tdtype, requires_grad=True)
        labels = torch.randint(0, cols, (rows,), device="cuda")
        labels[3::8] = -100
        loss = torch.nn.functional.cross_entropy(x, labels, reduction="none")
        return x, loss, torch.rand_like(loss) + 0.5

    def backward(state):
        x, loss, dloss = state
        return torch.autograd.grad(loss, (x,), dloss, retain_graph=True)

    return graphed(inputs, backward, nbytes)
