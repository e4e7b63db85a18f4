"""Backward of LayerNorm fused with ReLU (:mod:`kernels.layernorm_relu`) over the last
dimension of (rows, cols) matrices: the spec of ``layernorm_backward.cu`` rendered with
``EPILOGUE_RELU=1``.

From the forward's input x, weight w, bias b, the per-row mean and rstd it saved (float32) and
the gradient dy of ``y = relu(xhat * w + b)``, ``xhat = (x - mean) * rstd``::

    g = dy * (xhat * w + b > 0)                                 (relu's threshold_backward)
    dx, dweight, dbias = layernorm's backward of g              (kernels.layernorm_backward)

as torch's autograd of ``F.relu(F.layer_norm(x, ...))`` computes them, without y: the mask is
recomputed in float32 from the x, mean and rstd the backward reads anyway (the bias is the only
extra read, a weight-sized vector), so the forward saves x, not its output. Every path of the
template (register, shared-memory and streaming caches, split rows' head and tail, every
DW_ACC) masks dy as it reads it, before any sum or dx uses it. Where the pre-activation is
within float32 rounding of zero the recomputed mask may differ from the forward's (which
normalises through the row's pivot): a value that small is clipped either way, and
:meth:`LayerNormReluBackwardSpec.make_problem` keeps dy out of that band so that the float64
reference's mask is unambiguous.

Kernel arguments (:attr:`Problem.args` order, the same for both kernels): ``x, weight, bias,
mean, rstd, dy, dx, dweight, dbias, partials, nparts, rows, cols``: layernorm_backward's with
the bias after the weight. Parameter space, defaults and launches: layernorm_backward's
(:class:`kernels.layernorm_backward.LayerNormBackwardSpec`); its checks too, but for CACHE=2
configs at the edge of the register cap, which the bias loads would make spill
(:meth:`LayerNormReluBackwardSpec.extra_registers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kato.kernels import rowwise
from kato.kernels.layernorm_backward import (
    DW_RTOL,
    DW_SUM_ERROR,
    LayerNormBackwardSpec,
    layernorm_backward_reference,
)
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: dy is zeroed where the pre-activation xhat * w + b is within this fraction of |xhat w| + |b|
#: of zero: float32's recomputation from the stored inputs is good to a few 2**-24 of that, so
#: the mask is the float64 reference's everywhere else (a margin 2**12 times wider).
MASK_MARGIN = 2.0**-12
#: ... and within this fraction of |mean| rstd |w| more: a forward (Kato's through the row's
#: pivot, or torch's) computes y from a mean it rounds to float32 only when saving it, half an
#: ulp (2**-24 |mean|) from the one the mask is recomputed from; 4x that.
MEAN_ROUNDING = 2.0**-22
#: Rows of the reference per chunk (bounds its float64 temporaries to a few 2**22 elements).
_CHUNK_ELEMENTS = 2**22


def pre_activation(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``(xhat * w + b, edge)`` from the inputs as stored (mean and rstd float32): the
    value the ReLU's mask tests, and the width of the band around zero where a float32
    recomputation, or a forward's y, may fall on the other side (:data:`MASK_MARGIN`
    ``(|xhat w| + |b|) +`` :data:`MEAN_ROUNDING` ``|mean| rstd |w|``)."""
    r = rstd.astype(np.float64)[:, None]
    m = mean.astype(np.float64)[:, None]
    w = weight.astype(np.float64)
    b64 = bias.astype(np.float64)
    xw = (x.astype(np.float64) - m) * r * w
    edge = MASK_MARGIN * (np.abs(xw) + np.abs(b64)) + MEAN_ROUNDING * np.abs(m) * r * np.abs(w)
    return xw + b64, edge


