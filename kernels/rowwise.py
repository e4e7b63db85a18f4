"""What the row-wise training operators (``rmsnorm``, ``rmsnorm_backward``, ``softmax_backward``)
share: the row decomposition of their templates, their parameter model and its constraints.

Every one of them walks the rows of one or more row-major (rows, cols) matrices, one row per
*row group* of threads: ``ROW_THREADS`` lanes of a warp (8, 16 or 32: several rows per warp for
short rows, shuffles only) or the whole block (``ROW_THREADS=0``). A row is split where its
address allows full vectors (any ``cols``, any ``VEC``, issue 31):

- a scalar *head* of ``h < VEC`` elements up to the first ``VEC * itemsize``-aligned address
  (``h = (-address / itemsize) mod VEC``, from the row's own address, so it changes from row to
  row when ``cols % VEC != 0``),
- a *body* of ``(cols - h) // VEC`` aligned vectors, spread over the row group's threads,
- a scalar *tail* of fewer than ``VEC`` elements.

Head and tail elements go one per thread to threads ``0 .. VEC-2`` of the group (every group has
at least 8 threads, and ``VEC <= 8``). The row arrays of one call (x, y, dy, dx) must have base
addresses congruent modulo 16 bytes (every cudaMalloc and every torch allocation is; a view with
another offset faults with a misaligned address rather than computing garbage). Column-indexed
arrays (a weight) may have any alignment: they are read as vectors where their address allows
and element by element where it does not.

``CACHE`` keeps the row's body between the reduction pass and the output pass: 0 streams it
twice (the second read mostly from L2), 1 keeps it in dynamic shared memory, 2 in registers
(``ITEMS`` vectors per thread and array).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kato.kernels import limits
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec

#: CACHE=2 (and register accumulators) hold at most this many vectors per thread and array.
MAX_ITEMS = 16
#: The kernels take rows and cols as ``int``; column indices run one unrolled step past cols.
MAX_COLS = 2**31 - 2**16
#: IS_HALF, IS_BF16 per dtype (which CUDA headers and conversions a source needs).
CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}
#: Warp mode: the canonical ``__launch_bounds__`` (threads, min blocks) of each register cap, so
#: that warp-mode configs of equal cap render one source (rows per block come from blockDim).
CANONICAL_BOUNDS = {255: (256, 0), 128: (512, 0), 64: (1024, 0), 32: (1024, 2)}
#: Registers per cached vector (per item) beyond its elements: the guards and addresses of the
#: unrolled item loops (ptxas reports on sm_90: a float32 row group of 8 lanes with 9 vectors per
#: lane took 179 registers, 8 and 10 took 105 and 138).
ITEM_REGISTERS = 2
#: The smallest register cap a config may impose through MIN_BLOCKS: under 32 registers (1024
#: threads, 2 blocks) the streaming loops spill hundreds of bytes (ptxas reports on sm_90).
MIN_REGISTER_CAP = 64
#: Parameters every row-wise operator has, in this order, before its own.
COMMON_PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE": (128, 256, 512, 1024),
    "VEC": (1, 2, 4, 8),
    "ROW_THREADS": (8, 16, 32, 0),
    "CACHE": (0, 1, 2),
    "MIN_BLOCKS": (0, 2),
}


def threads_per_row(config: Config) -> int:
    """Threads that share one row: ROW_THREADS lanes, or the whole block (ROW_THREADS=0)."""
    return config["ROW_THREADS"] or config["BLOCK_SIZE"]


def rows_per_block(config: Config) -> int:
    return config["BLOCK_SIZE"] // threads_per_row(config)


def body_vectors(cols: int, vec: int) -> int:
    """The most aligned vectors a row of ``cols`` elements holds (its head may be empty)."""
    return cols // vec


def items_per_thread(config: Config, cols: int) -> int:
    """Vectors each thread holds per array for CACHE=2 (and per-column register accumulators):
    ``ceil(body_vectors / threads_per_row)``, at least 1."""
    return max(1, math.ceil(body_vectors(cols, config["VEC"]) / threads_per_row(config)))


def register_cap(config: Config) -> int:
    """Registers per thread ptxas may use under the config's ``__launch_bounds__``."""
    return limits.launch_bounds_register_cap(config["BLOCK_SIZE"], config["MIN_BLOCKS"])


