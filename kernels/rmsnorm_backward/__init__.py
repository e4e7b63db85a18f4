"""RMSNorm backward over the last dimension of (rows, cols) matrices: the spec of
``rmsnorm_backward.cu``.

From the forward's input x, weight w and per-row rstd (float32, what :mod:`kernels.rmsnorm`
saves) and the gradient dy of its output::

    dx = rstd * (w * dy - x * rstd^2 * mean(w * dy * x))      (one reduction per row)
    dweight = sum over rows of dy * x * rstd                  (a column reduction)

as torch's autograd of ``rms_norm`` computes them. dx is one pass over each row; dweight takes two
stages: every block of the first kernel sums the rows it processes into a float32 partial row,
the second sums the partial rows in a fixed order (deterministic) into dweight (element type).
float32 accumulation for every element type.

Kernel arguments (:attr:`Problem.args` order, the same for both kernels):
``x, weight, rstd, dy, dx, dweight, partials, nparts, rows, cols`` with ``partials`` float32
``min(rows, MAX_SPLIT * 132) * cols`` (one row per stage-1 block) and ``nparts`` int32 (stage 1
writes its block count there; stage 2 reads it).

Parameter space (Kernel Tuner key order; the row model is :mod:`kernels.rowwise`'s):

- ``BLOCK_SIZE``, ``VEC``, ``ROW_THREADS``, ``MIN_BLOCKS``: as every row-wise operator (any
  ``cols`` with any ``VEC``).
- ``CACHE``: 0 = the dx pass re-reads x and dy; 1 = both rows' vectors in dynamic shared
  memory; 2 = in registers.
- ``DW_ACC``: where a block sums dweight: 0 = each thread's own columns in registers (needs
  ``cols % VEC == 0``; the weight then stays in registers too where it fits, derived
  ``WB_REGS``); 1 = a float32 row of shared memory per row group; 2 = the block's partial row in
  global memory (block mode only: rows too long for shared memory).
- ``SPLIT``: stage-1 blocks per SM of the largest GPU, at most (grid = ``min(ceil(rows /
  rows_per_block), SPLIT * 132)``): more partial rows give more parallelism and more work to
  stage 2. Launch geometry only.
- ``REDUCE_LANES``: stage 2's ``blockDim.y``: partial rows summed side by side per column (a
  block covers 32 columns). Launch geometry only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import column_partials, rowwise
from kato.kernels.column_partials import MAX_SPLIT, partial_rows
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: Registers a kernel with register caches or accumulators needs besides them (pointers, the
#: row's head and tail, rstd, the sums; fit to ptxas reports on sm_90,
#: tests/kernels/test_rmsnorm_backward_compile.py: with 40, float32 rows of 12 vectors of 2 per
#: lane and their accumulators spilled under a 128-register cap).
REGISTER_OVERHEAD = 64
#: The same with the weight in registers too (WB_REGS).
WB_REGISTER_OVERHEAD = 72
EPS = 1e-6
#: atol of dweight as a fraction of max over columns of sum over rows |dy x rstd| (see
#: :meth:`RMSNormBackwardSpec.tolerance`).
DW_SUM_ERROR = 2.0**-18
#: rtol of dweight per dtype: float32 sums (1e-5); float16 / bfloat16 output rounding, 4x half
#: an ulp.
DW_RTOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}


def accumulator_registers(config: Config, cols: int) -> int:
    """DW_ACC=0's registers per thread: ITEMS vectors of VEC float accumulators, and with CACHE
    0/1 the x and dy vectors of its fully unrolled pass as well (ptxas issues all of their loads
    first: compile tests, where counting the accumulators alone let 16 vectors per lane spill
    hundreds of bytes)."""
    return column_partials.accumulator_registers(config, cols, 1)


class RMSNormBackwardSpec(column_partials.ColumnPartialsSpec):
    """RMSNorm backward: dx in one pass over each row, dweight by two-stage column reduction."""

    name = "rmsnorm_backward"
    description = (
        "rmsnorm backward over the last dimension of (rows, cols) matrices from x, weight, rstd "
        "and dy: dx (one pass per row) and dweight (per-block partials, then a reduce); "
        "float32 accumulation"
    )
    params = {
        **rowwise.COMMON_PARAMS,
        "DW_ACC": (0, 1, 2),
        "SPLIT": (1, 2, 4, 8),
        "REDUCE_LANES": (4, 16),
    }
    template = Path(__file__).with_name("rmsnorm_backward.cu")
    kernel_name = "rmsnorm_bwd"
    kernel_names = ("rmsnorm_bwd", "rmsnorm_bwd_reduce")
    cached_arrays = 2
    sums = 1
    wb_register_overhead = WB_REGISTER_OVERHEAD
    register_overhead = REGISTER_OVERHEAD
    #: dx against the float64 reference. |dx| ~ rstd |w dy| is 0.1 to 10 (:meth:`make_problem`).
    #: float32: a few roundings (rtol 1e-5); where w dy and x rstd^2 mean(w dy x) cancel, the
    #: error is a few ulp of the two terms (<= 3e-6): atol 1e-5. float16 / bfloat16: the output
    #: rounding alone is half an ulp, 2**-11 resp. 2**-9 relative: rtol is 4x that, atol as
    #: float32 (above float16's subnormals).
    TOLERANCES = {
        "float32": (1e-5, 1e-5),
        "float16": (1e-5, 2e-3),
        "bfloat16": (1e-5, 8e-3),
    }

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """:meth:`RowwiseSpec.check`, plus: DW_ACC=0 needs ``cols % VEC == 0`` (a thread keeps
        the same columns in every row only if every row has the same head) and DW_ACC=2 one row
        group per block (ROW_THREADS=0)."""
        reason = self.check_common(config, shape, dtype)
        if reason:
            return reason
        cols = shape[1]
        return self.check_partials(config, cols)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = U(0.1, 4) N(0, 1) + U(-2, 2) per row (rows 0, 4, ... 8 + 0.25 N(0, 1): a large
        mean(w dy x)); rstd from x (float64, eps 1e-6, stored as float32); weight ~ +-U(0.5,
        1.5); dy = N(0, 1), plus +-x rstd w on rows 1, 5, ... (a gradient that correlates with y:
        the rstd^2 mean(w dy x) term is as large as w dy there; the random sign keeps those
        rows' dweight terms from adding up past float16's range over many rows). dx, dweight and
        the partials pre-filled with NaN, nparts 0. References: float64 from the inputs as
        stored."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-2.0, 2.0, size=(rows, 1)).astype(np.float32)
        scales = rng.uniform(0.1, 4.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 8.0
        scales[0::4] = 0.25
        sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=cols)).astype(np.float32).astype(np_dtype)
        w64 = weight.astype(np.float64)
        x = np.empty((rows, cols), dtype=np_dtype)
        dy = np.empty((rows, cols), dtype=np_dtype)
        dx = np.empty((rows, cols), dtype=np_dtype)
        rstd = np.empty(rows, dtype=np.float32)
        ref_dx = np.empty((rows, cols), dtype=np.float64)
        dw_parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            n = chunk.stop - chunk.start
            x32 = gen.standard_normal((n, cols), dtype=np.float32)
            x32 *= scales[chunk]
            x32 += offsets[chunk]
            x[chunk] = x32
            x64 = x[chunk].astype(np.float64)
            r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1) + EPS)
            rstd[chunk] = r
            g = gen.standard_normal((n, cols), dtype=np.float32)
            first = chunk.start
            correlated = np.arange(first, chunk.stop) % 4 == 1
            signs = np.where(gen.random(int(correlated.sum())) < 0.5, -1.0, 1.0)[:, None]
            g[correlated] += (signs * x64[correlated] * r[correlated, None] * w64).astype(
                np.float32
            )
            dy[chunk] = g
            dx[chunk] = np.nan
            ref_dx[chunk], dw, dw_abs = rmsnorm_backward_reference(
                x[chunk], weight, rstd[chunk], dy[chunk]
            )
            dw_parts[first] = (dw, dw_abs)

        fill_rows(rng, rows, cols, fill)
        ref_dw = np.zeros(cols)
        dw_scale = np.zeros(cols)
        for first in sorted(dw_parts):  # a fixed order: the same sums whatever the threads
            ref_dw += dw_parts[first][0]
            dw_scale += dw_parts[first][1]
        dweight = np.full(cols, np.nan, dtype=np_dtype)
        partials = np.full(partial_rows(rows) * cols, np.nan, dtype=np.float32)
        nparts = np.zeros(1, dtype=np.int32)
        dw_atol = max(DW_SUM_ERROR * float(dw_scale.max()), 1e-30)
        return Problem(
            args=[
                x,
                weight,
                rstd,
                dy,
                dx,
                dweight,
                partials,
                nparts,
                np.int32(rows),
                np.int32(cols),
            ],
            outputs=[4, 5],
            references=[ref_dx, ref_dw],
            tolerances=[self.tolerance(dtype), (dw_atol, DW_RTOL[dtype])],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of dx (:attr:`TOLERANCES`). dweight's is the problem's own: rtol as
        dx's, atol = 2**-16 * max over columns of sum_r |dy x rstd|. Its float32 sums run
        sequentially over a block's rows (at most rows / grid), then over the partial rows (a
        few hundred), so their rounding error is a small multiple of 2**-24 times that sum of
        magnitudes, far below 2**-16 of it; a single row's term (~0.6 of the mean magnitude,
        against 2**-16 * rows * that) left out or counted twice still fails."""
        return super().tolerance(dtype)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x and dy read, dx written once; weight read and dweight written once; rstd read once
        (the partial rows, ``grid * cols * 8`` bytes through L2, depend on the config)."""
        rows, cols = shape
        itemsize = DTYPES[dtype][2]
        return 3 * rows * cols * itemsize + 2 * cols * itemsize + 4 * rows


def rmsnorm_backward_reference(
    x: np.ndarray, weight: np.ndarray, rstd: np.ndarray, dy: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (dx, dweight, sum over rows of |dy x rstd|) of a row-wise RMSNorm, from the
    rstd given (the forward's, as stored)."""
    x64 = x.astype(np.float64)
    dy64 = dy.astype(np.float64)
    r = rstd.astype(np.float64)[:, None]
    w = weight.astype(np.float64)
    g = dy64 * x64  # dy x
    dweight_terms = g * r
    s = (g * w).mean(axis=-1, keepdims=True)  # mean(w dy x)
    dx = dy64 * w
    dx -= x64 * (r * r * s)
    dx *= r
    return dx, dweight_terms.sum(axis=0), np.abs(dweight_terms).sum(axis=0)


RMSNORM_BACKWARD = register(RMSNormBackwardSpec())

__all__ = [
    "MAX_SPLIT",
    "RMSNORM_BACKWARD",
    "RMSNormBackwardSpec",
    "partial_rows",
    "rmsnorm_backward_reference",
]
