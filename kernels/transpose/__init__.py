"""Transpose of a (rows, cols) matrix into (cols, rows): the spec of ``transpose.cu``.

Parameter space (Kernel Tuner key order):

- ``TILE``: edge of the square tile staged in shared memory (16, 32, 64 elements).
- ``VEC``: elements per global vector load/store, at most 16 bytes; any shape (issue 31).
  Where ``rows % VEC == 0`` and ``cols % VEC == 0`` every input and output row starts on a
  vector boundary; for float16/bfloat16 with ``VEC >= 2`` the kernel then transposes 2x2
  sub-blocks in registers (``__byte_perm``) so that shared memory holds 32-bit words of two
  output-adjacent elements and the stores are vectors too. Other shapes render with
  ``ALIGNED=0`` (:func:`aligned`): rows start at offsets from a vector boundary that vary by
  row, so each tile row is read as the aligned vectors covering it (one more where it is
  misaligned) and written as whole aligned vectors with an element-by-element head and tail;
  2-byte elements stay single 16-bit units there. Aligned shapes render without the macro and
  compile to the program they compiled to before it existed.
- ``RPT``: vectors each thread loads and stores per tile; the block is
  ``(TILE / VEC) x (TILE / RPT)`` threads, 32 to 1024 of them.
- ``SMEM``: shared-memory layout: 0 plain ``[TILE][TILE]``, 1 padded by one word per row,
  2 XOR swizzle (column ``c ^ row``) against bank conflicts without padding.
- ``MIN_BLOCKS``: the min-blocks clause of ``__launch_bounds__`` (0 = none).
- ``HINTS``: cache hints of every global load and store (issue 31): 0 streaming loads and
  stores (``__ldcs``/``__stcs``, evict-first: the program before the parameter existed), 1
  streaming loads with plain write-back stores, 2 plain both (read-only ``__ldg`` loads, default
  L2 eviction). Where a row pitch is no multiple of 32 bytes (odd sides), tile rows start mid
  sector, so a sector at a tile boundary is written half by one block and half by its
  neighbour. The hypothesis HINTS 1 and 2 test: evict-first stores let the L2 write such a
  sector back half valid (a read-modify-write at the HBM) before the other half arrives, and
  evict-first loads drop a sector the neighbour reads again; write-back stores would merge it.
- ``SKEW``: output-aligned tiles (issue 31), valid only where an output row's pitch
  (``rows * itemsize``) is no multiple of 32 bytes (:func:`skew_applies`): elsewhere every
  output row starts at the same offset in a sector and ``SKEW=1`` would store what ``SKEW=0``
  stores, so it is left out of the space. 0 is the program from before the parameter existed
  (no macro). 1 places each block's tile boundaries in every output row on 32-byte sector
  boundaries of the flat output (the row's offset in a sector, taken from y's address, shifts
  its slice), so that each sector inside a row is written whole by one block in aligned vector
  stores instead of in halves by two neighbouring blocks; the block loads ``V - 1`` more input
  rows (``V`` elements per sector: 8 for 4-byte, 16 for 2-byte elements) into a shared tile of
  ``TILE + V - 1`` rows of single elements (no packed pairs). It renders ``ALIGNED=0`` on every
  shape (offsets from the addresses), so one compile serves every shape. With ``MIN_BLOCKS=0``
  its kernel declares a min-blocks clause of 1: without one, ptxas picked an occupancy of its
  own and spilled a few bytes to reach it in about 2% of the ``SKEW=1`` variants.

The source depends on the shape only through ``ALIGNED`` (sizes are kernel arguments), so
two compiles per (config, dtype) serve every shape (one for ``SKEW=1``). The grid is 1-D over
the tiles with a grid stride.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Problem

MAX_THREADS_PER_BLOCK = 1024
#: Registers besides the loaded vectors (indices, pointers, tile counters, loop state); fit to
#: ptxas reports on sm_80/sm_90 with margin.
REGISTER_OVERHEAD = 32
#: rows and cols are ``int`` kernel arguments; tile origins stay below 2**31 - 1 with a tile of
#: headroom, element offsets are 64-bit.
MAX_DIM = 2**31 - 1 - 64
#: One block per tile up to this many blocks; beyond, blocks loop over tiles (grid stride).
MAX_GRID = 1 << 20


def threads(config: Config) -> int:
    return (config["TILE"] // config["VEC"]) * (config["TILE"] // config["RPT"])


def aligned(config: Config, shape: Sequence[int]) -> bool:
    """Whether the kernel takes its ``ALIGNED`` path: every input and output row of ``shape``
    is whole vectors of ``VEC`` elements and the config is not ``SKEW=1`` (which renders
    ``ALIGNED=0`` everywhere); else rows are split at vector boundaries."""
    rows, cols = shape
    if config.get("SKEW", 0):
        return False
    return rows % config["VEC"] == 0 and cols % config["VEC"] == 0


def sector_elements(dtype: str) -> int:
    """``V``: elements of one 32-byte sector."""
    return 32 // DTYPES[dtype][2]


def skew_applies(shape: Sequence[int], dtype: str) -> bool:
    """Whether output rows start at different offsets in a 32-byte sector (``rows * itemsize``
    no multiple of 32): where ``SKEW=1`` is valid."""
    return shape[0] % sector_elements(dtype) != 0


def pack_pairs(config: Config, dtype: str, is_aligned: bool = True) -> int:
    """Elements per shared-memory unit: 2 when 2-byte elements are packed in 2x2 blocks
    (``VEC >= 2`` on an aligned shape: a pair's rows must share their offset from a vector
    boundary; never with ``SKEW=1``)."""
    pairs = DTYPES[dtype][2] == 2 and config["VEC"] >= 2 and is_aligned
    return 2 if pairs and not config.get("SKEW", 0) else 1


def register_cap(config: Config) -> int:
    """Registers per thread ptxas may use under the kernel's ``__launch_bounds__``."""
    return limits.launch_bounds_register_cap(threads(config), config["MIN_BLOCKS"])


