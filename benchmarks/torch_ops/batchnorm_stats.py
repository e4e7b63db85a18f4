"""torch.batch_norm_stats(x, eps): per-channel mean and invstd of an NCHW tensor (the
statistics half of training-mode BatchNorm; Kato's operator also writes the variance)."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

_SHAPES = [(32, 256, 56, 56), (256, 64, 112, 112), (64, 512, 28, 28), (16, 2048, 7, 7)]
CASES = [(s, d) for d in ("float32", "float16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    n, c, h, w = shape
    nbytes = n * c * h * w * tdtype.itemsize
    return rotating(
        lambda: torch.randn(n, c, h, w, device="cuda", dtype=tdtype),
        lambda x: torch.batch_norm_stats(x, 1e-5),
        nbytes,
    )
