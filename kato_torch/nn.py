"""``torch.nn`` drop-ins running Kato's kernels: the same constructor arguments, parameters,
buffers and state dicts as the torch modules they subclass, so a model swaps a class (or calls
:func:`kato_torch.patch`) and nothing else changes. Each forward calls the matching
:mod:`kato_torch.ops` function, which runs Kato's kernel where the policy picks it and PyTorch's
op everywhere else (other arguments, CPU tensors, unsupported dtypes)."""

from __future__ import annotations

import torch
from torch import Tensor

from kato_torch import ops


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm``; Kato's kernels over a last-dim normalized_shape with affine
    parameters."""

    def forward(self, input: Tensor) -> Tensor:
        return ops.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm``; Kato's kernels over a last-dim normalized_shape with a weight."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss``; Kato's fused kernel for (rows, classes) logits with
    class-index targets (no class weights, no label smoothing)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return ops.cross_entropy(
            input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing
        )


class Linear(torch.nn.Linear):
    """``torch.nn.Linear``; ``x @ weight^T`` by Kato's GEMM."""

    def forward(self, input: Tensor) -> Tensor:
        return ops.linear(input, self.weight, self.bias)


class ReLU(torch.nn.ReLU):
    """``torch.nn.ReLU``; Kato's ReLU with a bit-mask backward (``inplace=True``: PyTorch's)."""

    def forward(self, input: Tensor) -> Tensor:
        return ops.relu(input, self.inplace)


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax``; Kato's kernels when ``dim`` is the last dimension."""

    def forward(self, input: Tensor) -> Tensor:
        if self.dim is None:  # torch's legacy implicit dim
            return super().forward(input)
        return ops.softmax(input, self.dim)


class BatchNorm2d(torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d``; Kato's training-mode forward and backward (statistics,
    normalise, affine, running-statistics update; dx, dweight, dbias)."""

    def forward(self, input: Tensor) -> Tensor:
        running_mean, running_var, use_batch, factor = batch_norm_step(self, input)
        return ops.batch_norm(
            input, running_mean, running_var, self.weight, self.bias, use_batch, factor, self.eps
        )


def batch_norm_step(
    bn: torch.nn.modules.batchnorm._BatchNorm, input: Tensor
) -> tuple[Tensor | None, Tensor | None, bool, float]:
    """torch's ``_BatchNorm.forward`` bookkeeping for one call of ``bn`` on ``input``: checks the
    input's rank, counts the batch (``num_batches_tracked``), and returns the running statistics
    to use (None where untracked), whether batch statistics are used, and the update factor
    (the cumulative average's where ``momentum`` is None)."""
    bn._check_input_dim(input)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # a cumulative moving average
            factor = 1.0 / float(bn.num_batches_tracked)
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    return (bn.running_mean if track else None, bn.running_var if track else None, use_batch,
            factor)  # fmt: skip


#: torch class -> Kato drop-in, for :func:`kato_torch.patch`.
DROP_INS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.LayerNorm: LayerNorm,
    torch.nn.RMSNorm: RMSNorm,
    torch.nn.CrossEntropyLoss: CrossEntropyLoss,
    torch.nn.Linear: Linear,
    torch.nn.ReLU: ReLU,
    torch.nn.Softmax: Softmax,
    torch.nn.BatchNorm2d: BatchNorm2d,
}

__all__ = [
    "DROP_INS",
    "BatchNorm2d",
    "CrossEntropyLoss",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "ReLU",
    "Softmax",
]
