"""Residual add fused with RMSNorm over the last dimension of (rows, cols) matrices: the spec of
``add_rmsnorm.cu``.

``s = x + residual`` (rounded to the element type and written out: the next layer's residual
stream), ``y = s * rstd * weight`` with ``rstd = 1 / sqrt(mean(s^2) + eps)`` of s *as stored*,
as ``s = x + residual; y = torch.nn.functional.rms_norm(s, (cols,), weight, eps)`` computes
them. Outputs: s and y (element type) and rstd per row (float32: what
:mod:`kernels.rmsnorm_backward` reads, with s as its x). One read of x and of the residual, one
write of s and of y: the unfused pair reads s back. float32 accumulation for every element type.

Kernel arguments (:attr:`Problem.args` order): ``x, residual, weight, s, y, rstd, rows, cols,
eps`` (``rows``/``cols`` int32, ``eps`` float32). x, residual, s and y must not overlap.

Parameter space (Kernel Tuner key order; the row model is :mod:`kernels.rowwise`'s):

- ``BLOCK_SIZE``, ``VEC``, ``ROW_THREADS``, ``MIN_BLOCKS``: as every row-wise operator (any
  ``cols`` with any ``VEC``).
- ``CACHE``: 0 = the output pass re-reads s (the thread's own writes, mostly from L2); 1 = s's
  vectors in dynamic shared memory; 2 = in registers, and then with ``cols % VEC == 0`` the
  weight too where the launch bounds leave room for it (derived ``WB_REGS``).
- ``GROUP_ROWS``: rows each row group processes (grid = ``ceil(rows / rows_per_block /
  GROUP_ROWS)``, grid-stride loop). Launch geometry only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import rowwise
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.rmsnorm import EPS, RSTD_TOLERANCE, rmsnorm_reference
from kato.kernels.spec import DTYPES, Config, Problem

#: Registers a CACHE=2 kernel needs besides its cache of s (one per element,
#: :func:`kernels.rowwise.vector_registers`; fit to ptxas reports on sm_90,
#: tests/kernels/test_add_rmsnorm_compile.py: below this, the cache spills).
REGISTER_OVERHEAD = 32
#: The same with the weight in registers too (WB_REGS): row + weight registers + this.
WB_REGISTER_OVERHEAD = 40


def wb_regs(config: Config, cols: int, itemsize: int) -> int:
    """1 if CACHE=2 keeps the weight in registers too: every row must have the same head
    (``cols % VEC == 0``) and s, the loads of its first pass (:func:`load_registers`), the
    weight and WB_REGISTER_OVERHEAD must fit."""
    return rowwise.weight_registers_fit(config, cols, itemsize, 3, WB_REGISTER_OVERHEAD)


def load_registers(config: Config, cols: int, itemsize: int) -> int:
    """CACHE=2's registers beyond the cache of s: the x and residual vectors of its unrolled
    first pass, which ptxas loads ahead of the adds (one more register per element: compile
    tests, where counting s alone let 12 vectors of 4 per lane spill 160 to 208 bytes under a
    128-register cap)."""
    return rowwise.vector_registers(config, cols, itemsize) if config["CACHE"] == 2 else 0


class AddRMSNormSpec(rowwise.GroupedRowsSpec):
    """Residual add + row-wise RMSNorm with a weight; outputs the sum, y and rstd."""

    name = "add_rmsnorm"
    description = (
        "residual add fused with rmsnorm over the last dimension of (rows, cols) matrices: "
        "s = x + residual, y = s * rsqrt(mean(s^2) + eps) * weight; outputs s, y and per-row "
        "rstd (float32); float32 accumulation"
    )
    params = {**rowwise.COMMON_PARAMS, "GROUP_ROWS": (1, 4, 16)}
    template = Path(__file__).with_name("add_rmsnorm.cu")
    kernel_name = "add_rmsnorm_fwd"
    cached_arrays = 1
    register_overhead = REGISTER_OVERHEAD
    #: y against the float64 reference (from s as stored): float32: |y| up to ~10, a few
    #: roundings (rtol 1e-5), atol for results near zero; float16 / bfloat16: the output
    #: rounding alone is half an ulp, 2**-11 resp. 2**-9 relative: rtol 4x that. The same
    #: tolerances hold s against the exact sum x + residual: one rounding of it.
    TOLERANCES = {
        "float32": (1e-6, 1e-5),
        "float16": (1e-6, 2e-3),
        "bfloat16": (1e-6, 8e-3),
    }

    def extra_registers(self, config: Config, cols: int, itemsize: int) -> int:
        return load_registers(config, cols, itemsize)

    def wb_regs(self, config: Config, cols: int, itemsize: int) -> int:
        return wb_regs(config, cols, itemsize)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = U(0.1, 4) N(0, 1) + U(-2, 2) per row, residual = N(0, 1); rows 0, 4, 8, ... have
        x = 1e3 + 8 N(0, 1) (squares of s overflow float16: the sum must be float32); rows 2, 6,
        ... have residual = -x + 0.01 N(0, 1) as stored (s cancels to a hundredth of x: the norm
        must be of s, not of x and the residual); weight ~ +-U(0.5, 1.5); eps = 1e-6. s, y and
        rstd pre-filled with NaN. References: float64 s = x + residual exactly, y and rstd of s
        rounded to the element type (as the kernel stores it)."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-2.0, 2.0, size=(rows, 1)).astype(np.float32)
        scales = rng.uniform(0.1, 4.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 1e3
        scales[0::4] = 8.0
        sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=cols)).astype(np.float32).astype(np_dtype)
        x = np.empty((rows, cols), dtype=np_dtype)
        residual = np.empty((rows, cols), dtype=np_dtype)
        s = np.empty((rows, cols), dtype=np_dtype)
        y = np.empty((rows, cols), dtype=np_dtype)
        rstd = np.full(rows, np.nan, dtype=np.float32)
        ref_s = np.empty((rows, cols), dtype=np.float64)
        ref_y = np.empty((rows, cols), dtype=np.float64)
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
            ref_s[chunk], ref_y[chunk], ref_rstd[chunk] = add_rmsnorm_reference(
                x[chunk], residual[chunk], weight, EPS
            )

        fill_rows(rng, rows, cols, fill)
        tolerance = self.tolerance(dtype)
        return Problem(
            args=[x, residual, weight, s, y, rstd, np.int32(rows), np.int32(cols), np.float32(EPS)],
            outputs=[3, 4, 5],
            references=[ref_s, ref_y, ref_rstd],
            tolerances=[tolerance, tolerance, RSTD_TOLERANCE],
        )

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x and the residual read, s and y written once, the weight read once, rstd written
        once."""
        rows, cols = shape
        itemsize = DTYPES[dtype][2]
        return 4 * rows * cols * itemsize + cols * itemsize + 4 * rows


def add_rmsnorm_reference(
    x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (s, y, rstd): s = x + residual exactly; y and rstd the RMSNorm of s rounded to
    x's element type (what the next layer and the backward see)."""
    s = x.astype(np.float64) + residual.astype(np.float64)
    y, rstd = rmsnorm_reference(s.astype(x.dtype), weight, eps)
    return s, y, rstd


ADD_RMSNORM = register(AddRMSNormSpec())

__all__ = ["ADD_RMSNORM", "AddRMSNormSpec", "add_rmsnorm_reference"]
