"""RMSNorm forward over the last dimension of a (rows, cols) matrix: the spec of ``rmsnorm.cu``.

``y = x * rstd * weight`` per row with ``rstd = 1 / sqrt(mean(x^2) + eps)``, as
``torch.nn.functional.rms_norm(x, (cols,), weight, eps)``. Outputs: y (element type) and rstd per
row (float32, what the backward pass reads). float32 accumulation for every element type.

Kernel arguments (:attr:`Problem.args` order): ``x, weight, y, rstd, rows, cols, eps``
(``rows``/``cols`` int32, ``eps`` float32).

Parameter space (Kernel Tuner key order; the row model is :mod:`kernels.rowwise`'s):

- ``BLOCK_SIZE``, ``VEC``, ``ROW_THREADS``, ``MIN_BLOCKS``: as every row-wise operator (any
  ``cols`` with any ``VEC``: scalar head and tail around each row's aligned vectors).
- ``CACHE``: 0 = the output pass re-reads x; 1 = x's vectors in dynamic shared memory; 2 = in
  registers, and then with ``cols % VEC == 0`` (one head for every row) the weight too where the
  launch bounds leave room for it (derived ``WB_REGS``).
- ``GROUP_ROWS``: rows each row group processes (grid = ``ceil(rows / rows_per_block /
  GROUP_ROWS)``, grid-stride loop), amortising the weight's loads or registers. Launch geometry
  only: it does not change the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import rowwise
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: Registers a CACHE=2 kernel needs besides its row cache (one per element,
#: :func:`kernels.rowwise.vector_registers`; fit to ptxas reports on sm_90,
#: tests/kernels/test_rmsnorm_compile.py: below this, the cache spills).
REGISTER_OVERHEAD = 32
#: The same with the weight in registers too (WB_REGS, one per element as well): row + weight
#: registers + this.
WB_REGISTER_OVERHEAD = 40
EPS = 1e-6
#: ``(atol, rtol)`` of the float32 rstd output for every element type: a float32 sum of squares
#: (all terms positive, so no cancellation) over up to ~1e6 elements in per-thread partials and
#: a tree is good to a few 1e-7 relative, rsqrtf adds 2 ulp. rstd > 0: a relative check alone.
RSTD_TOLERANCE = (0.0, 1e-5)


def wb_regs(config: Config, cols: int, itemsize: int) -> int:
    """1 if CACHE=2 keeps the weight in registers too: every row must have the same head
    (``cols % VEC == 0``) and the row plus the weight plus WB_REGISTER_OVERHEAD must fit."""
    return rowwise.weight_registers_fit(config, cols, itemsize, 2, WB_REGISTER_OVERHEAD)


class RMSNormSpec(rowwise.GroupedRowsSpec):
    """Row-wise RMSNorm forward with a weight; outputs y and rstd."""

    name = "rmsnorm"
    description = (
        "rmsnorm forward over the last dimension of a (rows, cols) matrix with a weight: "
        "y = x * rsqrt(mean(x^2) + eps) * weight; outputs y and per-row rstd (float32); "
        "float32 accumulation"
    )
    params = {**rowwise.COMMON_PARAMS, "GROUP_ROWS": (1, 4, 16)}
    template = Path(__file__).with_name("rmsnorm.cu")
    kernel_name = "rmsnorm_fwd"
    cached_arrays = 1
    register_overhead = REGISTER_OVERHEAD
    #: y against the float64 reference. float32: |y| = |x| rstd |w| up to ~10, a few roundings
    #: (rtol 1e-5); atol 1e-6 only for results near zero (x near zero: the error is relative
    #: there too). float16 / bfloat16: the output rounding alone is half an ulp, 2**-11 resp.
    #: 2**-9 relative: rtol is 4x that; atol 1e-6 also covers float16's subnormals (2**-24).
    TOLERANCES = {
        "float32": (1e-6, 1e-5),
        "float16": (1e-6, 2e-3),
        "bfloat16": (1e-6, 8e-3),
    }

    def wb_regs(self, config: Config, cols: int, itemsize: int) -> int:
        return wb_regs(config, cols, itemsize)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = U(0.1, 4) N(0, 1) + U(-2, 2) per row; rows 0, 4, 8, ... are 1e3 + 8 N(0, 1) (their
        squares overflow float16: the sum must be float32); weight ~ +-U(0.5, 1.5); eps = 1e-6.
        y and rstd are pre-filled with NaN. References: float64 from the inputs as stored."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-2.0, 2.0, size=(rows, 1)).astype(np.float32)
        scales = rng.uniform(0.1, 4.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 1e3
        scales[0::4] = 8.0
        sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=cols)).astype(np.float32).astype(np_dtype)
        x = np.empty((rows, cols), dtype=np_dtype)
        y = np.empty((rows, cols), dtype=np_dtype)
        rstd = np.full(rows, np.nan, dtype=np.float32)
        ref_y = np.empty((rows, cols), dtype=np.float64)
        ref_rstd = np.empty(rows, dtype=np.float64)

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            x32 = gen.standard_normal((chunk.stop - chunk.start, cols), dtype=np.float32)
            x32 *= scales[chunk]
            x32 += offsets[chunk]
            x[chunk] = x32
            y[chunk] = np.nan
            ref_y[chunk], ref_rstd[chunk] = rmsnorm_reference(x[chunk], weight, EPS)

        fill_rows(rng, rows, cols, fill)
        return Problem(
            args=[x, weight, y, rstd, np.int32(rows), np.int32(cols), np.float32(EPS)],
            outputs=[2, 3],
            references=[ref_y, ref_rstd],
            tolerances=[self.tolerance(dtype), RSTD_TOLERANCE],
        )

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read and y written once, the weight read once, rstd written once."""
        rows, cols = shape
        itemsize = DTYPES[dtype][2]
        return 2 * rows * cols * itemsize + cols * itemsize + 4 * rows


def rmsnorm_reference(
    x: np.ndarray, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 (y, rstd) of a row-wise RMSNorm (``torch.nn.functional.rms_norm``)."""
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1) + eps)
    x64 *= rstd[:, None]
    x64 *= weight.astype(np.float64)
    return x64, rstd


RMSNORM = register(RMSNormSpec())

__all__ = ["EPS", "RMSNORM", "RMSNormSpec", "rmsnorm_reference"]
