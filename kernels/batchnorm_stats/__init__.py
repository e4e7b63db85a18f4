"""BatchNorm training-mode statistics of an NCHW tensor: the spec of ``batchnorm_stats.cu``.

Per channel: mean, biased variance and ``invstd = 1 / sqrt(var + eps)`` (float32), as
``torch.batch_norm_stats(x, eps)`` (which returns ``(mean, invstd)``). One read of x: Welford
partials per thread, Chan merges across lanes, warps and the SPLIT blocks of a channel.

Kernel arguments (:attr:`Problem.args` order, the same for every kernel):
``x, mean, var, invstd, workspace, counters, N, C, HW, eps`` with ``workspace`` float32
``C * MAX_SPLIT * 3`` (one (count, mean, M2) partial per block) and ``counters`` uint32 ``C + 1``
(zero at the start; the single-pass kernel leaves them zero after every call).

Parameter space (Kernel Tuner key order):

- ``BLOCK_SIZE``: threads per block.
- ``VEC``: elements per vector load over H*W, at most 16 bytes. Where ``HW % VEC != 0`` the
  source is rendered with ``PLANE_SPLIT=1``: the (n, c) planes then start off vector boundaries,
  and each is read as a scalar head, aligned vectors and a scalar tail
  (``kernels/common/kato_plane.cuh``), so every VEC is valid on every shape.
- ``UNROLL``: vectors each thread loads per step (bytes in flight per thread).
- ``STRATEGY``: 0 = two kernels (partials to the workspace, then a finalize kernel merges them);
  1 = one kernel, the last block of each channel merges (``__threadfence`` + ``atomicInc``).
  Does not change the source (both kernels are always compiled).
- ``SPLIT``: blocks per channel (grid = C * SPLIT); SPLIT=1 writes the outputs directly.
  Does not change the source.
- ``MIN_BLOCKS``: the min-blocks clause of ``__launch_bounds__`` (0 = none), rendered as 0 where
  it would not lower the register cap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits, parallel
from kato.kernels.parallel import fill_rows, run_chunks
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Problem, Step

#: N, C and H*W are ``int`` kernel arguments; (n, j) indices run a little past N and H*W.
MAX_DIM = 2**30
#: The largest SPLIT of the space: the workspace holds C * MAX_SPLIT partials.
MAX_SPLIT = 256
#: The default config's target for channels x SPLIT x BLOCK_SIZE (see ``default_config``).
THREADS_IN_FLIGHT = 132 * 1024
#: Threads per block of the finalize kernel (a warp per channel).
FINALIZE_THREADS = 256
#: Registers the kernel needs besides the UNROLL raw vectors in flight and one vector of
#: unpacked floats (fit to ptxas reports on sm_90: at a cap of 64 registers steps of up to 24
#: registers compile without spills; at a cap of 32 even 5 spill, so no config fits there).
REGISTER_OVERHEAD = 32
#: Further registers per vector in flight of a pass rendered with PLANE_SPLIT (the slot's span
#: in the plane, or its wider address), fit to ptxas reports on sm_90 like REGISTER_OVERHEAD
#: (docs/design.md, "Planes that are not whole vectors").
PLANE_SPLIT_REGISTERS = 1
EPS = 1e-5

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


def register_cap(config: Config) -> int:
    """Registers per thread ptxas may use under ``__launch_bounds__`` (multiple of 8, <= 255)."""
    return limits.launch_bounds_register_cap(config["BLOCK_SIZE"], config["MIN_BLOCKS"])


def effective_min_blocks(config: Config) -> int:
    """MIN_BLOCKS as rendered: 0 where it would not lower the register cap."""
    if config["MIN_BLOCKS"] and register_cap(config) < register_cap({**config, "MIN_BLOCKS": 0}):
        return config["MIN_BLOCKS"]
    return 0


def step_registers(config: Config, itemsize: int, plane_split: bool = False) -> int:
    """Registers one step holds: UNROLL raw vectors in flight plus one vector of floats, and
    with ``plane_split`` (HW % VEC != 0) :data:`PLANE_SPLIT_REGISTERS` per vector."""
    raw = config["UNROLL"] * config["VEC"] * itemsize
    regs = raw // 4 + (raw % 4 != 0) + config["VEC"]
    return regs + (config["UNROLL"] * PLANE_SPLIT_REGISTERS if plane_split else 0)


def static_shared_bytes(config: Config, kernel: str = "batchnorm_stats_partial") -> int:
    """Static shared memory: (count, mean, M2) per warp, plus the fused kernel's flag."""
    if kernel == "batchnorm_stats_finalize":
        return 0
    base = 12 * (config["BLOCK_SIZE"] // 32)
    return base + 1 if kernel == "batchnorm_stats_fused" else base  # + the bool flag


class BatchNormStatsSpec(OperatorSpec):
    """Per-channel mean / biased variance / invstd of an NCHW tensor (training-mode BatchNorm)."""

    name = "batchnorm_stats"
    description = (
        "batchnorm training statistics of an NCHW tensor: per-channel mean, biased variance "
        "and invstd (float32), one pass, Welford partials merged across blocks"
    )
    dtypes = ("float32", "float16", "bfloat16")
    rank = 4
    shape_names = ("N", "C", "H", "W")
    params = {
        "BLOCK_SIZE": (128, 256, 512, 1024),
        "VEC": (1, 2, 4, 8),
        "UNROLL": (2, 4),
        "STRATEGY": (0, 1),
        "SPLIT": (1, 2, 4, 8, 16, 32, 64, 128, 256),
        "MIN_BLOCKS": (0, 2),
    }
    template = Path(__file__).with_name("batchnorm_stats.cu")
    kernel_name = "batchnorm_stats_partial"
    kernel_names = (
        "batchnorm_stats_partial",
        "batchnorm_stats_finalize",
        "batchnorm_stats_fused",
    )

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: N, C and H*W at most 2**30 (``int`` indices with headroom)."""
        shape = super().validate(shape, dtype)
        n, c, h, w = shape
        if n > MAX_DIM or c > MAX_DIM or h * w > MAX_DIM:
            raise InvalidInput(
                f"batchnorm_stats takes N, C and H*W up to 2**30 each, got N={n}, C={c}, "
                f"H*W={h * w}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        ``MIN_BLOCKS * BLOCK_SIZE`` over 2048 threads per SM; a grid of ``C * SPLIT`` over
        2**31 - 1 blocks; a step's registers (:func:`step_registers`, with the plane split's
        where ``HW % VEC != 0``) plus REGISTER_OVERHEAD over the launch bounds' cap (it would
        spill). Any VEC may leave H*W a partial vector: that renders the plane split.
        """
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            _, c, h, w = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        itemsize = DTYPES[dtype][2]
        block, vec, min_blocks = config["BLOCK_SIZE"], config["VEC"], config["MIN_BLOCKS"]
        vector_bytes = vec * itemsize
        if reason := limits.vector_width_error(vec, vector_bytes, dtype):
            return reason
        if reason := limits.resident_threads_error(min_blocks, block):
            return reason
        if c * config["SPLIT"] > limits.MAX_GRID_X:
            return f"C * SPLIT = {c * config['SPLIT']} blocks exceed the grid limit 2**31-1"
        regs = step_registers(config, itemsize, (h * w) % vec != 0)
        cap = register_cap(config)
        if regs + REGISTER_OVERHEAD > cap:
            return (
                f"UNROLL={config['UNROLL']} vectors of {vec} elements hold {regs} registers per "
                f"thread, but the launch bounds allow {cap}: it would spill"
            )
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """The widest vector dividing H*W, 4 vectors in flight, single pass; blocks of 512
        threads (256 or 128 where a channel has fewer than 16 vectors per thread of them), and
        SPLIT blocks per channel doubled while the grid stays within about 132 x 1024 threads
        (a block of 1024 per SM of an H200, half its resident threads) and each block keeps
        >= 4 vectors per thread. More threads than that only add partial sums to combine: on
        the H200's recorded spaces the best configs all have channels x SPLIT x BLOCK_SIZE
        near 131072 (how close the rule comes to each optimum: docs/defaults.md).
        """
        n, c, h, w = self.validate(shape, dtype)
        itemsize = DTYPES[dtype][2]
        hw = h * w
        vec = max(v for v in self.params["VEC"] if v * itemsize <= 16 and hw % v == 0)
        vectors = n * hw // vec  # per channel
        block = next((b for b in (512, 256) if vectors >= 16 * b), 128)
        split = 1
        while (
            split < MAX_SPLIT
            and c * 2 * split * block <= THREADS_IN_FLIGHT
            and vectors // (2 * split) >= 4 * block
        ):
            split *= 2
        config = {
            "BLOCK_SIZE": block,
            "VEC": vec,
            "UNROLL": 4,
            "STRATEGY": 1,
            "SPLIT": split,
            "MIN_BLOCKS": 0,
        }
        reason = self.check(config, shape, dtype)
        if reason is not None:  # unreachable for a valid shape
            raise AssertionError(f"no default batchnorm_stats config for {tuple(shape)}: {reason}")
        return config

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """BLOCK_SIZE, VEC, UNROLL, effective MIN_BLOCKS, DTYPE, IS_HALF, IS_BF16, and
        PLANE_SPLIT=1 where ``H*W % VEC != 0`` (only there: the planes of whole vectors render
        the source they always did). The source depends on the shape only through that, and
        not on STRATEGY and SPLIT."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {
            "BLOCK_SIZE": config["BLOCK_SIZE"],
            "VEC": config["VEC"],
            "UNROLL": config["UNROLL"],
            "MIN_BLOCKS": effective_min_blocks(config),
            "DTYPE": DTYPES[dtype][1],
            "IS_HALF": is_half,
            "IS_BF16": is_bf16,
        }
        if shape[2] * shape[3] % config["VEC"] != 0:
            macros["PLANE_SPLIT"] = 1
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Partial / fused kernel: exactly ``C * SPLIT`` blocks of BLOCK_SIZE threads."""
        c = shape[1]
        return Launch(grid=(c * config["SPLIT"], 1, 1), block=(config["BLOCK_SIZE"], 1, 1))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """SPLIT=1: the partial kernel alone (it writes the outputs). STRATEGY 0: partial, then
        finalize (``ceil(C / 8)`` blocks of 256 threads). STRATEGY 1: the fused kernel."""
        main = self.launch(config, shape, dtype)
        if config["SPLIT"] == 1:
            return [Step("batchnorm_stats_partial", main)]
        if config["STRATEGY"] == 1:
            return [Step("batchnorm_stats_fused", main)]
        c = shape[1]
        warps = FINALIZE_THREADS // 32
        finalize = Launch(
            grid=(min(math.ceil(c / warps), limits.MAX_GRID_X), 1, 1),
            block=(FINALIZE_THREADS, 1, 1),
        )
        return [Step("batchnorm_stats_partial", main), Step("batchnorm_stats_finalize", finalize)]

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x = scale_c * N(0, 1) + offset_c per channel; outputs pre-filled with NaN.

        Channels 0, 4, 8, ... get a large offset with a small spread (float32: 1e4 + N(0, 1),
        where E[x^2] - E[x]^2 in float32 loses the variance entirely; float16/bfloat16:
        1e3 + 8 N(0, 1)); the others U(-5, 5) + U(0.1, 4) * N(0, 1). Workspace and counters
        start at zero (the counters must). References: float64 of x as stored.
        """
        n, c, h, w = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-5.0, 5.0, size=(1, c, 1, 1)).astype(np.float32)
        scales = rng.uniform(0.1, 4.0, size=(1, c, 1, 1)).astype(np.float32)
        offsets[:, 0::4] = 1e4 if dtype == "float32" else 1e3
        scales[:, 0::4] = 1.0 if dtype == "float32" else 8.0
        x = np.empty((n, c, h, w), dtype=np_dtype)

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # images of x
            x32 = gen.standard_normal((chunk.stop - chunk.start, c, h, w), dtype=np.float32)
            x32 *= scales
            x32 += offsets
            x[chunk] = x32

        fill_rows(rng, n, c * h * w, fill)
        mean = np.full(c, np.nan, dtype=np.float32)
        var = np.full(c, np.nan, dtype=np.float32)
        invstd = np.full(c, np.nan, dtype=np.float32)
        workspace = np.zeros(c * MAX_SPLIT * 3, dtype=np.float32)
        counters = np.zeros(c + 1, dtype=np.uint32)
        ref_mean, ref_var, ref_invstd = batchnorm_stats_reference(x, EPS)
        return Problem(
            args=[
                x,
                mean,
                var,
                invstd,
                workspace,
                counters,
                np.int32(n),
                np.int32(c),
                np.int32(h * w),
                np.float32(EPS),
            ],
            outputs=[1, 2, 3],
            references=[ref_mean, ref_var, ref_invstd],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of every output (float32 for every input type): float32 Welford/Chan
        over up to ~1e8 elements per channel is good to ~1e-6 relative; atol 1e-5 covers means
        near zero (channels of mean ~0 and values of magnitude ~10)."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"batchnorm_stats does not support dtype {dtype!r}")
        return (1e-5, 1e-5)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read once (the outputs, 12 bytes per channel, are negligible and not counted)."""
        n, c, h, w = shape
        return n * c * h * w * DTYPES[dtype][2]

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """x, three outputs, the workspace and the counters."""
        c = shape[1]
        return self.bytes_moved(shape, dtype) + 12 * c + 12 * c * MAX_SPLIT + 4 * (c + 1)


def batchnorm_stats_reference(x: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    """Float64 per-channel (mean, biased var, invstd) of an NCHW array, a few channels at a
    time (a float64 copy of a whole benchmark-size tensor would need gigabytes), the groups of
    channels on several threads (:func:`kernels.parallel.run_chunks`)."""
    n, c, h, w = x.shape
    mean = np.empty(c)
    var = np.empty(c)
    step = max(1, parallel.CHUNK_ELEMENTS // max(n * h * w, 1))

    def channels(i: int) -> None:  # channels [c0, c0 + step), on one of the threads
        c0 = i * step
        chunk = x[:, c0 : c0 + step].astype(np.float64)
        m = chunk.mean(axis=(0, 2, 3))
        chunk -= m[None, :, None, None]
        chunk *= chunk
        mean[c0 : c0 + step] = m
        var[c0 : c0 + step] = chunk.mean(axis=(0, 2, 3))

    run_chunks(channels, -(-c // step), chunk_bytes=8 * step * n * h * w)
    return mean, var, 1.0 / np.sqrt(var + eps)


register(BatchNormStatsSpec())
