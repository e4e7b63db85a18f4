"""x.sum(dim=-1) over the last dim (Kato's reduce_sum returns float32 for every input dtype;
PyTorch returns the input dtype with float32 accumulation: same bytes read, 2 bytes less written
per row for fp16)."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

_SHAPES = [(32768, 4096), (8192, 32768), (65536, 1024), (1048576, 128)]
CASES = [(s, d) for d in ("float32", "float16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    nbytes = shape[0] * shape[1] * tdtype.itemsize
    return rotating(
        lambda: torch.randn(*shape, device="cuda", dtype=tdtype),
        lambda x: x.sum(dim=-1),
        nbytes,
    )
