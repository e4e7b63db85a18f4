"""BatchNorm training forward fused with the ReLU that follows it (``batchnorm_relu``) and with
a residual add and ReLU (``batchnorm_add_relu``), as ResNet's blocks run them: the specs of
``batchnorm.cu`` rendered with ``BN_RELU`` 1 and 2 (a macro fixed by the operator, not a
tunable; the space, statistics, saved outputs and running-statistics update are
:mod:`kernels.batchnorm`'s)::

    batchnorm_relu:      y = relu(bn(x))
    batchnorm_add_relu:  y = relu(bn(x) + residual)     residual: x's shape and element type

Roundings: bn(x) is computed in float32 (as :mod:`kernels.batchnorm`'s y before its rounding),
the residual is added to it in float32, and y is rounded once to the element type after the
ReLU. (Torch's unfused ``relu(bn(x) + r)`` rounds bn(x) to the element type first, then the
sum: in float16 / bfloat16 the two differ by up to one ulp of y, both within the tolerances
below of the float64 value.) relu keeps NaN, as torch's.

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
    #: y: batchnorm's, atol 3e-5 instead of 2e-5 in every dtype for the float32 sum with the
    #: residual (|r| <= 3: a float32 rounding of up to ~12 is 7e-7, the bn term's error as
    #: batchnorm's); float16 / bfloat16 keep batchnorm's rtol, 4x half an ulp of y, since y is
    #: rounded once.
    Y_TOLERANCES = {
        "float32": (3e-5, 1e-5),
        "float16": (3e-5, 2e-3),
        "bfloat16": (3e-5, 8e-3),
    }

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """:meth:`ChannelwiseSpec.defines` plus ``BN_RELU`` (the operator's epilogue)."""
        return {**super().defines(config, shape, dtype), "BN_RELU": self.relu_mode}

    def apply_registers(self, config: Config, itemsize: int) -> int:
        """The normalise pass streams x and the residual: two raw vectors per step and one more
        vector of floats than batchnorm's."""
        raw = raw_registers(config["APPLY_VEC"], itemsize)
        return config["UNROLL"] * (2 * raw + 2) + 2 * config["APPLY_VEC"]

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """:meth:`BatchNormSpec.make_problem`'s inputs and outputs, with the residual
        U(-3, 3) (element type; the sum cancels to near 0 often) inserted after x; y's
        reference relu(bn(x) + residual) in float64 from the residual as stored."""
        base = super().make_problem(shape, dtype, rng)
        n, c, h, w = shape
        residual = np.empty(base.args[0].shape, dtype=DTYPES[dtype][0])

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # images of the residual
            residual[chunk] = gen.uniform(-3.0, 3.0, size=(chunk.stop - chunk.start, c, h, w))

        fill_rows(rng, n, c * h * w, fill)
        y_ref = base.references[0]
        for i in range(n):  # an image at a time: no second full float64 copy
            y_ref[i] += residual[i].astype(np.float64)
            np.maximum(y_ref[i], 0.0, out=y_ref[i])
        return Problem(
            args=[base.args[0], residual, *base.args[1:]],
            outputs=[i + 1 for i in base.outputs],
            references=base.references,
            tolerances=[self.Y_TOLERANCES[dtype], *base.tolerances[1:]],
        )

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """batchnorm's, plus the residual read once."""
        n, c, h, w = shape
        return super().bytes_moved(shape, dtype) + n * c * h * w * DTYPES[dtype][2]


BATCHNORM_RELU = register(BatchNormReluSpec())
BATCHNORM_ADD_RELU = register(BatchNormAddReluSpec())

__all__ = ["BATCHNORM_ADD_RELU", "BATCHNORM_RELU", "BatchNormAddReluSpec", "BatchNormReluSpec"]
