"""Softmax over the last dimension of a (rows, cols) matrix: the spec of ``softmax.cu``.

Parameter space (Kernel Tuner key order):

- ``BLOCK_SIZE``: threads per block.
- ``VEC``: elements per vector load/store, at most 16 bytes; any ``cols`` (issue 31). Where
  ``cols % VEC != 0`` rows start at different offsets from a vector boundary, and the source is
  rendered with ``ROW_SPLIT=1``: each row is a scalar head up to its first aligned address,
  aligned vectors, and a scalar tail. Shapes with ``cols % VEC == 0`` render without it and
  compile to the program they compiled to before it existed.
- ``STRATEGY``: 0 = a group of ``LANES`` lanes of a warp per row (``BLOCK_SIZE/LANES`` rows per
  block, shuffles within the group only); 1 = one block per row (warp shuffles, then a shared
  array across warps); 2 = few long rows (issue 31): each row cut into
  ``parts = (max(MIN_BLOCKS, 1) * 132) // rows`` contiguous pieces, one block per piece, so that
  the grid is ``MIN_BLOCKS`` blocks (at least one) on each of the H200's 132 SMs where one block
  per row would leave all but ``rows`` of them idle. Two launches (:meth:`SoftmaxSpec.steps`):
  ``softmax_split_stats`` writes each piece's (max, sum), then ``softmax_kernel`` merges its
  row's partials in a fixed order (deterministic) and writes the piece's y, re-reading x (3
  passes over memory instead of 2, the first launch's last reads served from L2). CACHE 0 and
  LANES 32 only; only where it splits (at least 2 pieces of at least ``BLOCK_SIZE`` vectors).
- ``CACHE``: 0 = online (max, sum) pass, then a second pass that re-reads x (from L2 if lucky);
  1 = the row is kept in dynamic shared memory between the passes, stored in the element type
  (``cols * itemsize`` bytes per row held); 2 = the row is kept in registers, ``ITEMS`` vectors
  per thread (``ITEMS = ceil(cols / (threads_per_row * VEC))``, at most 16).
- ``MIN_BLOCKS``: the min-blocks clause of ``__launch_bounds__`` (0 = none); for STRATEGY 2
  also the blocks per SM the grid is sized for (0 counts as 1), so that the grid is one wave of
  blocks the launch bounds keep resident together.
- ``LANES``: STRATEGY 0's lanes per row, 4, 8, 16 or 32 (issue 31: with a warp per row, a row
  of 7 elements left 25 of 32 lanes idle; 32 / LANES rows per warp keep them busy), at least
  ``VEC``. STRATEGY 1 takes 32. ``LANES=32`` is the program of a warp per row as it was before
  the parameter existed.

Accumulation is float32 for every element type. Inputs and outputs are float32, float16 or
bfloat16 (the CUDA types ``float``, ``__half``, ``__nv_bfloat16``).

STRATEGY 2's partials live in a global of the loaded module (``kSplitPieces`` =
:data:`SPLIT_PIECES` of them; the arguments stay ``x, y, rows, cols`` for every config, as
kato_torch passes them), so two calls on one loaded module must not overlap. Kato measures on
one stream; kato_torch sees the module's ``__device__`` globals in its cubin
(:func:`kato.tuner.cubin.has_device_globals`) and loads it once per stream that launches it.
Still shared: graphs captured on one stream (torch's default capture stream is one per
process) replayed at once on two streams (:class:`kato_torch._kernels.BoundOperator`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits, split_rows
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Problem, Step

#: CACHE=2 holds at most this many vectors per thread.
MAX_ITEMS = 16
#: Registers a CACHE=2 kernel needs besides its cache (pointers, indices, partial max/sum,
#: unpacked floats). Fit to ptxas reports on sm_80/sm_90: below this, the cache spills.
REGISTER_OVERHEAD = 28
#: The kernel takes rows and cols as ``int``; column indices run up to cols + 8192 (one step of
#: the streaming loop past the end), so cols keeps 64 Ki of headroom below INT32_MAX.
MAX_COLS = 2**31 - 2**16
#: STRATEGY 2's partials workspace (``kSplitPieces`` in softmax.cu): one per piece, for the
#: largest grid the spec launches, the largest MIN_BLOCKS on each of 132 SMs.
SPLIT_PIECES = 4 * limits.NUM_SMS
#: The split path's second kernel is ``softmax_kernel`` (it writes y, as in every strategy).
SPLIT_STATS_KERNEL = "softmax_split_stats"
#: The default splits rows of at least this many bytes where they are fewer than half the SMs:
#: one block streams about this much in the time of a second launch (a few microseconds).
SPLIT_MIN_ROW_BYTES = 128 * 1024

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


def threads_per_row(config: Config) -> int:
    """Threads that share one row (or piece): LANES lanes of a warp (STRATEGY 0) or the whole
    block."""
    return config["LANES"] if config["STRATEGY"] == 0 else config["BLOCK_SIZE"]


def rows_per_block(config: Config) -> int:
    return config["BLOCK_SIZE"] // threads_per_row(config)


def items_per_thread(config: Config, cols: int) -> int:
    """Vectors each thread holds for CACHE=2: ``ceil(cols / (threads_per_row * VEC))``."""
    return math.ceil(cols / (threads_per_row(config) * config["VEC"]))


def register_cap(config: Config) -> int:
    """Registers per thread ptxas may use under the kernel's ``__launch_bounds__``.

    ``__launch_bounds__(B)`` alone already promises one resident block of B threads, so the cap
    is ``65536 / (B * max(MIN_BLOCKS, 1))``, rounded down to ptxas's allocation unit of 8 and
    capped at 255.
    """
    return limits.launch_bounds_register_cap(config["BLOCK_SIZE"], config["MIN_BLOCKS"])


def split_parts(config: Config, rows: int) -> int:
    """STRATEGY 2's pieces per row: ``(max(MIN_BLOCKS, 1) * 132) // rows`` (floor: the grid
    never exceeds the one wave the launch bounds promise); 1 for the other strategies."""
    if config["STRATEGY"] != 2:
        return 1
    return split_rows.pieces_per_row(config, rows)


def static_shared_bytes(config: Config) -> int:
    """Static shared memory of each kernel: the block reduction's double-buffered float2
    array (a block per row or piece)."""
    if config["STRATEGY"] != 0 and config["BLOCK_SIZE"] > 32:
        return 2 * (config["BLOCK_SIZE"] // 32) * 8
    return 0


class SoftmaxSpec(OperatorSpec):
    """Row-wise, numerically stable softmax with float32 accumulation."""

    name = "softmax"
    description = "softmax over the last dimension of a (rows, cols) matrix, float32 accumulation"
    dtypes = ("float32", "float16", "bfloat16")
    rank = 2
    shape_names = ("rows", "cols")
    params = {
        "BLOCK_SIZE": (32, 64, 128, 256, 512, 1024),
        "VEC": (1, 2, 4, 8),
        "STRATEGY": (0, 1, 2),
        "CACHE": (0, 1, 2),
        "MIN_BLOCKS": (0, 1, 2, 4),
        "LANES": (4, 8, 16, 32),
    }
    template = Path(__file__).with_name("softmax.cu")
    kernel_name = "softmax_kernel"
    kernel_names = ("softmax_kernel", SPLIT_STATS_KERNEL)

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows and cols must fit the kernel's ``int`` indices."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if rows > limits.INT32_MAX or cols > MAX_COLS:
            raise InvalidInput(
                f"softmax takes up to 2**31-1 rows and 2**31-2**16 columns, got {rows} x {cols}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        LANES other than 32 with STRATEGY=1 or 2 (a block per row or piece has no sub-warp
        groups); STRATEGY=2 where it does not split (see :meth:`split_error`); LANES
        below VEC (a split row's head and tail elements go one per lane; the template asserts
        it for every row); ``MIN_BLOCKS * BLOCK_SIZE`` over 2048 threads per SM; CACHE=1
        needing more than 227 KiB of shared memory per block; CACHE=2 needing more than 16
        vectors per thread, or more registers for its cache than the launch bounds leave
        (``ITEMS * vector bytes / 4 + REGISTER_OVERHEAD > register_cap``: it would spill).
        Any ``cols`` works with any ``VEC`` (rows split into head, vectors and tail).
        """
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            rows, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)

        itemsize = DTYPES[dtype][2]
        block, vec = config["BLOCK_SIZE"], config["VEC"]
        cache, min_blocks = config["CACHE"], config["MIN_BLOCKS"]
        lanes = config["LANES"]
        vector_bytes = vec * itemsize
        if reason := limits.vector_width_error(vec, vector_bytes, dtype):
            return reason
        if config["STRATEGY"] != 0 and lanes != 32:
            return (
                f"LANES={lanes} groups lanes of a warp per row: "
                f"STRATEGY={config['STRATEGY']} takes LANES=32"
            )
        if reason := self.split_error(config, rows, cols):
            return reason
        if lanes < vec:
            return (
                f"LANES={lanes} < VEC={vec}: a row group needs a lane per element of a split "
                "row's head and tail"
            )
        if reason := limits.resident_threads_error(min_blocks, block):
            return reason
        if cache == 1:
            shared = self._dynamic_shared_bytes(config, cols, itemsize)
            total = shared + static_shared_bytes(config)
            if total > limits.MAX_SHARED_PER_BLOCK:
                return (
                    f"CACHE=1 needs {total} bytes of shared memory per block "
                    f"({rows_per_block(config)} row(s) of {cols * itemsize} bytes); "
                    f"at most {limits.MAX_SHARED_PER_BLOCK}"
                )
        if cache == 2:
            items = items_per_thread(config, cols)
            if items > MAX_ITEMS:
                return (
                    f"CACHE=2 needs ITEMS={items} vectors per thread "
                    f"({threads_per_row(config)} threads per row, VEC={vec}); at most {MAX_ITEMS}"
                )
            cache_registers = items * vector_bytes // 4 + (items * vector_bytes % 4 != 0)
            cap = register_cap(config)
            if cache_registers + REGISTER_OVERHEAD > cap:
                return (
                    f"CACHE=2 keeps {cache_registers} registers of row data per thread, but the "
                    f"launch bounds allow {cap} registers per thread: it would spill"
                )
        return None

    @staticmethod
    def split_error(config: Config, rows: int, cols: int) -> str | None:
        """Why STRATEGY 2 makes no sense for ``config`` at rows x cols, or None (also for the
        other strategies): :func:`kernels.split_rows.split_error`."""
        if config["STRATEGY"] != 2:
            return None
        return split_rows.split_error("STRATEGY=2", config, rows, cols)

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """A valid config for any valid shape. Rows of at least 32 elements: the widest vector
        (of at most 16 bytes) that still gives each of a warp's 32 lanes a vector (a 128-column
        float16 row takes VEC=4, not 8: with 8, half the lanes would idle). Shorter rows, where
        a warp per row idles lanes at any VEC: the widest vector that divides the row into at
        least 4 vectors (no split row's scalar ends), and the smallest group of 4, 8, 16 or 32
        lanes that holds it in one vector per lane (7 float32 columns: VEC=1 over 8 lanes, 4
        rows per warp). Then the row in registers over the fewest threads that hold at most 8
        vectors each (that lane group, else a block of 64 .. 1024), with MIN_BLOCKS=2 where the
        registers allow; shared memory or streaming for rows too long for that.

        Few long rows (issue 31: fewer than half of the 132 SMs, at least
        :data:`SPLIT_MIN_ROW_BYTES` a row), where a block per row leaves most SMs idle:
        STRATEGY 2 at 16-byte vectors, 2 blocks of 512 threads per SM (256 or 128 threads
        where pieces would be shorter than the block).

        The short-row choice is not measured yet (no recorded space has rows under 128
        elements): it follows the principle of layernorm's default, every lane of a row group
        holds a vector. How close the rest comes to each recorded optimum: docs/defaults.md.

        Raises:
            InvalidInput: the shape or dtype is invalid (see :meth:`validate`).
        """
        rows, cols = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        if 2 * rows <= limits.NUM_SMS and cols * itemsize >= SPLIT_MIN_ROW_BYTES:
            for block in (512, 256, 128):
                config = {"BLOCK_SIZE": block, "VEC": 16 // itemsize, "STRATEGY": 2, "CACHE": 0}
                config.update(MIN_BLOCKS=2, LANES=32)
                if self.check(config, shape, dtype) is None:
                    return config
        fitting = [v for v in self.params["VEC"] if v * itemsize <= 16 and v <= cols]
        if cols >= 32:
            vec, lanes = max(v for v in fitting if v * 32 <= cols), 32
        else:
            vec = max(v for v in fitting if cols % v == 0 and (cols // v >= 4 or v == 1))
            lanes = min(g for g in self.params["LANES"] if g * vec >= cols and g >= vec)
        vectors = cols // vec
        for threads in (lanes, 64, 128, 256, 512, 1024):
            if math.ceil(vectors / threads) > 8:
                continue
            for min_blocks in (2, 0):
                config = {
                    "BLOCK_SIZE": 256 if threads == lanes else threads,
                    "VEC": vec,
                    "STRATEGY": 0 if threads == lanes else 1,
                    "CACHE": 2,
                    "MIN_BLOCKS": min_blocks,
                    "LANES": threads if threads == lanes else 32,
                }
                if self.check(config, shape, dtype) is None:
                    return config
        for cache in (1, 0):  # rows too long for registers
            config = {"BLOCK_SIZE": 1024, "VEC": vec, "STRATEGY": 1, "CACHE": cache}
            config["MIN_BLOCKS"] = 0
            config["LANES"] = 32
            if self.check(config, shape, dtype) is None:
                return config
        # Unreachable for a valid shape: streaming has no limit on cols.
        raise AssertionError(f"no default softmax config for {tuple(shape)} {dtype}")

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Tunables (in space order), then DTYPE, IS_HALF, IS_BF16, ITEMS, and ROW_SPLIT=1
        where ``cols % VEC != 0`` (absent otherwise: the source of a shape whose rows are whole
        vectors is what it was before rows could be split).

        ITEMS is only meaningful for CACHE=2; it is 0 otherwise so that the source of a
        CACHE=0/1 variant does not depend on the shape (one compile serves every shape of its
        ROW_SPLIT).
        """
        _, cols = shape
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {name: config[name] for name in self.params}
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        macros["ITEMS"] = items_per_thread(config, cols) if config["CACHE"] == 2 else 0
        if cols % config["VEC"] != 0:
            macros["ROW_SPLIT"] = 1
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """STRATEGY 0: ``ceil(rows / (BLOCK_SIZE/LANES))`` blocks; STRATEGY 1: ``rows`` blocks
        (grid.x, capped at 2**31-1: the kernel loops over rows with a grid stride); STRATEGY 2:
        ``rows * split_parts`` blocks (at most :data:`SPLIT_PIECES`), each of its two launches.
        Dynamic shared memory only for CACHE=1: ``rows_per_block * cols * itemsize``."""
        rows, cols = shape
        if config["STRATEGY"] == 2:
            grid = rows * split_parts(config, rows)
        else:
            grid = min(math.ceil(rows / rows_per_block(config)), limits.MAX_GRID_X)
        shared = self._dynamic_shared_bytes(config, cols, DTYPES[dtype][2])
        return Launch(grid=(grid, 1, 1), block=(config["BLOCK_SIZE"], 1, 1), shared_bytes=shared)

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """STRATEGY 2: ``softmax_split_stats`` (each piece's (max, sum)), then ``softmax_kernel``
        (merge the row's partials, write y), both on the same grid and all four arguments.
        Otherwise ``softmax_kernel`` alone."""
        main = Step(self.kernel_name, self.launch(config, shape, dtype))
        if config["STRATEGY"] == 2:
            return [Step(SPLIT_STATS_KERNEL, main.launch), main]
        return [main]

    @staticmethod
    def _dynamic_shared_bytes(config: Config, cols: int, itemsize: int) -> int:
        if config["CACHE"] != 1:
            return 0
        return rows_per_block(config) * cols * itemsize

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = 3 * N(0, 1) + a per-row offset; y pre-filled with NaN.

        Offsets: rows 0, 4, 8, ... get +1000 and rows 2, 6, ... get -1000 (exp overflows or
        underflows to 0/0 there unless the row max is subtracted); the others get U(-10, 10).
        The reference is the float64 softmax of x *as stored* in ``dtype``.
        """
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-10.0, 10.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 1000.0
        offsets[2::4] = -1000.0
        x = np.empty((rows, cols), dtype=np_dtype)
        y = np.empty((rows, cols), dtype=np_dtype)
        reference = np.empty((rows, cols), dtype=np.float64)

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # rows of x, y, the reference
            x32 = gen.standard_normal((chunk.stop - chunk.start, cols), dtype=np.float32)
            x32 *= 3.0
            x32 += offsets[chunk]
            x[chunk] = x32
            y[chunk] = np.nan
            reference[chunk] = softmax_reference(x[chunk])

        fill_rows(rng, rows, cols, fill)
        return Problem(
            args=[x, y, np.int32(rows), np.int32(cols)],
            outputs=[1],
            references=[reference],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` against the float64 reference.

        The outputs span many decades (x has a spread of 3, so a row's outputs differ by e^10
        and more), and most of a long row is far below 1/cols: an absolute tolerance anywhere
        near the typical output would let a kernel write zeros over most of the row. So the
        check is relative, and atol only covers what the output type cannot hold:

        - float32 and bfloat16 (8 exponent bits): the kernel's float32 math flushes results
          below 2**-126 to zero (ex2.approx.ftz), an error of at most 2**-126; atol is 2**-125.
        - float16: results below its smallest normal are rounded to subnormals spaced 2**-24
          apart, an error of at most half of that; atol is 2**-24.

        rtol: float32 1e-4 covers ex2.approx (~2 ulp) and float32 accumulation over rows of up
        to ~1e6 elements; float16 / bfloat16: the output rounding alone is half an ulp, 2**-11
        (4.9e-4) resp. 2**-9 (2.0e-3) relative; rtol is 4x that.
        """
        if dtype not in self.dtypes:
            raise InvalidInput(f"softmax does not support dtype {dtype!r}")
        return {
            "float32": (2.0**-125, 1e-4),
            "float16": (2.0**-24, 2e-3),
            "bfloat16": (2.0**-125, 8e-3),
        }[dtype]

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once and y written once: ``2 * rows * cols * itemsize``."""
        rows, cols = shape
        return 2 * rows * cols * DTYPES[dtype][2]


def softmax_reference(x: np.ndarray) -> np.ndarray:
    """Float64 softmax over the last axis of ``x`` (any float dtype, incl. ml_dtypes)."""
    out = x.astype(np.float64)
    out -= out.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    return out


SOFTMAX = register(SoftmaxSpec())

__all__ = ["SOFTMAX", "SPLIT_PIECES", "SoftmaxSpec", "softmax_reference", "split_parts"]
