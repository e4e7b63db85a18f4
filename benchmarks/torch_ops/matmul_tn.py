"""a.t() @ b (cuBLAS) for matmul_tn: C = A^T @ B with A stored (K, M), as a linear layer's
weight gradient (dy^T @ x) and a matmul's dB = A^T @ dC; cuBLAS reads the transposed operand in
place (no copy). float32 with TF32 off, like Kato's FFMA kernel."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

#: (M, N, K) of the weight gradients of a GPT-2-small MLP and attention at 8192 tokens (K):
#: fc1's (3072, 768), fc2's (768, 3072), an attention projection's (768, 768), and the
#: language-model head's (50257, 768) (M is odd: A's rows are not 16-byte aligned).
_SHAPES = [(3072, 768, 8192), (768, 3072, 8192), (768, 768, 8192), (50257, 768, 8192)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    m, n, k = shape
    tdtype = getattr(torch, dtype)
    nbytes = (k * m + k * n + m * n) * tdtype.itemsize

    def inputs():
        a = torch.empty(k, m, device="cuda", dtype=tdtype).uniform_(-1, 1)
        b = torch.empty(k, n, device="cuda", dtype=tdtype).uniform_(-1, 1)
        return a, b, torch.empty(m, n, device="cuda", dtype=tdtype)

    return rotating(inputs, lambda abc: torch.matmul(abc[0].t(), abc[1], out=abc[2]), nbytes)
