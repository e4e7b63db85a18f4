"""BatchNorm training forward fused with the ReLU that follows it (``batchnorm_relu``) and with
a residual add and ReLU (``batchnorm_add_relu``), as ResNet's blocks run them: the specs of
``batchnorm.cu`` rendered with ``BN_RELU`` 1 and 2 (a macro fixed by the operator, not a
tunable; the space, statistics, saved outputs and running-statistics update are
:mod:`kernels.batchnorm`'s)::

    batchnorm_relu:      y = relu(bn(x))
    batchnorm_add_relu:  y = relu(bn(x) + residual)     residual: x's shape and element type

Roundings, those of torch's unfused sequence (so that a fused model computes what the model
did): bn(x) is computed in float32 and rounded to the element type (:mod:`kernels.batchnorm`'s
y); ``batchnorm_relu`` applies the ReLU to it (exact); ``batchnorm_add_relu`` adds the residual
to that rounded value in float32 and rounds the sum to the element type, then the ReLU. relu
keeps NaN, as torch's.

Kernel arguments: :mod:`kernels.batchnorm`'s; ``batchnorm_add_relu`` takes the residual right
after x::

    x, [residual,] weight, bias, running_mean_in, running_var_in,
    y, mean, invstd, running_mean, running_var, workspace, counters, N, C, HW, eps, momentum
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kato.kernels.batchnorm import BatchNormSpec
from kato.kernels.batchnorm.channelwise import raw_registers
from kato.kernels.batchnorm_stats import PLANE_SPLIT_REGISTERS
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem


class BatchNormReluSpec(BatchNormSpec):
    """Training-mode BatchNorm forward with the ReLU applied to its output in the same pass."""

    name = "batchnorm_relu"
    description = (
        "batchnorm training forward fused with relu: y = relu(xhat * weight + bias), per-channel "
        "statistics as batchnorm's, saved mean and invstd, running statistics updated"
    )
    #: The template's BN_RELU (fixed by the operator).
    relu_mode = 1

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """:meth:`ChannelwiseSpec.defines` plus ``BN_RELU`` (the operator's epilogue)."""
        return {**super().defines(config, shape, dtype), "BN_RELU": self.relu_mode}

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """:meth:`BatchNormSpec.make_problem`'s inputs (bias U(-1, 1) puts about half of each
        channel below zero); y's reference relu(bn(x)) in float64."""
        problem = super().make_problem(shape, dtype, rng)
        np.maximum(problem.references[0], 0.0, out=problem.references[0])
        return problem


class BatchNormAddReluSpec(BatchNormSpec):
    """Training-mode BatchNorm forward, plus a residual, then ReLU, in the same pass."""

    name = "batchnorm_add_relu"
    description = (
        "batchnorm training forward fused with a residual add and relu: y = relu(xhat * weight "
        "+ bias + residual), per-channel statistics as batchnorm's, saved mean and invstd, "
        "running statistics updated"
    )
    relu_mode = 2
    #: y for a problem whose bn(x) stays within 1 in magnitude: batchnorm's, atol 3e-5 instead
    #: of 2e-5 for the float32 sum with the residual (|r| <= 3: a float32 rounding of up to ~12
    #: is 7e-7, the bn term's error as batchnorm's); rtol (the sum's rounding) batchnorm's.
    #: Each problem adds the rounding of bn(x) before the add to atol in float16 / bfloat16:
    #: half an ulp of the largest |bn(x)| (:data:`UNIT_ROUNDOFF` times it), which the sum
    #: carries whatever its own size (see :meth:`make_problem`).
    Y_TOLERANCES = {
        "float32": (3e-5, 1e-5),
        "float16": (3e-5, 2e-3),
        "bfloat16": (3e-5, 8e-3),
    }
    #: Unit roundoff of the element type (0 for float32: no rounding before the add there).
    UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """:meth:`ChannelwiseSpec.defines` plus ``BN_RELU`` (the operator's epilogue)."""
        return {**super().defines(config, shape, dtype), "BN_RELU": self.relu_mode}

    def apply_registers(self, config: Config, itemsize: int, plane_split: bool = False) -> int:
        """The normalise pass streams x and the residual: two raw vectors per step and one more
        vector of floats than batchnorm's (addresses as :meth:`ChannelwiseSpec.apply_registers`
        counts them)."""
        raw = raw_registers(config["APPLY_VEC"], itemsize)
        address = 2 + (PLANE_SPLIT_REGISTERS if plane_split else 0)
        return config["UNROLL"] * (2 * raw + address) + 2 * config["APPLY_VEC"]

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """:meth:`BatchNormSpec.make_problem`'s inputs and outputs, with the residual
        U(-3, 3) (element type; the sum cancels to near 0 often) inserted after x; y's
        reference relu(bn(x) + residual) in float64 from the residual as stored, its atol
        :data:`Y_TOLERANCES`' plus :data:`UNIT_ROUNDOFF` times the largest |bn(x)| (bn(x)'s
        rounding to the element type before the add: a sum that cancels keeps it whole)."""
        base = super().make_problem(shape, dtype, rng)
        n, c, h, w = shape
        residual = np.empty(base.args[0].shape, dtype=DTYPES[dtype][0])

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # images of the residual
            residual[chunk] = gen.uniform(-3.0, 3.0, size=(chunk.stop - chunk.start, c, h, w))

        fill_rows(rng, n, c * h * w, fill)
        y_ref = base.references[0]
        largest = 0.0
        for i in range(n):  # an image at a time: no second full float64 copy
            largest = max(largest, float(np.abs(y_ref[i]).max()))
            y_ref[i] += residual[i].astype(np.float64)
            np.maximum(y_ref[i], 0.0, out=y_ref[i])
        atol, rtol = self.Y_TOLERANCES[dtype]
        atol += self.UNIT_ROUNDOFF[dtype] * largest
        return Problem(
            args=[base.args[0], residual, *base.args[1:]],
            outputs=[i + 1 for i in base.outputs],
            references=base.references,
            tolerances=[(atol, rtol), *base.tolerances[1:]],
        )

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """batchnorm's, plus the residual read once."""
        n, c, h, w = shape
        return super().bytes_moved(shape, dtype) + n * c * h * w * DTYPES[dtype][2]


BATCHNORM_RELU = register(BatchNormReluSpec())
BATCHNORM_ADD_RELU = register(BatchNormAddReluSpec())

__all__ = ["BATCHNORM_ADD_RELU", "BATCHNORM_RELU", "BatchNormAddReluSpec", "BatchNormReluSpec"]
