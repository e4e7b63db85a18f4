"""Occupancy: how many blocks of a kernel fit on one SM at once, and what stops more fitting.

A Python port of the logic of ``cudaOccMaxActiveBlocksPerMultiprocessor`` in the CUDA toolkit's
``cuda_occupancy.h`` (the reference implementation behind NVIDIA's occupancy calculator), which
is what the driver's ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` answers; the check against
the driver on real hardware is ``benchmarks/occupancy_check.py``, its recorded table
``tests/tuner/data/occupancy_h200.json``. Four limits, the smallest wins:

- warps: ``max_warps_per_sm // ceil(threads / 32)``; 0 above 1024 threads per block.
- blocks: the architecture's resident-block limit (32 on Hopper).
- registers: registers are allocated per warp, ``regs * 32`` rounded up to 256; each of the 4
  SM sub-partitions holds ``(65536 / 4) // regs_per_warp`` warps. 0 when a block exceeds the
  65536-register per-block limit, checked both with the block's warps and with its warps
  rounded up to a multiple of 4 (the hardware's check).
- shared memory: a block takes ``static + dynamic + reserved`` bytes (1 KiB reserved by the
  driver per block on cc >= 8.0) rounded up to 128 bytes (256 before cc 8.0), out of the SM's
  shared-memory carveout. 0 when a block needs more than the opt-in per-block maximum.

Shared-memory carveout. On Volta and later, L1 and shared memory share one array per SM and
the carveout (how much of it is shared memory) is a per-kernel preference
(``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``, a percentage). With no preference, the
default (-1), ``cuda_occupancy.h`` counts with the largest carveout, ``sharedMemPerMultiprocessor``
(228 KiB on Hopper): the driver picks the carveout at launch and will pick one big enough.
``shared_carveout="max"`` (the default here) is that. With a percentage, the preference is
``percent * shared_per_sm / 100`` rounded up to a size the hardware supports (on Hopper 0, 8,
16, 32, 64, 100, 132, 164, 196 or 228 KiB); when that is too small for even one block, the
preference is only a hint and the driver uses the smallest carveout that fits one block.

Not modelled, because no catalog GPU needs it: partitioned global caching (cc 5.2/6.x), the
block-barrier limit (on cc 9.0, two barriers per resident block, never the smallest limit for a
kernel using one barrier), thread-block clusters, and cc >= 10 virtual resources.

The shared-memory argument is the total per block (static + dynamic) and assumes the kernel
opted in (``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``) to whatever dynamic size above
48 KiB it uses, as a launch of that configuration must; without the opt-in the driver answers 0
for dynamic sizes above ``48 KiB - static``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kato.kernels.spec import InvalidInput

from kato.shared.gpus import GpuSpec

Limiter = Literal["warps", "registers", "shared", "blocks"]
CarveoutPreference = Literal["max", "default", "half", "min"] | int

#: Order in which tied limits are reported: cudaOccLimitingFactor's bit order.
_LIMITER_ORDER: tuple[Limiter, ...] = ("warps", "registers", "shared", "blocks")


@dataclass(frozen=True)
class Occupancy:
    """Result of :func:`occupancy` for one kernel configuration on one GPU.

    ``limit_*`` are the blocks per SM each resource alone would allow (None: the kernel does not
    use that resource, so it sets no limit). ``limiter`` names the smallest one ("none" when not
    even one block fits, with ``reason`` saying why); ``limiters`` names every limit equal to the
    smallest, in cudaOccLimitingFactor order (warps, registers, shared, blocks).
    """

    blocks_per_sm: int
    active_warps: int
    max_warps: int
    fraction: float  # active_warps / max_warps
    limiter: Limiter | Literal["none"]
    limiters: tuple[Limiter, ...]
    reason: str | None
    warps_per_block: int
    registers_per_block: int  # allocated, after per-warp rounding
    shared_per_block: int  # allocated, with the reserved bytes and rounding
    shared_per_sm: int  # the carveout counted with
    limit_warps: int
    limit_blocks: int
    limit_registers: int | None
    limit_shared: int | None


def _ceil_to(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def carveout_percent(preference: CarveoutPreference) -> int | None:
    """The carveout preference as a percentage, or None for no preference ("max"/"default").

    Accepts "max" / "default" (the driver's default: count with the largest carveout), "half"
    (50), "min" (0, the largest L1) or an integer percentage 0..100.
    """
    if isinstance(preference, bool):
        raise InvalidInput(f"shared_carveout must be a name or a percentage, not {preference!r}")
    if isinstance(preference, int):
        if preference == -1:  # CU_SHAREDMEM_CARVEOUT_DEFAULT
            return None
        if not 0 <= preference <= 100:
            raise InvalidInput(f"shared_carveout percentage must be 0..100, got {preference}")
        return preference
    named = {"max": None, "default": None, "half": 50, "min": 0}
    if preference not in named:
        raise InvalidInput(
            f"shared_carveout must be one of {sorted(named)} or a percentage, got {preference!r}"
        )
    return named[preference]


def _align_to_carveout(gpu: GpuSpec, size_bytes: int) -> int:
    """The smallest carveout the hardware supports that holds ``size_bytes``."""
    for kib in gpu.shared_carveouts_kib:
        if kib * 1024 >= size_bytes:
            return kib * 1024
    raise InvalidInput(
        f"{size_bytes} bytes exceed the largest shared-memory carveout of {gpu.name}"
    )


def _preferred_shared_per_sm(gpu: GpuSpec, percent: int | None) -> int:
    if percent is None:
        return _align_to_carveout(gpu, gpu.shared_per_sm_bytes)
    return _align_to_carveout(gpu, percent * gpu.shared_per_sm_bytes // 100)


def shared_allocated_per_block(gpu: GpuSpec, shared_bytes_per_block: int) -> int:
    """Shared memory one block takes from the SM: its own bytes plus the driver's reserved
    bytes, rounded up to the allocation unit."""
    total = shared_bytes_per_block + gpu.shared_reserved_per_block_bytes
    return _ceil_to(total, gpu.shared_alloc_unit_bytes)


def _shared_limit(gpu: GpuSpec, allocated: int, percent: int | None) -> tuple[int | None, int]:
    """(blocks per SM allowed by shared memory, carveout counted with) for blocks that each
    take ``allocated`` bytes (reserved bytes and rounding included)."""
    preferred = _preferred_shared_per_sm(gpu, percent)
    per_block_cap = _ceil_to(
        gpu.shared_per_block_optin_bytes + gpu.shared_reserved_per_block_bytes,
        gpu.shared_alloc_unit_bytes,
    )
    if allocated > per_block_cap:
        return 0, preferred
    # A preference too small for even one block is only a hint: the driver then configures the
    # smallest carveout that holds one block.
    shared_per_sm = preferred if preferred >= allocated else _align_to_carveout(gpu, allocated)
    return (shared_per_sm // allocated if allocated > 0 else None), shared_per_sm


def occupancy(
    gpu: GpuSpec,
    threads_per_block: int,
    registers_per_thread: int,
    shared_bytes_per_block: int = 0,
    shared_carveout: CarveoutPreference = "max",
) -> Occupancy:
    """Blocks of a kernel resident per SM, as ``cuOccupancyMaxActiveBlocksPerMultiprocessor``.

    Args:
        gpu: the GPU model (:func:`kato.shared.gpus.get_gpu`).
        threads_per_block: block size (x * y * z), >= 1.
        registers_per_thread: as reported by ptxas / ``CU_FUNC_ATTRIBUTE_NUM_REGS``.
        shared_bytes_per_block: static + dynamic shared memory of one block, without the
            driver's reserved bytes (they are added here).
        shared_carveout: the kernel's carveout preference; see :func:`carveout_percent`.

    Returns:
        The :class:`Occupancy`; ``blocks_per_sm == 0`` (with a ``reason``) when the
        configuration cannot launch at all.

    Raises:
        InvalidInput: a negative or zero size, or a carveout preference that is not one.
    """
    if threads_per_block < 1:
        raise InvalidInput(f"threads_per_block must be >= 1, got {threads_per_block}")
    if registers_per_thread < 0:
        raise InvalidInput(f"registers_per_thread must be >= 0, got {registers_per_thread}")
    if shared_bytes_per_block < 0:
        raise InvalidInput(f"shared_bytes_per_block must be >= 0, got {shared_bytes_per_block}")
    percent = carveout_percent(shared_carveout)

    warps_per_block = math.ceil(threads_per_block / gpu.warp_size)
    reasons: list[str] = []

    # Warps (thread slots). cudaOccMaxBlocksPerSMWarpsLimit.
    if threads_per_block > gpu.max_threads_per_block:
        limit_warps = 0
        reasons.append(
            f"{threads_per_block} threads per block exceed the maximum of "
            f"{gpu.max_threads_per_block}"
        )
    else:
        limit_warps = gpu.max_warps_per_sm // warps_per_block

    # Resident blocks. cudaOccMaxBlocksPerMultiprocessor.
    limit_blocks = gpu.max_blocks_per_sm

    # Registers. cudaOccMaxBlocksPerSMRegsLimit: allocated per warp in units of 256; the per-block
    # limit is checked as the software does (the block's warps) and as the hardware does (warps
    # rounded up to the sub-partition count); each sub-partition holds its own warps.
    regs_per_warp = _ceil_to(registers_per_thread * gpu.warp_size, gpu.register_alloc_unit)
    registers_per_block = regs_per_warp * warps_per_block
    regs_hw_check = regs_per_warp * _ceil_to(warps_per_block, gpu.warp_alloc_granularity)
    limit_registers: int | None
    if registers_per_thread > gpu.max_registers_per_thread:
        limit_registers = 0
        reasons.append(
            f"{registers_per_thread} registers per thread exceed the maximum of "
            f"{gpu.max_registers_per_thread}"
        )
    elif max(registers_per_block, regs_hw_check) > gpu.max_registers_per_block:
        limit_registers = 0
        reasons.append(
            f"{registers_per_thread} registers per thread x {warps_per_block} warps need "
            f"{max(registers_per_block, regs_hw_check)} registers per block (allocated per warp "
            f"in units of {gpu.register_alloc_unit}, warps counted in groups of "
            f"{gpu.warp_alloc_granularity}), more than the {gpu.max_registers_per_block} available"
        )
    elif regs_per_warp == 0:
        limit_registers = None
    else:
        regs_per_partition = gpu.registers_per_sm // gpu.warp_alloc_granularity
        warps_per_sm = (regs_per_partition // regs_per_warp) * gpu.warp_alloc_granularity
        limit_registers = warps_per_sm // warps_per_block

    # Shared memory. cudaOccMaxBlocksPerSMSmemLimit.
    shared_per_block = shared_allocated_per_block(gpu, shared_bytes_per_block)
    limit_shared, shared_per_sm = _shared_limit(gpu, shared_per_block, percent)
    if limit_shared == 0:
        reserved = gpu.shared_reserved_per_block_bytes
        reasons.append(
            f"{shared_bytes_per_block} bytes of shared memory per block"
            + (f" (+{reserved} reserved by the driver)" if reserved else "")
            + f" exceed the per-block maximum of {gpu.shared_per_block_optin_bytes}"
        )

    limits: dict[Limiter, int | None] = {
        "warps": limit_warps,
        "registers": limit_registers,
        "shared": limit_shared,
        "blocks": limit_blocks,
    }
    blocks = min(v for v in limits.values() if v is not None)
    limiters = tuple(k for k in _LIMITER_ORDER if limits[k] == blocks)
    active_warps = blocks * warps_per_block
    return Occupancy(
        blocks_per_sm=blocks,
        active_warps=active_warps,
        max_warps=gpu.max_warps_per_sm,
        fraction=active_warps / gpu.max_warps_per_sm,
        limiter=limiters[0] if blocks > 0 else "none",
        limiters=limiters,
        reason="; ".join(reasons) if blocks == 0 else None,
        warps_per_block=warps_per_block,
        registers_per_block=registers_per_block,
        shared_per_block=shared_per_block,
        shared_per_sm=shared_per_sm,
        limit_warps=limit_warps,
        limit_blocks=limit_blocks,
        limit_registers=limit_registers,
        limit_shared=limit_shared,
    )


def max_dynamic_shared_for(
    gpu: GpuSpec,
    blocks_per_sm: int,
    static_bytes: int = 0,
    shared_carveout: CarveoutPreference = "max",
) -> int | None:
    """The most dynamic shared memory per block that still lets ``blocks_per_sm`` blocks share an
    SM (shared memory alone; registers and warps are the caller's), or None if even no dynamic
    memory does (static memory and reserved bytes already too big, or more blocks than the SM
    can hold).

    The exact inverse of the shared-memory limit of :func:`occupancy`: the result ``d`` gives
    ``occupancy(..., static_bytes + d).limit_shared >= blocks_per_sm`` and ``d + 1`` does not.
    Unlike ``cuda_occupancy.h``'s ``cudaOccAvailableDynamicSMemPerBlock``, it subtracts the 1 KiB
    the driver reserves per block, so the answer can be launched at that occupancy.

    Raises:
        InvalidInput: ``blocks_per_sm < 1``, a negative ``static_bytes``, or a bad carveout.
    """
    if blocks_per_sm < 1:
        raise InvalidInput(f"blocks_per_sm must be >= 1, got {blocks_per_sm}")
    if static_bytes < 0:
        raise InvalidInput(f"static_bytes must be >= 0, got {static_bytes}")
    if blocks_per_sm > gpu.max_blocks_per_sm:
        return None
    percent = carveout_percent(shared_carveout)
    unit = gpu.shared_alloc_unit_bytes
    reserved = gpu.shared_reserved_per_block_bytes
    smallest = shared_allocated_per_block(gpu, static_bytes)
    # The limit is not monotonic in the block's size under a carveout preference (a block that
    # outgrows the preferred carveout gets one sized for it), so scan the allocation sizes from
    # the largest down: at most (228 KiB / 128 B) steps.
    cap = _ceil_to(gpu.shared_per_block_optin_bytes + reserved, unit)
    for allocated in range(cap, smallest - 1, -unit):
        limit, _ = _shared_limit(gpu, allocated, percent)
        if limit is None or limit >= blocks_per_sm:
            return allocated - reserved - static_bytes
    return None
