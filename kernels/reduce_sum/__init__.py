"""Sum over the last dimension of a (rows, cols) matrix into float32: the spec of ``reduce_sum.cu``.

Parameter space (Kernel Tuner key order):

- ``BLOCK_SIZE``: threads per block.
- ``ROW_THREADS``: threads per row: 1, 2, 4, 8, 16 or 32 (an aligned group of lanes in a warp,
  shuffles only: short rows; 1 is a thread per row, no shuffles, for rows of a few elements,
  issue 31) or 0 (the whole block per row: shuffles, then shared memory across warps). A group
  smaller than a vector's elements takes a split row's scalar head and tail in turns.
- ``VEC``: elements per vector load, at most 16 bytes; any ``cols``: where ``cols % VEC != 0``
  each row is a scalar head up to its first vector boundary, an aligned vector body and a scalar
  tail (rendered with ``ALIGNED_ROWS=0``; aligned shapes keep the plain whole-vector code).
- ``UNROLL``: vectors loaded per thread per step (bytes in flight per thread).
- ``SPLIT``: 0 = one block (or group of lanes) per row, the old behaviour; k > 0 = each row cut
  into ``parts = ceil(k * 132 / rows)`` pieces, one block per piece (about k blocks per SM of the
  H200, the largest supported GPU), the row's last block summing the pieces in a fixed order
  (deterministic). Only where it splits: ``ROW_THREADS=0``, ``rows < k * 132`` and at least
  ``BLOCK_SIZE`` vectors per piece. For a few long rows, where one block per row leaves most SMs
  idle (4 rows: 4 of 132 SMs).

No MIN_BLOCKS: every variant fits the register cap of its ``__launch_bounds__`` without spilling
(asserted by the compile test; the one combination that spills is refused by ``check``), nothing is
cached per thread, and bytes in flight are set by UNROLL * VEC directly; a min-blocks clause
would only trade those loads for spills.

Input float32, float16 or bfloat16; accumulation and the OUTPUT are float32 for every input type.
Accuracy: per thread, each step's ``UNROLL * VEC`` values are summed pairwise (each vector, then
the vector sums) and the step sums Kahan-accumulated, then butterflies across the row's threads:
a few dozen roundings of ``sum |x|`` at most, independent of ``cols`` (``row_sum_model``
reproduces it bit for bit).
Problem arguments: ``[x, out (float32[rows]), rows (int32), cols (int32)]`` (the split path's
workspace is the module's own, so every variant takes the same arguments).

``SPLIT > 0``'s workspace (pieces and per-row tickets) is a global of the loaded module, so
two calls on one loaded module must not overlap. Kato measures on one stream; a caller that
launches on several streams at once loads such a module once per stream, as kato_torch does
for every module with ``__device__`` globals (:func:`kato.tuner.cubin.has_device_globals`).
Moving the workspace into the arguments (as reduce_sum_all does) would lift that, at the cost
of a new version and a re-tune of the committed winners.
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

#: The split path's workspace holds up to this many rows (and twice as many pieces):
#: ``kSplitRows`` in reduce_sum.cu, the largest SPLIT times the SM count.
SPLIT_ROWS = 8 * limits.NUM_SMS


def threads_per_row(config: Config) -> int:
    return config["ROW_THREADS"] or config["BLOCK_SIZE"]


def rows_per_block(config: Config) -> int:
    return config["BLOCK_SIZE"] // threads_per_row(config)


def split_parts(config: Config, rows: int) -> int:
    """Pieces per row: ``ceil(SPLIT * 132 / rows)`` (1 where SPLIT is 0)."""
    if not config.get("SPLIT"):
        return 1
    return math.ceil(config["SPLIT"] * limits.NUM_SMS / rows)


def static_shared_bytes(config: Config) -> int:
    """Block per row (or per piece): a double-buffered float per warp (``2 * warps * 4``)."""
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
        "ROW_THREADS": (1, 2, 4, 8, 16, 32, 0),
        "VEC": (1, 2, 4, 8),
        "UNROLL": (2, 4, 8),
        "SPLIT": (0, 1, 2, 4, 8),
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
        a SPLIT that does not split (see the module docstring); 1024 threads with 128 bytes of
        loads in flight where rows have edges or are split (ptxas spills). Any cols works with
        any VEC. (Threads and shared memory fit for every config.)"""
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            rows, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        vec = config["VEC"]
        vector_bytes = vec * DTYPES[dtype][2]
        if reason := limits.vector_width_error(vec, vector_bytes, dtype):
            return reason
        if reason := self._split_error(config, rows, cols):
            return reason
        edges = config["SPLIT"] or cols % vec
        if edges and config["BLOCK_SIZE"] == 1024 and config["UNROLL"] * vector_bytes == 128:
            # The head, tail and piece bookkeeping beside 128 bytes of loads in flight need
            # more than the 64 registers a 1024-thread block leaves: ptxas spills.
            return (
                "BLOCK_SIZE=1024 with UNROLL * vector bytes = 128 spills registers on rows "
                "with a scalar head and tail or split rows"
            )
        return None

    @staticmethod
    def _split_error(config: Config, rows: int, cols: int) -> str | None:
        split = config["SPLIT"]
        if not split:
            return None
        if config["ROW_THREADS"] != 0:
            return f"SPLIT={split} cuts rows into pieces of a block each: needs ROW_THREADS=0"
        if rows >= split * limits.NUM_SMS:
            return (
                f"rows={rows} already give {split * limits.NUM_SMS} blocks or more: "
                f"SPLIT={split} would not split them"
            )
        per_piece = cols // config["VEC"] // split_parts(config, rows)
        if per_piece < config["BLOCK_SIZE"]:
            return (
                f"SPLIT={split} cuts rows of {cols // config['VEC']} vectors into pieces of "
                f"{per_piece}, fewer than BLOCK_SIZE={config['BLOCK_SIZE']} threads"
            )
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """16-byte vectors where cols is a multiple of them, else where a row holds at least
        four (head and tail are scalar), else the widest dividing cols. Rows of fewer than 32
        elements: the fewest of 1, 2 or 4 threads per row that hold at most 8 vectors each,
        UNROLL 8 (the row in one step; a thread per row spends no shuffles), a rule not measured
        on a GPU yet (docs/defaults.md). Longer rows, by vectors per row: <= 64 -> 8 threads per
        row, <= 1024 -> a warp per row, else a block of 512 per row; UNROLL 4 (8 for a warp).
        Rows of a block each that number fewer than two per SM are split (the largest SPLIT of
        4, 2, 1 that splits them), so the grid fills the GPU."""
        rows, cols = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        widest = 16 // itemsize
        vec = widest if cols % widest == 0 or cols >= 4 * widest else 1
        if vec == 1:
            vec = max(v for v in self.params["VEC"] if v * itemsize <= 16 and cols % v == 0)
        nvec = cols // vec
        if cols < 32:
            threads = min(p for p in (1, 2, 4) if nvec <= 8 * p)
            return {"BLOCK_SIZE": 256, "ROW_THREADS": threads, "VEC": vec, "UNROLL": 8, "SPLIT": 0}
        if nvec <= 64:
            return {"BLOCK_SIZE": 256, "ROW_THREADS": 8, "VEC": vec, "UNROLL": 4, "SPLIT": 0}
        if nvec <= 1024:
            return {"BLOCK_SIZE": 256, "ROW_THREADS": 32, "VEC": vec, "UNROLL": 8, "SPLIT": 0}
        config = {"BLOCK_SIZE": 512, "ROW_THREADS": 0, "VEC": vec, "UNROLL": 4, "SPLIT": 0}
        if rows < 2 * limits.NUM_SMS:
            for split in (4, 2, 1):
                if self._split_error({**config, "SPLIT": split}, rows, cols) is None:
                    return {**config, "SPLIT": split}
        return config

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """The tunables that shape the code (space order; SPLIT's value is launch geometry:
        ROW_SPLIT says whether rows are split), ALIGNED_ROWS (1 where no row is split and
        ``cols % VEC == 0``: whole vectors from each row's start), then DTYPE, IS_HALF,
        IS_BF16. Depends on the shape only through ALIGNED_ROWS."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        _, cols = shape
        split = int(config["SPLIT"] > 0)
        macros: dict[str, object] = {name: config[name] for name in self.params if name != "SPLIT"}
        macros["ROW_SPLIT"] = split
        macros["ALIGNED_ROWS"] = int(not split and cols % config["VEC"] == 0)
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """``ceil(rows / rows_per_block)`` blocks (grid.x, capped at 2**31-1); split rows: a
        block per piece, ``rows * split_parts`` (under ``2 * SPLIT_ROWS``)."""
        rows, _ = shape
        if config["SPLIT"]:
            grid = rows * split_parts(config, rows)
        else:
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


def row_sum_model(x: np.ndarray, config: Config, parts: int | None = None) -> np.ndarray:
    """The kernel's float32 row sums of ``x`` (2-D, any float dtype, its first element on a
    16-byte boundary), bit for bit; ``parts``: pieces per split row (default: as launched)."""
    rows, cols = x.shape
    vec = config["VEC"]
    parts = split_parts(config, rows) if parts is None else parts
    xf = x.astype(np.float32)
    out = np.empty(rows, dtype=np.float32)
    # Row r starts (r * cols) % VEC elements past a vector boundary: its scalar head.
    heads = np.minimum(-(np.arange(rows, dtype=np.int64) * cols) % vec, cols)
    for head in np.unique(heads):
        sel = heads == head
        xs = xf[sel]
        nvec = (cols - head) // vec
        tail = head + nvec * vec
        body = xs[:, head:tail].reshape(len(xs), nvec, vec)
        chunk = -(-nvec // parts)
        pieces = []
        for part in range(parts):
            lo = min(part * chunk, nvec)
            v = _thread_sums(body[:, lo : min(lo + chunk, nvec)], config)
            if part == 0:
                v += _edge_sums(xs[:, :head], xs[:, tail:], v.shape[1])
            pieces.append(_group_sum(v, config))
        if parts == 1:
            out[sel] = pieces[0]
            continue
        acc = np.zeros((len(xs), 32), dtype=np.float32)
        stacked = np.stack(pieces, axis=1)
        for i in range(0, parts, 32):
            run = stacked[:, i : i + 32]
            acc[:, : run.shape[1]] += run
        out[sel] = butterfly(acc)[:, 0]
    return out


def _thread_sums(xv: np.ndarray, config: Config) -> np.ndarray:
    """Each of a row's P threads' compensated sum of body vectors ``xv`` (rows, nvec, VEC)."""
    rows, nvec, vec = xv.shape
    unroll = config["UNROLL"]
    p = threads_per_row(config)
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
    return s - c


def _edge_sums(head: np.ndarray, tail: np.ndarray, p: int) -> np.ndarray:
    """Each of a row's P threads' sum of the row's scalar ends (float32, as the kernel adds
    them): head element t, plus tail element t, then for k = 1, 2, ... (P below the vector
    width) plus head element t + kP, plus tail element t + kP, where each exists."""
    rows = head.shape[0]
    edge = np.zeros((rows, p), dtype=np.float32)
    for k in range(0, max(head.shape[1], tail.shape[1]), p):
        for ends in (head, tail):
            part = ends[:, k : k + p]
            edge[:, : part.shape[1]] += part
    return edge


def _group_sum(v: np.ndarray, config: Config) -> np.ndarray:
    """The row's threads' values ``v`` (rows, P) summed as the kernel does: a butterfly over a
    group of lanes, or over each warp and then the warp sums."""
    rows, p = v.shape
    if config["ROW_THREADS"]:
        return butterfly(v, p)[:, 0]
    warps = butterfly(v.reshape(rows, p // 32, 32))[..., 0]
    if p == 32:
        return warps[:, 0]
    lanes32 = np.zeros((rows, 32), dtype=np.float32)
    lanes32[:, : p // 32] = warps
    return butterfly(lanes32)[:, 0]


REDUCE_SUM = register(ReduceSumSpec())

__all__ = [
    "REDUCE_SUM",
    "SPLIT_ROWS",
    "ReduceSumSpec",
    "row_sum_model",
    "split_parts",
    "static_shared_bytes",
]
