"""Sum over the last dimension of a (rows, cols) matrix into float32: the spec of ``reduce_sum.cu``.

Parameter space (Kernel Tuner key order):

- ``BLOCK_SIZE``: threads per block.
- ``ROW_THREADS``: threads per row: 8 or 32 (an aligned group of lanes in a warp, shuffles
  only: short rows) or 0 (the whole block per row: shuffles, then shared memory across warps).
- ``VEC``: elements per vector load, at most 16 bytes; ``cols % VEC == 0`` is required (rows
  start on a vector boundary); ``VEC=1`` serves every ``cols``.
- ``UNROLL``: vectors loaded per thread per step (bytes in flight per thread).

No MIN_BLOCKS: every variant needs <= 64 registers (asserted by the compile test), nothing is
cached per thread, and bytes in flight are set by UNROLL * VEC directly; a min-blocks clause
would only trade those loads for spills.

Input float32, float16 or bfloat16; accumulation and the OUTPUT are float32 for every input type.
Accuracy: per thread, each step's ``UNROLL * VEC`` values are summed pairwise (each vector, then
the vector sums) and the step sums Kahan-accumulated, then butterflies across the row's threads:
a few dozen roundings of ``sum |x|`` at most, independent of ``cols`` (``row_sum_model``
reproduces it bit for bit).
Problem arguments: ``[x, out (float32[rows]), rows (int32), cols (int32)]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.parallel import fill_rows
from kato.kernels.reduce_sum_all import EPS32, ERROR_ROUNDINGS, butterfly, step_sum
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Problem

#: Column indices run up to cols/VEC + ROW_THREADS * UNROLL (one step past the end) in int.
MAX_COLS = 2**31 - 2**16

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


def threads_per_row(config: Config) -> int:
    return config["ROW_THREADS"] or config["BLOCK_SIZE"]


def rows_per_block(config: Config) -> int:
    return config["BLOCK_SIZE"] // threads_per_row(config)


def static_shared_bytes(config: Config) -> int:
    """Block per row: a double-buffered float per warp (``2 * warps * 4`` bytes)."""
    if config["ROW_THREADS"] == 0 and config["BLOCK_SIZE"] > 32:
        return 2 * (config["BLOCK_SIZE"] // 32) * 4
    return 0


class ReduceSumSpec(OperatorSpec):
    """Row sums of a (rows, cols) matrix into float32."""

    name = "reduce_sum"
    description = "sum over the last dimension of a (rows, cols) matrix into float32"
    dtypes = ("float32", "float16", "bfloat16")
    rank = 2
    shape_names = ("rows", "cols")
    params = {
        "BLOCK_SIZE": (128, 256, 512, 1024),
        "ROW_THREADS": (8, 32, 0),
        "VEC": (1, 2, 4, 8),
        "UNROLL": (2, 4, 8),
    }
    template = Path(__file__).with_name("reduce_sum.cu")
    kernel_name = "reduce_sum_kernel"

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows and cols must fit the kernel's ``int`` arguments."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if rows > limits.INT32_MAX or cols > MAX_COLS:
            raise InvalidInput(
                f"reduce_sum takes up to 2**31-1 rows and 2**31-2**16 columns, got {rows} x {cols}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        ``cols % VEC != 0``. (Threads, shared memory and registers fit for every config.)"""
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            _, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        vec = config["VEC"]
        vector_bytes = vec * DTYPES[dtype][2]
        if reason := limits.vector_width_error(vec, vector_bytes, dtype):
            return reason
        if cols % vec != 0:
            return f"cols={cols} is not a multiple of VEC={vec}: rows would start misaligned"
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """The widest vector dividing cols; then by vectors per row: <= 64 -> 8 threads per
        row, <= 1024 -> a warp per row, else a block of 512 per row; UNROLL 4 (8 for a warp)."""
        _, cols = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        vec = max(v for v in self.params["VEC"] if v * itemsize <= 16 and cols % v == 0)
        nvec = cols // vec
        if nvec <= 64:
            return {"BLOCK_SIZE": 256, "ROW_THREADS": 8, "VEC": vec, "UNROLL": 4}
        if nvec <= 1024:
            return {"BLOCK_SIZE": 256, "ROW_THREADS": 32, "VEC": vec, "UNROLL": 8}
        return {"BLOCK_SIZE": 512, "ROW_THREADS": 0, "VEC": vec, "UNROLL": 4}

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Tunables (space order), then DTYPE, IS_HALF, IS_BF16: independent of the shape."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {name: config[name] for name in self.params}
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """``ceil(rows / rows_per_block)`` blocks (grid.x, capped at 2**31-1)."""
        rows, _ = shape
        grid = min(math.ceil(rows / rows_per_block(config)), limits.MAX_GRID_X)
        return Launch(grid=(grid, 1, 1), block=(config["BLOCK_SIZE"], 1, 1))

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Rows 0, 1, 2 (mod 4): U(0.5, 1.5) with a random quarter negated (positive-biased: a
        serial float32 sum drifts); rows 3 (mod 4): N(0, 1) (the sum cancels to ~sqrt(cols)).
        No zeros. out pre-filled with NaN. Absolute tolerance: ``ERROR_ROUNDINGS`` roundings
        of the largest row's ``sum |x|``."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        x = np.empty((rows, cols), dtype=np_dtype)
        reference = np.empty(rows, dtype=np.float64)
        abs_sums = np.empty(rows, dtype=np.float64)

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # rows of x, the sums
            n = chunk.stop - chunk.start
            x32 = gen.uniform(0.5, 1.5, size=(n, cols)).astype(np.float32)
            np.negative(x32, out=x32, where=gen.random((n, cols), dtype=np.float32) < 0.25)
            # Rows 3 (mod 4) of the whole problem: the chunk's first row is row chunk.start.
            normal = range((3 - chunk.start) % 4, n, 4)
            x32[normal.start :: 4] = gen.standard_normal((len(normal), cols), dtype=np.float32)
            x64 = x32.astype(np_dtype).astype(np.float64)  # the values as stored
            x64[x64 == 0] = 1.0  # N(0, 1) never gives 0 in practice; make sure
            x[chunk] = x64
            reference[chunk] = x64.sum(axis=1)
            abs_sums[chunk] = np.abs(x64, out=x64).sum(axis=1)

        fill_rows(rng, rows, cols, fill)
        abs_sum = float(abs_sums.max())
        return Problem(
            args=[x, np.full(rows, np.nan, dtype=np.float32), np.int32(rows), np.int32(cols)],
            outputs=[1],
            references=[reference],
            tolerances=[(ERROR_ROUNDINGS * EPS32 * abs_sum + 1e-30, 0.0)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """Default ``(atol, rtol)`` of a float32 sum; problems carry their own absolute
        tolerance scaled by the rows' ``sum |x|``."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"reduce_sum does not support dtype {dtype!r}")
        return (1e-6, ERROR_ROUNDINGS * EPS32)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once, the float32 sums written: ``rows * (cols * itemsize + 4)``."""
        rows, cols = shape
        return rows * (cols * DTYPES[dtype][2] + 4)


def row_sum_model(x: np.ndarray, config: Config) -> np.ndarray:
    """The kernel's float32 row sums of ``x`` (2-D, any float dtype), bit for bit."""
    rows, cols = x.shape
    vec, unroll = config["VEC"], config["UNROLL"]
    p = threads_per_row(config)
    nvec = cols // vec
    xv = x.astype(np.float32).reshape(rows, nvec, vec)
    s = np.zeros((rows, p), dtype=np.float32)
    c = np.zeros((rows, p), dtype=np.float32)
    lanes = np.arange(p)
    for base in range(0, nvec, p * unroll):
        f = np.zeros((rows, p, unroll, vec), dtype=np.float32)
        for u in range(unroll):
            lo = base + u * p
            chunk = xv[:, lo : min(lo + p, nvec)]
            f[:, : chunk.shape[1], u] = chunk
        total = step_sum(f)
        active = base + lanes < nvec
        y = total - c
        t = s + y
        c = np.where(active, (t - s) - y, c)
        s = np.where(active, t, s)
    v = s - c
    if config["ROW_THREADS"]:
        return butterfly(v, p)[:, 0]
    warps = butterfly(v.reshape(rows, p // 32, 32))[..., 0]
    if p == 32:
        return warps[:, 0]
    lanes32 = np.zeros((rows, 32), dtype=np.float32)
    lanes32[:, : p // 32] = warps
    return butterfly(lanes32)[:, 0]


REDUCE_SUM = register(ReduceSumSpec())

__all__ = ["REDUCE_SUM", "ReduceSumSpec", "row_sum_model", "static_shared_bytes"]
