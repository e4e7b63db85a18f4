"""LayerNorm forward over the last dimension of a (rows, cols) matrix: the spec of ``layernorm.cu``.

``y = (x - mean) * rstd * weight + bias`` per row, with ``mean`` and the biased variance computed
in one pass (Welford partials per thread, Chan merges across lanes and warps, all on ``x - K``
with the row's first element as pivot K), ``rstd = 1 / sqrt(var + eps)``. Outputs: y (element
type), mean and rstd per row (float32, what a backward pass needs).

Kernel arguments (:attr:`Problem.args` order): ``x, weight, bias, y, mean, rstd, rows, cols, eps``
(``rows``/``cols`` int32, ``eps`` float32).

Parameter space (Kernel Tuner key order):

- ``BLOCK_SIZE``: threads per block.
- ``VEC``: elements per vector load/store, at most 16 bytes; any ``cols`` (issue 31). Where
  ``cols % VEC != 0`` the source is rendered with ``ROW_SPLIT=1``: each row is a scalar head up
  to its first aligned address, aligned vectors and a scalar tail, weight and bias read as
  vectors where their address allows. Shapes with ``cols % VEC == 0`` render without it and
  compile to the program they compiled to before it existed.
- ``ROW_THREADS``: threads sharing one row: 8, 16 or 32 lanes of a warp (several rows per warp
  for short rows, shuffles only), or 0 = the whole block (one row per block at a time).
- ``CACHE``: 0 = the output pass re-reads x; 1 = the row is kept in dynamic shared memory
  (``rows_per_block * cols * itemsize`` bytes); 2 = the row is kept in registers, ``ITEMS``
  vectors per thread (at most 16). With CACHE=2 weight and bias also stay in registers across
  the rows a thread processes when the launch bounds leave room for them (derived ``WB_REGS``).
- ``MIN_BLOCKS``: the min-blocks clause of ``__launch_bounds__`` (0 = none). Only the register cap
  it implies reaches the source (:func:`launch_bounds`): equivalent variants share one compile.
- ``GROUP_ROWS``: rows each row group processes (grid = ``ceil(rows / rows_per_block /
  GROUP_ROWS)``, grid-stride loop): more rows per group amortise the weight/bias loads. Launch
  geometry only; it does not change the source. 0 = less than a row per block, for few long
  rows (issue 31; rendered ``ROW_PIECES=1``): each row cut into ``parts = (max(MIN_BLOCKS, 1) *
  132) // rows`` contiguous pieces, one block per piece, so that the grid is ``MIN_BLOCKS``
  blocks (at least one) on each of the H200's 132 SMs where a block per row would leave all but
  ``rows`` of them idle. Two launches (:meth:`LayerNormSpec.steps`): ``layernorm_split_stats``
  writes each piece's Welford partial (count, mean, M2), then ``layernorm_fwd`` merges its row's
  partials in a fixed order (deterministic: every block of a row gets the same bits) and writes
  the piece's y (the first piece: a split row's head and tail, the row's mean and rstd),
  re-reading x (3 passes over memory instead of 2, the first launch's last reads served from
  L2). ROW_THREADS 0 and CACHE 0 only; only where it splits (:meth:`LayerNormSpec.split_error`).

The split's partials live in a global of the loaded module (:data:`SPLIT_PIECES` of them; the
arguments stay those of every config, as kato_torch passes them), so two calls on one loaded
module must not overlap: kato_torch loads a module with ``__device__`` globals once per stream
(:func:`kato.tuner.cubin.has_device_globals`), as for softmax's STRATEGY 2.

Accumulation is float32 for every element type (float32, float16, bfloat16).
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
#: Registers a CACHE=2 kernel needs besides its caches (pointers, indices, statistics, unpacked
#: floats). Fit to ptxas reports on sm_80/sm_90 (tests/kernels/test_layernorm_compile.py): below
#: this, the row cache spills.
REGISTER_OVERHEAD = 40
#: The same for CACHE=2 with weight and bias in registers too (see :func:`wb_regs`).
WB_REGISTER_OVERHEAD = 48
#: Registers split rows (``cols % VEC != 0``) hold besides: head and tail values, the split and
#: the weight's and bias's alignment (fit to ptxas reports like REGISTER_OVERHEAD).
SPLIT_REGISTERS = 8
#: Column indices run up to cols + one unrolled step (<= 8 * 1024 vectors) past the end.
MAX_COLS = 2**31 - 2**16
EPS = 1e-5
#: GROUP_ROWS=0's partials workspace (``kSplitPieces`` in layernorm.cu): one per piece, for the
#: largest grid the spec launches, the largest MIN_BLOCKS (2) on each of 132 SMs.
SPLIT_PIECES = 2 * limits.NUM_SMS
#: GROUP_ROWS=0's first kernel; the second is ``layernorm_fwd`` (it writes y, as every config).
SPLIT_STATS_KERNEL = "layernorm_split_stats"
#: The default splits rows of at least this many bytes where they are fewer than half the SMs:
#: one block streams about this much in the time of a second launch (a few microseconds), as
#: softmax's rule.
SPLIT_MIN_ROW_BYTES = 128 * 1024

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


def threads_per_row(config: Config) -> int:
    """Threads that share one row: ROW_THREADS lanes, or the whole block (ROW_THREADS=0)."""
    return config["ROW_THREADS"] or config["BLOCK_SIZE"]


def rows_per_block(config: Config) -> int:
    return config["BLOCK_SIZE"] // threads_per_row(config)


def items_per_thread(config: Config, cols: int) -> int:
    """Vectors each thread holds for CACHE=2: ``ceil(cols / (threads_per_row * VEC))``."""
    return math.ceil(cols / (threads_per_row(config) * config["VEC"]))


def register_cap(config: Config) -> int:
    """Registers per thread ptxas may use under ``__launch_bounds__``: ``65536 / (BLOCK_SIZE *
    max(MIN_BLOCKS, 1))`` rounded down to 8, at most 255."""
    return limits.launch_bounds_register_cap(config["BLOCK_SIZE"], config["MIN_BLOCKS"])


def effective_min_blocks(config: Config) -> int:
    """MIN_BLOCKS as rendered: 0 where the clause would not lower the register cap (ptxas's
    only use of it), so equivalent configs render the same source."""
    if config["MIN_BLOCKS"] and register_cap(config) < register_cap({**config, "MIN_BLOCKS": 0}):
        return config["MIN_BLOCKS"]
    return 0


#: Warp mode: the canonical __launch_bounds__ (threads, min blocks) of each register cap.
_CANONICAL_BOUNDS = {255: (256, 0), 128: (512, 0), 64: (1024, 0), 32: (1024, 2)}


def launch_bounds(config: Config) -> tuple[int, int]:
    """``(LB_THREADS, LB_MIN_BLOCKS)`` as rendered. Block mode: BLOCK_SIZE and
    :func:`effective_min_blocks`. Warp mode (the kernel takes rows per block from blockDim):
    the canonical bounds of the config's register cap, at least BLOCK_SIZE threads, so that
    configs with the same cap share one source (a 128- and a 256-thread block compile once)."""
    if config["ROW_THREADS"] == 0:
        return config["BLOCK_SIZE"], effective_min_blocks(config)
    threads, min_blocks = _CANONICAL_BOUNDS[register_cap(config)]
    assert threads >= config["BLOCK_SIZE"]
    return threads, min_blocks


def cache_registers(config: Config, cols: int, itemsize: int) -> int:
    """32-bit registers of row data one thread holds with CACHE=2."""
    nbytes = items_per_thread(config, cols) * config["VEC"] * itemsize
    return nbytes // 4 + (nbytes % 4 != 0)


def wb_regs(config: Config, cols: int, itemsize: int) -> int:
    """1 if CACHE=2 keeps weight and bias in registers too. ptxas keeps the row unpacked to
    float32 between the statistics and the output pass (one register per element) and weight
    and bias packed, so this needs ``ITEMS * VEC + 2 * row registers + WB_REGISTER_OVERHEAD``
    registers within the cap (fit to ptxas reports: tighter margins spill)."""
    if config["CACHE"] != 2:
        return 0
    floats = items_per_thread(config, cols) * config["VEC"]
    need = floats + 2 * cache_registers(config, cols, itemsize) + WB_REGISTER_OVERHEAD
    return int(need <= register_cap(config))


def split_parts(config: Config, rows: int) -> int:
    """GROUP_ROWS=0's pieces per row: ``(max(MIN_BLOCKS, 1) * 132) // rows`` (floor: the grid
    never exceeds the one wave the launch bounds promise); 1 for the other configs."""
    if config["GROUP_ROWS"] != 0:
        return 1
    return split_rows.pieces_per_row(config, rows)


def static_shared_bytes(config: Config) -> int:
    """Static shared memory: block mode's double-buffered (n, mean, M2) per warp."""
    if config["ROW_THREADS"] == 0 and config["BLOCK_SIZE"] > 32:
        return 2 * (config["BLOCK_SIZE"] // 32) * 12
    return 0


class LayerNormSpec(OperatorSpec):
    """Row-wise LayerNorm forward with weight and bias; one-pass Welford statistics."""

    name = "layernorm"
    description = (
        "layernorm forward over the last dimension of a (rows, cols) matrix with weight and "
        "bias; outputs y, per-row mean and rstd (float32); one-pass Welford, float32 accumulation"
    )
    dtypes = ("float32", "float16", "bfloat16")
    rank = 2
    shape_names = ("rows", "cols")
    params = {
        "BLOCK_SIZE": (128, 256, 512, 1024),
        "VEC": (1, 2, 4, 8),
        "ROW_THREADS": (8, 16, 32, 0),
        "CACHE": (0, 1, 2),
        "MIN_BLOCKS": (0, 2),
        "GROUP_ROWS": (1, 4, 16, 0),
    }
    template = Path(__file__).with_name("layernorm.cu")
    kernel_name = "layernorm_fwd"
    kernel_names = ("layernorm_fwd", SPLIT_STATS_KERNEL)

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows and cols must fit the kernel's ``int`` arguments."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if rows > limits.INT32_MAX or cols > MAX_COLS:
            raise InvalidInput(
                f"layernorm takes up to 2**31-1 rows and 2**31-2**16 columns, got {rows} x {cols}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        ``MIN_BLOCKS * BLOCK_SIZE`` over 2048 threads per SM; CACHE=1
        needing more than 227 KiB of shared memory per block; CACHE=2 needing more than 16
        vectors per thread or more registers for the row than the launch bounds leave
        (``row registers + REGISTER_OVERHEAD > register_cap``, plus SPLIT_REGISTERS for
        split rows: it would spill); GROUP_ROWS=0 where it makes no sense (:meth:`split_error`).
        Any ``cols`` works with any ``VEC``.
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
        vector_bytes = vec * itemsize
        if reason := limits.vector_width_error(vec, vector_bytes, dtype):
            return reason
        if reason := limits.resident_threads_error(min_blocks, block):
            return reason
        if reason := self.split_error(config, rows, cols):
            return reason
        if cache == 1:
            total = self._dynamic_shared_bytes(config, cols, itemsize) + static_shared_bytes(config)
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
            regs = cache_registers(config, cols, itemsize)
            if cols % vec != 0:
                regs += SPLIT_REGISTERS
            cap = register_cap(config)
            if regs + REGISTER_OVERHEAD > cap:
                return (
                    f"CACHE=2 keeps {regs} registers of row data per thread, but the "
                    f"launch bounds allow {cap} registers per thread: it would spill"
                )
        return None

    @staticmethod
    def split_error(config: Config, rows: int, cols: int) -> str | None:
        """Why GROUP_ROWS=0 makes no sense for ``config`` at rows x cols, or None (also for the
        other GROUP_ROWS): ROW_THREADS other than 0 (a block per piece), then
        :func:`kernels.split_rows.split_error`."""
        if config["GROUP_ROWS"] != 0:
            return None
        if config["ROW_THREADS"] != 0:
            return (
                f"GROUP_ROWS=0 takes a block per piece: ROW_THREADS=0, got {config['ROW_THREADS']}"
            )
        return split_rows.split_error("GROUP_ROWS=0", config, rows, cols)

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """A valid config for any valid shape. The widest vector (of at most 16 bytes and ``cols``
        elements) that still gives 16 lanes a vector each; then the row in registers over the fewest
        threads that hold at most 16 vectors each, at least 16 (16 or 32 lanes of a warp in blocks
        of 256 with MIN_BLOCKS=2 where the registers allow, else a block of 128 .. 1024 per row);
        shared memory or streaming for rows too long for that. Many short rows: each group handles 4
        rows so that weight/bias registers are reused. Few long rows (issue 31: fewer than half
        of the 132 SMs, at least :data:`SPLIT_MIN_ROW_BYTES` a row), where a block per row
        leaves most SMs idle: GROUP_ROWS=0 (rows cut into pieces) at 16-byte vectors, 2 blocks
        of 512 threads per SM (256 or 128 threads where pieces would be shorter than the block),
        as softmax's rule. How close this comes to each recorded optimum: docs/defaults.md.
        """
        rows, cols = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        if 2 * rows <= limits.NUM_SMS and cols * itemsize >= SPLIT_MIN_ROW_BYTES:
            for block in (512, 256, 128):
                config = {
                    "BLOCK_SIZE": block,
                    "VEC": 16 // itemsize,
                    "ROW_THREADS": 0,
                    "CACHE": 0,
                    "MIN_BLOCKS": 2,
                    "GROUP_ROWS": 0,
                }
                if self.check(config, shape, dtype) is None:
                    return config
        fitting = [v for v in self.params["VEC"] if v * itemsize <= 16 and v <= cols]
        vec = max([v for v in fitting if v * 16 <= cols] or fitting)

        def grouped(config: Config) -> Config:
            # 4 rows per group where that still leaves >= 4 waves of 132 SMs x 8 blocks.
            if math.ceil(rows / rows_per_block(config)) >= 4 * (4 * 132 * 8):
                config["GROUP_ROWS"] = 4
            return config

        candidates = [(256, lanes, 2, mb) for lanes in (16, 32) for mb in (2, 0)]
        candidates += [(block, 0, 2, 0) for block in (128, 256, 512, 1024)]
        for block, lanes, cache, min_blocks in candidates:
            config = {
                "BLOCK_SIZE": block,
                "VEC": vec,
                "ROW_THREADS": lanes,
                "CACHE": cache,
                "MIN_BLOCKS": min_blocks,
                "GROUP_ROWS": 1,
            }
            if (
                items_per_thread(config, cols) <= MAX_ITEMS
                and self.check(config, shape, dtype) is None
            ):
                return grouped(config)
        for cache in (1, 0):  # rows too long for registers
            config = {
                "BLOCK_SIZE": 1024,
                "VEC": vec,
                "ROW_THREADS": 0,
                "CACHE": cache,
                "MIN_BLOCKS": 0,
                "GROUP_ROWS": 1,
            }
            if self.check(config, shape, dtype) is None:
                return grouped(config)
        raise AssertionError(f"no default layernorm config for {tuple(shape)} {dtype}")

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """BLOCK_SIZE (block mode only), VEC, ROW_THREADS, CACHE, the launch bounds
        (:func:`launch_bounds`), DTYPE, IS_HALF, IS_BF16, ITEMS and WB_REGS; ROW_SPLIT=1 where
        ``cols % VEC != 0`` (then WB_REGS=0: each row has its own head, so a thread's columns
        change from row to row), absent otherwise; ROW_PIECES=1 for GROUP_ROWS=0, absent
        otherwise (the other configs render the source they rendered before it existed).

        GROUP_ROWS other than 0 only changes the grid and is not rendered; ITEMS and WB_REGS
        are 0 unless CACHE=2, so a CACHE=0/1 source does not depend on the shape (one compile
        serves every shape).
        """
        _, cols = shape
        itemsize = DTYPES[dtype][2]
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {}
        if config["ROW_THREADS"] == 0:
            macros["BLOCK_SIZE"] = config["BLOCK_SIZE"]
        macros.update({name: config[name] for name in ("VEC", "ROW_THREADS", "CACHE")})
        macros["LB_THREADS"], macros["LB_MIN_BLOCKS"] = launch_bounds(config)
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        macros["ITEMS"] = items_per_thread(config, cols) if config["CACHE"] == 2 else 0
        if cols % config["VEC"] != 0:
            macros["WB_REGS"] = 0
            macros["ROW_SPLIT"] = 1
        else:
            macros["WB_REGS"] = wb_regs(config, cols, itemsize)
        if config["GROUP_ROWS"] == 0:
            macros["ROW_PIECES"] = 1
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """``ceil(rows / (rows_per_block * GROUP_ROWS))`` blocks (grid-stride over rows);
        GROUP_ROWS=0: ``rows * split_parts`` blocks (at most :data:`SPLIT_PIECES`), each of its
        two launches. Dynamic shared memory only for CACHE=1: ``rows_per_block * cols *
        itemsize``."""
        rows, cols = shape
        if config["GROUP_ROWS"] == 0:
            grid = rows * split_parts(config, rows)
        else:
            grid = min(
                math.ceil(rows / (rows_per_block(config) * config["GROUP_ROWS"])),
                limits.MAX_GRID_X,
            )
        shared = self._dynamic_shared_bytes(config, cols, DTYPES[dtype][2])
        return Launch(grid=(grid, 1, 1), block=(config["BLOCK_SIZE"], 1, 1), shared_bytes=shared)

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """GROUP_ROWS=0: ``layernorm_split_stats`` (each piece's Welford partial), then
        ``layernorm_fwd`` (merge the row's partials, write y, mean and rstd), both on the same
        grid and all nine arguments. Otherwise ``layernorm_fwd`` alone."""
        main = Step(self.kernel_name, self.launch(config, shape, dtype))
        if config["GROUP_ROWS"] == 0:
            return [Step(SPLIT_STATS_KERNEL, main.launch), main]
        return [main]

    @staticmethod
    def _dynamic_shared_bytes(config: Config, cols: int, itemsize: int) -> int:
        if config["CACHE"] != 1:
            return 0
        return rows_per_block(config) * cols * itemsize

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = scale * N(0, 1) + a per-row offset; weight ~ +-U(0.5, 1.5), bias ~ U(-1, 1).

        Rows 0, 4, 8, ... get a large offset with a small spread (float32: 1e4 + N(0, 1), where
        the naive E[x^2] - E[x]^2 in float32 loses the variance entirely; float16/bfloat16:
        1e3 + 8 N(0, 1), still far beyond their spacing at 1e3); the others get U(-5, 5) +
        U(0.1, 4) * N(0, 1). eps = 1e-5. y, mean and rstd are pre-filled with NaN. References are
        float64, from the inputs *as stored* in ``dtype``.
        """
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-5.0, 5.0, size=(rows, 1)).astype(np.float32)
        scales = rng.uniform(0.1, 4.0, size=(rows, 1)).astype(np.float32)
        big = 1e4 if dtype == "float32" else 1e3
        offsets[0::4] = big
        scales[0::4] = 1.0 if dtype == "float32" else 8.0
        sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=cols)).astype(np.float32).astype(np_dtype)
        bias = rng.uniform(-1.0, 1.0, size=cols).astype(np.float32).astype(np_dtype)
        x = np.empty((rows, cols), dtype=np_dtype)
        y = np.empty((rows, cols), dtype=np_dtype)
        mean = np.full(rows, np.nan, dtype=np.float32)
        rstd = np.full(rows, np.nan, dtype=np.float32)
        ref_y = np.empty((rows, cols), dtype=np.float64)
        ref_mean = np.empty(rows, dtype=np.float64)
        ref_rstd = np.empty(rows, dtype=np.float64)

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # rows of x, y, the references
            x32 = gen.standard_normal((chunk.stop - chunk.start, cols), dtype=np.float32)
            x32 *= scales[chunk]
            x32 += offsets[chunk]
            x[chunk] = x32
            y[chunk] = np.nan
            ref_y[chunk], ref_mean[chunk], ref_rstd[chunk] = layernorm_reference(
                x[chunk], weight, bias, EPS
            )

        fill_rows(rng, rows, cols, fill)
        atol, rtol = self.tolerance(dtype)
        return Problem(
            args=[x, weight, bias, y, mean, rstd, np.int32(rows), np.int32(cols), np.float32(EPS)],
            outputs=[3, 4, 5],
            references=[ref_y, ref_mean, ref_rstd],
            tolerances=[(atol, rtol), STATS_TOLERANCE, STATS_TOLERANCE],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of y against the float64 reference (mean and rstd: STATS_TOLERANCE).

        float32: a few ulp of |x - mean| * rstd * |w| + |b| (values up to ~10): rtol 1e-5 and
        atol 2e-5 for outputs near zero after cancellation of the two terms. The pivot keeps
        (x - mean) exact even for rows at 1e4.
        float16 / bfloat16: the output rounding alone is half an ulp, 2**-11 resp. 2**-9
        relative; rtol is 4x that, atol covers results near zero (a few ulp of |b| ~ 1).
        """
        if dtype not in self.dtypes:
            raise InvalidInput(f"layernorm does not support dtype {dtype!r}")
        return {"float32": (2e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (8e-3, 8e-3)}[dtype]

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read and y written once, weight and bias read once, mean and rstd written once."""
        rows, cols = shape
        itemsize = DTYPES[dtype][2]
        return 2 * rows * cols * itemsize + 2 * cols * itemsize + 2 * rows * 4


#: ``(atol, rtol)`` of the float32 mean and rstd outputs, for every element type: a float32
#: mean/variance over up to ~1e6 elements in Welford/Chan order is good to a few 1e-7 relative;
#: atol covers means near zero (rows of mean ~0 with values of magnitude ~10).
STATS_TOLERANCE = (1e-5, 1e-5)


def layernorm_reference(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 (y, mean, rstd) of a row-wise layernorm with biased variance (torch.layer_norm)."""
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1)
    centred = x64 - mean[:, None]
    var = np.mean(centred * centred, axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    centred *= rstd[:, None]
    centred *= weight.astype(np.float64)
    centred += bias.astype(np.float64)
    return centred, mean, rstd


register(LayerNormSpec())
