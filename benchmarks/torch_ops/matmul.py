"""torch.matmul (cuBLAS) for C = A @ B; float32 with TF32 off, like Kato's FFMA kernel."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

#: (M, N, K); the last is a language-model head's dx = dlogits @ W at 8192 tokens: K = 50257
#: is odd, so A's rows are not 16-byte aligned.
_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 768, 50257)]
CASES = [(s, d) for d in ("float32", "float16", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    # Kato's float32 kernel runs plain FFMA: compare with cuBLAS's float32 SIMT path, not TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    m, n, k = shape
    tdtype = getattr(torch, dtype)
    nbytes = (m * k + k * n + m * n) * tdtype.itemsize

    def inputs():
        a = torch.empty(m, k, device="cuda", dtype=tdtype).uniform_(-1, 1)
        b = torch.empty(k, n, device="cuda", dtype=tdtype).uniform_(-1, 1)
        return a, b, torch.empty(m, n, device="cuda", dtype=tdtype)

    return rotating(inputs, lambda abc: torch.matmul(abc[0], abc[1], out=abc[2]), nbytes)