def effective_min_blocks(config: Config) -> int:
    """MIN_BLOCKS as rendered: 0 where the clause would not lower the register cap."""
    if config["MIN_BLOCKS"] and register_cap(config) < register_cap({**config, "MIN_BLOCKS": 0}):
        return config["MIN_BLOCKS"]
    return 0


def launch_bounds(config: Config) -> tuple[int, int]:
    """``(LB_THREADS, LB_MIN_BLOCKS)`` as rendered: BLOCK_SIZE and :func:`effective_min_blocks`
    in block mode; in warp mode the canonical bounds of the config's register cap (at least
    BLOCK_SIZE threads), so configs of one cap share a compile."""
    if config["ROW_THREADS"] == 0:
        return config["BLOCK_SIZE"], effective_min_blocks(config)
    threads, min_blocks = CANONICAL_BOUNDS[register_cap(config)]
    assert threads >= config["BLOCK_SIZE"]
    return threads, min_blocks


def vector_registers(config: Config, cols: int, itemsize: int) -> int:
    """32-bit registers of one array's cached row (or register weight) per thread: one per
    element whatever the element type, since ptxas keeps a 16-bit row unpacked to float32
    between the reduction and the output pass (compile tests: counting packed registers
    instead, float16 rows of 12 vectors spilled under a 128-register cap)."""
    return items_per_thread(config, cols) * config["VEC"]


