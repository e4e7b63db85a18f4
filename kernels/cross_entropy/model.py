"""What ``cross_entropy`` and ``cross_entropy_backward`` share: their parameter space, the split
of a row into chunks, the checks, the launch geometry, the test problem's inputs and the float64
references.

Both walk the rows of (rows, cols) logits as :mod:`kernels.rowwise` does (row groups of 8, 16 or
32 lanes or a whole block, every row segment a scalar head, aligned vectors and a scalar tail,
so any ``cols`` and any address takes any ``VEC``), with one addition for vocabulary-sized rows
that are few (a batch of 1 to 16 sequences' last tokens has fewer rows than the H200 has SMs):
``SPLIT`` cuts each row into that many chunks of ``ceil(cols / SPLIT)`` columns rounded up to a
multiple of 8, each a work item of its own row group. The forward then writes a (max, sum) pair
per chunk and a second kernel merges them per row; the backward needs no merge.

Labels are int64 (torch's class-index targets). int32 labels are not accepted: a row reads one
label, so a second index type would double every variant's compiles for no measurable gain; a
caller converts (``labels.long()``, 8 bytes a row). The ignore index is a kernel argument
(default -100, torch's), so any value works with the same compiled kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from kato.kernels import limits, rowwise
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec

#: torch's default ``ignore_index``.
IGNORE_INDEX = -100
SPLITS = (1, 2, 4, 8, 16, 32, 64)
#: The forward's partials buffer holds MAX_SPLIT (max, sum) pairs per row.
MAX_SPLIT = max(SPLITS)
PARAMS: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE": (128, 256, 512, 1024),
    "VEC": (1, 2, 4, 8),
    "ROW_THREADS": (8, 16, 32, 0),
    "MIN_BLOCKS": (0, 2),
    "SPLIT": SPLITS,
}
#: Per-row logit offsets of the test problems: rows 0, 4, ... sit at +100, rows 2, 6, ... at
#: -100 (exp(100) overflows float32: a kernel that does not subtract the row's max fails).
OFFSET = 100.0
#: Every IGNORE_EVERY-th row (from row 3) has the ignore index as its label.
IGNORE_EVERY = 8


def chunk_cols(cols: int, split: int) -> int:
    """Columns of one chunk: ``ceil(cols / split)`` rounded up to a multiple of 8 (the whole
    row for SPLIT=1); the last chunks may be shorter or empty."""
    if split == 1:
        return cols
    return (math.ceil(cols / split) + 7) // 8 * 8


def reduction_shared_bytes(config: Config) -> int:
    """Static shared memory of the block-wide merge: a double-buffered (max, sum) per warp."""
    if config["ROW_THREADS"] == 0 and config["BLOCK_SIZE"] > 32:
        return 2 * (config["BLOCK_SIZE"] // 32) * 8
    return 0


class CrossEntropyBase(OperatorSpec):
    """The part of the two specs that is the same; subclasses set the class attributes of
    :class:`~kernels.spec.OperatorSpec`, :attr:`TOLERANCES` and the problem methods.
    """

    dtypes = ("float32", "float16", "bfloat16")
    rank = 2
    shape_names = ("rows", "cols")
    params = PARAMS
    #: ``(atol, rtol)`` of the main output per dtype (see each spec for why).
    TOLERANCES: dict[str, tuple[float, float]] = {}

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows and cols must fit the kernels' ``int`` arguments."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if rows > limits.INT32_MAX or cols > rowwise.MAX_COLS:
            raise InvalidInput(
                f"{self.name} takes up to 2**31-1 rows and 2**31-2**16 columns, got {rows} x {cols}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        ``MIN_BLOCKS * BLOCK_SIZE`` over 2048 threads per SM or a register cap under
        :data:`kernels.rowwise.MIN_REGISTER_CAP`; ``SPLIT > 1`` whose chunks are shorter than one
        vector per thread of a row group (splitting finer only adds idle threads). Any ``cols``
        works with any ``VEC``.
        """
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            _, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        block, vec = config["BLOCK_SIZE"], config["VEC"]
        if reason := limits.vector_width_error(vec, vec * DTYPES[dtype][2], dtype):
            return reason
        if reason := limits.resident_threads_error(config["MIN_BLOCKS"], block):
            return reason
        if rowwise.register_cap(config) < rowwise.MIN_REGISTER_CAP:
            return (
                f"MIN_BLOCKS={config['MIN_BLOCKS']} blocks of {block} threads cap registers at "
                f"{rowwise.register_cap(config)} per thread; the kernels need "
                f"{rowwise.MIN_REGISTER_CAP}"
            )
        split = config["SPLIT"]
        group = rowwise.threads_per_row(config) * vec
        if split > 1 and chunk_cols(cols, split) < group:
            return (
                f"SPLIT={split} leaves chunks of {chunk_cols(cols, split)} of {cols} columns, "
                f"fewer than one vector for each of the row group's "
                f"{rowwise.threads_per_row(config)} threads ({group} columns)"
            )
        if split > 1 and (split - 1) * chunk_cols(cols, split) >= cols:
            return (
                f"SPLIT={split} chunks of {chunk_cols(cols, split)} columns leave the last "
                f"chunk of a {cols}-column row empty"
            )
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """The widest vector; the fewest lanes per row (8, 16, 32) that give each lane at most 4
        vectors, else a block per row (256 threads up to 8 vectors each, 512 up to 16, else
        1024); then the smallest SPLIT that makes two waves of resident blocks (by 2048 threads
        per SM on 132 SMs) where the chunks stay valid."""
        rows, cols = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        vec = max(v for v in PARAMS["VEC"] if v * itemsize <= 16 and v <= cols)
        vectors = cols // vec
        config = {"BLOCK_SIZE": 256, "VEC": vec, "ROW_THREADS": 0, "MIN_BLOCKS": 0, "SPLIT": 1}
        lanes = [n for n in (8, 16, 32) if vectors <= 4 * n]
        if lanes:
            config["ROW_THREADS"] = lanes[0]
        else:
            fits = [block for block, per in ((256, 8), (512, 16)) if vectors <= block * per]
            config["BLOCK_SIZE"] = fits[0] if fits else 1024
        waves = 2 * limits.NUM_SMS * (limits.MAX_THREADS_PER_SM // config["BLOCK_SIZE"])
        if config["ROW_THREADS"] == 0 and self.row_groups(config, rows) < waves:
            # Few long rows: more, smaller blocks per row rather than few large ones.
            config["BLOCK_SIZE"] = 256
            waves = 2 * limits.NUM_SMS * (limits.MAX_THREADS_PER_SM // 256)
        for split in SPLITS if config["ROW_THREADS"] == 0 else ():
            trial = {**config, "SPLIT": split}
            if self.check(trial, shape, dtype) is not None:
                break
            config = trial
            if self.row_groups(config, rows) >= waves:
                break
        assert self.check(config, shape, dtype) is None, (config, shape, dtype)
        return config

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """BLOCK_SIZE (block mode only), VEC, ROW_THREADS, SPLIT, the launch bounds
        (:func:`kernels.rowwise.launch_bounds`), DTYPE, IS_HALF, IS_BF16. Nothing depends on
        the shape."""
        is_half, is_bf16 = rowwise.CUDA_FLAGS[dtype]
        macros: dict[str, object] = {}
        if config["ROW_THREADS"] == 0:
            macros["BLOCK_SIZE"] = config["BLOCK_SIZE"]
        macros.update({name: config[name] for name in ("VEC", "ROW_THREADS", "SPLIT")})
        macros["LB_THREADS"], macros["LB_MIN_BLOCKS"] = rowwise.launch_bounds(config)
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        return macros

    def row_groups(self, config: Config, rows: int) -> int:
        """Blocks for one row group per work item: ``ceil(rows * SPLIT / rows_per_block)``."""
        return math.ceil(rows * config["SPLIT"] / rowwise.rows_per_block(config))

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """:meth:`row_groups` blocks (capped at 2**31-1: the kernels loop over work items with a
        grid stride), no dynamic shared memory."""
        rows, _ = shape
        grid = min(self.row_groups(config, rows), limits.MAX_GRID_X)
        return Launch(grid=(grid, 1, 1), block=(config["BLOCK_SIZE"], 1, 1))

    def tolerance(self, dtype: str) -> tuple[float, float]:
        if dtype not in self.dtypes:
            raise InvalidInput(f"{self.name} does not support dtype {dtype!r}")
        return self.TOLERANCES[dtype]


def make_logits(
    rows: int, cols: int, dtype: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Test logits and labels: ``N(0, 1) + offset`` per row as stored in ``dtype`` (offsets
    +-:data:`OFFSET` on alternate even rows, U(-2, 2) elsewhere), labels uniform in ``[0,
    cols)`` with every :data:`IGNORE_EVERY`-th row (from row 3) ignored (:data:`IGNORE_INDEX`).
    """
    from kato.kernels.parallel import fill_rows

    offsets = rng.uniform(-2.0, 2.0, size=(rows, 1)).astype(np.float32)
    offsets[0::4] = OFFSET
    offsets[2::4] = -OFFSET
    labels = rng.integers(0, cols, size=rows, dtype=np.int64)
    labels[3::IGNORE_EVERY] = IGNORE_INDEX
    logits = np.empty((rows, cols), dtype=DTYPES[dtype][0])

    def fill(chunk: slice, gen: np.random.Generator) -> None:
        x = gen.standard_normal((chunk.stop - chunk.start, cols), dtype=np.float32)
        x += offsets[chunk]
        logits[chunk] = x

    fill_rows(rng, rows, cols, fill)
    return logits, labels


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """Float64 log(sum(exp(x))) over the last axis, max-shifted."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def cross_entropy_reference(
    logits: np.ndarray, labels: np.ndarray, ignore_index: int = IGNORE_INDEX
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 (loss, lse) per row, as ``F.cross_entropy(logits, labels, reduction='none',
    ignore_index=...)`` and the row's logsumexp: loss 0 for ignored rows, NaN for a label
    outside ``[0, cols)`` that is not the ignore index."""
    rows, cols = logits.shape
    lse = logsumexp(logits)
    loss = np.zeros(rows)
    inside = (labels >= 0) & (labels < cols)
    take = inside & (labels != ignore_index)
    picked = logits[np.flatnonzero(take), labels[take]].astype(np.float64)
    loss[take] = lse[take] - picked
    loss[~inside & (labels != ignore_index)] = np.nan
    return loss, lse


def cross_entropy_backward_reference(
    logits: np.ndarray,
    labels: np.ndarray,
    lse: np.ndarray,
    dloss: np.ndarray,
    ignore_index: int = IGNORE_INDEX,
) -> np.ndarray:
    """Float64 ``(exp(x - lse) - onehot(label)) * dloss`` per row, from the lse given (the
    forward's, as stored); zeros for ignored rows, NaN rows for labels outside ``[0, cols)``."""
    rows, cols = logits.shape
    out = np.exp(logits.astype(np.float64) - lse.astype(np.float64)[:, None])
    inside = (labels >= 0) & (labels < cols)
    take = np.flatnonzero(inside & (labels != ignore_index))
    out[take, labels[take]] -= 1.0
    out *= dloss.astype(np.float64)[:, None]
    out[labels == ignore_index] = 0.0
    out[~inside & (labels != ignore_index)] = np.nan
    return out
