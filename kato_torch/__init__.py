"""Kato's tuned kernels inside PyTorch (optional: needs torch; Kato's kernels need a CUDA GPU
and nvcc).

    import kato_torch
    from kato_client import KatoClient
    kato_torch.configure(client=KatoClient("http://kato:8000"))   # policy="auto" by default
    kato_torch.patch(model)                  # nn.LayerNorm -> kato_torch.nn.LayerNorm, ...
    kato_torch.fuse(model)                   # norm -> [add ->] ReLU: one fused op
    with kato_torch.record() as rec:         # which (operator, shape, dtype) a step runs
        train_step(model, batch)
    rec.submit(budget=50)                    # tune them as one batch job

Functions (:mod:`kato_torch.ops`) take what their ``torch.nn.functional`` namesakes take and are
differentiable; each is a ``torch.library`` custom op (``torch.ops.kato.*``) with a fake
implementation, so ``torch.compile`` keeps it in its graph, and it launches on the current CUDA
stream, so CUDA graphs capture it. Modules (:mod:`kato_torch.nn`) are drop-ins for torch's with
the same signatures and state dicts.

Never slower than PyTorch: under the default policy ``"auto"`` a call runs Kato's kernel only
where the service holds a winner for that exact shape measured faster than PyTorch's op on the
same inputs; everything else runs PyTorch's own op (:mod:`kato_torch.policy`). ``policy=
"kato"`` always runs Kato's kernels (the served config, else the operator's default), and
``"torch"`` never does. Configs are looked up once per (shape, dtype) through the client (whose
caches make later lookups a dictionary read) and compiled once per config (nvcc, on-disk cache).

Nothing outside this package imports torch.
"""

from kato_torch import nn
from kato_torch._kernels import BoundOperator, bind, configure, prepare
from kato_torch.fuse import fuse, unfuse
from kato_torch.ops import (
    add_layer_norm,
    add_rms_norm,
    batch_norm,
    batch_norm_relu,
    cross_entropy,
    layer_norm,
    layer_norm_relu,
    layernorm,
    linear,
    matmul,
    relu,
    rms_norm,
    softmax,
    transpose,
)
from kato_torch.patch import patch, unpatch
from kato_torch.policy import Key, Recorder, record
from kato_torch.user import UserKernel, user_kernel

__all__ = [
    "BoundOperator",
    "Key",
    "Recorder",
    "UserKernel",
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "batch_norm_relu",
    "bind",
    "configure",
    "cross_entropy",
    "fuse",
    "unfuse",
    "layer_norm",
    "layer_norm_relu",
    "layernorm",
    "linear",
    "matmul",
    "nn",
    "patch",
    "prepare",
    "record",
    "relu",
    "rms_norm",
    "softmax",
    "transpose",
    "unpatch",
    "user_kernel",
]
