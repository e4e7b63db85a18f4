"""``torch.nn`` drop-ins running Kato's kernels: the same constructor arguments, parameters,
buffers and state dicts as the torch modules they subclass, so a model swaps a class (or calls
:func:`kato_torch.patch`) and nothing else changes. Each forward calls the matching
:mod:`kato_torch.ops` function, which runs Kato's kernel where the policy picks it and PyTorch's
op everywhere else (other arguments, CPU tensors, unsupported dtypes), through
:func:`kato_torch._fallbacks.module_call`: a module whose call with the same input shape, dtype
and device (and parameters' types) ran PyTorch's op under the same policy runs the torch
functional its torch class calls, directly."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from kato_torch import ops
from kato_torch._fallbacks import module_call


def _cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing):
    """What ``torch.nn.CrossEntropyLoss.forward`` calls."""
    return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)  # fmt: skip


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm``; Kato's kernels over a last-dim normalized_shape with affine
    parameters."""

    def forward(self, input: Tensor) -> Tensor:
        shape, weight, bias = self.normalized_shape, self.weight, self.bias
        key = (input.shape, input.dtype, input.device, shape,
               None if weight is None else weight.dtype,
               None if bias is None else bias.dtype)  # fmt: skip
        return module_call(self, "_kato_layer_norm", key, F.layer_norm, ops.layer_norm, input,
                           shape, weight, bias, self.eps)  # fmt: skip


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm``; Kato's kernels over a last-dim normalized_shape with a weight."""

    def forward(self, x: Tensor) -> Tensor:
        shape, weight = self.normalized_shape, self.weight
        key = (x.shape, x.dtype, x.device, shape, None if weight is None else weight.dtype)
        return module_call(self, "_kato_rms_norm", key, F.rms_norm, ops.rms_norm, x, shape,
                           weight, self.eps)  # fmt: skip


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss``; Kato's fused kernel for (rows, classes) logits with
    class-index targets (no class weights, no label smoothing)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        weight, reduction, smoothing = self.weight, self.reduction, self.label_smoothing
        key = (input.shape, input.dtype, input.device, target.shape, target.dtype,
               weight is None, reduction, smoothing)  # fmt: skip
        return module_call(self, "_kato_cross_entropy", key, _cross_entropy, ops.cross_entropy,
                           input, target, weight, self.ignore_index, reduction,
                           smoothing)  # fmt: skip


class Linear(torch.nn.Linear):
    """``torch.nn.Linear``; ``x @ weight^T`` by Kato's GEMM."""

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        key = (input.shape, input.dtype, input.device, weight.shape, weight.dtype, weight.device,
               None if bias is None else bias.dtype)  # fmt: skip
        return module_call(self, "_kato_linear", key, F.linear, ops.linear, input, weight, bias)


class ReLU(torch.nn.ReLU):
    """``torch.nn.ReLU``; Kato's ReLU with a bit-mask backward (``inplace=True``: PyTorch's)."""

    def forward(self, input: Tensor) -> Tensor:
        inplace = self.inplace
        # Contiguity too: a non-contiguous input runs PyTorch's op (ops.relu).
        key = (input.shape, input.dtype, input.device, input.is_contiguous(), inplace)
        return module_call(self, "_kato_relu", key, F.relu, ops.relu, input, inplace)


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax``; Kato's kernels when ``dim`` is the last dimension."""

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim
        if dim is None:  # torch's legacy implicit dim
            return super().forward(input)
        key = (input.shape, input.dtype, input.device, dim)
        return module_call(self, "_kato_softmax", key, torch.softmax, ops.softmax, input, dim)


class BatchNorm2d(torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d``; Kato's training-mode forward and backward (statistics,
    normalise, affine, running-statistics update; dx, dweight, dbias)."""

    def forward(self, input: Tensor) -> Tensor:
        running_mean, running_var, use_batch, factor = batch_norm_step(self, input)
        weight, bias = self.weight, self.bias
        key = (input.shape, input.dtype, input.device, input.is_contiguous(), use_batch,
               weight is None, bias is None, running_mean is None, running_var is None)  # fmt: skip
        return module_call(self, "_kato_batch_norm", key, F.batch_norm, ops.batch_norm, input,
                           running_mean, running_var, weight, bias, use_batch, factor,
                           self.eps)  # fmt: skip


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
