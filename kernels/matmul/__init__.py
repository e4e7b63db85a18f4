"""Matrix multiplication in three layouts, one template (``matmul.cu``) and one parameter space:

- ``matmul``: ``C = A @ B``, A stored (M, K), B stored (K, N);
- ``matmul_nt``: ``C = A @ B^T``, B stored (N, K) (``x @ W^T`` of a linear layer, ``dA = dC @
  B^T`` of a matmul's backward);
- ``matmul_tn``: ``C = A^T @ B``, A stored (K, M) (``dB = A^T @ dC``, ``dW = dy^T @ x``).

Every array is row-major and contiguous; C is (M, N). Shape ``(M, N, K)`` for all three, kernel
arguments ``(A, B, C, M, N, K)`` in that order.

Two code paths share one parameter space; :meth:`MatmulSpec.check` pins the parameters a path
does not use, so that no two valid configs render the same source.

float32, CUDA cores (FFMA, never TF32):

- ``BM``, ``BN``, ``BK``: block tile; BK in {8, 16}.
- ``WM``, ``WN``: warp tile. A warp's 32 lanes are laid out ``LM x LN`` with ``LM = WM / TM``
  and ``LN = 32 / LM``; ``WN`` must equal ``LN * TN``.
- ``TM``, ``TN``: per-thread register tile (4 or 8 each), read from shared memory as float4s.
- ``VEC``: 4 = float4 global loads and stores, 1 = scalar (only with BK=8, STAGES=2,
  MIN_BLOCKS=0: its scalar prefetch of larger tiles spills). Both are valid on every shape: a
  matrix whose row pitch is not a multiple of 4 loads each float4's elements one by one (the
  shared-memory side keeps its vectors; see ``ALIGN_*`` in the template).
- ``STAGES``: 1 = single shared buffer; 2 = double buffering, the next tile prefetched into
  registers while the current one is multiplied.
- ``SPLIT_K`` (sm_90 and later: clusters): 1, or 2-4 CTAs of a cluster per output tile, each
  multiplying a contiguous range of the k tiles; they exchange partial sums through
  distributed shared memory and each adds them in rank order (deterministic, no workspace)
  and stores a share of the tile's rows. Only where the tiles make fewer than two waves
  (:data:`SPLIT_K_MAX_TILES`) and every CTA gets a k tile; the partial sums need ``BM * BN *
  4`` bytes of shared memory (:func:`shared_bytes`).
- ``PAD``: 0 or 4 floats of padding per row of the tiles that the stores into shared memory
  transpose (A in ``matmul``, A and B in ``matmul_nt``; ``matmul_tn`` transposes nothing and
  pins PAD to 0). VEC=1 keeps PAD=4 where a tile is transposed.

float16 / bfloat16, tensor cores (``mma.sync.m16n8k16``, float32 accumulators, C rounded to the
input type like torch):

- ``BM``, ``BN`` in {64, 128, 256}, ``BK`` in {32, 64}; ``WM``, ``WN`` in {32, 64}.
- ``STAGES``: 2-4 shared-memory stages filled by ``cp.async``.
- ``VEC``: 8 = 16-byte ``cp.async`` (an operand whose row pitch is not a multiple of 8 loads
  its chunks element by element into registers one tile ahead, stored to shared memory after
  the current tile's mma); 1 = scalar synchronous loads (only with STAGES 2: more stages cannot
  overlap synchronous loads; likewise VEC=8 where neither operand streams by cp.async).
- ``TM``, ``TN``, ``PAD`` are unused and pinned to 4, 4, 0.

float16 / bfloat16 on sm_90, ``ENGINE="wgmma"`` (``matmul_wgmma.cu``: TMA loads into a
shared-memory pipeline, ``wgmma.mma_async`` from a producer warpgroup and consumer warpgroups
with ``setmaxnreg``; built for ``sm_90a`` and invalid on any other arch, :meth:`MatmulSpec.
check_arch`):

- ``BM``, ``BN`` in {64, 128, 256} but not 256 x 256 (a consumer's accumulators, ``BM /
  consumers / 64 * BN / 2``, must fit 128 registers); ``BK`` 64 (one 128-byte swizzle row);
  ``STAGES`` 2-6 as far as shared memory holds them. Consumer warpgroups: 1 for BM 64 (256
  threads, no setmaxnreg), else 2 (384 threads, 40 / 232 registers: two consumers beat one in
  the H200 probe, docs/results_h200.md).
- ``PINGPONG``: 1 = two consumers taking turns at whole tiles (each BM x BN, so at most 128
  accumulators: 64 x 64..256, 128 x 64/128, 256 x 64), their k loops in order, so that one's
  epilogue overlaps the other's k loop; persistent only.
- ``CLUSTER_M``: 2 = clusters of two CTAs on vertically adjacent tiles sharing B, each
  multicasting half of it (BN 128 or 256).
- ``PERSISTENT``: 1 = one CTA (cluster) per SM of an H200 (:data:`PERSISTENT_CTAS`) looping
  over the tiles, the next tile's loads overlapping this one's stores; only where there are
  more tiles than that (else it is the same launch as 0).
- ``EPILOGUE``: 0 = each consumer thread stores its accumulators to C; 1 = they go to a
  swizzled BM x BN tile in shared memory that TMA stores (``cp.async.bulk.tensor``), so the
  consumers start their next tile at once (with PERSISTENT); C's row pitch N must then be a
  multiple of 8 and the tile counts against shared memory.
- ``SPLIT_K``: 1, or 2-4 CTAs in a cluster per output tile, each multiplying a contiguous
  range of the k blocks, their partial sums added through distributed shared memory in a fixed
  order (deterministic, no workspace); for problems of fewer than two waves of tiles
  (:data:`SPLIT_K_MAX_TILES`), with CLUSTER_M 1, PERSISTENT 0, EPILOGUE 0 and at least one k
  block per CTA.
- ``STREAM_K``: 1 = stream-K: a persistent grid of :data:`PERSISTENT_CTAS` CTAs (one per SM,
  all resident) splits the iteration space, tiles x k blocks in the tile order, into equal
  contiguous ranges, one per CTA, so that a problem whose tiles are not whole waves still
  keeps every SM busy to the end. A tile shared by several CTAs is finished by the one that
  starts it: the others leave their float32 partial sums in a workspace and signal a counter,
  and it adds them in CTA order (deterministic) before its epilogue. The workspace (a slot of
  ``BM * BN`` floats per CTA and a counter per tile and consumer warpgroup,
  :func:`stream_k_workspace_bytes`) is a ``__device__`` global of the loaded module, zeroed
  when it loads and left zeroed by every launch, so the kernel arguments stay those of every
  other config; two launches of one loaded module must not overlap (Kato measures on one
  stream; kato_torch loads a module with ``__device__`` globals once per stream). With
  PERSISTENT 1, CLUSTER_M 1, SPLIT_K 1 and PINGPONG 0 (either epilogue); only where the tiles
  are not a whole number of waves of :data:`PERSISTENT_CTAS`, fewer than
  :data:`STREAM_K_MAX_TILES`, and each CTA gets at least one k block. 0 renders exactly the
  program of the configs before the parameter (no macro). A CTA waits only for CTAs of higher
  index that signal before any wait of their own, so the grid cannot deadlock while all its
  CTAs are resident (132 SMs: H100 SXM, H200) or, on a GPU with fewer SMs, as long as the
  hardware starts blocks in index order (the waits time out and trap rather than hang).
- The row pitches of A and B must be multiples of 8 elements (TMA's 16-byte pitch); C's may be
  anything. ``WM``, ``WN``, ``TM``, ``TN``, ``VEC``, ``PAD``, ``MIN_BLOCKS`` are unused and
  pinned to 64, 64, 4, 4, 8, 0, 0; under ``ENGINE="mma"`` CLUSTER_M, PERSISTENT, EPILOGUE,
  SPLIT_K (but float32's), PINGPONG and STREAM_K are pinned to 1, 0, 0, 1, 0, 0 and render
  nothing, so an mma.sync config's source is what it was before the wgmma path. A and B reach
  the kernel as TMA tensor maps (:class:`kernels.spec.TensorMap` in its step's arguments),
  which every launch path encodes from the operands' pointers.

Both: ``MIN_BLOCKS`` is the min-blocks clause of ``__launch_bounds__`` (0 = none); threads per
block are ``32 * (BM / WM) * (BN / WN)``. The grid has one block per output tile, visited in groups
of 8 tile-rows for L2 reuse (see :meth:`MatmulSpec.launch`). The rendered source depends on the
shape only through which matrices' row pitches are multiples of VEC (``ALIGN_A``, ``ALIGN_B``,
``ALIGN_C``): one compile serves every shape of one alignment class.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.registry import register
from kato.kernels.spec import (
    DTYPES,
    Config,
    InvalidInput,
    Launch,
    OperatorSpec,
    Problem,
    Step,
    TensorMap,
)

#: M, N and K are ``int`` kernel arguments; tile origins and k offsets run up to a dimension +
#: 256: keep 64 Ki of headroom below INT32_MAX.
MAX_DIM = 2**31 - 2**16
#: Rows of tiles visited together (``kGroupM`` in the template): grid.y counts groups of GROUP_M
#: tile-rows, grid.x the tiles of a group.
GROUP_M = 8
#: The smallest BM of the space: with grid.y <= MAX_GRID_Y, M is at most 65535 * 8 * 64.
MIN_TILE_M = 64
MAX_M = limits.MAX_GRID_Y * GROUP_M * MIN_TILE_M
#: Registers besides the accumulators, fragments and prefetch buffers (indices, pointers, loop
#: state). Fit to ptxas reports for sm_80/sm_90: with less headroom than this, a tile spills.
FP32_REGISTER_OVERHEAD = 40
#: Registers the float32 split-K reduction adds (the cluster addresses and a float4 partial
#: sum; ptxas sm_90: 167 -> 189 for a 64 x 128 tile of 8 x 8 per thread).
FP32_SPLIT_REGISTERS = 24
TC_REGISTER_OVERHEAD = 48
#: Prefetch registers of one float4 whose elements load one by one (an unaligned operand): its
#: 4 values and a share of the guards; tiles at the cap spill with 4 (ptxas, sm_90).
UNALIGNED_VEC_REGISTERS = 5
#: Tensor cores with VEC 8 and an unaligned operand, its 16-byte chunks staged through registers
#: one tile ahead, element by element: TC_STAGED_REGISTERS + TC_STAGED_CHUNK_REGISTERS per chunk
#: a thread stages (fit to ptxas for sm_80 and sm_90: 44, 70, 80 more registers for 2, 4, 6).
TC_STAGED_REGISTERS = 24
TC_STAGED_CHUNK_REGISTERS = 12

#: float32 layouts kept in the space, (BM, BN, WM, WN, TM, TN): the classic 128 x 128 tile with
#: 8 x 8 per thread and warps of 32 x 64 or 64 x 32, its 128- and 512-thread relatives, and
#: smaller tiles for problems with fewer tiles than SMs.
FP32_TILES = (
    (128, 128, 32, 64, 8, 8),
    (128, 128, 64, 32, 8, 8),
    (128, 256, 32, 64, 8, 8),
    (256, 128, 64, 32, 8, 8),
    (128, 64, 32, 64, 8, 8),
    (64, 128, 32, 64, 8, 8),
    (128, 128, 32, 32, 8, 4),
    (64, 64, 16, 32, 4, 4),
)
#: Tensor-core layouts kept, (BM, BN, WM, WN): 4 warps of 64 x 64, 8 warps of 64 x 64 on
#: 256-wide tiles, 8 warps of 64 x 32 / 32 x 64 on 128 x 128, and 4 warps of 32 x 32 on
#: 64 x 64 for small problems.
TC_TILES = (
    (128, 128, 64, 64),
    (128, 256, 64, 64),
    (256, 128, 64, 64),
    (128, 128, 64, 32),
    (128, 128, 32, 64),
    (64, 128, 32, 64),
    (128, 64, 64, 32),
    (64, 256, 64, 64),
    (256, 64, 64, 64),
    (64, 64, 32, 32),
)

_TC_TILE_SET = frozenset(TC_TILES)
_FP32_TILE_SET = frozenset(FP32_TILES)
_FP32_KEYS = ("BM", "BN", "WM", "WN", "TM", "TN")

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16
_TC_PINNED = {"TM": 4, "TN": 4, "PAD": 0}

#: The mma.sync template's tunables: the only ones an ``ENGINE="mma"`` config renders.
MMA_PARAMS = ("BM", "BN", "BK", "WM", "WN", "TM", "TN", "VEC", "STAGES", "PAD", "MIN_BLOCKS")
#: The wgmma path's own tunables, pinned to these values under ``ENGINE="mma"`` (SPLIT_K but in
#: float32, whose CUDA-core path splits k too: :data:`FP32_SPLIT_K`).
MMA_PINNED = {
    "CLUSTER_M": 1,
    "PERSISTENT": 0,
    "EPILOGUE": 0,
    "SPLIT_K": 1,
    "PINGPONG": 0,
    "STREAM_K": 0,
}
#: SPLIT_K values of the float32 path (clusters of that many CTAs: sm_90 and later).
FP32_SPLIT_K = (1, 2, 3, 4)
#: The first arch with thread block clusters (float32's SPLIT_K > 1).
CLUSTER_MIN_CC = 90
#: The mma.sync tunables a wgmma config does not read, pinned to these values.
WGMMA_PINNED = {"WM": 64, "WN": 64, "TM": 4, "TN": 4, "VEC": 8, "PAD": 0, "MIN_BLOCKS": 0}
WGMMA_TEMPLATE = Path(__file__).with_name("matmul_wgmma.cu")
WGMMA_KERNEL = "kato_matmul_wgmma"
#: The wgmma path's k tile: one 128-byte swizzle row of 16-bit elements.
WGMMA_BK = 64
#: TMA addresses rows whose pitch is a multiple of 16 bytes: 8 elements of 16 bits.
WGMMA_PITCH = 8
#: Pipeline stages of the mma.sync path (cp.async groups) and of the wgmma one (its mbarrier
#: ring; more stages let the producer run further ahead of short k loops, as far as shared
#: memory allows).
MMA_MAX_STAGES = 4
WGMMA_MAX_STAGES = 6
#: Accumulator registers one consumer thread may hold (the template's static_assert).
WGMMA_MAX_ACCUMULATORS = 128
#: setmaxnreg targets of the producer and of the consumers with two consumer warpgroups (384
#: threads: 128 * 40 + 256 * 232 <= 65536; measured on the H200 by benchmarks/wgmma_probe.py).
WGMMA_PRODUCER_REGS = 40
WGMMA_CONSUMER_REGS = 232
#: Tile-rows (in cluster tiles) visited together by the wgmma kernel's tile order.
WGMMA_GROUP_M = 8
#: CTAs of a persistent launch: the SMs of an H200 (and an H100 SXM). The tile loop is correct
#: for any grid; on an sm_90 GPU with fewer SMs the last wave is only less balanced.
PERSISTENT_CTAS = 132
#: SPLIT_K > 1 is kept for problems of fewer cluster tiles than this (two waves of
#: PERSISTENT_CTAS): with more, every SM already has whole tiles to work on.
SPLIT_K_MAX_TILES = 2 * PERSISTENT_CTAS
#: STREAM_K=1 is kept for problems of fewer tiles than this (four waves of PERSISTENT_CTAS: a
#: last wave's idle SMs then cost at most a fifth); the template's counters hold this many
#: tiles (``STREAM_K_MAX_TILES``) and its workspace PERSISTENT_CTAS slots (``STREAM_K_CTAS``).
STREAM_K_MAX_TILES = 4 * PERSISTENT_CTAS
#: The arch whose wgmma and setmaxnreg a wgmma config needs, and the nvcc target it builds for.
WGMMA_ARCH = "sm_90"
WGMMA_TARGET = "sm_90a"
#: Static shared memory of the wgmma kernel (its mbarriers, padded by ptxas to the 1024-byte
#: alignment of the dynamic buffer; ptxas for sm_90a).
WGMMA_STATIC_SHARED = 1024
#: Grid limit of the wgmma launch (grid.x) and of its int tile index.
MAX_GRID_X = 2**31 - 1


def is_tensor_core(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


def is_wgmma(config: Config) -> bool:
    return config.get("ENGINE") == "wgmma"


def wgmma_consumers(config: Config) -> int:
    """Consumer warpgroups of a wgmma config: 2 with PINGPONG (taking turns at tiles), else 1
    for BM 64 and 2 for the rest (sharing each tile's rows)."""
    return 2 if config.get("PINGPONG") or config["BM"] != 64 else 1


def wgmma_rows_per_consumer(config: Config) -> int:
    """Rows of a tile one consumer warpgroup multiplies: all BM with PINGPONG, else its share."""
    return config["BM"] if config.get("PINGPONG") else config["BM"] // wgmma_consumers(config)


def wgmma_accumulators(config: Config) -> int:
    """float32 accumulators per consumer thread: ``rows / 64`` m64 slices of BN / 2."""
    return wgmma_rows_per_consumer(config) // 64 * config["BN"] // 2


def wgmma_shared_bytes(config: Config) -> int:
    """Dynamic shared memory of a wgmma config: STAGES A and B tiles, with ``EPILOGUE`` 1 the
    BM x BN output tile staged for the TMA stores, and 1 KiB of slack to align the stages to
    1024 bytes (the swizzle's period)."""
    c_tile = config["BM"] * config["BN"] * 2 if config.get("EPILOGUE") else 0
    if config.get("PINGPONG"):  # one tile per consumer
        c_tile *= 2
    return config["STAGES"] * (config["BM"] + config["BN"]) * WGMMA_BK * 2 + c_tile + 1024


def wgmma_split_buffer_bytes(config: Config) -> int:
    """Shared memory a split-K CTA receives the other CTAs' partial accumulators in (the
    template's kSplitBufferBytes): for each of the SPLIT_K - 1 others, the accumulators of the
    consumer warps it owns (warp w belongs to CTA w % SPLIT_K), 32 lanes each."""
    split = config.get("SPLIT_K", 1)
    warps = 4 * wgmma_consumers(config)
    owned = -(-warps // split)
    return (split - 1) * owned * 32 * wgmma_accumulators(config) * 4


def threads_per_block(config: Config) -> int:
    if is_wgmma(config):
        return 128 * (wgmma_consumers(config) + 1)
    return 32 * (config["BM"] // config["WM"]) * (config["BN"] // config["WN"])


def register_cap(config: Config) -> int:
    """Registers per thread ptxas may use under ``__launch_bounds__(threads, MIN_BLOCKS)``:
    ``65536 / (threads * max(MIN_BLOCKS, 1))`` rounded down to 8, at most 255."""
    return limits.launch_bounds_register_cap(threads_per_block(config), config["MIN_BLOCKS"])


def registers_needed(config: Config, dtype: str, aligned: tuple[bool, bool] = (True, True)) -> int:
    """The register model check() compares with :func:`register_cap` (no spills below it);
    ``aligned``: whether A's and B's row pitches are multiples of VEC (see
    :meth:`MatmulSpec.alignment`).

    Fit to ptxas reports (sm_80 and sm_90), which fill whatever the cap allows by hoisting
    addresses and fragments, so the model is about where spilling starts, not the count:

    - float32: TM*TN accumulators + TM + TN fragment values + the register prefetch of
      STAGES 2 (the thread's share of one A and one B tile: VEC registers per float4 load,
      3 per scalar load, which also keeps its address; a float4 of an unaligned operand loads
      its 4 elements one by one: UNALIGNED_VEC_REGISTERS) + 40.
    - tensor cores: 4 floats per mma tile ((WM/16) * (WN/8) tiles) + the A and B fragments
      of every 16-wide k step of a BK tile (the loop is unrolled and its ldmatrix hoisted:
      (4 * WM/16 + 2 * WN/8) * BK/16) + 48. A 64 x 64 warp tile fits with BK 32, not 64.
      With VEC 8 and an unaligned operand (its chunks staged through registers), the registers
      of the staged chunks (TC_STAGED_REGISTERS + TC_STAGED_CHUNK_REGISTERS per chunk).
    """
    if is_tensor_core(dtype):
        mi, ni = config["WM"] // 16, config["WN"] // 8
        extra = 0
        if config["VEC"] > 1 and not all(aligned):
            threads = threads_per_block(config)
            chunks = sum(
                math.ceil(size * config["BK"] // 8 / threads)
                for size, ok in zip((config["BM"], config["BN"]), aligned, strict=True)
                if not ok
            )
            extra = TC_STAGED_REGISTERS + TC_STAGED_CHUNK_REGISTERS * chunks
        return mi * ni * 4 + (mi * 4 + ni * 2) * (config["BK"] // 16) + TC_REGISTER_OVERHEAD + extra
    tm, tn = config["TM"], config["TN"]
    prefetch = 0
    if config["STAGES"] == 2:
        threads = threads_per_block(config)
        vec = config["VEC"]
        for size, ok in zip((config["BM"], config["BN"]), aligned, strict=True):
            loads = math.ceil(size * config["BK"] // vec / threads)
            per_load = 3 if vec == 1 else vec if ok else UNALIGNED_VEC_REGISTERS
            prefetch += loads * per_load
    split = FP32_SPLIT_REGISTERS if config.get("SPLIT_K", 1) > 1 else 0
    return tm * tn + tm + tn + prefetch + FP32_REGISTER_OVERHEAD + split


def shared_bytes(config: Config, dtype: str, trans_a: bool = False, trans_b: bool = False) -> int:
    """Dynamic shared memory per block (the kernel has no static shared memory). float32 pads
    the rows of the tiles its stores transpose: A's unless ``trans_a``, B's if ``trans_b``."""
    bm, bn, bk, stages = config["BM"], config["BN"], config["BK"], config["STAGES"]
    if is_tensor_core(dtype):
        return stages * (bm * bk + bk * bn) * 2
    pad = config["PAD"]
    stage = stages * (bk * (bm + (0 if trans_a else pad)) + bk * (bn + (pad if trans_b else 0))) * 4
    # Split-K reuses the stages for the tile's partial sums, one float each.
    return max(stage, bm * bn * 4) if config.get("SPLIT_K", 1) > 1 else stage


def static_shared_bytes(config: Config) -> int:
    """Static shared memory: none (every buffer is dynamic)."""
    return 0


class MatmulSpec(OperatorSpec):
    """C = A @ B with float32 accumulation; float32 on CUDA cores, fp16/bf16 on tensor cores.

    :attr:`trans_a` / :attr:`trans_b` choose the layout (the subclasses ``matmul_tn`` and
    ``matmul_nt``): A stored (K, M) and C = A^T @ B, or B stored (N, K) and C = A @ B^T.
    """

    name = "matmul"
    description = (
        "C = A @ B, row-major (M, K) x (K, N), float32 accumulation; float32 on CUDA cores "
        "(no TF32), float16/bfloat16 on tensor cores (mma.sync; wgmma + TMA on sm_90)"
    )
    #: A is stored (K, M): C = A^T @ B.
    trans_a = False
    #: B is stored (N, K): C = A @ B^T.
    trans_b = False
    dtypes = ("float32", "float16", "bfloat16")
    rank = 3
    shape_names = ("M", "N", "K")
    params = {
        "BM": (64, 128, 256),
        "BN": (64, 128, 256),
        "BK": (8, 16, 32, 64),
        "WM": (16, 32, 64),
        "WN": (16, 32, 64),
        "TM": (4, 8),
        "TN": (4, 8),
        "VEC": (1, 4, 8),
        "STAGES": (1, 2, 3, 4, 5, 6),
        "PAD": (0, 4),
        "MIN_BLOCKS": (0, 2),
        "ENGINE": ("mma", "wgmma"),
        "CLUSTER_M": (1, 2),
        "PERSISTENT": (0, 1),
        "EPILOGUE": (0, 1),
        "SPLIT_K": (1, 2, 3, 4),
        "PINGPONG": (0, 1),
        "STREAM_K": (0, 1),
    }
    template = Path(__file__).with_name("matmul.cu")
    extra_templates = (WGMMA_TEMPLATE,)
    kernel_name = "matmul_kernel"
    kernel_names = ("matmul_kernel", WGMMA_KERNEL)

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """The base checks, plus: M, N and K must fit the kernel's ``int`` arguments, and M the
        grid (``ceil(M / BM / 8) <= 65535`` for every BM: ``M <= 33553920``)."""
        shape = super().validate(shape, dtype)
        if shape[0] > MAX_M:
            raise InvalidInput(
                f"matmul takes M up to {MAX_M} (65535 groups of 8 tiles of 64 rows); got "
                f"M={shape[0]}: split the rows into several calls"
            )
        big = [f"{n}={s}" for n, s in zip(self.shape_names, shape, strict=True) if s > MAX_DIM]
        if big:
            raise InvalidInput(
                f"matmul takes M, N and K up to 2**31-2**16 ({MAX_DIM}); got {', '.join(big)}"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Why ``config`` cannot run correctly for ``shape``/``dtype``, or None if it can.

        Rejects: parameters missing, unknown or outside the space; threads per block outside
        64..512 or ``MIN_BLOCKS * threads`` over 2048; warp tiles that do not divide the block
        tile; shared memory over 227 KiB; register tiles the launch bounds cannot hold
        (:func:`registers_needed` > :func:`register_cap` for the shape's :meth:`alignment`:
        they would spill; with A^T, MIN_BLOCKS=2 on an 8 x 8 thread tile); and, per path and
        layout, the parameter values that path does not implement (see the module docstring).
        Every VEC is valid on every shape. ``ENGINE="wgmma"``: :meth:`_check_wgmma` (the
        arch is :meth:`check_arch`'s: check() is device-independent).
        """
        reason = self.check_params(config)
        if reason:
            return reason
        if is_wgmma(config):
            return self._check_wgmma(config, shape, dtype)
        tc = is_tensor_core(dtype)
        for name, value in MMA_PINNED.items():
            if config[name] != value and (tc or name != "SPLIT_K"):
                return f"{name} is a wgmma tunable, pinned to {value} under ENGINE=mma"
        # The layout whitelists first: they reject most of the space, cheaply.
        if tc and (config["BM"], config["BN"], config["WM"], config["WN"]) not in _TC_TILE_SET:
            return (
                f"tile {config['BM']}x{config['BN']}, warp {config['WM']}x{config['WN']} "
                "is not in TC_TILES"
            )
        if not tc and tuple(config[p] for p in _FP32_KEYS) not in _FP32_TILE_SET:
            return "tile {}x{}, warp {}x{}, thread {}x{} is not in FP32_TILES".format(
                *(config[p] for p in _FP32_KEYS)
            )
        try:
            shape = _validated(self, tuple(shape), dtype)
        except InvalidInput as exc:
            return str(exc)

        bm, bn, wm, wn = config["BM"], config["BN"], config["WM"], config["WN"]
        min_blocks = config["MIN_BLOCKS"]
        if bm % wm or bn % wn:
            return f"warp tile {wm}x{wn} does not divide the block tile {bm}x{bn}"
        threads = threads_per_block(config)
        if not 64 <= threads <= 512:
            return f"{threads} threads per block; the space keeps 64..512"
        if min_blocks and register_cap(config) == register_cap({**config, "MIN_BLOCKS": 0}):
            return f"MIN_BLOCKS={min_blocks} does not lower the register cap at {threads} threads"
        if reason := limits.resident_threads_error(min_blocks, threads):
            return reason
        aligned = self.alignment(config, shape)
        if tc:
            reason = self._check_tc(config, aligned)
        else:
            reason = self._check_fp32(config, self.trans_a and not self.trans_b)
            thread_tile = config["TM"] * config["TN"]
            if not reason and self.trans_a and min_blocks and thread_tile == 64:
                reason = (
                    "MIN_BLOCKS=2 spills an 8 x 8 thread tile with A^T (ptxas, sm_80 and sm_90)"
                )
        if not reason and not tc:
            reason = self._check_fp32_split(config, shape)
        if reason:
            return reason
        smem = shared_bytes(config, dtype, self.trans_a, self.trans_b)
        if smem > limits.MAX_SHARED_PER_BLOCK:
            return f"{smem} bytes of shared memory per block; at most {limits.MAX_SHARED_PER_BLOCK}"
        need, cap = registers_needed(config, dtype, aligned[:2]), register_cap(config)
        if need > cap:
            return (
                f"the tile needs ~{need} registers per thread but the launch bounds allow {cap}: "
                "it would spill"
            )
        return None

    def _check_wgmma(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """The wgmma path's constraints (see the module docstring); the arch is
        :meth:`check_arch`'s."""
        if not is_tensor_core(dtype):
            return f"ENGINE=wgmma takes float16 or bfloat16, not {dtype}"
        for name, value in WGMMA_PINNED.items():
            if config[name] != value:
                return f"{name} is unused by ENGINE=wgmma and pinned to {value}"
        if config["BK"] != WGMMA_BK:
            return f"ENGINE=wgmma takes BK {WGMMA_BK} (a 128-byte swizzle row), got {config['BK']}"
        if config["STAGES"] < 2:
            return f"ENGINE=wgmma takes STAGES 2..{WGMMA_MAX_STAGES}"
        if (acc := wgmma_accumulators(config)) > WGMMA_MAX_ACCUMULATORS:
            return (
                f"tile {config['BM']}x{config['BN']} needs {acc} accumulators per consumer "
                f"thread; at most {WGMMA_MAX_ACCUMULATORS}"
            )
        if config["CLUSTER_M"] == 2 and config["BN"] == 64:
            return "CLUSTER_M=2 splits B between two CTAs: BN 128 or 256"
        if config["STAGES"] > WGMMA_MAX_STAGES:
            return f"ENGINE=wgmma takes STAGES 2..{WGMMA_MAX_STAGES}"
        if config["PINGPONG"] and not config["PERSISTENT"]:
            return "PINGPONG=1 alternates a CTA's tiles between its consumers: PERSISTENT 1"
        split = config["SPLIT_K"]
        stream_k = config["STREAM_K"]
        if stream_k and (
            not config["PERSISTENT"] or config["CLUSTER_M"] != 1 or split != 1 or config["PINGPONG"]
        ):
            return (
                "STREAM_K=1 takes PERSISTENT 1 (a CTA per SM, each on a range of tiles x k "
                "blocks), CLUSTER_M 1, SPLIT_K 1 and PINGPONG 0"
            )
        if split > 1 and config["PINGPONG"]:
            return "SPLIT_K > 1 takes PINGPONG 0 (one tile per cluster)"
        if split > 1:
            if config["CLUSTER_M"] != 1 or config["PERSISTENT"] or config["EPILOGUE"]:
                return (
                    "SPLIT_K > 1 takes CLUSTER_M 1, PERSISTENT 0 and EPILOGUE 0 (a cluster of "
                    "SPLIT_K CTAs per tile, reducing through the stage memory)"
                )
            stage_memory = config["STAGES"] * (config["BM"] + config["BN"]) * WGMMA_BK * 2
            if (need := wgmma_split_buffer_bytes(config)) > stage_memory:
                return (
                    f"SPLIT_K={split} receives {need} bytes of partial sums; the "
                    f"{config['STAGES']} stages it reuses hold {stage_memory}"
                )
        try:
            m, n, k = _validated(self, tuple(shape), dtype)
        except InvalidInput as exc:
            return str(exc)
        lda, ldb = (m if self.trans_a else k), (k if self.trans_b else n)
        for name, pitch in (("A", lda), ("B", ldb)):
            if pitch % WGMMA_PITCH:
                return (
                    f"ENGINE=wgmma loads {name} by TMA, which needs a row pitch of a multiple of "
                    f"{WGMMA_PITCH} elements; {name}'s is {pitch}"
                )
        if config["EPILOGUE"] and n % WGMMA_PITCH:
            return (
                f"EPILOGUE=1 stores C by TMA, which needs a row pitch of a multiple of "
                f"{WGMMA_PITCH} elements; C's is {n}"
            )
        cluster_tiles = wgmma_cluster_tiles(config, m, n)
        if split > 1 and cluster_tiles >= SPLIT_K_MAX_TILES:
            return (
                f"SPLIT_K > 1 where {cluster_tiles} tiles already fill two waves of "
                f"{PERSISTENT_CTAS} SMs: splitting only adds the reduction"
            )
        if split > 1 and math.ceil(k / WGMMA_BK) < split:
            return f"SPLIT_K={split} with {math.ceil(k / WGMMA_BK)} k blocks: a CTA would get none"
        if cluster_tiles * config["CLUSTER_M"] * split > MAX_GRID_X:
            return f"{cluster_tiles} cluster tiles exceed the grid and the kernel's int index"
        if stream_k:
            if reason := _check_stream_k(cluster_tiles, k):
                return reason
        elif config["PERSISTENT"] and cluster_tiles <= PERSISTENT_CTAS // config["CLUSTER_M"]:
            return (
                f"PERSISTENT=1 launches what PERSISTENT=0 does for {cluster_tiles} cluster tiles "
                f"(at most one per SM of {PERSISTENT_CTAS})"
            )
        smem = wgmma_shared_bytes(config) + WGMMA_STATIC_SHARED
        if smem > limits.MAX_SHARED_PER_BLOCK:
            return f"{smem} bytes of shared memory per block; at most {limits.MAX_SHARED_PER_BLOCK}"
        return None

    def candidates(self, shape: Sequence[int], dtype: str) -> list[Config]:
        """The mma.sync product (STAGES up to :data:`MMA_MAX_STAGES`) with the wgmma tunables
        pinned, and for float16 / bfloat16 the wgmma product (BM, BN, STAGES, CLUSTER_M,
        PERSISTENT, EPILOGUE, SPLIT_K, PINGPONG, STREAM_K) with the rest pinned: a small part
        of the whole product, which holds no other valid config."""
        names = list(self.params)
        mma_values = {
            p: [v for v in self.params[p] if p != "STAGES" or v <= MMA_MAX_STAGES]
            for p in MMA_PARAMS
        }
        found = [
            {**dict(zip(MMA_PARAMS, values, strict=True)), "ENGINE": "mma", **MMA_PINNED}
            for values in itertools.product(*(mma_values[p] for p in MMA_PARAMS))
        ]
        if not is_tensor_core(dtype):
            # SPLIT_K > 1 only on the listed tiles: the rest of the product is invalid anyway,
            # and four copies of it would quadruple the listing's and the checks' cost.
            found += [
                {**c, "SPLIT_K": split}
                for c in found
                if tuple(c[p] for p in _FP32_KEYS) in _FP32_TILE_SET
                for split in FP32_SPLIT_K[1:]
            ]
        if is_tensor_core(dtype):
            own = (
                "BM", "BN", "STAGES", "CLUSTER_M", "PERSISTENT", "EPILOGUE", "SPLIT_K", "PINGPONG",
                "STREAM_K",
            )  # fmt: skip
            fixed = {**WGMMA_PINNED, "BK": WGMMA_BK, "ENGINE": "wgmma"}
            found += [
                {**fixed, **dict(zip(own, values, strict=True))}
                for values in itertools.product(*(self.params[p] for p in own))
            ]
        position = {name: {v: i for i, v in enumerate(self.params[name])} for name in names}
        found = [{name: c[name] for name in names} for c in found]
        return sorted(found, key=lambda c: tuple(position[p][c[p]] for p in names))

    def check_arch(self, config: Config, arch: str) -> str | None:
        """wgmma, setmaxnreg and TMA multicast exist on sm_90 alone (built for sm_90a): a wgmma
        config is invalid on every other arch. float32's SPLIT_K > 1 needs clusters (sm_90 and
        later)."""
        if is_wgmma(config) and arch != WGMMA_ARCH:
            return f"ENGINE=wgmma needs {WGMMA_ARCH} ({WGMMA_TARGET} code), the GPU is {arch}"
        if not is_wgmma(config) and config.get("SPLIT_K", 1) > 1:
            digits = "".join(ch for ch in arch if ch.isdigit())
            if not digits or int(digits) < CLUSTER_MIN_CC:
                return (
                    f"SPLIT_K > 1 needs thread block clusters (sm_90 or later); the GPU is {arch}"
                )
        return None

    def check_sms(self, config: Config, sm_count: int) -> str | None:
        """STREAM_K=1 launches :data:`PERSISTENT_CTAS` CTAs whose owners wait on later CTAs'
        partial sums: every one must be resident at once, one per SM (a GPU with fewer SMs,
        an H100 PCIe's 114, would rely on the hardware starting blocks in index order, and
        run a second, partial wave)."""
        if config.get("STREAM_K") and sm_count < PERSISTENT_CTAS:
            return (
                f"STREAM_K=1 needs its {PERSISTENT_CTAS} CTAs resident at once, one per SM; the "
                f"GPU has {sm_count} SMs"
            )
        return None

    def arch_for(self, config: Config, arch: str) -> str:
        """wgmma configs build for ``sm_90a``; the mma.sync ones for the GPU's own arch."""
        return WGMMA_TARGET if is_wgmma(config) else arch

    def template_for(self, config: Config) -> Path:
        return WGMMA_TEMPLATE if is_wgmma(config) else self.template

    def main_kernel(self, config: Config) -> str:
        return WGMMA_KERNEL if is_wgmma(config) else self.kernel_name

    @staticmethod
    def _check_fp32(config: Config, nothing_transposed: bool) -> str | None:
        bm, bn, bk = config["BM"], config["BN"], config["BK"]
        wm, wn, tm, tn = config["WM"], config["WN"], config["TM"], config["TN"]
        if bk not in (8, 16):
            return f"float32 takes BK 8 or 16, got {bk}"
        if config["VEC"] not in (1, 4):
            return f"float32 takes VEC 1 or 4, got {config['VEC']}"
        if config["STAGES"] not in (1, 2):
            return f"float32 takes STAGES 1 or 2 (register prefetch), got {config['STAGES']}"
        if wm % tm or 32 % (wm // tm) or wn != (32 // (wm // tm)) * tn:
            return f"WN must be TN * 32 / (WM / TM) for WM={wm}, TM={tm}, TN={tn}; got {wn}"
        if (bm, bn, wm, wn, tm, tn) not in FP32_TILES:
            return f"tile {bm}x{bn}, warp {wm}x{wn}, thread {tm}x{tn} is not in FP32_TILES"
        if nothing_transposed and config["PAD"]:
            return "PAD is unused where no tile is transposed into shared memory (A^T @ B): 0"
        pad = 0 if nothing_transposed else 4
        if config["VEC"] == 1 and (bk, config["STAGES"], config["PAD"], config["MIN_BLOCKS"]) != (
            8,
            2,
            pad,
            0,
        ):
            return (
                f"VEC=1 keeps BK=8, STAGES=2, PAD={pad}, MIN_BLOCKS=0 only (its scalar prefetch "
                "of a BK=16 tile spills)"
            )
        return None

    @staticmethod
    def _check_fp32_split(config: Config, shape: Sequence[int]) -> str | None:
        """float32 SPLIT_K > 1: only where the tiles make fewer than two waves (with more, every
        SM already has whole tiles and splitting only adds the reduction) and every CTA of a
        cluster gets at least one k tile."""
        split = config["SPLIT_K"]
        if split == 1:
            return None
        m, n, k = shape
        tiles = math.ceil(m / config["BM"]) * math.ceil(n / config["BN"])
        if tiles >= SPLIT_K_MAX_TILES:
            return (
                f"SPLIT_K > 1 where {tiles} tiles already fill two waves of "
                f"{PERSISTENT_CTAS} SMs: splitting only adds the reduction"
            )
        if (k_tiles := math.ceil(k / config["BK"])) < split:
            return f"SPLIT_K={split} with {k_tiles} k tiles: a CTA would get none"
        return None

    @staticmethod
    def _check_tc(config: Config, aligned: tuple[bool, bool, bool]) -> str | None:
        for name, value in _TC_PINNED.items():
            if config[name] != value:
                return f"{name} is unused on tensor cores and pinned to {value}"
        bm, bn, bk, wm, wn = (config[p] for p in ("BM", "BN", "BK", "WM", "WN"))
        if (bm, bn, wm, wn) not in TC_TILES:
            return f"tile {bm}x{bn}, warp {wm}x{wn} is not in TC_TILES"
        if bk not in (32, 64):
            return f"tensor cores take BK 32 or 64, got {bk}"
        if config["VEC"] not in (1, 8):
            return f"tensor cores take VEC 1 or 8 (16-byte cp.async), got {config['VEC']}"
        if not 2 <= config["STAGES"] <= MMA_MAX_STAGES:
            return "tensor cores take STAGES 2, 3 or 4"
        if config["VEC"] == 1 and config["STAGES"] != 2:
            return "VEC=1 loads are synchronous: STAGES beyond 2 cannot overlap them"
        if not any(aligned[:2]) and config["STAGES"] != 2:
            return (
                "neither operand's rows are 16-byte aligned, so no load is a cp.async (both are "
                "staged through registers one tile ahead): STAGES beyond 2 add nothing"
            )
        return None

    def alignment(self, config: Config, shape: Sequence[int]) -> tuple[bool, bool, bool]:
        """Whether the row pitches of A, B and C are multiples of ``VEC`` (A's is M with
        :attr:`trans_a`, else K; B's is K with :attr:`trans_b`, else N; C's is N): then every
        vector of that matrix is aligned and entirely inside or outside it, else its elements
        are loaded or stored one by one (the template's ``ALIGN_A``, ``ALIGN_B``, ``ALIGN_C``)."""
        m, n, k = shape
        vec = config["VEC"]
        lda = m if self.trans_a else k
        ldb = k if self.trans_b else n
        return lda % vec == 0, ldb % vec == 0, n % vec == 0

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """A valid config for any valid shape: the widest vector (valid on every shape); the
        128 x 128 tile (8 x 8 per thread in float32, 64 x 64 per warp on tensor cores) when it
        gives at least one tile per SM of an H200 (132), else 64 x 64 tiles. float32 takes
        128 x 256 tiles (twice the reuse of each A tile) where they still fill the GPU: at
        least 100 tiles and waves of 132 at least 85% full, where it does not spill (measured:
        docs/defaults.md). Tensor cores take 3 stages where both operands stream by
        cp.async, else 2 stages and 64 x 32 warp tiles.

        Raises:
            InvalidInput: the shape or dtype is invalid (see :meth:`validate`).
        """
        m, n, k = self.validate(shape, dtype)
        big = math.ceil(m / 128) * math.ceil(n / 128) >= 132
        if is_tensor_core(dtype):
            vec = 8
            stages = 3 if all(self.alignment({"VEC": vec}, (m, n, k))[:2]) else 2
            if big:
                # 64 x 64 warp tiles spill with element-wise loads of an unaligned operand
                wn = 64 if stages == 3 else 32
                tile = {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": wn}
            else:
                tile = {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 32}
            config = {**tile, **_TC_PINNED, "VEC": vec, "STAGES": stages, "MIN_BLOCKS": 0}
            config.update(ENGINE="mma", **MMA_PINNED)
        else:
            wide = math.ceil(m / 128) * math.ceil(n / 256)
            pad = 0 if self.trans_a and not self.trans_b else 4
            rest = {"VEC": 4, "STAGES": 2, "PAD": pad, "MIN_BLOCKS": 0}
            wide_tile = {"BM": 128, "BN": 256, "BK": 8, "WM": 32, "WN": 64, "TM": 8, "TN": 8}
            if (
                wide >= 100
                and wide / (math.ceil(wide / 132) * 132) >= 0.85
                and self.check({**wide_tile, **rest, "ENGINE": "mma", **MMA_PINNED}, shape, dtype)
                is None
            ):
                tile = wide_tile
            elif big:
                tile = {"BM": 128, "BN": 128, "BK": 8, "WM": 32, "WN": 64, "TM": 8, "TN": 8}
            else:
                tile = {"BM": 64, "BN": 64, "BK": 16, "WM": 16, "WN": 32, "TM": 4, "TN": 4}
            config = {**tile, **rest, "ENGINE": "mma", **MMA_PINNED}
        reason = self.check(config, shape, dtype)
        if reason:  # unreachable for a valid shape
            raise AssertionError(f"default matmul config invalid for {tuple(shape)}: {reason}")
        return config

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """Tunables (in space order), then DTYPE, IS_HALF, IS_BF16, the layout (TRANS_A,
        TRANS_B) and :meth:`alignment` (ALIGN_A, ALIGN_B, ALIGN_C): the shape matters only
        through those, so one compile serves every (M, N, K) of one alignment class."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        if is_wgmma(config):
            return self._wgmma_defines(config, is_bf16)
        macros: dict[str, object] = {name: config[name] for name in MMA_PARAMS}
        if config.get("SPLIT_K", 1) > 1:  # absent at 1: the source of the configs before it
            macros["SPLIT_K"] = config["SPLIT_K"]
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        macros["TRANS_A"] = int(self.trans_a)
        macros["TRANS_B"] = int(self.trans_b)
        align = self.alignment(config, shape)
        for name, ok in zip(("ALIGN_A", "ALIGN_B", "ALIGN_C"), align, strict=True):
            macros[name] = int(ok)
        return macros

    def _wgmma_defines(self, config: Config, is_bf16: int) -> dict[str, object]:
        """The wgmma template's macros: the tile, stages, consumers, cluster, tile order,
        setmaxnreg targets, element type and layout (the shape does not enter the source;
        PERSISTENT only changes the grid); with STREAM_K 1, that and its workspace's capacity
        (absent at 0: the source of the configs before the parameter)."""
        consumers = wgmma_consumers(config)
        two = consumers == 2
        macros: dict[str, object] = {
            "BM": config["BM"],
            "BN": config["BN"],
            "BK": WGMMA_BK,
            "STAGES": config["STAGES"],
            "CONSUMERS": consumers,
            "CLUSTER_M": config["CLUSTER_M"],
            "EPILOGUE": config["EPILOGUE"],
            "SPLIT_K": config["SPLIT_K"],
            "PINGPONG": config["PINGPONG"],
            "GROUP_M": WGMMA_GROUP_M,
            "INFLIGHT": 1,
            # One consumer (256 threads) may hold 255 registers: no setmaxnreg (a raise below
            # what ptxas allocated would be undefined).
            "PRODUCER_REGS": WGMMA_PRODUCER_REGS if two else 0,
            "CONSUMER_REGS": WGMMA_CONSUMER_REGS if two else 0,
            "IS_BF16": is_bf16,
            "TRANS_A": int(self.trans_a),
            "TRANS_B": int(self.trans_b),
        }
        if config.get("STREAM_K"):
            macros["STREAM_K"] = 1
            macros["STREAM_K_CTAS"] = PERSISTENT_CTAS
            macros["STREAM_K_MAX_TILES"] = STREAM_K_MAX_TILES
        return macros

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """wgmma: :meth:`_wgmma_launch`. mma.sync: one block per output tile: grid.y =
        ``ceil(tiles_m / 8)`` groups of 8 tile-rows, grid.x = ``min(tiles_m, 8) * tiles_n``
        (times SPLIT_K: a cluster per tile; blocks past the last, smaller group return at
        once); ``32 * (BM/WM) * (BN/WN)`` threads; the stages' shared memory as dynamic
        memory."""
        if is_wgmma(config):
            return self._wgmma_launch(config, shape)
        m, n, _ = shape
        tiles_m, tiles_n = math.ceil(m / config["BM"]), math.ceil(n / config["BN"])
        split = config.get("SPLIT_K", 1)  # a cluster of SPLIT_K CTAs, consecutive in x, per tile
        return Launch(
            grid=(min(tiles_m, GROUP_M) * tiles_n * split, math.ceil(tiles_m / GROUP_M), 1),
            block=(threads_per_block(config), 1, 1),
            shared_bytes=shared_bytes(config, dtype, self.trans_a, self.trans_b),
        )

    def _wgmma_launch(self, config: Config, shape: Sequence[int]) -> Launch:
        """One CTA per output tile, in whole clusters (``CLUSTER_M`` CTAs on a cluster tile of
        ``CLUSTER_M * BM`` x BN, or ``SPLIT_K`` CTAs on one tile), or with PERSISTENT at most
        :data:`PERSISTENT_CTAS` CTAs looping over the cluster tiles (with STREAM_K, over
        ranges of tiles x k blocks: :func:`stream_k_ctas`); 128 threads per warpgroup; the
        stages' (and the staged C tile's) shared memory."""
        m, n, _ = shape
        cl = config["CLUSTER_M"] * config["SPLIT_K"]  # one of the two is 1
        clusters = wgmma_cluster_tiles(config, m, n)
        if config.get("STREAM_K"):
            clusters = stream_k_ctas(config, shape)
        elif config["PERSISTENT"]:
            clusters = min(clusters, PERSISTENT_CTAS // cl)
        return Launch(
            grid=(clusters * cl, 1, 1),
            block=(threads_per_block(config), 1, 1),
            shared_bytes=wgmma_shared_bytes(config),
        )

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """One launch. wgmma: ``kato_matmul_wgmma(map_a, map_b, C, M, N, K)`` with A and B as
        TMA tensor maps (:meth:`tensor_maps`)."""
        if not is_wgmma(config):
            return super().steps(config, shape, dtype)
        maps = self.tensor_maps(config, shape, dtype)
        if config["EPILOGUE"]:
            maps += (self.output_map(config, shape, dtype),)
        launch = self._wgmma_launch(config, shape)
        return [Step(WGMMA_KERNEL, launch, (*maps, 2, 3, 4, 5))]

    def output_map(self, config: Config, shape: Sequence[int], dtype: str) -> TensorMap:
        """The map of C (argument 2) that ``EPILOGUE`` 1 stores through: boxes of 64 columns (128
        bytes, the swizzle's row) by one consumer warpgroup's rows of the tile."""
        m, n, _ = shape
        rows = wgmma_rows_per_consumer(config)
        return TensorMap(2, dtype, rows=m, cols=n, box_rows=rows, box_cols=64)

    def tensor_maps(
        self, config: Config, shape: Sequence[int], dtype: str
    ) -> tuple[TensorMap, TensorMap]:
        """The maps of A (argument 0) and B (argument 1) the wgmma kernel reads, 128-byte
        swizzle: a K-major operand (A of ``matmul`` / ``matmul_nt``, B of ``matmul_nt``) in
        boxes of 64 k by the tile's rows (B's split between a cluster's CTAs); an MN-major one
        (B of ``matmul`` / ``matmul_tn``, A of ``matmul_tn``) in boxes of 64 m or n by 64 k."""
        m, n, k = shape
        bm, bn, cl = config["BM"], config["BN"], config["CLUSTER_M"]
        if self.trans_a:
            map_a = TensorMap(0, dtype, rows=k, cols=m, box_rows=WGMMA_BK, box_cols=64)
        else:
            map_a = TensorMap(0, dtype, rows=m, cols=k, box_rows=bm, box_cols=WGMMA_BK)
        if self.trans_b:
            map_b = TensorMap(1, dtype, rows=n, cols=k, box_rows=bn // cl, box_cols=WGMMA_BK)
        else:
            map_b = TensorMap(1, dtype, rows=k, cols=n, box_rows=WGMMA_BK, box_cols=64)
        return map_a, map_b

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """A ((M, K), or (K, M) with :attr:`trans_a`), B ((K, N), or (N, K) with
        :attr:`trans_b`) ~ U(-1, 1) rounded to ``dtype`` (zeros redrawn as 0.5: never zero); C
        (M, N) pre-filled with NaN. The reference is the float64 product of the inputs *as
        stored*. The tolerance scales with K (see :meth:`tolerance_for`)."""
        m, n, k = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        a = _uniform_nonzero(rng, (k, m) if self.trans_a else (m, k), np_dtype)
        b = _uniform_nonzero(rng, (n, k) if self.trans_b else (k, n), np_dtype)
        c = np.full((m, n), np.nan, dtype=np_dtype)
        return Problem(
            args=[a, b, c, np.int32(m), np.int32(n), np.int32(k)],
            outputs=[2],
            references=[matmul_reference(a, b, self.trans_a, self.trans_b)],
            tolerances=[self.tolerance_for(k, dtype)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` for K = 1; :meth:`make_problem` attaches :meth:`tolerance_for` K."""
        return self.tolerance_for(1, dtype)

    def tolerance_for(self, k: int, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` for a K-term dot product of U(-1, 1) inputs with float32 sums.

        An output is a sum of K products of magnitude <= 1; its typical size is sqrt(K/9), and
        float32 accumulation in any order (sequential per thread, in k-tiles of any size) errs
        by about eps32 * sqrt(K) * sqrt(K/9) typically and a few times that at the tails of
        millions of outputs. atol = 4e-7 * sqrt(K) * (sqrt(K) + 3) is ~7 * eps32 * K: for
        K = 4096 it is 1.7e-3 against outputs of typical size 21 (8e-5 relative), far below
        what any indexing error produces. rtol covers the rounding of C to the output type:
        2**-11 (float16) and 2**-8 (bfloat16) at most, doubled; 1e-5 for float32.
        """
        if dtype not in self.dtypes:
            raise InvalidInput(f"matmul does not support dtype {dtype!r}")
        root = math.sqrt(max(int(k), 1))
        atol = 4e-7 * root * (root + 3.0)
        rtol = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
        return atol, rtol

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """A and B read once, C written once: ``(M*K + K*N + M*N) * itemsize``."""
        m, n, k = shape
        return (m * k + k * n + m * n) * DTYPES[dtype][2]

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """A, B and C on the device (the backend also keeps a float32 copy of the reference:
        ``4 * M * N`` more). 8192^3 float32: 768 MiB + 256 MiB."""
        m, n, _ = shape
        return self.bytes_moved(shape, dtype) + 4 * m * n

    def flops(self, shape: Sequence[int], dtype: str) -> int:
        """``2 * M * N * K`` (one multiply and one add per term)."""
        m, n, k = shape
        return 2 * m * n * k


def wgmma_cluster_tiles(config: Config, m: int, n: int) -> int:
    """Cluster tiles (``CLUSTER_M * BM`` x BN) covering the M x N output."""
    return math.ceil(m / (config["BM"] * config["CLUSTER_M"])) * math.ceil(n / config["BN"])


def stream_k_ctas(config: Config, shape: Sequence[int]) -> int:
    """CTAs of a STREAM_K=1 launch: :data:`PERSISTENT_CTAS`, or one per iteration (tile x k
    block) where there are fewer (check() rejects those configs)."""
    m, n, k = shape
    iterations = wgmma_cluster_tiles(config, m, n) * math.ceil(k / WGMMA_BK)
    return min(PERSISTENT_CTAS, iterations)


def stream_k_workspace_bytes(config: Config) -> int:
    """Device memory of a STREAM_K=1 module's workspace (its ``__device__`` globals): a slot
    of BM x BN float32 partial sums per CTA (:data:`PERSISTENT_CTAS`) and an int32 counter per
    tile (:data:`STREAM_K_MAX_TILES`) and consumer warpgroup; 0 for other configs."""
    if not config.get("STREAM_K"):
        return 0
    slots = PERSISTENT_CTAS * config["BM"] * config["BN"] * 4
    return slots + STREAM_K_MAX_TILES * wgmma_consumers(config) * 4


def _check_stream_k(tiles: int, k: int) -> str | None:
    """STREAM_K=1 at ``tiles`` output tiles and K: only where it can balance what whole tiles
    do not (tiles not a whole number of waves of :data:`PERSISTENT_CTAS`), within the
    template's counters (:data:`STREAM_K_MAX_TILES`), and with a k block for every CTA."""
    if tiles % PERSISTENT_CTAS == 0:
        return (
            f"STREAM_K=1 where {tiles} tiles are whole waves of {PERSISTENT_CTAS} SMs: nothing "
            "to balance"
        )
    if tiles >= STREAM_K_MAX_TILES:
        return (
            f"STREAM_K=1 where {tiles} tiles make {STREAM_K_MAX_TILES // PERSISTENT_CTAS} waves "
            f"or more of {PERSISTENT_CTAS} SMs (the last one's idle SMs cost little)"
        )
    if (iterations := tiles * math.ceil(k / WGMMA_BK)) < PERSISTENT_CTAS:
        return (
            f"STREAM_K=1 with {iterations} tile k blocks for {PERSISTENT_CTAS} CTAs: a CTA "
            "would get none"
        )
    return None


@functools.lru_cache(maxsize=64)
def _validated(spec: MatmulSpec, shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """``spec.validate`` memoised: check() runs for every config of the space."""
    return spec.validate(shape, dtype)


def _uniform_nonzero(rng: np.random.Generator, shape: tuple[int, int], dtype: np.dtype):
    x = rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)
    out = x.astype(dtype, copy=False)
    zeros = out == 0
    if zeros.any():
        out[zeros] = 0.5
    return out


def matmul_reference(
    a: np.ndarray, b: np.ndarray, trans_a: bool = False, trans_b: bool = False
) -> np.ndarray:
    """Float64 ``op(a) @ op(b)`` of the inputs as stored (any float dtype, incl. ml_dtypes);
    op transposes where ``trans_a`` / ``trans_b``."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)


class MatmulNTSpec(MatmulSpec):
    """C = A @ B^T, B stored (N, K): a linear layer's ``x @ W^T`` and a matmul's ``dC @ B^T``."""

    name = "matmul_nt"
    description = (
        "C = A @ B^T, row-major A (M, K) and B (N, K), float32 accumulation; float32 on CUDA "
        "cores (no TF32), float16/bfloat16 on tensor cores (mma.sync; wgmma + TMA on sm_90)"
    )
    trans_b = True


class MatmulTNSpec(MatmulSpec):
    """C = A^T @ B, A stored (K, M): a matmul's ``A^T @ dC``, a linear layer's ``dy^T @ x``."""

    name = "matmul_tn"
    description = (
        "C = A^T @ B, row-major A (K, M) and B (K, N), float32 accumulation; float32 on CUDA "
        "cores (no TF32), float16/bfloat16 on tensor cores (mma.sync; wgmma + TMA on sm_90)"
    )
    trans_a = True


MATMUL = register(MatmulSpec())
MATMUL_NT = register(MatmulNTSpec())
MATMUL_TN = register(MatmulTNSpec())

__all__ = [
    "MATMUL",
    "MATMUL_NT",
    "MATMUL_TN",
    "MMA_PARAMS",
    "MMA_PINNED",
    "WGMMA_PINNED",
    "MatmulNTSpec",
    "MatmulSpec",
    "MatmulTNSpec",
    "matmul_reference",
    "register_cap",
    "registers_needed",
    "shared_bytes",
    "static_shared_bytes",
    "stream_k_ctas",
    "stream_k_workspace_bytes",
    "threads_per_block",
    "wgmma_accumulators",
    "wgmma_consumers",
    "wgmma_shared_bytes",
]
