"""LayerNorm backward over the last dimension of (rows, cols) matrices: the spec of
``layernorm_backward.cu``.

From the forward's input x, weight w and the per-row mean and rstd it saved (float32: what
:mod:`kernels.layernorm`'s forward writes, so the backward never recomputes the statistics) and
the gradient dy of its output ``y = xhat * w + b``, ``xhat = (x - mean) * rstd``::

    dx = rstd * (w dy - mean(w dy) - xhat * mean(w dy xhat))     (two sums, one reduction per row)
    dweight = sum over rows of dy * xhat                         (column reductions)
    dbias = sum over rows of dy

as torch's autograd of ``layer_norm`` computes them. dx is one pass over each row; dweight and
dbias take two stages: every block of the first kernel sums the rows it processes into a float32
partial row of ``2 * cols`` floats (dweight's columns, then dbias's), the second sums the
partial rows in a fixed order (deterministic) into dweight and dbias (element type). float32
accumulation for every element type.

Kernel arguments (:attr:`Problem.args` order, the same for both kernels):
``x, weight, mean, rstd, dy, dx, dweight, dbias, partials, nparts, rows, cols`` with ``partials``
float32 ``min(rows, MAX_SPLIT * 132) * 2 * cols`` (one row per stage-1 block) and ``nparts``
int32 (stage 1 writes its block count there; stage 2 reads it).

Parameter space (Kernel Tuner key order; the row model is :mod:`kernels.rowwise`'s, the
column reduction :mod:`kernels.rmsnorm_backward`'s with two accumulated columns per column):

- ``BLOCK_SIZE``, ``VEC``, ``ROW_THREADS``, ``MIN_BLOCKS``: as every row-wise operator (any
  ``cols`` with any ``VEC``).
- ``CACHE``: 0 = the dx pass re-reads x and dy; 1 = both rows' vectors in dynamic shared
  memory; 2 = in registers.
- ``DW_ACC``: where a block sums dweight and dbias: 0 = each thread's own columns in registers
  (needs ``cols % VEC == 0``; the weight then stays in registers too where it fits, derived
  ``WB_REGS``); 1 = two float32 rows of shared memory per row group; 2 = the block's partial
  row in global memory (block mode only: rows too long for shared memory).
- ``SPLIT``: stage-1 blocks per SM of the largest GPU, at most (grid = ``min(ceil(rows /
  rows_per_block), SPLIT * 132)``). Launch geometry only.
- ``REDUCE_LANES``: stage 2's ``blockDim.y``: partial rows summed side by side per column (a
  block covers 32 of the ``2 * cols`` partial columns). Launch geometry only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import column_partials, limits, rowwise
from kato.kernels.column_partials import MAX_SPLIT, partial_rows
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: Registers a kernel with register caches or accumulators needs besides them (pointers, the
#: row's head and tail, mean, rstd, the sums; fit to ptxas reports on sm_90,
#: tests/kernels/test_layernorm_backward_compile.py).
REGISTER_OVERHEAD = 64
#: The same with the weight in registers too (WB_REGS).
WB_REGISTER_OVERHEAD = 72
#: The forward's eps (kernels.layernorm.EPS, torch's default): the problems' mean and rstd.
EPS = 1e-5
#: atol of dweight (dbias) as a fraction of max over columns of sum over rows |dy xhat| (|dy|):
#: see :meth:`LayerNormBackwardSpec.tolerance`.
DW_SUM_ERROR = 2.0**-18
#: rtol of dweight and dbias per dtype: float32 sums (1e-5); float16 / bfloat16 output
#: rounding, 4x half an ulp.
DW_RTOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}


def reduction_shared_bytes(config: Config) -> int:
    """Static shared memory of the block-wide row reduction: a double-buffered float2 per warp
    (the two row sums travel together: one barrier per row)."""
    return 2 * rowwise.reduction_shared_bytes(config)


def accumulator_registers(config: Config, cols: int) -> int:
    """DW_ACC=0's registers per thread: ITEMS vectors of VEC float accumulators for dweight and
    as many for dbias, and with CACHE 0/1 the x and dy vectors of its fully unrolled pass as
    well (ptxas issues all of their loads first, as in rmsnorm_backward)."""
    return column_partials.accumulator_registers(config, cols, 2)


class LayerNormBackwardSpec(column_partials.ColumnPartialsSpec):
    """LayerNorm backward: dx in one pass over each row, dweight and dbias by two-stage column
    reduction."""

    name = "layernorm_backward"
    description = (
        "layernorm backward over the last dimension of (rows, cols) matrices from x, weight, "
        "the forward's mean and rstd, and dy: dx (one pass per row), dweight and dbias "
        "(per-block partials, then a reduce); float32 accumulation"
    )
    params = {
        **rowwise.COMMON_PARAMS,
        "DW_ACC": (0, 1, 2),
        "SPLIT": (1, 2, 4, 8),
        "REDUCE_LANES": (4, 16),
    }
    template = Path(__file__).with_name("layernorm_backward.cu")
    kernel_name = "layernorm_bwd"
    kernel_names = ("layernorm_bwd", "layernorm_bwd_reduce")
    cached_arrays = 2
    sums = 2
    wb_register_overhead = WB_REGISTER_OVERHEAD
    register_overhead = REGISTER_OVERHEAD
    #: dx against the float64 reference. |dx| ~ rstd |w dy| is 0.1 to 10 (:meth:`make_problem`).
    #: float32: a few roundings (rtol 1e-5); where w dy, mean(w dy) and xhat mean(w dy xhat)
    #: cancel, the error is a few ulp of the three terms (up to ~30: 2e-6 each): atol 2e-5.
    #: float16 / bfloat16: the output rounding alone is half an ulp, 2**-11 resp. 2**-9
    #: relative: rtol is 4x that, atol as float32.
    TOLERANCES = {
        "float32": (2e-5, 1e-5),
        "float16": (2e-5, 2e-3),
        "bfloat16": (2e-5, 8e-3),
    }

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """:meth:`RowwiseSpec.check` (with the float2 row reduction's static shared memory),
        plus: DW_ACC=0 needs ``cols % VEC == 0`` (a thread keeps the same columns in every row
        only if every row has the same head) and DW_ACC=2 one row group per block
        (ROW_THREADS=0)."""
        reason = self.check_common(config, shape, dtype)
        if reason:
            return reason
        cols = shape[1]
        shared = self.dynamic_shared_bytes(config, cols, DTYPES[dtype][2])
        total = shared + reduction_shared_bytes(config)
        if total > limits.MAX_SHARED_PER_BLOCK:
            return (
                f"needs {total} bytes of shared memory per block ({rowwise.rows_per_block(config)}"
                f" row group(s) of {cols} columns); at most {limits.MAX_SHARED_PER_BLOCK}"
            )
        return self.check_partials(config, cols)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = U(0.25, 4) N(0, 1) + U(-5, 5) per row (rows 0, 4, ... 1e3 + 8 N(0, 1): x - mean
        must be taken in float32 from the saved mean); mean and rstd from x (float64, biased
        variance, eps 1e-5, stored as float32, as the forward saves them); weight ~ +-U(0.5,
        1.5); dy = N(0, 1), plus +-xhat w on rows 1, 5, ... (a gradient that correlates with y:
        the xhat mean(w dy xhat) term is as large as w dy there) and +-sign(w) on rows 2, 6, ...
        (mean(w dy) as large as w dy); the random signs per row keep those rows' dweight and
        dbias terms from adding up past float16's range over many rows. dx, dweight, dbias and the
        partials pre-filled with NaN, nparts 0. References: float64 from the inputs as stored
        (x, weight, dy in the element type, mean and rstd in float32)."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-5.0, 5.0, size=(rows, 1)).astype(np.float32)
        scales = rng.uniform(0.25, 4.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 1e3
        scales[0::4] = 8.0
        sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=cols)).astype(np.float32).astype(np_dtype)
        w64 = weight.astype(np.float64)
        x = np.empty((rows, cols), dtype=np_dtype)
        dy = np.empty((rows, cols), dtype=np_dtype)
        dx = np.empty((rows, cols), dtype=np_dtype)
        mean = np.empty(rows, dtype=np.float32)
        rstd = np.empty(rows, dtype=np.float32)
        ref_dx = np.empty((rows, cols), dtype=np.float64)
        parts: dict[int, tuple[np.ndarray, ...]] = {}

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            n = chunk.stop - chunk.start
            x32 = gen.standard_normal((n, cols), dtype=np.float32)
            x32 *= scales[chunk]
            x32 += offsets[chunk]
            x[chunk] = x32
            x64 = x[chunk].astype(np.float64)
            mu = x64.mean(axis=1)
            centred = x64 - mu[:, None]
            r = 1.0 / np.sqrt(np.mean(centred * centred, axis=1) + EPS)
            mean[chunk] = mu
            rstd[chunk] = r
            g = gen.standard_normal((n, cols), dtype=np.float32)
            index = np.arange(chunk.start, chunk.stop) % 4
            correlated, shifted = index == 1, index == 2
            signs = np.where(gen.random(int(correlated.sum())) < 0.5, -1.0, 1.0)[:, None]
            xhat = centred[correlated] * r[correlated, None]
            g[correlated] += (signs * xhat * w64).astype(np.float32)
            signs = np.where(gen.random(int(shifted.sum())) < 0.5, -1.0, 1.0)[:, None]
            g[shifted] += (signs * np.sign(w64)).astype(np.float32)
            dy[chunk] = g
            dx[chunk] = np.nan
            ref_dx[chunk], *sums = layernorm_backward_reference(
                x[chunk], weight, mean[chunk], rstd[chunk], dy[chunk]
            )
            parts[chunk.start] = tuple(sums)

        fill_rows(rng, rows, cols, fill)
        ref_dw, ref_db, dw_scale, db_scale = (np.zeros(cols) for _ in range(4))
        for first in sorted(parts):  # a fixed order: the same sums whatever the threads
            dw, db, dw_abs, db_abs = parts[first]
            ref_dw += dw
            ref_db += db
            dw_scale += dw_abs
            db_scale += db_abs
        dweight = np.full(cols, np.nan, dtype=np_dtype)
        dbias = np.full(cols, np.nan, dtype=np_dtype)
        partials = np.full(partial_rows(rows) * 2 * cols, np.nan, dtype=np.float32)
        nparts = np.zeros(1, dtype=np.int32)
        dw_atol = max(DW_SUM_ERROR * float(dw_scale.max()), 1e-30)
        db_atol = max(DW_SUM_ERROR * float(db_scale.max()), 1e-30)
        return Problem(
            args=[
                x,
                weight,
                mean,
                rstd,
                dy,
                dx,
                dweight,
                dbias,
                partials,
                nparts,
                np.int32(rows),
                np.int32(cols),
            ],
            outputs=[5, 6, 7],
            references=[ref_dx, ref_dw, ref_db],
            tolerances=[
                self.tolerance(dtype),
                (dw_atol, DW_RTOL[dtype]),
                (db_atol, DW_RTOL[dtype]),
            ],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of dx (:attr:`TOLERANCES`). dweight's and dbias's are the problem's
        own: rtol :data:`DW_RTOL`, atol = 2**-18 * max over columns of sum_r |dy xhat| (resp.
        |dy|). Their float32 sums run sequentially over a block's rows (at most rows / grid),
        then over the partial rows (a few hundred), so their rounding error is a small multiple
        of 2**-24 times that sum of magnitudes, far below 2**-18 of it; a single row's term
        left out or counted twice still fails (a row's |dy xhat| is ~0.6 of the mean, against
        2**-18 * rows of it)."""
        return super().tolerance(dtype)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x and dy read, dx written once; weight read, dweight and dbias written once; mean and
        rstd read once (the partial rows, ``grid * 2 * cols * 8`` bytes through L2, depend on the
        config)."""
        rows, cols = shape
        itemsize = DTYPES[dtype][2]
        return 3 * rows * cols * itemsize + 3 * cols * itemsize + 8 * rows


def layernorm_backward_reference(
    x: np.ndarray, weight: np.ndarray, mean: np.ndarray, rstd: np.ndarray, dy: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (dx, dweight, dbias, sum over rows of |dy xhat|, sum over rows of |dy|) of a
    row-wise LayerNorm, from the mean and rstd given (the forward's, as stored)."""
    x64 = x.astype(np.float64)
    dy64 = dy.astype(np.float64)
    r = rstd.astype(np.float64)[:, None]
    xhat = (x64 - mean.astype(np.float64)[:, None]) * r
    g = dy64 * weight.astype(np.float64)
    a = g.mean(axis=-1, keepdims=True)  # mean(w dy)
    b = (g * xhat).mean(axis=-1, keepdims=True)  # mean(w dy xhat)
    dx = (g - a - xhat * b) * r
    dweight_terms = dy64 * xhat
    return (
        dx,
        dweight_terms.sum(axis=0),
        dy64.sum(axis=0),
        np.abs(dweight_terms).sum(axis=0),
        np.abs(dy64).sum(axis=0),
    )


LAYERNORM_BACKWARD = register(LayerNormBackwardSpec())

__all__ = [
    "EPS",
    "LAYERNORM_BACKWARD",
    "LayerNormBackwardSpec",
    "MAX_SPLIT",
    "layernorm_backward_reference",
    "partial_rows",
]
