"""Bitonic sort of 32-bit keys, ascending: ``sort`` (every row of a matrix) and ``sort_1d`` (one
long array). Both are specs of ``sort.cu``.

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

``sort`` (rows): a row of ``cols`` keys is padded virtually to ``N = next_pow2(cols)`` keys with
the maximum key, so ``N <= C`` is required, and a block sorts ``C / N`` rows at a time. Rows are
limited to ``MAX_ROW`` = 8192 keys (the largest C whose keys stay in registers).

``sort_1d`` adds ``FUSE``: merge strides done per global pass (1, 2 or 3). n keys are sorted
as: blocks of C keys sorted in shared memory (``sort_1d_block``); then for every merge size
``k = 2C, 4C, ..., next_pow2(n)``: the strides ``k/2 .. C`` in global passes of up to FUSE
strides each (``sort_1d_global<F>``, one launch per pass, the first of a merge compares
mirrors), then strides ``C/2 .. 1`` in shared memory (``sort_1d_merge``). Padding to the next
power of two is virtual, the output buffer is the only workspace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kernels import limits
from kernels.registry import register
from kernels.spec import Config, InvalidInput, Launch, OperatorSpec, Problem, Step

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
    """Sort every row of a (rows, cols) matrix ascending, bitonic in shared memory/registers."""

    name = "sort"
    description = "ascending bitonic sort of every row of a (rows, cols) matrix of 32-bit keys"
    dtypes = KEY_DTYPES
    rank = 2
    shape_names = ("rows", "cols")
    params = {
        "BLOCK": (64, 128, 256, 512, 1024),
        "ITEMS": (1, 2, 4, 8),
        "WARP_SHFL": (0, 1),
        "SMEM_FUSE": (1, 2),
    }
    template = Path(__file__).with_name("sort.cu")
    kernel_name = "sort_rows_kernel"
    kernel_names = ("sort_rows_kernel",)

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: rows up to 2**31 - 1 and at most MAX_ROW columns."""
        shape = super().validate(shape, dtype)
        rows, cols = shape
        if cols > MAX_ROW:
            raise InvalidInput(
                f"sort sorts rows of at most {MAX_ROW} keys in shared memory, got cols={cols}; "
                "sort longer arrays one at a time with sort_1d"
            )
        if rows > limits.INT32_MAX:
            raise InvalidInput(f"sort takes at most {limits.INT32_MAX} rows, got {rows}")
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; ``MIN_BLOCKS * BLOCK``
        over 2048 threads per SM; ITEMS keys that would not fit the registers the launch bounds
        leave; a block buffer ``C = BLOCK * ITEMS`` smaller than ``next_pow2(cols)``."""
        try:
            _, cols = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
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
        """8 keys per thread with warp shuffles; 128 threads for rows up to 1024 keys (several
        rows per block), else just enough threads for one row."""
        _, cols = self.validate(shape, dtype)
        block = min(1024, max(128, next_pow2(cols) // 8))
        config = {"BLOCK": block, "ITEMS": 8, "WARP_SHFL": 1, "SMEM_FUSE": 2}
        assert self.check(config, shape, dtype) is None, self.check(config, shape, dtype)
        return config

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        return _defines(self, config, dtype, sort_1d=False)

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """One block per ``C / next_pow2(cols)`` rows (at most MAX_GRID blocks, grid stride)."""
        rows, cols = shape
        per_block = capacity(config) // next_pow2(cols)
        grid = min(math.ceil(rows / per_block), MAX_GRID)
        return Launch((grid, 1, 1), (config["BLOCK"], 1, 1), shared_bytes(config))

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Keys from :func:`make_keys`; y pre-filled with NaN (floats) or a poison int."""
        rows, cols = self.validate(shape, dtype)
        x = make_keys(rows * cols, dtype, rng).reshape(rows, cols)
        y = _poisoned((rows, cols), dtype)
        return Problem(
            args=[x, y, np.int32(rows), np.int32(cols), np.int32(dtype == "float32")],
            outputs=[1],
            references=[sort_reference(x)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """Exact: the output is a permutation of the input."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"sort does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        rows, cols = shape
        return 2 * rows * cols * 4


class Sort1dSpec(OperatorSpec):
    """Sort one long array of n 32-bit keys ascending: block sorts + global bitonic merges."""

    name = "sort_1d"
    description = "ascending bitonic sort of one array of n 32-bit keys (block sorts + merges)"
    dtypes = KEY_DTYPES
    rank = 1
    shape_names = ("n",)
    params = {
        "BLOCK": (128, 256, 512, 1024),
        "ITEMS": (2, 4, 8),
        "WARP_SHFL": (0, 1),
        "SMEM_FUSE": (1, 2),
        "FUSE": (1, 2, 3),
    }
    template = Path(__file__).with_name("sort.cu")
    kernel_name = "sort_1d_block"
    kernel_names = (
        "sort_1d_block",
        "sort_1d_merge",
        "sort_1d_global1",
        "sort_1d_global2",
        "sort_1d_global3",
    )

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        shape = super().validate(shape, dtype)
        if shape[0] > MAX_N:
            raise InvalidInput(f"sort_1d takes at most 2**40 keys, got n={shape[0]}")
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; ``MIN_BLOCKS * BLOCK``
        over 2048 threads per SM; ITEMS keys that would not fit the registers the launch bounds
        leave. Every such config sorts every n."""
        try:
            self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        return _check_common(self, config)

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """8192-key blocks (1024 threads x 8 keys), warp shuffles, 3 strides per global pass."""
        self.validate(shape, dtype)
        return {"BLOCK": 1024, "ITEMS": 8, "WARP_SHFL": 1, "SMEM_FUSE": 2, "FUSE": 3}

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """FUSE only changes the launch sequence, not the source."""
        return _defines(self, config, dtype, sort_1d=True)

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """The block-sort step: one block per C keys (MAX_GRID at most, grid stride)."""
        (n,) = shape
        grid = min(math.ceil(n / capacity(config)), MAX_GRID)
        return Launch((grid, 1, 1), (config["BLOCK"], 1, 1), shared_bytes(config))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """Block sort, then per merge size k = 2C .. next_pow2(n): global passes of up to FUSE
        strides (k/2 .. C), then the shared-memory merge of strides C/2 .. 1.

        Arguments are indices into the problem's args ``[x, y, n, 0, 1, 2, ..., 63]`` (int32
        scalars 0..63 at index 3 + value): ``sort_1d_block(x, y, n, log2seg, key_float)``,
        ``sort_1d_global<F>(y, n, hi, flip, key_float)``, ``sort_1d_merge(y, n, key_float)``
        (key_float 1 for float32 keys, 0 for int32: both key types share one compiled kernel).
        """
        (n,) = shape
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
        """Keys from :func:`make_keys`; y poisoned; scalars n (int64) and 0..63 (int32)."""
        (n,) = self.validate(shape, dtype)
        x = make_keys(n, dtype, rng)
        y = _poisoned((n,), dtype)
        scalars = [np.int32(v) for v in range(64)]
        return Problem(
            args=[x, y, np.int64(n), *scalars],
            outputs=[1],
            references=[sort_reference(x)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        if dtype not in self.dtypes:
            raise InvalidInput(f"sort_1d does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once and y written once (the minimum; the merge passes move much more)."""
        return 2 * shape[0] * 4

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        return 2 * shape[0] * 4


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