def layernorm_relu_backward_reference(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    dy: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (dx, dweight, dbias, sum over rows of |g xhat|, sum over rows of |g|) of
    ``relu(layer_norm(x))``: layernorm's backward of ``g = dy * (xhat * w + b > 0)``."""
    pre, _ = pre_activation(x, weight, bias, mean, rstd)
    g = np.where(pre > 0.0, dy.astype(np.float64), 0.0)
    return layernorm_backward_reference(x, weight, mean, rstd, g)


class LayerNormReluBackwardSpec(LayerNormBackwardSpec):
    """LayerNorm + ReLU backward: dy masked by the recomputed pre-activation, then layernorm's
    backward (dx in one pass per row, dweight and dbias by two-stage column reduction)."""

    name = "layernorm_relu_backward"
    description = (
        "backward of relu(layer_norm(x)) over the last dimension of (rows, cols) matrices from "
        "x, weight, bias, the forward's mean and rstd, and dy: the relu mask recomputed from x, "
        "then layernorm's dx, dweight and dbias; float32 accumulation"
    )

    def extra_registers(self, config: Config, cols: int, itemsize: int) -> int:
        """Layernorm_backward's, plus with CACHE=2 one more row-sized register set: the bias
        vectors the mask reads in the first pass, which ptxas loads ahead with x's and dy's
        (compile tests: a float32 VEC=1 row of 16 items under a 128-register cap, at the plain
        kernel's limit, spilled 80 bytes without it). Only :meth:`check` reads it: the fused
        space rejects the register-cache configs at the plain one's edge."""
        extra = super().extra_registers(config, cols, itemsize)
        if config["CACHE"] == 2:
            extra += rowwise.vector_registers(config, cols, itemsize)
        return extra

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Layernorm_backward's macros and ``EPILOGUE_RELU=1``."""
        return {**super().defines(config, shape, dtype), "EPILOGUE_RELU": 1}

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Layernorm_backward's problem (:meth:`LayerNormBackwardSpec.make_problem`: x, weight,
        mean, rstd, dy and the NaN-filled outputs) with a bias ~ U(-1, 1) (about half of each
        row clipped), and dy zeroed where the pre-activation is within the band around zero
        where float32, or a forward's y, may fall on the other side (:func:`pre_activation`:
        a few 1e-4 relative, from the float32 rounding of the saved mean besides). dx,
        dweight, dbias and their tolerances from the masked gradient (float64, the inputs as
        stored), dweight's and dbias's atol scaled as layernorm_backward's by the sums of |g
        xhat| and |g|."""
        rows, cols = self.validate(shape, dtype)
        base = super().make_problem(shape, dtype, rng)
        x, weight, mean, rstd, dy = base.args[:5]
        np_dtype = DTYPES[dtype][0]
        bias = rng.uniform(-1.0, 1.0, size=cols).astype(np.float32).astype(np_dtype)
        ref_dx = np.empty((rows, cols), dtype=np.float64)
        ref_dw, ref_db, dw_scale, db_scale = (np.zeros(cols) for _ in range(4))
        step = max(1, _CHUNK_ELEMENTS // cols)
        for start in range(0, rows, step):  # a fixed order: the same sums on every run
            chunk = slice(start, min(rows, start + step))
            pre, edge = pre_activation(x[chunk], weight, bias, mean[chunk], rstd[chunk])
            dy[chunk][np.abs(pre) <= edge] = 0
            ref_dx[chunk], dw, db, dw_abs, db_abs = layernorm_relu_backward_reference(
                x[chunk], weight, bias, mean[chunk], rstd[chunk], dy[chunk]
            )
            ref_dw += dw
            ref_db += db
            dw_scale += dw_abs
            db_scale += db_abs
        dw_atol = max(DW_SUM_ERROR * float(dw_scale.max()), 1e-30)
        db_atol = max(DW_SUM_ERROR * float(db_scale.max()), 1e-30)
        args = [*base.args[:2], bias, *base.args[2:]]
        return Problem(
            args=args,
            outputs=[6, 7, 8],
            references=[ref_dx, ref_dw, ref_db],
            tolerances=[
                self.tolerance(dtype),
                (dw_atol, DW_RTOL[dtype]),
                (db_atol, DW_RTOL[dtype]),
            ],
        )

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """Layernorm_backward's (x and dy read, dx written, weight read, dweight and dbias
        written, mean and rstd read) and the bias read once."""
        return super().bytes_moved(shape, dtype) + shape[1] * DTYPES[dtype][2]


LAYERNORM_RELU_BACKWARD = register(LayerNormReluBackwardSpec())

__all__ = [
    "LAYERNORM_RELU_BACKWARD",
    "MASK_MARGIN",
    "MEAN_ROUNDING",
    "LayerNormReluBackwardSpec",
    "layernorm_relu_backward_reference",
    "pre_activation",
]
