"""Backward of the fused BatchNorm + ReLU forwards (:mod:`kernels.batchnorm_relu`): the specs of
``batchnorm_backward.cu`` rendered with ``BN_RELU`` 1 and 2 (a macro fixed by the operator, not
a tunable; the space and reductions are :mod:`kernels.batchnorm_backward`'s). With ``g`` the
gradient that reaches batch norm's output through the ReLU (torch's ``threshold_backward``: a
select, dy where the mask holds, else 0)::

    batchnorm_relu_backward:      g = dy where bn(x) > 0, bn(x) recomputed in float32 from x, the
                                  saved mean and invstd, weight and bias (no read of y)
    batchnorm_add_relu_backward:  g = dy where y > 0, y the forward's output; dresidual = g
    dbias = sum g, dweight = sum g xhat, dx = weight invstd (g - dbias / n - xhat dweight / n)

Kernel arguments::

    batchnorm_relu_backward:      x, dy, mean, invstd, weight, bias, dx, dweight, dbias,
                                  workspace, counters, N, C, HW
    batchnorm_add_relu_backward:  x, dy, y, mean, invstd, weight, dx, dweight, dbias, dresidual,
                                  workspace, counters, N, C, HW

The recomputed mask of ``batchnorm_relu_backward`` can differ from the forward's where bn(x) is
within float32 rounding of 0 (a few 1e-7 of |xhat weight|): there the gradient of relu is
ambiguous anyway. The problems keep dy = 0 at elements within :data:`MASK_MARGIN` of the
boundary, so that the verification does not depend on which side they fall.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kato.kernels.batchnorm_backward import (
    DW_RTOL,
    DW_SUM_ERROR,
    BatchNormBackwardSpec,
    batchnorm_backward_reference,
)
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: |bn(x)| (float64) within which the problems set dy = 0: far above the float32 recomputation's
#: error (|xhat weight| <= ~9 and |bias| <= 1 give a few 1e-6 at most).
MASK_MARGIN = 1e-4


def _relu_problem(
    base: Problem, x: np.ndarray, dy: np.ndarray, keep: np.ndarray, args: list, outputs: list[int]
) -> tuple[Problem, np.ndarray]:
    """The problem with g = where(keep, dy, 0) in place of dy in the references (dx, dweight,
    dbias) and their tolerances rescaled to g's sums; ``args`` / ``outputs`` as given. Returns
    it and g."""
    g = np.where(keep, dy, np.zeros((), dtype=dy.dtype))
    mean, invstd, weight = base.args[2], base.args[3], base.args[4]
    dx_ref, dw_ref, db_ref, dw_abs, db_abs = batchnorm_backward_reference(
        x, g, mean, invstd, weight
    )
    problem = Problem(
        args=args,
        outputs=outputs,
        references=[dx_ref, dw_ref, db_ref],
        tolerances=[
            base.tolerances[0],
            (max(DW_SUM_ERROR * float(dw_abs.max()), 1e-30), DW_RTOL),
            (max(DW_SUM_ERROR * float(db_abs.max()), 1e-30), DW_RTOL),
        ],
    )
    return problem, g


class BatchNormReluBackwardSpec(BatchNormBackwardSpec):
    """Backward of ``batchnorm_relu``: the ReLU's mask recomputed from x in both passes."""

    name = "batchnorm_relu_backward"
    description = (
        "backward of batchnorm_relu: relu's mask recomputed from x, the saved mean and invstd, "
        "weight and bias; dweight, dbias (deterministic per-channel float32 sums), then dx"
    )
    relu_mode = 1

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """:meth:`ChannelwiseSpec.defines` plus ``BN_RELU`` (the operator's epilogue)."""
        return {**super().defines(config, shape, dtype), "BN_RELU": self.relu_mode}

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """:meth:`BatchNormBackwardSpec.make_problem`'s x, dy, mean, invstd and weight, bias
        U(-1, 1) (about half of each channel masked; channels 3, 7, ... get bias +-8: all
        active or all masked); dy set to 0 where |bn(x)| < :data:`MASK_MARGIN`. References
        from g = dy where bn(x) > 0 (float64 from the stored inputs)."""
        base = super().make_problem(shape, dtype, rng)
        n, c, h, w = shape
        x, dy, mean, invstd, weight = base.args[:5]
        bias = rng.uniform(-1.0, 1.0, size=c).astype(np.float32)
        extreme = np.arange(c) % 4 == 3
        bias[extreme] = np.where(rng.random(int(extreme.sum())) < 0.5, -8.0, 8.0)
        a = (invstd.astype(np.float64) * weight)[:, None, None]
        mu = mean.astype(np.float64)[:, None, None]
        b = bias.astype(np.float64)[:, None, None]
        keep = np.empty(x.shape, dtype=bool)
        for i in range(n):  # an image at a time: float64 temporaries of one image
            y = (x[i].astype(np.float64) - mu) * a + b
            dy[i][np.abs(y) < MASK_MARGIN] = 0
            keep[i] = y > 0
        args = [*base.args[:5], bias, *base.args[5:]]
        problem, _ = _relu_problem(base, x, dy, keep, args, [6, 7, 8])
        return problem

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """batchnorm_backward's, plus the bias read (float32, C)."""
        return super().bytes_moved(shape, dtype) + 4 * shape[1]


