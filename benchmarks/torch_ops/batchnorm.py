"""torch.nn.functional.batch_norm(training=True) on an NCHW tensor (eps 1e-5, momentum 0.1): the
statistics, y = xhat * weight + bias, and the in-place running-statistics update, with float32
weight, bias and running statistics for every input type (as Kato's batchnorm takes them),
replayed from CUDA graphs (:mod:`benchmarks.torch_ops._graphs`: at 128 x 512 x 7 x 7 the call's
host time would otherwise be what is timed)."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

#: ResNet-50 training shapes at batch 256 (128 for the last stage): stage 1's 56 x 56 planes,
#: stage 3's 14 x 14, stage 4's 7 x 7.
_SHAPES = [(256, 64, 56, 56), (256, 256, 14, 14), (128, 512, 7, 7)]
CASES = [(s, d) for d in ("float32", "bfloat16", "float16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    n, c, h, w = shape
    nbytes = 2 * n * c * h * w * tdtype.itemsize

    def inputs():
        x = torch.randn(n, c, h, w, device="cuda", dtype=tdtype)
        weight = torch.rand(c, device="cuda") + 0.5
        bias = torch.rand(c, device="cuda") - 0.5
        return x, weight, bias, torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")

    def forward(state):
        x, weight, bias, running_mean, running_var = state
        return torch.nn.functional.batch_norm(
            x, running_mean, running_var, weight, bias, training=True, momentum=0.1, eps=1e-5
        )

    return graphed(inputs, forward, nbytes)
