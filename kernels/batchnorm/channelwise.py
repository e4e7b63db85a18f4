"""What the two training batchnorm operators (``batchnorm``, ``batchnorm_backward``) share: their
NCHW shape, the per-channel reduction of :mod:`kernels.batchnorm_stats` (SPLIT blocks per
channel, merged by a finalize kernel or by the channel's last block) followed by an elementwise
pass over the channel, the parameter space and its constraints, and the launch steps.

Each operator's template has four kernels, ``<prefix>_partial``, ``<prefix>_finalize``,
``<prefix>_fused`` (the reduction, as batchnorm_stats' partial / finalize / fused) and
``<prefix>_apply`` (the elementwise pass), all taking the same arguments. Parameters (Kernel
Tuner key order):

- ``BLOCK_SIZE``, ``VEC``, ``UNROLL``, ``STRATEGY``, ``SPLIT``, ``MIN_BLOCKS``: the reduction's,
  as batchnorm_stats' (``UNROLL`` also sets the elementwise pass's vectors in flight).
- ``APPLY``: 0 = the elementwise pass is its own kernel (``<prefix>_apply``); 1 = the block that
  finished the channel's reduction (the only one with SPLIT=1, the last one with STRATEGY 1)
  runs it over the whole channel: one launch instead of two, and the second read of the channel
  comes from L2 while it is there, but a channel is then one block's work.
- ``APPLY_BLOCK``: threads per block of ``<prefix>_apply`` (launch geometry only: the kernel is
  compiled for up to 1024). Only APPLY=0 launches it, so APPLY=1 takes the first value alone.
- ``APPLY_VEC``: elements per vector of the elementwise pass.

VEC and APPLY_VEC need not divide H*W: where one does not, its pass is rendered with
``PLANE_SPLIT=1`` (``APPLY_PLANE_SPLIT=1``) and reads each (n, c) plane as a scalar head, aligned
vectors and a scalar tail (``kernels/common/kato_plane.cuh``); shapes whose planes are whole
vectors render no such macro and the source they always did.

The apply kernel's grid is C times :func:`apply_split` blocks, derived from the shape (at least
two waves of resident blocks, at most one block per ``APPLY_BLOCK * UNROLL`` vectors of a
channel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kato.kernels import limits
from kato.kernels.batchnorm_stats import (
    MAX_DIM,
    PLANE_SPLIT_REGISTERS,
    effective_min_blocks,
    register_cap,
)
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Step

#: Threads per block of the finalize kernels (a warp per channel).
FINALIZE_THREADS = 256
#: ``__launch_bounds__`` of the apply kernels: every APPLY_BLOCK of the space runs under it.
APPLY_MAX_THREADS = 1024
#: The apply kernels' register cap (``__launch_bounds__(1024)``).
APPLY_REGISTER_CAP = limits.launch_bounds_register_cap(APPLY_MAX_THREADS, 0)
#: Waves of resident apply blocks the derived apply grid covers at least (where the channels
#: have that many vectors): enough blocks per SM to hide latency, few enough that each thread
#: streams several steps.
APPLY_WAVES = 2

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


def raw_registers(vec: int, itemsize: int) -> int:
    """32-bit registers of one raw vector of ``vec`` elements."""
    raw = vec * itemsize
    return raw // 4 + (raw % 4 != 0)


def apply_split(config: Config, shape: Sequence[int]) -> int:
    """Blocks per channel of the apply kernel: enough for :data:`APPLY_WAVES` waves of resident
    APPLY_BLOCK-thread blocks over the largest GPU's SMs, at most one per APPLY_BLOCK * UNROLL
    vectors of a channel (each thread then has a full step), at least 1, and within the grid
    limit."""
    n, c, h, w = shape
    block = config["APPLY_BLOCK"]
    resident = limits.NUM_SMS * (limits.MAX_THREADS_PER_SM // block) * APPLY_WAVES
    vectors = n * h * w // config["APPLY_VEC"]
    split = min(math.ceil(resident / c), math.ceil(vectors / (block * config["UNROLL"])))
    return max(1, min(split, limits.MAX_GRID_X // c))


class ChannelwiseSpec(OperatorSpec):
    """The shared part of the training batchnorm specs. Subclasses set the
    :class:`~kernels.spec.OperatorSpec` attributes and:

    Attributes:
        prefix: the kernels' name prefix (``batchnorm_fwd``).
        arrays: element-type arrays each thread streams per step (x; or x and dy).
        register_overhead: registers the reduction kernels need besides a step's vectors.
        apply_overhead: the same for the elementwise pass.
    """

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
        "APPLY": (0, 1),
        "APPLY_BLOCK": (256, 512, 1024),
        "APPLY_VEC": (1, 2, 4, 8),
    }
    prefix: str
    arrays: int = 1
    register_overhead: int = 32
    apply_overhead: int = 32

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: N, C and H*W at most 2**30 (``int`` indices with headroom)."""
        shape = super().validate(shape, dtype)
        n, c, h, w = shape
        if n > MAX_DIM or c > MAX_DIM or h * w > MAX_DIM:
            raise InvalidInput(
                f"{self.name} takes N, C and H*W up to 2**30 each, got N={n}, C={c}, H*W={h * w}"
            )
        return shape

    def reduction_registers(self, config: Config, itemsize: int, plane_split: bool = False) -> int:
        """Registers one reduction step holds: UNROLL raw vectors per array in flight, plus one
        vector of floats per array; with ``plane_split`` (HW % VEC != 0) PLANE_SPLIT_REGISTERS
        per vector in flight."""
        raw = raw_registers(config["VEC"], itemsize)
        regs = self.arrays * (config["UNROLL"] * raw + config["VEC"])
        return regs + (config["UNROLL"] * PLANE_SPLIT_REGISTERS if plane_split else 0)

    def apply_registers(self, config: Config, itemsize: int, plane_split: bool = False) -> int:
        """Registers one elementwise step holds: UNROLL raw vectors per array and their
        addresses (two registers each, PLANE_SPLIT_REGISTERS more with ``plane_split``: HW %
        APPLY_VEC != 0, the address a slot), plus one vector of floats per array."""
        raw = raw_registers(config["APPLY_VEC"], itemsize)
        address = 2 + (PLANE_SPLIT_REGISTERS if plane_split else 0)
        return config["UNROLL"] * (self.arrays * raw + address) + self.arrays * config["APPLY_VEC"]

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; a shape :meth:`validate`
        refuses; VEC or APPLY_VEC over 16 bytes; ``MIN_BLOCKS * BLOCK_SIZE`` over 2048 threads
        per SM; ``C * SPLIT`` over the grid limit; APPLY=1 with two-kernel merging of several
        blocks (STRATEGY 0, SPLIT > 1: no block holds the channel's result); APPLY=1 with
        another APPLY_BLOCK than the first (it launches no apply kernel: a duplicate); a step's
        registers plus the kernel's overhead over its launch bounds' cap (it would spill; a
        pass whose vector does not divide H*W counts its plane split's registers). VEC and
        APPLY_VEC need not divide H*W.
        """
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            _, c, h, w = self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        itemsize = DTYPES[dtype][2]
        hw = h * w
        for name in ("VEC", "APPLY_VEC"):
            vec = config[name]
            if reason := limits.vector_width_error(vec, vec * itemsize, dtype):
                return f"{name}: {reason}"
        block, min_blocks = config["BLOCK_SIZE"], config["MIN_BLOCKS"]
        if reason := limits.resident_threads_error(min_blocks, block):
            return reason
        if c * config["SPLIT"] > limits.MAX_GRID_X:
            return f"C * SPLIT = {c * config['SPLIT']} blocks exceed the grid limit 2**31-1"
        if config["APPLY"] == 1:
            if config["STRATEGY"] == 0 and config["SPLIT"] > 1:
                return (
                    "APPLY=1 runs the elementwise pass in the block that merged the channel: "
                    "STRATEGY=0 with SPLIT > 1 merges in the finalize kernel (use STRATEGY=1)"
                )
            if config["APPLY_BLOCK"] != self.params["APPLY_BLOCK"][0]:
                return (
                    "APPLY_BLOCK sizes the separate apply kernel, which APPLY=1 does not launch: "
                    f"only APPLY_BLOCK={self.params['APPLY_BLOCK'][0]} is a distinct config"
                )
        cap = register_cap(config)
        split = hw % config["VEC"] != 0
        regs = self.reduction_registers(config, itemsize, split) + self.register_overhead
        if regs > cap:
            return (
                f"UNROLL={config['UNROLL']} vectors of {config['VEC']} elements need about "
                f"{regs} registers per thread, but the launch bounds allow {cap}: it would spill"
            )
        apply_cap = cap if config["APPLY"] == 1 else APPLY_REGISTER_CAP
        split = hw % config["APPLY_VEC"] != 0
        regs = self.apply_registers(config, itemsize, split) + self.apply_overhead
        if regs > apply_cap:
            return (
                f"the elementwise pass's UNROLL={config['UNROLL']} vectors of "
                f"{config['APPLY_VEC']} elements need about {regs} registers per thread, but "
                f"its launch bounds allow {apply_cap}: it would spill"
            )
        return None

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """BLOCK_SIZE, VEC, UNROLL, effective MIN_BLOCKS, APPLY, APPLY_VEC, DTYPE, IS_HALF,
        IS_BF16, and PLANE_SPLIT=1 (APPLY_PLANE_SPLIT=1) where VEC (APPLY_VEC) does not divide
        H*W, only there. The source depends on the shape only through those, and not on
        STRATEGY, SPLIT and APPLY_BLOCK."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {
            "BLOCK_SIZE": config["BLOCK_SIZE"],
            "VEC": config["VEC"],
            "UNROLL": config["UNROLL"],
            "MIN_BLOCKS": effective_min_blocks(config),
            "APPLY": config["APPLY"],
            "APPLY_VEC": config["APPLY_VEC"],
            "DTYPE": DTYPES[dtype][1],
            "IS_HALF": is_half,
            "IS_BF16": is_bf16,
        }
        hw = shape[2] * shape[3]
        if hw % config["VEC"] != 0:
            macros["PLANE_SPLIT"] = 1
        if hw % config["APPLY_VEC"] != 0:
            macros["APPLY_PLANE_SPLIT"] = 1
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Partial / fused kernel: exactly ``C * SPLIT`` blocks of BLOCK_SIZE threads."""
        c = shape[1]
        return Launch(grid=(c * config["SPLIT"], 1, 1), block=(config["BLOCK_SIZE"], 1, 1))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """The reduction: SPLIT=1: the partial kernel alone (it finishes its channel);
        STRATEGY 0: partial, then finalize (``ceil(C / 8)`` blocks of 256 threads); STRATEGY 1:
        the fused kernel. Then, with APPLY=0, the apply kernel: ``C * apply_split`` blocks of
        APPLY_BLOCK threads."""
        main = self.launch(config, shape, dtype)
        p = self.prefix
        if config["SPLIT"] == 1:
            steps = [Step(f"{p}_partial", main)]
        elif config["STRATEGY"] == 1:
            steps = [Step(f"{p}_fused", main)]
        else:
            warps = FINALIZE_THREADS // 32
            finalize = Launch(
                grid=(min(math.ceil(shape[1] / warps), limits.MAX_GRID_X), 1, 1),
                block=(FINALIZE_THREADS, 1, 1),
            )
            steps = [Step(f"{p}_partial", main), Step(f"{p}_finalize", finalize)]
        if config["APPLY"] == 0:
            grid = shape[1] * apply_split(config, shape)
            steps.append(Step(f"{p}_apply", Launch((grid, 1, 1), (config["APPLY_BLOCK"], 1, 1))))
        return steps

    def with_apply(self, stats: Config, shape: Sequence[int], dtype: str) -> Config:
        """The default's elementwise parameters added to a reduction config ``stats``
        (batchnorm_stats' default, measured on the H200): APPLY=1 where each channel is one
        block's work anyway (SPLIT=1: one launch, and the block's second read of its channel
        comes from L2), else a separate pass of 512-thread blocks; APPLY_VEC = VEC (the widest
        that divides H*W), narrower, then with UNROLL 2, where the registers do not allow it."""
        apply = 1 if stats["SPLIT"] == 1 else 0
        tried = []
        for unroll in (stats["UNROLL"], 2):
            for vec in (v for v in (8, 4, 2, 1) if v <= stats["VEC"]):
                config = {
                    **stats,
                    "UNROLL": unroll,
                    "APPLY": apply,
                    "APPLY_BLOCK": 256 if apply else 512,
                    "APPLY_VEC": vec,
                }
                reason = self.check(config, shape, dtype)
                if reason is None:
                    return config
                tried.append(reason)
        raise AssertionError(f"no default {self.name} config for {tuple(shape)}: {tried[-1]}")