class BatchNormAddReluBackwardSpec(BatchNormBackwardSpec):
    """Backward of ``batchnorm_add_relu``: the ReLU's mask from the forward's output y; writes
    the residual's gradient too."""

    name = "batchnorm_add_relu_backward"
    description = (
        "backward of batchnorm_add_relu: relu's mask from the forward's output y; dweight, dbias "
        "(deterministic per-channel float32 sums), then dx and dresidual"
    )
    relu_mode = 2
    #: x, dy and y stream through both passes.
    arrays = 3

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """:meth:`ChannelwiseSpec.defines` plus ``BN_RELU`` (the operator's epilogue)."""
        return {**super().defines(config, shape, dtype), "BN_RELU": self.relu_mode}

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """:meth:`BatchNormBackwardSpec.make_problem`'s x, dy, mean, invstd and weight; y =
        max(N(0, 1), 0) in the element type (about half exactly 0; channels 3, 7, ... all
        positive), inserted after dy; dresidual (after dbias) NaN. References: dx, dweight,
        dbias from g = dy where y > 0, and dresidual = g, exactly (it is dy's values or 0)."""
        base = super().make_problem(shape, dtype, rng)
        n, c, h, w = shape
        x, dy = base.args[:2]
        y = np.empty(x.shape, dtype=DTYPES[dtype][0])
        positive = (np.arange(c) % 4 == 3)[None, :, None, None]

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # images of y
            v = gen.standard_normal((chunk.stop - chunk.start, c, h, w))
            v = np.where(positive, np.abs(v) + 0.5, np.maximum(v, 0.0))
            y[chunk] = v

        fill_rows(rng, n, c * h * w, fill)
        dres = np.full(x.shape, np.nan, dtype=DTYPES[dtype][0])
        args = [x, dy, y, *base.args[2:8], dres, *base.args[8:]]
        problem, g = _relu_problem(base, x, dy, y > 0, args, [6, 7, 8, 9])
        problem.references.append(g.astype(np.float64))
        problem.tolerances.append((0.0, 0.0))
        return problem

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """batchnorm_backward's, plus y read and dresidual written once."""
        n, c, h, w = shape
        return super().bytes_moved(shape, dtype) + 2 * n * c * h * w * DTYPES[dtype][2]


BATCHNORM_RELU_BACKWARD = register(BatchNormReluBackwardSpec())
BATCHNORM_ADD_RELU_BACKWARD = register(BatchNormAddReluBackwardSpec())

__all__ = [
    "BATCHNORM_ADD_RELU_BACKWARD",
    "BATCHNORM_RELU_BACKWARD",
    "MASK_MARGIN",
    "BatchNormAddReluBackwardSpec",
    "BatchNormReluBackwardSpec",
]
