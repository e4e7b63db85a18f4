"""Kato's tuned kernels on PyTorch CUDA tensors (optional: needs torch, a CUDA GPU and nvcc).

    import kato_torch
    from kato_client import KatoClient            # or service.client, see README
    kato_torch.configure(client=KatoClient("http://kato:8000"))
    y = kato_torch.softmax(x)                     # x: a CUDA tensor, softmax over the last dim

Every function runs on the caller's current CUDA stream in PyTorch's own context, looks its
config up once per (shape, dtype) through the client (whose in-process and on-disk caches make
that a dictionary read after the first call) and compiles once per config (nvcc, on-disk cache).
Without a configured client, operators run their default configs. Functions are differentiable:
backward passes use Kato kernels where the issue asks for them (ReLU's bit mask, matmul) and
plain PyTorch math on the saved statistics elsewhere (softmax, layernorm).

Nothing outside this package imports torch.
"""

from kato_torch._kernels import BoundOperator, bind, configure
from kato_torch.ops import layernorm, matmul, relu, softmax, transpose

__all__ = [
    "BoundOperator",
    "bind",
    "configure",
    "layernorm",
    "matmul",
    "relu",
    "softmax",
    "transpose",
]
