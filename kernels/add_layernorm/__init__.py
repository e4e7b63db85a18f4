"""Residual add fused with LayerNorm over the last dimension of (rows, cols) matrices: the spec
of ``add_layernorm.cu``.

``s = x + residual`` (rounded to the element type and written out: the next layer's residual
stream), ``y = (s - mean) * rstd * weight + bias`` with the mean and biased variance of s *as
stored*, ``rstd = 1 / sqrt(var + eps)``, as ``s = x + residual; y =
torch.nn.functional.layer_norm(s, (cols,), weight, bias, eps)`` computes them. Outputs: s and y
(element type), mean and rstd per row (float32: what :mod:`kernels.layernorm_backward` reads,
with s as its x). The statistics are two-pass (the mean, then the squared deviations from it,
two row reductions), of s - K with the row's first element K as pivot (a plain float32 sum of
rows at 1e3 + 8 N(0, 1) lost the mean to ~1e-4, past y's tolerance, on the H200), over s kept in
registers or shared memory, or re-read (CACHE 0).
float32 accumulation for every element type.

Kernel arguments (:attr:`Problem.args` order): ``x, residual, weight, bias, s, y, mean, rstd,
rows, cols, eps`` (``rows``/``cols`` int32, ``eps`` float32). x, residual, s and y must not
overlap.

Parameter space (Kernel Tuner key order; the row model is :mod:`kernels.rowwise`'s):

- ``BLOCK_SIZE``, ``VEC``, ``ROW_THREADS``, ``MIN_BLOCKS``: as every row-wise operator (any
  ``cols`` with any ``VEC``).
- ``CACHE``: 0 = the variance and output passes re-read s (the thread's own writes, mostly from
  L2); 1 = s's vectors in dynamic shared memory; 2 = in registers, and then with
  ``cols % VEC == 0`` weight and bias too where the launch bounds leave room (derived
  ``WB_REGS``).
- ``GROUP_ROWS``: rows each row group processes (grid = ``ceil(rows / rows_per_block /
  GROUP_ROWS)``, grid-stride loop). Launch geometry only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import rowwise
from kato.kernels.layernorm import STATS_TOLERANCE, layernorm_reference
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: Registers a CACHE=2 kernel needs besides its cache of s and the loads of its first pass (fit
#: to ptxas reports on sm_90, tests/kernels/test_add_layernorm_compile.py).
REGISTER_OVERHEAD = 32
#: The same with weight and bias in registers too (WB_REGS).
WB_REGISTER_OVERHEAD = 40
#: torch's default eps of layer_norm (kernels.layernorm's).
EPS = 1e-5


def load_registers(config: Config, cols: int, itemsize: int) -> int:
    """CACHE=2's registers beyond the cache of s: the x and residual vectors of its unrolled
    first pass, which ptxas loads ahead of the adds (one more register per element, as in
    :func:`kernels.add_rmsnorm.load_registers`)."""
    return rowwise.vector_registers(config, cols, itemsize) if config["CACHE"] == 2 else 0


def wb_regs(config: Config, cols: int, itemsize: int) -> int:
    """1 if CACHE=2 keeps weight and bias in registers too: every row must have the same head
    (``cols % VEC == 0``) and s, its loads, weight, bias and WB_REGISTER_OVERHEAD must fit."""
    return rowwise.weight_registers_fit(config, cols, itemsize, 4, WB_REGISTER_OVERHEAD)


class AddLayerNormSpec(rowwise.GroupedRowsSpec):
    """Residual add + row-wise LayerNorm with weight and bias; outputs the sum, y, mean and
    rstd."""

    name = "add_layernorm"
    description = (
        "residual add fused with layernorm over the last dimension of (rows, cols) matrices: "
        "s = x + residual, y = (s - mean) * rstd * weight + bias; outputs s, y and per-row mean "
        "and rstd (float32); two-pass statistics, float32 accumulation"
    )
    params = {**rowwise.COMMON_PARAMS, "GROUP_ROWS": (1, 4, 16)}
    template = Path(__file__).with_name("add_layernorm.cu")
    kernel_name = "add_layernorm_fwd"
    cached_arrays = 1
    register_overhead = REGISTER_OVERHEAD
    #: y against the float64 reference (from s as stored), as kernels.layernorm's: float32 a
    #: few ulp of |s - mean| rstd |w| + |b| (rtol 1e-5, atol 2e-5 where the two terms cancel);
    #: float16 / bfloat16 4x half an ulp relative, atol a few ulp of |b| ~ 1.
    TOLERANCES = {
        "float32": (2e-5, 1e-5),
        "float16": (1e-3, 2e-3),
        "bfloat16": (8e-3, 8e-3),
    }
    #: s against the exact sum x + residual: one rounding (half an ulp, 4x as rtol).
    SUM_TOLERANCES = {
        "float32": (1e-6, 1e-5),
        "float16": (1e-6, 2e-3),
        "bfloat16": (1e-6, 8e-3),
    }

    def extra_registers(self, config: Config, cols: int, itemsize: int) -> int:
        return load_registers(config, cols, itemsize)

    def wb_regs(self, config: Config, cols: int, itemsize: int) -> int:
        return wb_regs(config, cols, itemsize)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = U(0.1, 4) N(0, 1) + U(-5, 5) per row, residual = N(0, 1); rows 0, 4, 8, ... have
        x = 1e3 + 8 N(0, 1) (a mean far from zero against the spread: E[s^2] - E[s]^2 in
        float32 would lose the variance); rows 2, 6, ... have residual = -x + 0.01 N(0, 1) as
        stored (s cancels to a hundredth of x: the norm must be of s); weight ~ +-U(0.5, 1.5),
        bias ~ U(-1, 1); eps = 1e-5. s, y, mean and rstd pre-filled with NaN. References:
        float64 s = x + residual exactly; y, mean and rstd of s rounded to the element type."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-5.0, 5.0, size=(rows, 1)).astype(np.float32)
        scales = rng.uniform(0.1, 4.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 1e3
        scales[0::4] = 8.0
        sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=cols)).astype(np.float32).astype(np_dtype)
        bias = rng.uniform(-1.0, 1.0, size=cols).astype(np.float32).astype(np_dtype)
        x = np.empty((rows, cols), dtype=np_dtype)
        residual = np.empty((rows, cols), dtype=np_dtype)
        s = np.empty((rows, cols), dtype=np_dtype)
        y = np.empty((rows, cols), dtype=np_dtype)
        mean = np.full(rows, np.nan, dtype=np.float32)
        rstd = np.full(rows, np.nan, dtype=np.float32)
        ref_s = np.empty((rows, cols), dtype=np.float64)
        ref_y = np.empty((rows, cols), dtype=np.float64)
        ref_mean = np.empty(rows, dtype=np.float64)
        ref_rstd = np.empty(rows, dtype=np.float64)

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            n = chunk.stop - chunk.start
            x32 = gen.standard_normal((n, cols), dtype=np.float32)
            x32 *= scales[chunk]
            x32 += offsets[chunk]
            x[chunk] = x32
            r32 = gen.standard_normal((n, cols), dtype=np.float32)
            cancel = np.arange(chunk.start, chunk.stop) % 4 == 2
            r32[cancel] *= 0.01
            r32[cancel] -= x[chunk][cancel].astype(np.float32)
            residual[chunk] = r32
            s[chunk] = np.nan
            y[chunk] = np.nan
            out = add_layernorm_reference(x[chunk], residual[chunk], weight, bias, EPS)
            ref_s[chunk], ref_y[chunk], ref_mean[chunk], ref_rstd[chunk] = out

        fill_rows(rng, rows, cols, fill)
        return Problem(
            args=[
                x,
                residual,
                weight,
                bias,
                s,
                y,
                mean,
                rstd,
                np.int32(rows),
                np.int32(cols),
                np.float32(EPS),
            ],
            outputs=[4, 5, 6, 7],
            references=[ref_s, ref_y, ref_mean, ref_rstd],
            tolerances=[
                self.SUM_TOLERANCES[dtype],
                self.tolerance(dtype),
                STATS_TOLERANCE,
                STATS_TOLERANCE,
            ],
        )

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x and the residual read, s and y written once, weight and bias read once, mean and
        rstd written once."""
        rows, cols = shape
        itemsize = DTYPES[dtype][2]
        return 4 * rows * cols * itemsize + 2 * cols * itemsize + 8 * rows


def add_layernorm_reference(
    x: np.ndarray, residual: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (s, y, mean, rstd): s = x + residual exactly; y, mean and rstd the LayerNorm of
    s rounded to x's element type (what the next layer and the backward see)."""
    s = x.astype(np.float64) + residual.astype(np.float64)
    y, mean, rstd = layernorm_reference(s.astype(x.dtype), weight, bias, eps)
    return s, y, mean, rstd


ADD_LAYERNORM = register(AddLayerNormSpec())

__all__ = ["ADD_LAYERNORM", "EPS", "AddLayerNormSpec", "add_layernorm_reference"]