def reduction_shared_bytes(config: Config) -> int:
    """Static shared memory of the block-wide row reduction: a double-buffered float per warp."""
    if config["ROW_THREADS"] == 0 and config["BLOCK_SIZE"] > 32:
        return 2 * (config["BLOCK_SIZE"] // 32) * 4
    return 0


def row_cache_bytes(config: Config, cols: int, itemsize: int, arrays: int) -> int:
    """CACHE=1's dynamic shared memory: ``arrays`` row bodies per row group of the block."""
    if config["CACHE"] != 1:
        return 0
    vec_bytes = config["VEC"] * itemsize
    return rows_per_block(config) * arrays * body_vectors(cols, config["VEC"]) * vec_bytes


def weight_registers_fit(
    config: Config, cols: int, itemsize: int, arrays: int, overhead: int
) -> int:
    """1 if CACHE=2 keeps the weight (and a bias) in registers too (WB_REGS): every row must have
    the same head (``cols % VEC == 0``) and ``arrays`` row-sized register sets (the cached row,
    the loads of its first pass, the weight, a bias: :func:`vector_registers` each), ITEM_REGISTERS
    per item and ``overhead`` must fit under the register cap."""
    if config["CACHE"] != 2 or cols % config["VEC"] != 0:
        return 0
    items = items_per_thread(config, cols)
    need = arrays * vector_registers(config, cols, itemsize) + overhead
    need += ITEM_REGISTERS * items
    return int(need <= register_cap(config))


class RowwiseSpec(OperatorSpec):
    """The part of a row-wise operator's spec the three share; subclasses set the class
    attributes of :class:`~kernels.spec.OperatorSpec` plus:

    Attributes:
        cached_arrays: row arrays CACHE=1/2 keep (x; or x and dy; or y and dy).
        register_overhead: registers a CACHE=2 kernel needs besides its caches (fit to ptxas
            reports, tests/kernels/test_<name>_compile.py): below this, the cache spills.
    """

    dtypes = ("float32", "float16", "bfloat16")
    rank = 2
    shape_names = ("rows", "cols")
    cached_arrays: int = 1
    register_overhead: int = 32

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows and cols must fit the kernels' ``int`` arguments."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if rows > limits.INT32_MAX or cols > MAX_COLS:
            raise InvalidInput(
                f"{self.name} takes up to 2**31-1 rows and 2**31-2**16 columns, got {rows} x {cols}"
            )
        return shape

    def extra_registers(self, config: Config, cols: int, itemsize: int) -> int:
        """Registers beyond the row caches and the overhead a config holds (accumulators)."""
        return 0

    def dynamic_shared_bytes(self, config: Config, cols: int, itemsize: int) -> int:
        """Dynamic shared memory of the main kernel's launch (default: CACHE=1's rows)."""
        return row_cache_bytes(config, cols, itemsize, self.cached_arrays)

    def check_common(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """The constraints every row-wise operator has; see :meth:`check`."""
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            _, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        itemsize = DTYPES[dtype][2]
        block, vec = config["BLOCK_SIZE"], config["VEC"]
        if reason := limits.vector_width_error(vec, vec * itemsize, dtype):
            return reason
        if reason := limits.resident_threads_error(config["MIN_BLOCKS"], block):
            return reason
        if register_cap(config) < MIN_REGISTER_CAP:
            return (
                f"MIN_BLOCKS={config['MIN_BLOCKS']} blocks of {block} threads cap registers at "
                f"{register_cap(config)} per thread; the kernels need {MIN_REGISTER_CAP}"
            )
        shared = self.dynamic_shared_bytes(config, cols, itemsize)
        total = shared + reduction_shared_bytes(config)
        if total > limits.MAX_SHARED_PER_BLOCK:
            return (
                f"needs {total} bytes of shared memory per block ({rows_per_block(config)} "
                f"row group(s) of {cols} columns); at most {limits.MAX_SHARED_PER_BLOCK}"
            )
        if config["CACHE"] == 2 or self.extra_registers(config, cols, itemsize):
            items = items_per_thread(config, cols)
            if items > MAX_ITEMS:
                return (
                    f"registers would hold ITEMS={items} vectors per thread "
                    f"({threads_per_row(config)} threads per row, VEC={vec}); at most {MAX_ITEMS}"
                )
            regs = self.extra_registers(config, cols, itemsize) + ITEM_REGISTERS * items
            if config["CACHE"] == 2:
                regs += self.cached_arrays * vector_registers(config, cols, itemsize)
            cap = register_cap(config)
            if regs + self.register_overhead > cap:
                return (
                    f"keeps {regs} registers of row data per thread, but the launch bounds "
                    f"allow {cap} registers per thread: it would spill"
                )
        return None

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        ``MIN_BLOCKS * BLOCK_SIZE`` over 2048 threads per SM or a register cap under
        :data:`MIN_REGISTER_CAP`; dynamic + static shared memory
        over 227 KiB per block; register caches (CACHE=2, accumulators) of more than 16 vectors
        per thread or more registers than the launch bounds leave (it would spill). Any
        ``cols`` works with any ``VEC``: rows are split into a scalar head, aligned vectors
        and a scalar tail.
        """
        return self.check_common(config, shape, dtype)

    # --- defaults -----------------------------------------------------------------------------

    def widest_vec(self, cols: int, dtype: str) -> int:
        """The widest vector of at most 16 bytes that is not wider than the row."""
        itemsize = DTYPES[dtype][2]
        fits = [v for v in self.params["VEC"] if v * itemsize <= 16 and v <= max(cols, 1)]
        return max(fits)

    def default_candidates(self, cols: int, vec: int) -> list[tuple[int, int, int, int]]:
        """``(BLOCK_SIZE, ROW_THREADS, CACHE, max ITEMS)`` to try in order: short rows in
        registers shared by the fewest lanes that keep <= 2 vectors per lane (several rows per
        warp), a warp per row in registers (<= 8 vectors per lane), a block per row in
        registers (<= 8 per thread), in shared memory, and streaming for the longest rows."""
        candidates = [(256, lanes, 2, 2) for lanes in (8, 16, 32)]
        candidates += [(256, 32, 2, 8)]
        candidates += [(block, 0, 2, 8) for block in (256, 512, 1024)]
        candidates += [(1024, 0, 1, 0), (1024, 0, 0, 0)]
        return candidates

    def base_default(self, shape: Sequence[int], dtype: str, extra: Config) -> Config:
        """The first valid candidate of :meth:`default_candidates` (``extra``: the operator's
        own parameters, fixed)."""
        _, cols = self.validate(shape, dtype)
        vec = self.widest_vec(cols, dtype)
        for block, lanes, cache, limit in self.default_candidates(cols, vec):
            config = {
                "BLOCK_SIZE": block,
                "VEC": vec,
                "ROW_THREADS": lanes,
                "CACHE": cache,
                "MIN_BLOCKS": 0,
                **extra,
            }
            if cache == 2 and items_per_thread(config, cols) > limit:
                continue
            if self.check(config, shape, dtype) is None:
                return config
        raise AssertionError(f"no default {self.name} config for {tuple(shape)} {dtype}")

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """BLOCK_SIZE (block mode only), VEC, ROW_THREADS, CACHE, the launch bounds
        (:func:`launch_bounds`), DTYPE, IS_HALF, IS_BF16 and ITEMS (CACHE=2 only, else 0: a
        streaming source does not depend on the shape)."""
        _, cols = shape
        is_half, is_bf16 = CUDA_FLAGS[dtype]
        macros: dict[str, object] = {}
        if config["ROW_THREADS"] == 0:
            macros["BLOCK_SIZE"] = config["BLOCK_SIZE"]
        macros.update({name: config[name] for name in ("VEC", "ROW_THREADS", "CACHE")})
        macros["LB_THREADS"], macros["LB_MIN_BLOCKS"] = launch_bounds(config)
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        macros["ITEMS"] = items_per_thread(config, cols) if config["CACHE"] == 2 else 0
        return macros

    def row_groups(self, config: Config, rows: int) -> int:
        """Blocks needed for one row group per row: ``ceil(rows / rows_per_block)``."""
        return math.ceil(rows / rows_per_block(config))

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """``ceil(rows / rows_per_block)`` blocks (capped at 2**31-1: the kernels loop over rows
        with a grid stride), dynamic shared memory from :meth:`dynamic_shared_bytes`."""
        rows, cols = shape
        grid = min(self.row_groups(config, rows), limits.MAX_GRID_X)
        shared = self.dynamic_shared_bytes(config, cols, DTYPES[dtype][2])
        return Launch(grid=(grid, 1, 1), block=(config["BLOCK_SIZE"], 1, 1), shared_bytes=shared)

    def tolerance(self, dtype: str) -> tuple[float, float]:
        if dtype not in self.dtypes:
            raise InvalidInput(f"{self.name} does not support dtype {dtype!r}")
        return self.TOLERANCES[dtype]

    #: ``(atol, rtol)`` of the main output per dtype (see each spec's docstring for why).
    TOLERANCES: dict[str, tuple[float, float]] = {}


class GroupedRowsSpec(RowwiseSpec):
    """A row-wise norm forward (``rmsnorm``, ``add_rmsnorm``, ``add_layernorm``): GROUP_ROWS row
    groups per block (launch geometry only; each subclass lists it in its :attr:`params`) and,
    with CACHE=2, the weight kept in registers where :meth:`wb_regs` says it fits."""

    def wb_regs(self, config: Config, cols: int, itemsize: int) -> int:
        """1 if CACHE=2 keeps the weight in registers too (the WB_REGS macro), else 0."""
        raise NotImplementedError

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """:meth:`RowwiseSpec.base_default`, then 4 rows per group where the grid still has at
        least 4 waves of 132 SMs x 8 blocks (weight loads shared by 4 rows)."""
        rows, _ = self.validate(shape, dtype)
        config = self.base_default(shape, dtype, {"GROUP_ROWS": 1})
        if math.ceil(rows / rows_per_block(config)) >= 4 * (4 * limits.NUM_SMS * 8):
            config["GROUP_ROWS"] = 4
        return config

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """The row-wise macros (:meth:`RowwiseSpec.defines`) and WB_REGS (:meth:`wb_regs`);
        GROUP_ROWS is launch geometry only."""
        macros = super().defines(config, shape, dtype)
        macros["WB_REGS"] = self.wb_regs(config, shape[1], DTYPES[dtype][2])
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """``ceil(rows / (rows_per_block * GROUP_ROWS))`` blocks (grid-stride over rows)."""
        rows, cols = shape
        groups = rows_per_block(config) * config["GROUP_ROWS"]
        grid = min(math.ceil(rows / groups), limits.MAX_GRID_X)
        shared = self.dynamic_shared_bytes(config, cols, DTYPES[dtype][2])
        return Launch(grid=(grid, 1, 1), block=(config["BLOCK_SIZE"], 1, 1), shared_bytes=shared)