def static_shared_bytes(config: Config, dtype: str, is_aligned: bool = True) -> int:
    """The shared tile: ``TILE / E`` rows of ``TILE + pad`` units of ``E * itemsize`` bytes;
    ``SKEW=1``: ``TILE + V - 1`` rows of single elements."""
    pad = 1 if config["SMEM"] == 1 else 0
    if config.get("SKEW", 0):
        unit_rows = config["TILE"] + sector_elements(dtype) - 1
        return unit_rows * (config["TILE"] + pad) * DTYPES[dtype][2]
    e = pack_pairs(config, dtype, is_aligned)
    return (config["TILE"] // e) * (config["TILE"] + pad) * e * DTYPES[dtype][2]


def edge_vectors(config: Config, dtype: str = "float32") -> int:
    """Misaligned tile rows' extra (edge) vectors each thread loads: ``ceil(TILE / threads)``
    (``SKEW=1``: of its ``TILE + V - 1`` tile rows)."""
    return math.ceil(tile_rows(config, dtype) / threads(config))


def tile_rows(config: Config, dtype: str) -> int:
    """Input rows a block loads per tile: ``TILE``, plus the ``V - 1`` halo rows with
    ``SKEW=1``."""
    halo = sector_elements(dtype) - 1 if config.get("SKEW", 0) else 0
    return config["TILE"] + halo


def loaded_vectors(config: Config, dtype: str, is_aligned: bool = True) -> int:
    """Vectors each thread holds between its loads and its shared-memory stores: one per tile
    row it loads (``RPT``, more with ``SKEW=1``'s halo rows), plus the edge vectors where rows
    are split (not ``is_aligned``, and not ``VEC=1`` under ``SKEW=1``)."""
    if config.get("SKEW", 0):
        loads = math.ceil(tile_rows(config, dtype) / (config["TILE"] // config["RPT"]))
        return loads + (edge_vectors(config, dtype) if config["VEC"] > 1 else 0)
    return config["RPT"] + (0 if is_aligned else edge_vectors(config, dtype))


def data_registers(config: Config, dtype: str, is_aligned: bool = True) -> int:
    """32-bit registers holding the loaded vectors (:func:`loaded_vectors`)."""
    vectors = loaded_vectors(config, dtype, is_aligned)
    return math.ceil(vectors * config["VEC"] * DTYPES[dtype][2] / 4)


class TransposeSpec(OperatorSpec):
    """y = x.T for a row-major (rows, cols) matrix, through shared-memory tiles."""

    name = "transpose"
    description = "transpose of a (rows, cols) matrix into (cols, rows) via shared-memory tiles"
    dtypes = ("float32", "float16", "bfloat16")
    rank = 2
    shape_names = ("rows", "cols")
    params = {
        "TILE": (16, 32, 64),
        "VEC": (1, 2, 4, 8),
        "RPT": (1, 2, 4, 8),
        "SMEM": (0, 1, 2),
        "MIN_BLOCKS": (0, 4),
        "HINTS": (0, 1, 2),
        "SKEW": (0, 1),
    }
    template = Path(__file__).with_name("transpose.cu")
    kernel_name = "transpose_kernel"
    kernel_names = ("transpose_kernel",)

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows and cols fit the kernel's ``int`` arguments."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if rows > MAX_DIM or cols > MAX_DIM:
            raise InvalidInput(
                f"transpose takes rows and cols up to {MAX_DIM} (2**31 - 65), got {rows} x {cols}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        ``VEC`` or ``RPT`` not dividing ``TILE``; blocks outside 32..1024 threads; an odd
        ``RPT`` with packed 2-byte pairs; ``MIN_BLOCKS`` blocks over 2048 threads per SM;
        loaded vectors that would not fit the registers the launch bounds leave (they would
        spill); ``SKEW=1`` where output rows start on sector boundaries (:func:`skew_applies`:
        it would store as ``SKEW=0`` does). Any rows and cols: where they are not multiples of
        ``VEC`` the kernel splits rows at vector boundaries (:func:`aligned`).

        Assumed, not checked (no addresses here): x and y aligned to ``VEC`` elements where the
        shape is aligned (the backends' cudaMalloc gives 256 bytes), to one element otherwise
        (the split path takes each row's offset from the addresses) and with ``SKEW=1`` (its
        sector offsets too; with y on a 32-byte boundary, as cudaMalloc's is, the output rows of
        a shape :func:`skew_applies` rejects all start on sectors).
        """
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            rows, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        tile, vec, rpt = config["TILE"], config["VEC"], config["RPT"]
        itemsize = DTYPES[dtype][2]
        if reason := limits.vector_width_error(vec, vec * itemsize, dtype):
            return reason
        if config["SKEW"] and not skew_applies((rows, cols), dtype):
            return (
                f"SKEW=1 needs output rows that start mid 32-byte sector: rows={rows} x "
                f"{itemsize} bytes is a multiple of 32 (SKEW=0 stores the same)"
            )
        if vec > tile or rpt > tile:
            return f"VEC={vec} and RPT={rpt} must divide TILE={tile}"
        n_threads = threads(config)
        if not 32 <= n_threads <= MAX_THREADS_PER_BLOCK:
            return f"(TILE/VEC) x (TILE/RPT) = {n_threads} threads; must be 32..1024"
        is_aligned = aligned(config, (rows, cols))
        if rpt % pack_pairs(config, dtype, is_aligned):
            return f"{dtype} with VEC>=2 packs row pairs: RPT={rpt} must be even"
        if reason := limits.resident_threads_error(config["MIN_BLOCKS"], n_threads):
            return reason
        cap = register_cap(config)
        data = data_registers(config, dtype, is_aligned)
        if data + REGISTER_OVERHEAD > cap:
            return (
                f"{data} registers of loaded data per thread, but the launch bounds allow "
                f"{cap}: it would spill"
            )
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """Padded 64x64 tiles of 4 vectors per thread, else 8 vectors, else 32x32 and smaller
        tiles where the block's thread count or registers rule the larger out. 64x64 tiles move
        twice the bytes per block barrier (measured against 32x32: docs/defaults.md).

        The vector: the widest (up to 16 bytes) that divides both sizes where it is at least 8
        bytes wide (aligned rows; float16's packed pairs), else the widest there is, rows split
        at vector boundaries (issue 31): a split tile row moves its TILE elements in
        TILE/VEC + 1 vector loads and TILE/VEC - 1 vector stores plus VEC single elements, where
        the 4-byte or scalar vectors that divide an odd shape take 4 to 16 times the loads and
        stores (VEC=1 ran the 8191 x 8193 float32 case at 70% of copy bandwidth on the H100).
        Every recorded space is a shape of the first kind, so its default is unchanged; the
        split choice is not measured yet. ``HINTS=0`` (streaming loads and stores, what every
        recorded space measured); the plain ones are not measured yet. ``SKEW=0``: the skewed
        tiles are not measured yet."""
        rows, cols = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        widths = [v for v in self.params["VEC"] if v * itemsize <= 16]
        dividing = max(v for v in widths if rows % v == 0 and cols % v == 0)
        first = dividing if dividing * itemsize >= 8 else max(widths)
        for vec in dict.fromkeys((first, dividing, 1)):
            for tile, rpt in ((64, 4), (64, 8), (32, 4), (32, 2), (32, 1), (16, 2), (16, 1)):
                config = {"TILE": tile, "VEC": vec, "RPT": rpt, "SMEM": 1, "MIN_BLOCKS": 0}
                config["HINTS"] = config["SKEW"] = 0
                if self.check(config, shape, dtype) is None:
                    return config
        raise AssertionError(f"no default transpose config for {tuple(shape)} {dtype}")

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Tunables, then ELEM_BYTES: the kernel moves bits, so float16 and bfloat16 render
        (and compile) the same source; ALIGNED=0 where rows or cols is not a multiple of
        ``VEC`` or with ``SKEW=1`` (absent otherwise: an aligned shape's source is what it was
        before rows could be split, and every shape of a split config shares one compile).
        ``SKEW`` only where it is 1, last: a ``SKEW=0`` config renders the ``#define`` lines it
        rendered before the parameter existed."""
        macros: dict[str, object] = {name: config[name] for name in self.params if name != "SKEW"}
        macros["ELEM_BYTES"] = DTYPES[dtype][2]
        if not aligned(config, shape):
            macros["ALIGNED"] = 0
        if config["SKEW"]:
            macros["SKEW"] = 1
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Block ``(TILE/VEC, TILE/RPT)``; grid: one block per tile, at most ``MAX_GRID``
        (the kernel loops over the remaining tiles)."""
        rows, cols = shape
        tile = config["TILE"]
        ntiles = math.ceil(rows / tile) * math.ceil(cols / tile)
        block = (tile // config["VEC"], tile // config["RPT"], 1)
        return Launch(grid=(min(ntiles, MAX_GRID), 1, 1), block=block, shared_bytes=0)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x: nonzero values spread over 24 binades with random signs (as distinct as the
        dtype allows, so a misplaced element almost surely differs from the right one); y
        pre-filled with NaN. The reference is exact."""
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        x32 = np.exp2(rng.uniform(-12.0, 12.0, size=(rows, cols))).astype(np.float32)
        x32 *= rng.choice(np.array([-1.0, 1.0], np.float32), size=(rows, cols))
        x = x32.astype(np_dtype, copy=False)
        del x32
        y = np.full((cols, rows), np.nan, dtype=np_dtype)
        return Problem(
            args=[x, y, np.int32(rows), np.int32(cols)],
            outputs=[1],
            references=[transpose_reference(x)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """Exact: a transpose only moves bits."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"transpose does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once, y written once."""
        rows, cols = shape
        return 2 * rows * cols * DTYPES[dtype][2]


def transpose_reference(x: np.ndarray) -> np.ndarray:
    """Float64 transpose of ``x`` as stored."""
    return np.ascontiguousarray(x.astype(np.float64).T)


SPEC = register(TransposeSpec())
