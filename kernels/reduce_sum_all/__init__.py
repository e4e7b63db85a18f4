"""Sum of all elements of a 1-D array into one float32: the spec of ``reduce_sum_all.cu``.

Parameter space (Kernel Tuner key order):

- ``BLOCK_SIZE``: threads per block.
- ``VEC``: elements per vector load (at most 16 bytes). Any ``n`` works with any VEC: the
  ``n % VEC`` elements after the last whole vector are added by the first ``n % VEC`` threads.
- ``UNROLL``: vectors loaded per thread per step of the grid-stride loop (bytes in flight).
- ``BLOCKS_PER_SM``: the grid is ``min(BLOCKS_PER_SM * 132, blocks needed)`` (132 = the H200's
  SM count, the largest supported GPU; on smaller GPUs the same grid is simply more waves).
  Launch geometry only: it does not change the source.
- ``FINISH``: 0 = two-phase (block partials to a workspace, a second one-block kernel sums
  them; deterministic); 1 = atomic (an init kernel zeroes the output, blocks ``atomicAdd`` their
  partials; order not deterministic); 2 = last block done (``__threadfence`` + ticket counter;
  the last block sums the partials with FINISH 0's tree; deterministic, one kernel).

Input float32, float16 or bfloat16; accumulation and the OUTPUT are float32 for every input
type (a bfloat16 sum of 2**28 elements would keep 8 bits; the caller rounds if it wants).

Accuracy: per thread, each step's ``UNROLL * VEC`` values are summed pairwise (each vector,
then the vector sums) and the step sums are Kahan-accumulated; then butterfly trees across the
warp, the block and the grid. The error is a few dozen roundings of ``sum |x|`` at most,
independent of ``n`` (a serial float32 sum is off by ~``n`` roundings: at 2**26 positive values,
by whole percent). ``summation_model`` below reproduces the deterministic variants' float32
arithmetic exactly.

Problem arguments: ``[x, out (float32[1]), partials (float32[MAX_GRID]), counter (uint32[2]),
n (int64)]``; ``counter`` must be 0 before the first launch (the last block resets it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.parallel import fill_rows, row_chunks
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Problem, Step

#: The kernel indexes with long long; keep n well inside it (slot + grid-stride step).
MAX_N = 2**62
#: float32 unit roundoff.
EPS32 = 2.0**-24
#: Tolerance: this many roundings of sum |x| (the model's worst case is ~30; FINISH 1's atomic
#: chain of up to MAX_GRID partials adds a random walk of ~sqrt(MAX_GRID) more).
ERROR_ROUNDINGS = 256
#: Sentinels at each end of x and at random positions (:meth:`ReduceSumAllSpec.make_problem`).
SENTINELS = 32

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


class ReduceSumAllSpec(OperatorSpec):
    """Sum of every element of x (shape (n,)) into one float32."""

    name = "reduce_sum_all"
    description = "sum of all elements of a 1-D array into one float32 (float32 accumulation)"
    dtypes = ("float32", "float16", "bfloat16")
    rank = 1
    shape_names = ("n",)
    params = {
        "BLOCK_SIZE": (128, 256, 512, 1024),
        "VEC": (2, 4, 8),
        "UNROLL": (2, 4, 8),
        "BLOCKS_PER_SM": (1, 2, 4, 8, 16, 32),
        "FINISH": (0, 1, 2),
    }
    template = Path(__file__).with_name("reduce_sum_all.cu")
    kernel_name = "reduce_sum_all_kernel"
    kernel_names = ("reduce_sum_all_kernel", "reduce_sum_all_finish", "reduce_sum_all_init")

    #: Size of the partials workspace: the largest grid of the space.
    MAX_GRID = max(params["BLOCKS_PER_SM"]) * limits.NUM_SMS

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        shape = super().validate(shape, dtype)
        if shape[0] > MAX_N:
            raise InvalidInput(f"reduce_sum_all takes up to 2**62 elements, got n={shape[0]}")
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes.

        Everything else runs correctly for every n (tails are handled in the kernel, the loop is
        grid-stride, block sizes and registers fit: ptxas reports <= 64 registers, under the cap
        of 64 that ``__launch_bounds__(1024)`` sets).
        """
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        vector_bytes = config["VEC"] * DTYPES[dtype][2]
        if reason := limits.vector_width_error(config["VEC"], vector_bytes, dtype):
            return reason
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """16-byte vectors, 4 per thread in flight (64 KiB per SM), 256 threads, 4 blocks per
        SM (one wave: every block resident at once at <= 64 registers), last-block-done finish
        (one launch, deterministic). Where n gives fewer than those 4 blocks per SM a full step
        each (under 8 MiB), 128 threads with 2 vectors in flight: 4 times the blocks, so a few
        MiB still spread over every SM."""
        self.validate(shape, dtype)
        vec = 16 // DTYPES[dtype][2]
        config = {"BLOCK_SIZE": 256, "VEC": vec, "UNROLL": 4, "BLOCKS_PER_SM": 4, "FINISH": 2}
        if self.grid(config, shape) < config["BLOCKS_PER_SM"] * limits.NUM_SMS:
            config.update(BLOCK_SIZE=128, UNROLL=2)
        return config

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """The tunables that shape the code (not BLOCKS_PER_SM: launch geometry only), then
        DTYPE, IS_HALF, IS_BF16. Independent of n: one compile serves every shape."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {
            name: config[name] for name in self.params if name != "BLOCKS_PER_SM"
        }
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        return macros

    def grid(self, config: Config, shape: Sequence[int]) -> int:
        """``min(BLOCKS_PER_SM * 132, blocks that have at least one step of work)``, >= 1."""
        (n,) = shape
        slots = math.ceil(n / config["VEC"])
        needed = math.ceil(slots / (config["BLOCK_SIZE"] * config["UNROLL"]))
        return max(1, min(config["BLOCKS_PER_SM"] * limits.NUM_SMS, needed))

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        return Launch(grid=(self.grid(config, shape), 1, 1), block=(config["BLOCK_SIZE"], 1, 1))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """FINISH 0: main kernel, then the finish kernel (one block) on (partials, out,
        counter). FINISH 1: init (one thread zeroes out), then the main kernel. FINISH 2: the
        main kernel alone."""
        main = Step(self.kernel_name, self.launch(config, shape, dtype), (0, 1, 2, 3, 4))
        if config["FINISH"] == 0:
            one_block = Launch(grid=(1, 1, 1), block=(config["BLOCK_SIZE"], 1, 1))
            return [main, Step("reduce_sum_all_finish", one_block, (2, 1, 3))]
        if config["FINISH"] == 1:
            one_thread = Launch(grid=(1, 1, 1), block=(1, 1, 1))
            return [Step("reduce_sum_all_init", one_thread, (1,)), main]
        return [main]

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x ~ U(0.5, 1.5) with a random quarter negated (positive-biased: a serial float32
        sum drifts far; the negated quarter adds cancellation); never zero. out pre-filled
        with NaN, partials with NaN, counter 0. Tolerance: ``ERROR_ROUNDINGS`` roundings of
        ``sum |x|`` (absolute).

        That tolerance grows with n (~1000 at 2**26), more than a few elements are worth, so
        sentinels make a skipped element visible where kernels skip them: the first and last
        ``SENTINELS`` elements (a missed vector head or remainder) and as many at random
        positions are :func:`sentinel_magnitude` (signs alternating), at least 8 tolerances."""
        (n,) = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        edges = np.unique(np.r_[np.arange(min(n, SENTINELS)), np.arange(max(n - SENTINELS, 0), n)])
        inside = rng.integers(0, n, size=SENTINELS)
        where = np.unique(np.r_[edges, inside])  # sorted
        signs = np.where(np.arange(where.size) % 2 == 0, 1.0, -1.0).astype(np.float32)
        sentinels = signs * np.float32(sentinel_magnitude(n, dtype))
        x = np.empty(n, dtype=np_dtype)
        chunks = row_chunks(n, 1)
        sums = np.empty((len(chunks), 2), dtype=np.float64)  # per chunk: sum x, sum |x|
        index = {chunk.start: i for i, chunk in enumerate(chunks)}

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            x32 = gen.uniform(0.5, 1.5, size=chunk.stop - chunk.start).astype(np.float32)
            np.negative(x32, out=x32, where=gen.random(x32.size, dtype=np.float32) < 0.25)
            lo, hi = np.searchsorted(where, [chunk.start, chunk.stop])
            x32[where[lo:hi] - chunk.start] = sentinels[lo:hi]
            x[chunk] = x32
            x64 = x[chunk].astype(np.float64)  # the values as stored
            sums[index[chunk.start]] = x64.sum(), np.abs(x64, out=x64).sum()

        fill_rows(rng, n, 1, fill)
        reference = np.array([sums[:, 0].sum()])
        abs_sum = float(sums[:, 1].sum())
        return Problem(
            args=[
                x,
                np.full(1, np.nan, dtype=np.float32),
                np.full(self.MAX_GRID, np.nan, dtype=np.float32),
                np.zeros(2, dtype=np.uint32),
                np.int64(n),
            ],
            outputs=[1],
            references=[reference],
            tolerances=[(sum_tolerance(abs_sum), 0.0)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """Default ``(atol, rtol)`` for a float32 sum; problems carry their own absolute
        tolerance scaled by ``sum |x|`` (:func:`sum_tolerance`)."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"reduce_sum_all does not support dtype {dtype!r}")
        return (1e-6, ERROR_ROUNDINGS * EPS32)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once (the partials and the 4-byte output are negligible)."""
        return shape[0] * DTYPES[dtype][2]

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        return self.bytes_moved(shape, dtype) + 4 * (self.MAX_GRID + 3)


def sentinel_magnitude(n: int, dtype: str) -> float:
    """The power of two a sentinel of :meth:`ReduceSumAllSpec.make_problem` has: at least 8
    times the tolerance of n elements of mean magnitude 1 plus the 3 * SENTINELS sentinels
    themselves (so that losing one fails verification), at least 64, and at most 2**15 for
    float16 (its largest power of two; from about n = 2**28 on, float16 sentinels are worth
    less than 8 tolerances)."""
    per_unit = 8 * ERROR_ROUNDINGS * EPS32  # 8 tolerances per unit of sum |x|
    magnitude = per_unit * 1.5 * n / (1 - per_unit * 3 * SENTINELS)
    exponent = max(6, math.ceil(math.log2(max(magnitude, 1.0))))
    return float(2 ** min(exponent, 15 if dtype == "float16" else 60))


def sum_tolerance(abs_sum: float) -> float:
    """Absolute tolerance of a float32 tree sum whose terms have ``sum |x| = abs_sum``."""
    return ERROR_ROUNDINGS * EPS32 * abs_sum + 1e-30


# --- an exact float32 model of the kernel's summation (used by the tests) -----------------------


def pairwise_in_place(f: np.ndarray) -> np.ndarray:
    """``f[..., i] += f[..., i + w]`` for w = N/2 .. 1 over the last axis (N a power of two):
    the kernel's ``vector_sum`` / ``pairwise``. Returns element 0 of the last axis."""
    f = f.copy()
    w = f.shape[-1] // 2
    while w > 0:
        f[..., :w] = f[..., :w] + f[..., w : 2 * w]
        w //= 2
    return f[..., 0]


def step_sum(f: np.ndarray) -> np.ndarray:
    """One step's sum of ``f[..., u, j]`` (vector u, element j): each vector pairwise, then the
    vector sums pairwise, as the kernel does."""
    return pairwise_in_place(pairwise_in_place(f))


def butterfly(v: np.ndarray, width: int = 32) -> np.ndarray:
    """``v += shfl_xor(v, o)`` for o = width/2 .. 1 over the last axis (groups of ``width``)."""
    v = v.copy()
    lanes = np.arange(v.shape[-1])
    o = width // 2
    while o > 0:
        v = v + v[..., lanes ^ o]
        o //= 2
    return v


def block_sum_model(v: np.ndarray) -> np.ndarray:
    """The kernel's ``block_sum`` on per-thread values ``v`` of shape (blocks, BLOCK_SIZE)."""
    blocks, block = v.shape
    warps = butterfly(v.reshape(blocks, block // 32, 32))[..., 0]  # warp sums
    if block == 32:
        return warps[:, 0]
    lanes = np.zeros((blocks, 32), dtype=np.float32)
    lanes[:, : block // 32] = warps
    return butterfly(lanes)[:, 0]


def summation_model(x: np.ndarray, config: Config, grid: int) -> np.float32:
    """The float32 result of FINISH 0 / 2 for input ``x`` (1-D, any float dtype), bit for bit."""
    block, vec, unroll = config["BLOCK_SIZE"], config["VEC"], config["UNROLL"]
    xf = x.astype(np.float32)
    n = xf.size
    nvec = n // vec
    threads = grid * block
    s = np.zeros(threads, dtype=np.float32)
    c = np.zeros(threads, dtype=np.float32)
    body = xf[: nvec * vec].reshape(nvec, vec)
    step = threads * unroll
    for base in range(0, nvec, step):
        f = np.zeros((threads, unroll, vec), dtype=np.float32)
        for u in range(unroll):
            lo = base + u * threads
            chunk = body[lo : min(lo + threads, nvec)]
            f[: len(chunk), u] = chunk
        total = step_sum(f)
        active = base + np.arange(threads) < nvec  # threads whose loop ran this step
        y = total - c
        t = s + y
        c = np.where(active, (t - s) - y, c)
        s = np.where(active, t, s)
    v = s - c
    tail = n - nvec * vec
    v[:tail] = v[:tail] + xf[nvec * vec :]
    partials = block_sum_model(v.reshape(grid, block))
    acc = np.zeros(block, dtype=np.float32)
    for i in range(0, grid, block):
        chunk = partials[i : i + block]
        acc[: len(chunk)] = acc[: len(chunk)] + chunk
    return block_sum_model(acc.reshape(1, block))[0]


REDUCE_SUM_ALL = register(ReduceSumAllSpec())

__all__ = [
    "REDUCE_SUM_ALL",
    "ReduceSumAllSpec",
    "block_sum_model",
    "butterfly",
    "pairwise_in_place",
    "step_sum",
    "sum_tolerance",
    "summation_model",
]
