"""Sorts of 32-bit keys, ascending: ``sort`` (every row of a matrix: bitonic in shared memory or
LSD radix, the ``ALGO`` tunable), ``sort_1d`` (one long array: bitonic or LSD radix) and
``sort_1d_pairs`` (one long array of keys with int32 values, stable radix). The bitonic kernels
are ``sort.cu``, the radix ones ``radix.cu`` (:mod:`kernels.sort.radix`).

Keys are float32 or int32 and only keys are sorted (no values, stability irrelevant). Floats
sort by value with -0.0 before +0.0 (they compare equal, so the output matches np.sort); NaN
keys are not supported: the inputs never contain them and the order they would get (positive
NaNs after +inf, negative ones before -inf) is not NumPy's.

Shared parameters (Kernel Tuner key order):

- ``BLOCK``: threads per block of the shared-memory kernels.
- ``ITEMS``: keys per thread; a block holds ``C = BLOCK * ITEMS`` keys in registers (blocked:
  thread t holds keys ``t*ITEMS ..``) and in dynamic shared memory (``(C + C/32) * 4`` bytes).
- ``WARP_SHFL``: 1 = merge strides in ``[ITEMS, 32*ITEMS)`` are warp shuffles
  (``__shfl_xor_sync``) in registers, 0 = every stride >= ITEMS goes through shared memory.
  Strides below ITEMS are always compare-exchanges between a thread's registers.
- ``SMEM_FUSE``: merge strides per ``__syncthreads`` in shared memory: 1 (pairs of keys) or 2
  (each thread exchanges groups of 4 keys over two strides, half the barriers).

The kernels use 32-44 registers, far below what any block size leaves, so the min-blocks clause
of ``__launch_bounds__`` is not tuned (the template takes MIN_BLOCKS, default 0).

``sort`` (rows) adds ``ALGO`` ("bitonic", the first value: the row sort from before ALGO, or
"radix") and the radix tunables ``RADIX_BITS``, ``RANK``, ``HIST``; ITEMS gains the radix
sort's 12..24. ALGO=bitonic: a row of ``cols`` keys is padded virtually to ``N =
next_pow2(cols)`` keys with the maximum key, so ``N <= C`` is required, and a block sorts ``C /
N`` rows at a time; rows of at most ``MAX_ROW`` = 8192 keys (the largest C whose keys stay in
registers), ITEMS 1..8. ALGO=radix: rows longer than MAX_ROW (up to 2**30 - 1 keys, at most
2**40 keys in all), every row sorted on its own by the radix kernels launched once for all rows
(radix.cu's SEGMENTED: tiles of all rows in one grid, a histogram and look-back words per row,
scratch sized by rows: :func:`kernels.sort.radix.scratch`). Each algorithm fixes the other's
tunables at their first value (WARP_SHFL, SMEM_FUSE under radix; RADIX_BITS, RANK, HIST under
bitonic), so no two configs run the same program. A shape takes one algorithm: rows that fit a
block stay bitonic (their problems, launches and scratch-free buffers as before ALGO), longer
ones are radix; the default follows.

``sort_1d`` adds ``ALGO`` ("bitonic" or "radix"), ``RADIX_BITS``, ``RANK``, ``HIST`` and ``FUSE``:
merge strides done per global pass (1, 2 or 3). n keys are sorted as: blocks of C keys sorted in
shared memory (``sort_1d_block``); then for every merge size ``k = 2C, 4C, ..., next_pow2(n)``: the
strides ``k/2 .. C`` in global passes of up to FUSE strides each (``sort_1d_global<F>``, one launch
per pass, the first of a merge compares mirrors), then strides ``C/2 .. 1`` in shared memory
(``sort_1d_merge``). Padding to the next power of two is virtual, the output buffer is the only
workspace.

``ALGO=radix`` runs :mod:`kernels.sort.radix` instead (onesweep LSD radix sort, ``RADIX_BITS``
per pass, tiles of ``BLOCK * ITEMS`` keys with ITEMS in 8..24, the warp ranking method
``RANK``, the histogram kernel's loads and counters ``HIST``); the bitonic-only tunables
(WARP_SHFL, SMEM_FUSE, FUSE) are then fixed at their first value, and the radix-only ones
(RADIX_BITS, RANK, HIST) are fixed at their first value under
``ALGO=bitonic`` (ITEMS 2, 4 or 8), so no two configs of the space run
the same code. The radix sort takes n < 2**30 and needs scratch (a second key buffer, histograms,
look-back words: :func:`kernels.sort.radix.scratch`), which every sort_1d problem carries after
its scalars so that both algorithms share one argument list.

``sort_1d_pairs`` sorts keys with an int32 value each (the values of a problem are the indices
0..n-1, so the values out are the argsort): radix only, stable, ties keep their input order
and -0.0 sorts before +0.0 (np.argsort would treat those two as a tie).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.registry import register
from kato.kernels.sort import radix
from kato.kernels.spec import Config, InvalidInput, Launch, OperatorSpec, Problem, Step

#: Registers besides the ITEMS keys (indices, loop state, shuffle temporaries); fit to ptxas
#: reports on sm_80/sm_90 (ITEMS=8: 32-42 registers).
REGISTER_OVERHEAD = 28
#: The longest row ``sort`` takes: the largest block buffer of the space (1024 threads x 8 keys).
#: (16 keys per thread made ptxas spill on some block sizes although far below the register cap.)
MAX_ROW = 8192
#: Threads per block of the global passes of ``sort_1d``.
GLOBAL_BLOCK = 256
#: One block per work item up to this many blocks, grid-stride loops beyond.
MAX_GRID = 1 << 20
#: The 1-D sort indexes keys with 64-bit integers, but n itself stays below 2**40 (4 TiB).
MAX_N = 2**40

KEY_DTYPES = ("float32", "int32")
#: ITEMS of the bitonic 1-D sort (powers of two); the radix sort takes the rest of the list.
BITONIC_ITEMS = (2, 4, 8)
#: Tunables only the bitonic sort_1d reads: fixed at their first value under ALGO=radix.
BITONIC_ONLY = ("WARP_SHFL", "SMEM_FUSE", "FUSE")
#: Tunables only the radix sort_1d reads: fixed at their first value under ALGO=bitonic.
RADIX_ONLY = ("RADIX_BITS", "RANK", "HIST")
#: ITEMS of the bitonic row sort (powers of two); the radix row sort takes the rest too.
ROW_BITONIC_ITEMS = (1, 2, 4, 8)
#: Tunables only the bitonic row sort reads: fixed at their first value under ALGO=radix.
ROW_BITONIC_ONLY = ("WARP_SHFL", "SMEM_FUSE")
#: The most keys of all rows of a radix row sort (as sort_1d's n): its grid of tiles then
#: stays far below 2**31 blocks.
MAX_ROW_KEYS = 2**40
#: The fewest keys for which sort_1d's default config is the radix sort (see
#: :meth:`Sort1dSpec.default_config`): the smallest size at which radix was timed against bitonic.
RADIX_DEFAULT_MIN = 1 << 20
#: The argument layouts of the radix kernels in the sort_1d and sort_1d_pairs problems.
KEYS_LAYOUT = radix.ArgLayout(pairs=False)
PAIRS_LAYOUT = radix.ArgLayout(pairs=True)
#: The argument layout of the radix kernels in a sort problem of rows longer than MAX_ROW.
ROWS_LAYOUT = radix.ArgLayout(pairs=False, rows=True)


def capacity(config: Config) -> int:
    """Keys a block holds: ``BLOCK * ITEMS``."""
    return config["BLOCK"] * config["ITEMS"]


def shared_bytes(config: Config) -> int:
    """Dynamic shared memory of the block kernels: C keys plus one padding word per 32."""
    c = capacity(config)
    return (c + c // 32) * 4


def register_cap(config: Config) -> int:
    return limits.launch_bounds_register_cap(config["BLOCK"], config.get("MIN_BLOCKS", 0))


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_common(spec: OperatorSpec, config: Config) -> str | None:
    reason = spec.check_params(config)
    if reason:
        return reason
    block, min_blocks = config["BLOCK"], config.get("MIN_BLOCKS", 0)
    if reason := limits.resident_threads_error(min_blocks, block):
        return reason
    cap = register_cap(config)
    if config["ITEMS"] + REGISTER_OVERHEAD > cap:
        return (
            f"ITEMS={config['ITEMS']} keys per thread need about "
            f"{config['ITEMS'] + REGISTER_OVERHEAD} registers; the launch bounds allow {cap}: "
            "it would spill"
        )
    if shared_bytes(config) > limits.MAX_SHARED_PER_BLOCK:
        return f"{shared_bytes(config)} bytes of shared memory per block; at most 227 KiB"
    return None


def _defines(spec: OperatorSpec, config: Config, dtype: str, sort_1d: bool) -> dict[str, object]:
    macros: dict[str, object] = {
        name: config[name] for name in ("BLOCK", "ITEMS", "WARP_SHFL", "SMEM_FUSE")
    }
    macros["SORT_1D"] = int(sort_1d)
    return macros


def make_keys(size: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random keys that stress a sort: many duplicates (a third of the keys from 16 values),
    the extremes (+-inf and -0.0/0.0 for floats, INT_MIN/INT_MAX for ints), the rest spread
    over the whole range. Never all zeros; no NaN."""
    if dtype == "float32":
        keys = (rng.standard_normal(size) * np.float32(1e3)).astype(np.float32)
        keys *= np.exp2(rng.integers(-20, 20, size)).astype(np.float32)
        specials = np.array([np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, 3.5, -2.25], np.float32)
        small = rng.integers(-8, 8, 16).astype(np.float32) / 4
    else:
        keys = rng.integers(-(2**31), 2**31, size, dtype=np.int64).astype(np.int32)
        specials = np.array([-(2**31), 2**31 - 1, 0, -1, 1, 7, -(2**31) + 1, 2**31 - 2], np.int32)
        small = rng.integers(-8, 8, 16).astype(np.int32)
    picks = rng.random(size)
    dup = picks < 1 / 3
    keys[dup] = small[rng.integers(0, small.size, int(dup.sum()))]
    special = picks > 0.95
    keys[special] = specials[rng.integers(0, specials.size, int(special.sum()))]
    if size and not np.any(keys != 0):
        keys[0] = specials[0]
    return keys


