"""torch.nn.functional.cross_entropy over the last dim with int64 labels and
``reduction='none'`` (ignore index -100), replayed from CUDA graphs
(:mod:`benchmarks.torch_ops._graphs`). 50257 columns: a GPT-2 vocabulary, odd; 128256: Llama 3's;
16 rows of 128256: fewer rows than SMs (Kato's SPLIT).

Kato's cross_entropy also writes the row's logsumexp (float32) for the backward, and its loss
is float32 for every logits type (torch's has the logits' type); torch's forward writes the
whole log-softmax matrix instead (what its backward reads), which ``bytes_per_call`` below does
not count."""

from __future__ import annotations

from benchmarks.torch_ops._graphs import graphed

_SHAPES = [(8192, 50257), (4096, 128256), (16, 128256)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    tdtype = getattr(torch, dtype)
    rows, cols = shape
    nbytes = rows * cols * tdtype.itemsize

    def inputs():
        x = torch.randn(rows, cols, device="cuda", dtype=tdtype)
        labels = torch.randint(0, cols, (rows,), device="cuda")
        labels[3::8] = -100
        return x, labels

    return graphed(
        inputs,
        lambda s: torch.nn.functional.cross_entropy(s[0], s[1], reduction="none"),
        nbytes,
    )
