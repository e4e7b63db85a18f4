"""LayerNorm fused with ReLU over the last dimension of a (rows, cols) matrix:
``y = relu((x - mean) * rstd * weight + bias)``, the same outputs as :mod:`kernels.layernorm`
(y in the element type, mean and rstd per row in float32: what
:mod:`kernels.layernorm_relu_backward` reads) and torch's ``F.relu(F.layer_norm(x, ...))``
computes, in one pass over y instead of layer_norm's and relu's two.

The kernel is ``layernorm.cu`` rendered with ``EPILOGUE_RELU=1`` (fixed by the operator, not a
tunable): every path that writes y, the split-row head and tail and the two-launch
GROUP_ROWS=0 path included, applies ``max(y, 0)`` (NaN kept) before the store. The parameter
space, checks, defaults, launches and kernel arguments are layernorm's
(:class:`kernels.layernorm.LayerNormSpec`): ``x, weight, bias, y, mean, rstd, rows, cols,
eps``; the problem is layernorm's with the ReLU in y's reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kato.kernels.layernorm import LayerNormSpec
from kato.kernels.registry import register
from kato.kernels.spec import Config, Problem


class LayerNormReluSpec(LayerNormSpec):
    """Row-wise LayerNorm with weight and bias, then ReLU; layernorm's space and kernel."""

    name = "layernorm_relu"
    description = (
        "layernorm forward fused with relu over the last dimension of a (rows, cols) matrix: "
        "y = relu(layer_norm(x)); outputs y, per-row mean and rstd (float32, what the backward "
        "needs); one-pass Welford, float32 accumulation"
    )

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Layernorm's macros (:meth:`LayerNormSpec.defines`) and ``EPILOGUE_RELU=1``."""
        return {**super().defines(config, shape, dtype), "EPILOGUE_RELU": 1}

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Layernorm's problem (:meth:`LayerNormSpec.make_problem`: rows far from zero, weight
        of both signs, bias ~ U(-1, 1), so about half of y is clipped in every row) with
        ``max(y, 0)`` as y's float64 reference; mean and rstd are the layernorm's. y's
        tolerance is layernorm's: the ReLU is exact and cannot add error (a value within the
        tolerance of zero is clipped or not, within the tolerance either way)."""
        problem = super().make_problem(shape, dtype, rng)
        np.maximum(problem.references[0], 0.0, out=problem.references[0])
        return problem


LAYERNORM_RELU = register(LayerNormReluSpec())

__all__ = ["LAYERNORM_RELU", "LayerNormReluSpec"]
