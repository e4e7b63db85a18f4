"""a @ b.t() (cuBLAS) for matmul_nt: C = A @ B^T with B stored (N, K), as a linear layer's
forward (x @ W^T) and a matmul's dA = dC @ B^T; cuBLAS reads the transposed operand in place
(no copy). float32 with TF32 off, like Kato's FFMA kernel."""

from __future__ import annotations

from benchmarks.torch_ops import rotating

#: (M, N, K) of a GPT-2-small MLP and attention at 8192 tokens: fc1 (768 -> 3072), fc2
#: (3072 -> 768), the qkv projection (768 -> 2304), and the language-model head (768 -> 50257:
#: N is odd, C's rows are not 16-byte aligned).
_SHAPES = [(8192, 3072, 768), (8192, 768, 3072), (8192, 2304, 768), (8192, 50257, 768)]
CASES = [(s, d) for d in ("float32", "bfloat16") for s in _SHAPES]


def make(shape, dtype):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    m, n, k = shape
    tdtype = getattr(torch, dtype)
    nbytes = (m * k + n * k + m * n) * tdtype.itemsize

    def inputs():
        a = torch.empty(m, k, device="cuda", dtype=tdtype).uniform_(-1, 1)
        b = torch.empty(n, k, device="cuda", dtype=tdtype).uniform_(-1, 1)
        return a, b, torch.empty(m, n, device="cuda", dtype=tdtype)

    return rotating(inputs, lambda abc: torch.matmul(abc[0], abc[1].t(), out=abc[2]), nbytes)