class SortSpec(OperatorSpec):
    """Sort every row of a (rows, cols) matrix ascending: bitonic in shared memory/registers
    (rows of up to MAX_ROW keys) or LSD radix over all rows at once (longer rows)."""

    name = "sort"
    description = (
        "ascending sort of every row of a (rows, cols) matrix of 32-bit keys (bitonic in shared "
        "memory, or LSD radix for rows over 8192 keys)"
    )
    dtypes = KEY_DTYPES
    rank = 2
    shape_names = ("rows", "cols")
    params = {
        "BLOCK": (64, 128, 256, 512, 1024),
        "ITEMS": (*ROW_BITONIC_ITEMS, 12, 16, 20, 24),
        "WARP_SHFL": (0, 1),
        "SMEM_FUSE": (1, 2),
        "ALGO": ("bitonic", "radix"),
        "RADIX_BITS": radix.RADIX_BITS,
        "RANK": radix.RANKS,
        "HIST": radix.HISTS,
    }
    template = Path(__file__).with_name("sort.cu")
    extra_templates = (radix.TEMPLATE,)
    kernel_name = "sort_rows_kernel"
    kernel_names = ("sort_rows_kernel", *radix.KERNELS)

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows up to 2**31 - 1, cols up to 2**30 - 1 (the radix sort's
        30-bit counts) and, for rows longer than MAX_ROW, at most 2**40 keys in all."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if cols > radix.MAX_N:
            raise InvalidInput(
                f"sort takes rows of at most 2**30 - 1 keys (the radix sort's limit), "
                f"got cols={cols}"
            )
        if rows > limits.INT32_MAX:
            raise InvalidInput(f"sort takes at most {limits.INT32_MAX} rows, got {rows}")
        if cols > MAX_ROW and rows * cols > MAX_ROW_KEYS:
            raise InvalidInput(
                f"sort takes at most 2**40 keys in rows longer than {MAX_ROW}, got {rows} x {cols}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; a tunable the algorithm
        ignores off its first value. Bitonic: rows longer than MAX_ROW, ITEMS not a power of
        two up to 8, ``MIN_BLOCKS * BLOCK`` over 2048 threads per SM, ITEMS keys that would not
        fit the registers the launch bounds leave, a block buffer ``C = BLOCK * ITEMS`` smaller
        than ``next_pow2(cols)``. Radix: rows of at most MAX_ROW keys (bitonic's), what
        :func:`kernels.sort.radix.check` rejects (tiles under 2048 keys, registers, shared
        memory, over 2**31 - 1 tiles of all rows)."""
        try:
            rows, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        if reason := self.check_params(config):
            return reason
        if config["ALGO"] == "radix":
            if cols <= MAX_ROW:
                return (
                    f"ALGO=radix sorts rows longer than {MAX_ROW} keys, got cols={cols}: rows "
                    "that fit a block are sorted in shared memory (ALGO=bitonic)"
                )
            for name in ROW_BITONIC_ONLY:
                if config[name] != self.params[name][0]:
                    return f"{name} is ignored by ALGO=radix: fixed at {self.params[name][0]}"
            return radix.check(config, cols, pairs=False, rows=rows)
        if cols > MAX_ROW:
            return (
                f"ALGO=bitonic sorts rows of at most {MAX_ROW} keys in shared memory, got "
                f"cols={cols}; longer rows take ALGO=radix"
            )
        if config["ITEMS"] not in ROW_BITONIC_ITEMS:
            return f"ALGO=bitonic takes ITEMS in {ROW_BITONIC_ITEMS}, got {config['ITEMS']}"
        for name in RADIX_ONLY:
            if config[name] != self.params[name][0]:
                return f"{name} is ignored by ALGO=bitonic: fixed at {self.params[name][0]}"
        reason = _check_common(self, config)
        if reason:
            return reason
        if capacity(config) < next_pow2(cols):
            return (
                f"BLOCK x ITEMS = {capacity(config)} keys per block < next_pow2(cols) = "
                f"{next_pow2(cols)}"
            )
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """Rows that fit a block (up to MAX_ROW keys; the only ones bitonic takes): bitonic, 8
        keys per thread with warp shuffles; 128 threads for rows up to 1024 keys (several rows
        per block), else just enough threads for one row. Longer rows (radix only): tiles of 256
        x 16 keys, 8-bit digits, atomic ranking, the vec4 histogram kernel: the fastest of the
        285 row configs timed on an H100 at 64 x 128256 and of the leading ten at three other
        shapes (data/benchmarks/radix_sort_rows_h100.json), 23-27% faster there than
        sort_1d's 512 x 16 tiles with the scalar histogram (more blocks resident a row)."""
        _, cols = self.validate(shape, dtype)
        first = {name: values[0] for name, values in self.params.items()}
        if cols > MAX_ROW:
            config = {**first, "BLOCK": 256, "ITEMS": 16, "ALGO": "radix", "RADIX_BITS": 8}
            config.update(RANK="atomic", HIST="vec4")
        else:
            block = min(1024, max(128, next_pow2(cols) // 8))
            config = {**first, "BLOCK": block, "ITEMS": 8, "WARP_SHFL": 1, "SMEM_FUSE": 2}
        assert self.check(config, shape, dtype) is None, self.check(config, shape, dtype)
        return config

    def template_for(self, config: Config) -> Path:
        return radix.TEMPLATE if _row_algo(config) == "radix" else self.template

    def main_kernel(self, config: Config) -> str:
        return radix.MAIN_KERNEL if _row_algo(config) == "radix" else self.kernel_name

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Bitonic: the macros from before ALGO (ALGO and the radix tunables are not macros).
        Radix: radix.cu's, with SEGMENTED=1."""
        if _row_algo(config) == "radix":
            return radix.defines(config, pairs=False, segmented=True)
        return _defines(self, config, dtype, sort_1d=False)

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Bitonic: one block per ``C / next_pow2(cols)`` rows (at most MAX_GRID blocks, grid
        stride). Radix: a scatter pass, one block per tile of every row."""
        rows, cols = shape
        if _row_algo(config) == "radix":
            return radix.pass_launch(config, cols, pairs=False, rows=rows)
        per_block = capacity(config) // next_pow2(cols)
        grid = min(math.ceil(rows / per_block), MAX_GRID)
        return Launch((grid, 1, 1), (config["BLOCK"], 1, 1), shared_bytes(config))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """Bitonic: the row kernel on all args (the problem of rows up to MAX_ROW keys).
        Radix: :func:`kernels.sort.radix.steps` for rows on ``[x, y, cols, rows, 0..63,
        scratch]`` (the problem of longer rows)."""
        if _row_algo(config) == "radix":
            rows, cols = shape
            key_float = dtype == "float32"
            return radix.steps(config, cols, ROWS_LAYOUT, key_float=key_float, rows=rows)
        return super().steps(config, shape, dtype)

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Keys from :func:`make_keys`; y pre-filled with NaN (floats) or a poison int. Rows up
        to MAX_ROW keys (bitonic): ``[x, y, rows, cols, key_float]`` (int32 scalars). Longer
        rows (radix): ``[x, y, cols, rows]`` (int64), the int32 scalars 0..63, the radix
        scratch for rows (:func:`kernels.sort.radix.scratch`)."""
        rows, cols = self.validate(shape, dtype)
        x = make_keys(rows * cols, dtype, rng).reshape(rows, cols)
        y = _poisoned((rows, cols), dtype)
        if cols > MAX_ROW:
            scalars = [np.int32(v) for v in range(64)]
            scratch = radix.scratch(cols, dtype, pairs=False, rows=rows)
            args = [x, y, np.int64(cols), np.int64(rows), *scalars, *scratch]
        else:
            args = [x, y, np.int32(rows), np.int32(cols), np.int32(dtype == "float32")]
        return Problem(args=args, outputs=[1], references=[sort_reference(x)])

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """Exact: the output is a permutation of the input."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"sort does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        rows, cols = shape
        return 2 * rows * cols * 4

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """x and y, and for rows longer than MAX_ROW the radix scratch."""
        rows, cols = shape
        scratch = radix.scratch_bytes(cols, pairs=False, rows=rows) if cols > MAX_ROW else 0
        return 2 * rows * cols * 4 + scratch


class Sort1dSpec(OperatorSpec):
    """Sort one long array of n 32-bit keys ascending: bitonic (block sorts + global merges) or
    LSD radix (``ALGO``)."""

    name = "sort_1d"
    description = "ascending sort of one array of n 32-bit keys (bitonic merges or LSD radix)"
    dtypes = KEY_DTYPES
    rank = 1
    shape_names = ("n",)
    params = {
        "BLOCK": (128, 256, 512, 1024),
        "ITEMS": (*BITONIC_ITEMS, 12, 16, 20, 24),
        "WARP_SHFL": (0, 1),
        "SMEM_FUSE": (1, 2),
        "FUSE": (1, 2, 3),
        "ALGO": ("bitonic", "radix"),
        "RADIX_BITS": radix.RADIX_BITS,
        "RANK": radix.RANKS,
        "HIST": radix.HISTS,
    }
    template = Path(__file__).with_name("sort.cu")
    extra_templates = (radix.TEMPLATE,)
    kernel_name = "sort_1d_block"
    kernel_names = (
        "sort_1d_block",
        "sort_1d_merge",
        "sort_1d_global1",
        "sort_1d_global2",
        "sort_1d_global3",
        *radix.KERNELS,
    )

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        shape = super().validate(shape, dtype)
        if shape[0] > MAX_N:
            raise InvalidInput(f"sort_1d takes at most 2**40 keys, got n={shape[0]}")
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; a tunable the algorithm
        ignores off its first value. Bitonic: ITEMS not a power of two up to 8, ``MIN_BLOCKS *
        BLOCK`` over 2048 threads per SM, ITEMS keys that would not fit the registers the
        launch bounds leave (every other config sorts every n). Radix: what
        :func:`kernels.sort.radix.check` rejects (n >= 2**30, tiles under 2048 keys, registers,
        shared memory)."""
        try:
            (n,) = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        if reason := self.check_params(config):
            return reason
        if config["ALGO"] == "bitonic":
            if config["ITEMS"] not in BITONIC_ITEMS:
                return f"ALGO=bitonic takes ITEMS in {BITONIC_ITEMS}, got {config['ITEMS']}"
            for name in RADIX_ONLY:
                if config[name] != self.params[name][0]:
                    return f"{name} is ignored by ALGO=bitonic: fixed at {self.params[name][0]}"
            return _check_common(self, config)
        for name in BITONIC_ONLY:
            if config[name] != self.params[name][0]:
                return f"{name} is ignored by ALGO=radix: fixed at {self.params[name][0]}"
        return radix.check(config, n, pairs=False)

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """From :data:`RADIX_DEFAULT_MIN` keys (and up to the radix sort's limit): the radix
        sort in tiles of 512 x 16 keys, 8-bit digits, atomic ranking, the scalar histogram
        kernel -- the fastest radix config at every size timed (2**20, 2**24 float32 and int32,
        2**26 on an H100, 2026-12-07, docs/results_h200.md "Session 9"), where bitonic took
        1.7x (2**20) to 6x (2**26) as long. Below it, bitonic: 8192-key blocks (1024 threads x
        8 keys), warp shuffles, 3 strides per global pass (shorter arrays were not timed)."""
        (n,) = self.validate(shape, dtype)
        if RADIX_DEFAULT_MIN <= n <= radix.MAX_N:
            config = {name: self.params[name][0] for name in BITONIC_ONLY}
            config.update(
                BLOCK=512, ITEMS=16, ALGO="radix", RADIX_BITS=8, RANK="atomic",
                HIST=self.params["HIST"][0],
            )  # fmt: skip
            assert self.check(config, shape, dtype) is None, self.check(config, shape, dtype)
            return config
        return {
            "BLOCK": 1024,
            "ITEMS": 8,
            "WARP_SHFL": 1,
            "SMEM_FUSE": 2,
            "FUSE": 3,
            "ALGO": "bitonic",
            "RADIX_BITS": self.params["RADIX_BITS"][0],
            "RANK": self.params["RANK"][0],
            "HIST": self.params["HIST"][0],
        }

    def template_for(self, config: Config) -> Path:
        return radix.TEMPLATE if config["ALGO"] == "radix" else self.template

    def main_kernel(self, config: Config) -> str:
        return radix.MAIN_KERNEL if config["ALGO"] == "radix" else self.kernel_name

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Bitonic: FUSE only changes the launch sequence, not the source (and ALGO,
        RADIX_BITS, RANK and HIST are not macros: the bitonic source is what it was before the
        radix path)."""
        if config["ALGO"] == "radix":
            return radix.defines(config, pairs=False)
        return _defines(self, config, dtype, sort_1d=True)

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Bitonic: the block-sort step, one block per C keys (MAX_GRID at most, grid stride).
        Radix: a scatter pass, one block per tile."""
        (n,) = shape
        if config["ALGO"] == "radix":
            return radix.pass_launch(config, n, pairs=False)
        grid = min(math.ceil(n / capacity(config)), MAX_GRID)
        return Launch((grid, 1, 1), (config["BLOCK"], 1, 1), shared_bytes(config))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """Radix: :func:`kernels.sort.radix.steps`. Bitonic: block sort, then per merge size
        k = 2C .. next_pow2(n): global passes of up to FUSE strides (k/2 .. C), then the
        shared-memory merge of strides C/2 .. 1.

        Arguments are indices into the problem's args ``[x, y, n, 0, 1, 2, ..., 63, scratch]``
        (int32 scalars 0..63 at index 3 + value): ``sort_1d_block(x, y, n, log2seg, key_float)``,
        ``sort_1d_global<F>(y, n, hi, flip, key_float)``, ``sort_1d_merge(y, n, key_float)``
        (key_float 1 for float32 keys, 0 for int32: both key types share one compiled kernel).
        """
        (n,) = shape
        if config["ALGO"] == "radix":
            return radix.steps(config, n, KEYS_LAYOUT, key_float=dtype == "float32")
        c = capacity(config)
        log_c = c.bit_length() - 1
        log_p = next_pow2(n).bit_length() - 1
        block_launch = self.launch(config, shape, dtype)
        key = 3 + int(dtype == "float32")  # the int32 scalar 1 (float keys) or 0 (int keys)
        if n <= c:
            return [Step("sort_1d_block", block_launch, (0, 1, 2, 3 + log_p, key))]
        steps = [Step("sort_1d_block", block_launch, (0, 1, 2, 3 + log_c, key))]
        fuse = config["FUSE"]
        for log_k in range(log_c + 1, log_p + 1):
            hi = log_k - 1  # the merge's first stride is 2^hi = k/2
            flip = 1
            while hi >= log_c:
                f = min(fuse, hi - log_c + 1)
                groups = math.ceil(n / 2 ** (hi + 1)) * 2 ** (hi + 1 - f)
                grid = min(math.ceil(groups / GLOBAL_BLOCK), MAX_GRID)
                launch = Launch((grid, 1, 1), (GLOBAL_BLOCK, 1, 1), 0)
                steps.append(Step(f"sort_1d_global{f}", launch, (1, 2, 3 + hi, 3 + flip, key)))
                hi -= f
                flip = 0
            steps.append(Step("sort_1d_merge", block_launch, (1, 2, key)))
        return steps

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Keys from :func:`make_keys`; y poisoned; scalars n (int64) and 0..63 (int32); the
        radix scratch (one-word stand-ins where n is beyond the radix sort)."""
        (n,) = self.validate(shape, dtype)
        x = make_keys(n, dtype, rng)
        y = _poisoned((n,), dtype)
        scalars = [np.int32(v) for v in range(64)]
        return Problem(
            args=[x, y, np.int64(n), *scalars, *radix.scratch(_radix_n(n), dtype, pairs=False)],
            outputs=[1],
            references=[sort_reference(x)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        if dtype not in self.dtypes:
            raise InvalidInput(f"sort_1d does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once and y written once (the minimum; the passes move much more)."""
        return 2 * shape[0] * 4

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """x, y and the radix scratch."""
        return 2 * shape[0] * 4 + radix.scratch_bytes(_radix_n(shape[0]), pairs=False)


class Sort1dPairsSpec(OperatorSpec):
    """Stable ascending sort of n 32-bit keys, each with an int32 value: LSD radix."""

    name = "sort_1d_pairs"
    description = (
        "stable ascending radix sort of n 32-bit keys with int32 values (argsort: values are "
        "the indices)"
    )
    dtypes = KEY_DTYPES
    rank = 1
    shape_names = ("n",)
    params = {
        "BLOCK": (128, 256, 512, 1024),
        "ITEMS": (8, 12, 16, 20, 24),
        "RADIX_BITS": radix.RADIX_BITS,
        "RANK": radix.RANKS,
        "HIST": radix.HISTS,
    }
    template = radix.TEMPLATE
    kernel_name = radix.MAIN_KERNEL
    kernel_names = radix.KERNELS

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        shape = super().validate(shape, dtype)
        if shape[0] > radix.MAX_N:
            raise InvalidInput(f"sort_1d_pairs takes at most 2**30 - 1 keys, got n={shape[0]}")
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space, and what
        :func:`kernels.sort.radix.check` rejects (tiles under 2048 keys, registers for a key, a
        rank and a value per item, shared memory)."""
        try:
            (n,) = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        if reason := self.check_params(config):
            return reason
        return radix.check(config, n, pairs=True)

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """8-bit digits (4 passes), tiles of 256 x 24 keys, atomic ranking, the scalar
        histogram kernel: the fastest config at 2**24 float32 pairs on an H100 (0.711 ms; the
        earlier default, 512 x 12 with match ranking, 0.775; 2026-12-07, docs/results_h200.md
        "Session 9")."""
        self.validate(shape, dtype)
        return {
            "BLOCK": 256,
            "ITEMS": 24,
            "RADIX_BITS": 8,
            "RANK": "atomic",
            "HIST": radix.HISTS[0],
        }

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        return radix.defines(config, pairs=True)

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        return radix.pass_launch(config, shape[0], pairs=True)

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """:func:`kernels.sort.radix.steps` on ``[x, v, y, w, n, 0..63, scratch]``."""
        return radix.steps(config, shape[0], PAIRS_LAYOUT, key_float=dtype == "float32")

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Keys from :func:`make_keys` (a third duplicates: ties test stability), values the
        indices 0..n-1; y and w poisoned. References: the sorted keys and the values in the
        order of a stable argsort by the kernels' key order (:func:`radix.stable_order`)."""
        (n,) = self.validate(shape, dtype)
        x = make_keys(n, dtype, rng)
        v = np.arange(n, dtype=np.int32)
        y = _poisoned((n,), dtype)
        w = np.full(n, -1, np.int32)
        scalars = [np.int32(s) for s in range(64)]
        return Problem(
            args=[x, v, y, w, np.int64(n), *scalars, *radix.scratch(n, dtype, pairs=True)],
            outputs=[2, 3],
            references=[sort_reference(x), v[radix.stable_order(x)].astype(np.int64)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        if dtype not in self.dtypes:
            raise InvalidInput(f"sort_1d_pairs does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """Keys and values read once and written once."""
        return 4 * shape[0] * 4

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        return 4 * shape[0] * 4 + radix.scratch_bytes(shape[0], pairs=True)


def _row_algo(config: Config) -> str:
    """A sort config's algorithm: "bitonic" for a config from before ALGO."""
    return config.get("ALGO", "bitonic")


def _radix_n(n: int) -> int:
    """The n the radix scratch of a sort_1d problem is sized for: one word beyond the radix
    sort's reach (only bitonic configs are valid there)."""
    return n if n <= radix.MAX_N else 1


def _poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "float32":
        return np.full(shape, np.nan, np.float32)
    return np.full(shape, -12345, np.int32)


def sort_reference(x: np.ndarray) -> np.ndarray:
    """np.sort along the last axis, in float64 (floats) or int64 (ints)."""
    wide = np.float64 if x.dtype.kind == "f" else np.int64
    return np.sort(x.astype(wide), axis=-1)


SORT = register(SortSpec())
SORT_1D = register(Sort1dSpec())
SORT_1D_PAIRS = register(Sort1dPairsSpec())
