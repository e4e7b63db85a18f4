"""Limits every supported GPU (sm_80, sm_90) shares: the specs' constraint sets check against them.

Per-GPU limits (shared memory per block on sm_80, SM counts, memory) live in
``kato.shared.gpus``; the specs use these to reject configs that cannot run on any supported GPU.
"""

from __future__ import annotations

#: Opt-in maximum of dynamic + static shared memory per block (sm_90; sm_80 has 163 KiB and the
#: tuner checks that per GPU with its catalog, ``kato.shared.gpus``).
MAX_SHARED_PER_BLOCK = 227 * 1024
#: Shared memory per block (static + dynamic) a kernel gets without opting in.
SHARED_WITHOUT_OPT_IN = 48 * 1024
#: Resident threads per SM: MIN_BLOCKS blocks of B threads beyond it cannot be met.
MAX_THREADS_PER_SM = 2048
#: 32-bit registers per SM.
REGISTERS_PER_SM = 65536
#: ptxas's hard limit per thread.
MAX_REGISTERS_PER_THREAD = 255
#: CUDA's grid limits.
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
#: Kernels take sizes as ``int``.
INT32_MAX = 2**31 - 1
#: The widest vector a thread loads or stores in one instruction (``float4``, ``int4``).
MAX_VECTOR_BYTES = 16
#: SMs of the largest supported GPU (H200): grid-stride kernels scale their grid from it.
NUM_SMS = 132


def launch_bounds_register_cap(threads: int, min_blocks: int) -> int:
    """Registers per thread ptxas may use under ``__launch_bounds__(threads, min_blocks)``.

    ``__launch_bounds__(B)`` alone already promises one resident block of B threads, so the cap
    is ``65536 / (B * max(min_blocks, 1))``, rounded down to ptxas's allocation unit of 8 and
    at most 255.
    """
    per_thread = REGISTERS_PER_SM // (threads * max(min_blocks, 1))
    return min(MAX_REGISTERS_PER_THREAD, per_thread // 8 * 8)


def vector_width_error(vec: int, vector_bytes: int, dtype: str) -> str | None:
    """Why ``VEC`` elements of ``dtype`` (``vector_bytes`` in all) cannot be one vector access,
    or None."""
    if vector_bytes > MAX_VECTOR_BYTES:
        return (
            f"VEC={vec} of {dtype} is a {vector_bytes}-byte vector; "
            f"at most {MAX_VECTOR_BYTES} bytes"
        )
    return None


def resident_threads_error(min_blocks: int, threads: int) -> str | None:
    """Why ``MIN_BLOCKS`` resident blocks of ``threads`` threads cannot be promised (more than
    an SM holds), or None."""
    if min_blocks * threads > MAX_THREADS_PER_SM:
        return (
            f"MIN_BLOCKS={min_blocks} blocks of {threads} threads exceed "
            f"{MAX_THREADS_PER_SM} threads per SM"
        )
    return None


def needs_shared_opt_in(static_bytes: int, dynamic_bytes: int) -> bool:
    """Whether a launch must opt in (``MAX_DYNAMIC_SHARED_SIZE_BYTES``) to its dynamic shared
    memory. The driver allows static + dynamic up to 48 KiB per block without it, so this is
    judged on the sum: 48 KiB of dynamic plus a kernel's static reduction array fails to launch
    without the opt-in, though neither part alone exceeds 48 KiB."""
    return dynamic_bytes > 0 and static_bytes + dynamic_bytes > SHARED_WITHOUT_OPT_IN
