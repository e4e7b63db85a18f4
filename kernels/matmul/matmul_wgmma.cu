// Hopper GEMM C = op(A) @ op(B) with wgmma.mma_async fed by TMA (sm_90a only), float16 or
// bfloat16 inputs, float32 accumulation, C written in the input type (as torch). Layouts as in
// matmul.cu: TRANS_A = 1 reads A stored (K, M) (C = A^T B), TRANS_B = 1 reads B stored (N, K)
// (C = A B^T); every matrix row-major. The matmul operators render it for ENGINE="wgmma"
// configs (kernels/matmul/__init__.py: the macros below, the launch, the tensor maps);
// benchmarks/wgmma_probe.py compiles it with -D options of its own.
//
// Structure (one CTA = 1 producer warpgroup + CONSUMERS consumer warpgroups, 128 threads each):
//
// * Shared memory holds STAGES stages, each an A tile (BM x BK) and a B tile (BN x BK), written
//   by the TMA unit (cp.async.bulk.tensor) with the 128-byte swizzle and read by wgmma through
//   matrix descriptors with the same swizzle. BK = 64 half-words = 128 bytes: one swizzle row.
//   - A K-major operand (A of nn / nt, B of nt) is stored as rows of 64 k (128 bytes), one TMA
//     box {64, rows}; 8-row groups are 1024 bytes apart (the descriptor's stride byte offset).
//   - An MN-major operand (B of nn, A of tn) is stored as chunks of 64 m/n (128 bytes) by BK k
//     rows, one TMA box {64, BK} per chunk, chunks 64 * 128 = 8192 bytes apart (leading byte
//     offset), 8-row k groups 1024 bytes apart (stride byte offset).
// * Two mbarriers per stage: full (the producer's arrive.expect_tx + the TMA's complete_tx) and
//   empty (one arrival per consumer warp once its wgmmas that read the stage are complete).
// * The producer warpgroup drops to PRODUCER_REGS registers (setmaxnreg), one thread issues the
//   TMA copies; the consumers rise to CONSUMER_REGS. Consumer c owns rows [c * BM / CONSUMERS,
//   (c + 1) * BM / CONSUMERS) of the block tile: MI = BM / CONSUMERS / 64 wgmma m64nBNk16 per
//   16-wide k step, BN / 2 * MI float32 accumulators per thread.
// * Tiles: every CTA (every cluster, with CLUSTER_M 2) loops over output tiles tile = blockIdx.x,
//   + gridDim.x, ... in the grouped order of matmul.cu (GROUP_M tile-rows at a time,
//   column-major inside a group). A grid of one CTA per tile is the classic launch; a grid of
//   one CTA per SM is the persistent one (the producer then loads the next tile while the
//   consumers store this one).
// * Edges: TMA zero-fills the parts of a box outside the matrix (any M, N, K), and the
//   epilogue's stores are guarded. TMA needs 16-byte aligned row pitches: the K and M / N
//   pitches of A and B must be multiples of 8 elements (the host checks); C's pitch N may be
//   anything (pairs are stored as one 4-byte word only where N is even).
// * Every mbarrier wait gives up after WAIT_TIMEOUT_NS of the global timer and traps, so that a
//   wrong descriptor or byte count fails the launch instead of hanging the GPU (a debug build
//   records which barrier instead; see KATO_WGMMA_DEBUG).
//
// Tunables (-D): BM (64, 128, 256), BN (64, 128, 256), BK (64), STAGES (2..8), CONSUMERS (1, 2),
// CLUSTER_M (1, or 2: clusters of 2 CTAs on vertically adjacent tiles, each loading half of the
// shared B tile and multicasting it to both; the grid must then be even), GROUP_M (tile-rows
// per raster group, counted in cluster tiles of CLUSTER_M * BM rows), INFLIGHT (0: wait for
// each stage's wgmmas before releasing it; 1: keep one stage's wgmmas in flight, release the
// previous stage),
// EPILOGUE (0: consumers store C from registers; 1: through a swizzled tile in shared memory
// and TMA stores, see the epilogue), SPLIT_K (1, or 2..8 CTAs of a cluster per tile, each on a
// range of k blocks, partial sums added through distributed shared memory), STREAM_K (0, or 1:
// see "Stream-K" below; with STREAM_K_CTAS and STREAM_K_MAX_TILES, its workspace's capacity),
// PRODUCER_REGS / CONSUMER_REGS (setmaxnreg targets; 0 = no setmaxnreg), IS_BF16, TRANS_A,
// TRANS_B. Diagnostics: MN_SWAP_LBO_SBO = 1 swaps the two offsets of MN-major descriptors;
// FLIP_TRANSPOSE = 1 inverts both transpose immediates (the smem layouts stay);
// KATO_WGMMA_DEBUG = 1 records a timed-out wait in kato_wgmma_timeout instead of trapping.
//
// Stream-K (STREAM_K 1; CLUSTER_M 1, SPLIT_K 1, PINGPONG 0): the grid is at most STREAM_K_CTAS
// CTAs, all resident at once (one per SM), and the iteration space, tiles x k blocks (tile-major,
// tiles in the grouped order above), is cut into gridDim.x contiguous ranges of equal length
// (+-1), CTA b taking [total * b / gridDim.x, total * (b + 1) / gridDim.x). A CTA walks its range
// as segments, one per tile it touches (the producer loads exactly those k blocks, the stage
// ring running on across segments). A segment that covers its whole tile stores C as usual; one
// that starts past the tile's first k block (only the CTA's first segment can) writes its float32
// partial sums to the CTA's slot of the workspace and arrives on the tile's counter; the segment
// that starts the tile without finishing it (only the CTA's last can) is the tile's owner: it
// waits until the counter says every later CTA whose range reaches into the tile (b + 1, ...,
// last) has arrived, adds their slots in that order (the same order every run: deterministic),
// resets the counter and stores C. Consumer warpgroup c of a CTA only ever meets warpgroup c of
// another (same rows of the tile), so each has counters of its own. The workspace is a global of
// the loaded module (stream_k_partials, stream_k_flags: zeroed when the module loads); invariant:
// every counter is 0 between launches (each is reset by its owner after the last arrival, and a
// launch on one stream starts after the previous one ends). A wait can not deadlock: an owner
// waits only at the end of its range, for CTAs that arrive at the start of theirs, after no wait
// of their own; with every CTA resident (or blocks dispatched in index order) they all run.
//
// Kernel: kato_matmul_wgmma(tmap_a, tmap_b, [tmap_c with EPILOGUE 1,] C, M, N, K); block
// 128 * (CONSUMERS + 1) threads; dynamic shared memory STAGES * (BM + BN) * BK * 2 (+ BM * BN
// * 2 with EPILOGUE 1) + 1024 (alignment slack). C's map: row-major M x N, box {64, BM /
// CONSUMERS}, 128-byte swizzle (N a multiple of 8). The host encodes
// the tensor maps (cuTensorMapEncodeTiled) over the stored matrices, row-major, 128-byte
// swizzle, zero fill: a K-major operand with box {64, BM} (A) or {64, BN / CLUSTER_M} (B), an
// MN-major one with box {64, 64}. C must be 4-byte aligned.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 256
#endif
#ifndef BK
#define BK 64
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef CONSUMERS
#define CONSUMERS 2
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef INFLIGHT
#define INFLIGHT 1
#endif
#ifndef PRODUCER_REGS
#define PRODUCER_REGS 40
#endif
#ifndef CONSUMER_REGS
#define CONSUMER_REGS 232
#endif
#ifndef IS_BF16
#define IS_BF16 0
#endif
#ifndef TRANS_A
#define TRANS_A 0
#endif
#ifndef TRANS_B
#define TRANS_B 0
#endif
#ifndef MN_SWAP_LBO_SBO
#define MN_SWAP_LBO_SBO 0
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1
#endif
#ifndef FLIP_TRANSPOSE
#define FLIP_TRANSPOSE 0
#endif
#ifndef EPILOGUE
#define EPILOGUE 0
#endif
#ifndef SPLIT_K
#define SPLIT_K 1
#endif
#ifndef PINGPONG
#define PINGPONG 0
#endif
#ifndef STREAM_K
#define STREAM_K 0
#endif
#ifndef STREAM_K_CTAS
#define STREAM_K_CTAS 132
#endif
#ifndef STREAM_K_MAX_TILES
#define STREAM_K_MAX_TILES 528
#endif
#ifndef KATO_WGMMA_DEBUG
#define KATO_WGMMA_DEBUG 0
#endif
#ifndef WAIT_TIMEOUT_NS
#define WAIT_TIMEOUT_NS 2000000000ull
#endif

#if IS_BF16
#define KATO_WGMMA_TYPE "bf16"
#else
#define KATO_WGMMA_TYPE "f16"
#endif

// Helpers live in KATO_NS (tests/kernels/compile_harness.py renames it to put several
// variants into one translation unit).
#ifndef KATO_NS
#define KATO_NS kato_wgmma
#endif

// wgmma's transpose immediates: 1 = the operand is MN-major in shared memory.
#define TRANS_A_MN ((TRANS_A) ^ (FLIP_TRANSPOSE))
#define TRANS_B_MN ((1 - (TRANS_B)) ^ (FLIP_TRANSPOSE))

namespace KATO_NS {

#if IS_BF16
typedef __nv_bfloat16 DTYPE;
typedef __nv_bfloat162 DTYPE2;
#else
typedef __half DTYPE;
typedef __half2 DTYPE2;
#endif

constexpr int kThreads = 128 * (CONSUMERS + 1);
// PINGPONG 1: the consumers take turns at whole tiles (consumer c the c-th, c+2-th, ... tile of
// its CTA), so that one's epilogue overlaps the other's k loop; else they split each tile's rows.
constexpr int kRowsPerConsumer = PINGPONG ? BM : BM / CONSUMERS;
constexpr int kMI = kRowsPerConsumer / 64;
constexpr int kAccPerWgmma = BN / 2;
constexpr int kATileBytes = BM * BK * 2;
constexpr int kBTileBytes = BN * BK * 2;
constexpr int kStageBytes = kATileBytes + kBTileBytes;
// Bytes of one 64-wide chunk of an MN-major tile (64 elements x BK rows) and of one 64-row
// slice of a K-major tile (64 rows x BK elements): the same with BK = 64.
constexpr int kChunkBytes = 64 * BK * 2;

static_assert(BK == 64, "BK must be 64: one 128-byte swizzle row of 16-bit elements");
static_assert(BM == 64 || BM == 128 || BM == 256, "BM must be 64, 128 or 256");
static_assert(BN == 64 || BN == 128 || BN == 256, "BN must be 64, 128 or 256 (wgmma n)");
static_assert(CONSUMERS == 1 || CONSUMERS == 2, "CONSUMERS must be 1 or 2");
static_assert(kRowsPerConsumer % 64 == 0, "each consumer needs whole m64 slices");
static_assert(kMI * kAccPerWgmma <= 128, "more than 128 accumulators per thread");
static_assert(STAGES >= 2 && STAGES <= 8, "STAGES must be 2..8");
// EPILOGUE 1 stages the output tile in shared memory (BM x BN of DTYPE) for TMA stores: each
// consumer owns its kRowsPerConsumer rows, as BN / 64 column chunks of kRowsPerConsumer rows of
// 128 bytes (one TMA store box each, 128-byte swizzle).
constexpr int kCTileBytes = EPILOGUE ? (PINGPONG ? CONSUMERS : 1) * BM * BN * 2 : 0;
#if EPILOGUE
constexpr int kCChunkBytes = kRowsPerConsumer * 128;
#endif
static_assert(EPILOGUE == 0 || EPILOGUE == 1, "EPILOGUE must be 0 or 1");
// SPLIT_K > 1: a cluster of SPLIT_K CTAs shares one output tile, CTA r of it multiplying the
// r-th of SPLIT_K contiguous ranges of k blocks; the partial accumulators are summed through
// distributed shared memory (the consumers' split-K reduction), so no global workspace.
static_assert(SPLIT_K >= 1 && SPLIT_K <= 8, "SPLIT_K must be 1..8 (a portable cluster)");
static_assert(SPLIT_K == 1 || (CLUSTER_M == 1 && EPILOGUE == 0 && PINGPONG == 0),
              "SPLIT_K > 1 takes CLUSTER_M 1, the register epilogue and no ping-pong");
static_assert(PINGPONG == 0 || (PINGPONG == 1 && CONSUMERS == 2),
              "PINGPONG takes two consumer warpgroups");
static_assert(STREAM_K == 0 || (STREAM_K == 1 && CLUSTER_M == 1 && SPLIT_K == 1 && PINGPONG == 0),
              "STREAM_K 1 takes CLUSTER_M 1, SPLIT_K 1 and no ping-pong");
// Consumer warps, and those of them whose rows one CTA of a split-K cluster sums and stores
// (warp w belongs to CTA w % SPLIT_K): the receive buffer holds, for each of the other
// SPLIT_K - 1 CTAs, kOwnedWarps warps' accumulators, in the stage memory the k loop is done with.
constexpr int kConsumerWarps = 4 * CONSUMERS;
constexpr int kOwnedWarps = (kConsumerWarps + SPLIT_K - 1) / SPLIT_K;
constexpr int kWarpAccBytes = 32 * kMI * kAccPerWgmma * 4;
constexpr int kSplitBufferBytes = (SPLIT_K - 1) * kOwnedWarps * kWarpAccBytes;
static_assert(kSplitBufferBytes <= STAGES * kStageBytes,
              "the split-K receive buffer exceeds the stage memory it reuses");
static_assert(STAGES * kStageBytes + kCTileBytes + 1024 <= 232448,
              "stages (and the output tile) exceed 227 KiB of shared memory");
static_assert(INFLIGHT == 0 || INFLIGHT == 1, "INFLIGHT must be 0 or 1");
static_assert(CLUSTER_M == 1 || CLUSTER_M == 2, "CLUSTER_M must be 1 or 2");
static_assert(CLUSTER_M == 1 || (BN / 64) % 2 == 0, "a 2-CTA cluster splits B: BN 128 or 256");
// Rows of B one CTA of a cluster loads and multicasts (K-major B: its TMA box height).
constexpr int kBRowsPerCta = BN / CLUSTER_M;
static_assert(kBRowsPerCta % 8 == 0, "a CTA's share of B is whole 8-row swizzle groups");

// A CUtensorMap (cuda.h's is 64-byte aligned, 128 bytes); only its address is used here.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t global_timer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// --- mbarrier -------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

#if KATO_WGMMA_DEBUG
// Debug builds record the first timed-out wait here (what + 1, stage, parity, block) and end
// the thread instead of trapping, so that the host can read it back after the launch.
__device__ unsigned int kato_wgmma_timeout[4];
#endif

// Waits for the phase of parity `parity` to complete. After WAIT_TIMEOUT_NS (a bug: a wrong
// transaction count or a lost arrival) it traps, or in debug builds records the barrier and
// exits. `what`: 0 full, 1 empty. Inlined: a call would serialise the wgmma pipeline.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int what, int stage) {
    if (mbar_try_wait(bar, parity)) return;
    const uint64_t start = global_timer();
    for (uint32_t spin = 1;; ++spin) {
        if (mbar_try_wait(bar, parity)) return;
        if ((spin & 255) == 0 && global_timer() - start > WAIT_TIMEOUT_NS) {
#if KATO_WGMMA_DEBUG
            if (atomicCAS(&kato_wgmma_timeout[0], 0u, static_cast<unsigned>(what + 1)) == 0u) {
                kato_wgmma_timeout[1] = stage;
                kato_wgmma_timeout[2] = parity;
                kato_wgmma_timeout[3] = blockIdx.x;
            }
            asm volatile("exit;");
#else
            __trap();
#endif
        }
    }
}

// --- TMA ------------------------------------------------------------------------------------

// Copies the box at element coordinates (c0 innermost, c1) of `map` into shared memory at
// `dst`; the copied bytes complete a transaction of `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TensorMap* map, uint32_t bar,
                                            int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// As tma_load_2d, into the same shared-memory offset of every CTA of the cluster in `mask`;
// each destination's mbarrier at `bar`'s offset receives the bytes it got.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const TensorMap* map,
                                                      uint32_t bar, int c0, int c1,
                                                      uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}

#if EPILOGUE
// Stores the box at (c0 innermost, c1) of `map` from shared memory at `src` (TMA clips the
// parts outside the matrix); completes in this thread's current bulk async-group.
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::
                     "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}

__device__ __forceinline__ void tma_store_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until this thread's committed stores have read their shared memory (it may be
// rewritten); their global writes may still be in flight.
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Waits until this thread's committed stores are complete (before the CTA exits).
__device__ __forceinline__ void tma_store_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Makes this thread's generic-proxy writes to shared memory visible to the TMA unit.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}


__device__ __forceinline__ uint32_t pack2(float v0, float v1) {
#if IS_BF16
    __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
#else
    __half2 h = __floats2half2_rn(v0, v1);
#endif
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
#endif

#if EPILOGUE || PINGPONG || STREAM_K
// Named barriers of `count` threads: ids 1, 2 one consumer warpgroup's epilogue, 3, 4 the
// ping-pong order of the two, 5, 6 one consumer warpgroup's stream-K exchange (0 is
// __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
#endif

// --- clusters -------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_rank() {
#if CLUSTER_M > 1 || SPLIT_K > 1
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
#else
    return 0;
#endif
}

// Every thread of every CTA of the cluster (a CTA barrier without clusters).
__device__ __forceinline__ void cluster_sync() {
#if CLUSTER_M > 1 || SPLIT_K > 1
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n"
        "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

// One arrival on the barrier at `bar`'s offset in CTA `rank` of the cluster (this CTA's own
// barrier without clusters).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
#if CLUSTER_M > 1
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote)
                 : "memory");
#else
    mbar_arrive(bar);
#endif
}

#if SPLIT_K > 1
// The address of shared-memory address `addr` in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t map_shared_rank(uint32_t addr, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
}

__device__ __forceinline__ void st_cluster_v4(uint32_t addr, float a, float b, float c,
                                              float d) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a),
                 "f"(b), "f"(c), "f"(d)
                 : "memory");
}

__device__ __forceinline__ float4 ld_shared_v4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
#endif

// --- wgmma ----------------------------------------------------------------------------------

// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address >> 4 in bits 0-13,
// leading byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45, base offset 0 (every
// stage is 1024-byte aligned), swizzle mode in 62-63 (1 = 128-byte swizzle).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
           (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32) |
           (1ull << 62);
}

// K-major operand: rows of 128 bytes, 8-row groups 1024 bytes apart; the leading offset is
// unused with a 128-byte swizzle (k16 = 32 bytes lies inside one swizzle row); a k step moves
// the start address by 32 bytes inside the swizzled row.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int kstep) {
    return make_desc(tile + kstep * 32, 16, 1024);
}

// MN-major operand: 64-element chunks kChunkBytes apart (leading), 8-row k groups 1024 bytes
// apart (stride); a k step (16 rows of 128 bytes) moves the start address by 2048 bytes.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile, int kstep) {
#if MN_SWAP_LBO_SBO
    return make_desc(tile + kstep * 2048, 1024, kChunkBytes);
#else
    return make_desc(tile + kstep * 2048, kChunkBytes, 1024);
#endif
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Generated: m64nNk16, float32 accumulators d[N / 2] in wgmma's fragment order, operands from
// shared memory through descriptors, scale-d = (scale_d != 0), no negation, transpose
// immediates TRANS_A_MN / TRANS_B_MN.
__device__ __forceinline__ void wgmma_n64(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." KATO_WGMMA_TYPE "." KATO_WGMMA_TYPE " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A_MN), "n"(TRANS_B_MN));
}

__device__ __forceinline__ void wgmma_n128(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." KATO_WGMMA_TYPE "." KATO_WGMMA_TYPE " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A_MN), "n"(TRANS_B_MN));
}

__device__ __forceinline__ void wgmma_n256(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." KATO_WGMMA_TYPE "." KATO_WGMMA_TYPE " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A_MN), "n"(TRANS_B_MN));
}

template <int N>
__device__ __forceinline__ void wgmma_tile(float* d, uint64_t desc_a, uint64_t desc_b,
                                           int scale_d);
template <>
__device__ __forceinline__ void wgmma_tile<64>(float* d, uint64_t a, uint64_t b, int s) {
    wgmma_n64(d, a, b, s);
}
template <>
__device__ __forceinline__ void wgmma_tile<128>(float* d, uint64_t a, uint64_t b, int s) {
    wgmma_n128(d, a, b, s);
}
template <>
__device__ __forceinline__ void wgmma_tile<256>(float* d, uint64_t a, uint64_t b, int s) {
    wgmma_n256(d, a, b, s);
}

__device__ __forceinline__ void setmaxnreg_dec() {
#if PRODUCER_REGS > 0
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
#endif
}

__device__ __forceinline__ void setmaxnreg_inc() {
#if CONSUMER_REGS > 0
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
#endif
}

// Output tile `tile` in the grouped order: GROUP_M tile-rows at a time, column-major inside.
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& tm,
                                            int& tn) {
    const int group_size = GROUP_M * tiles_n;
    const int group = tile / group_size;
    const int first_m = group * GROUP_M;
    const int rows = min(tiles_m - first_m, GROUP_M);
    const int in_group = tile - group * group_size;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
}

__device__ __forceinline__ void store_pair(DTYPE* C, int M, int N, int row, int col, float v0,
                                           float v1) {
    if (row >= M) return;
    DTYPE* p = C + static_cast<size_t>(row) * N + col;
    if (col + 1 < N && (N & 1) == 0) {
#if IS_BF16
        *reinterpret_cast<DTYPE2*>(p) = __floats2bfloat162_rn(v0, v1);
#else
        *reinterpret_cast<DTYPE2*>(p) = __floats2half2_rn(v0, v1);
#endif
    } else {
        if (col < N) p[0] = static_cast<DTYPE>(v0);
        if (col + 1 < N) p[1] = static_cast<DTYPE>(v1);
    }
}

#if STREAM_K
// --- stream-K (see the header) --------------------------------------------------------------

// The workspace: a slot of BM x BN partial sums per CTA (consumer c's part at c * kSkPartVecs
// float2s, its thread t's pair v at v * 128 + t: a warp's lanes move 256 contiguous bytes),
// and an arrival counter per tile and consumer warpgroup. Pairs, not float4s: the owner's
// reduction of 128 accumulators per thread then fits 168 registers (ptxas spilled with float4s).
constexpr int kSkSlotVecs = BM * BN / 2;
constexpr int kSkVecs = kAccPerWgmma / 2;  // float2s per m64 slice per thread
constexpr int kSkPartVecs = kMI * kSkVecs * 128;
static_assert(CONSUMERS * kSkPartVecs == kSkSlotVecs, "a slot is one tile of accumulators");
__device__ float2 stream_k_partials[static_cast<size_t>(STREAM_K_CTAS) * kSkSlotVecs];
__device__ int stream_k_flags[STREAM_K_MAX_TILES * CONSUMERS];

// A CTA's range of the iteration space (tiles x k_all k blocks, `total` in all), as segments:
// k blocks [first_k, ...) of first_tile, whole tiles, then [0, end_k) of last_tile (one tile:
// [first_k, end_k)); helpers: how many later CTAs' ranges reach into last_tile when this one
// is its owner (starts it without finishing it), else 0.
struct StreamKRange {
    int first_tile, first_k, last_tile, end_k, helpers;
};

// CTA `cta` of `ctas` takes iterations [total * cta / ctas, total * (cta + 1) / ctas): at least
// one each (total >= ctas). CTA c's range starts before iteration x iff total * c / ctas < x,
// i.e. c <= (x * ctas - 1) / total: the last CTA in last_tile (which ends at x).
__device__ __forceinline__ StreamKRange stream_k_range(long long total, int k_all, int cta,
                                                       int ctas) {
    const long long begin = total * cta / ctas;
    const long long end = total * (cta + 1) / ctas;
    StreamKRange r;
    r.first_tile = static_cast<int>(begin / k_all);
    r.first_k = static_cast<int>(begin - static_cast<long long>(r.first_tile) * k_all);
    r.last_tile = static_cast<int>((end - 1) / k_all);
    r.end_k = static_cast<int>(end - static_cast<long long>(r.last_tile) * k_all);
    const bool owner = r.end_k != k_all && (r.first_tile != r.last_tile || r.first_k == 0);
    const long long tile_end = static_cast<long long>(r.last_tile + 1) * k_all;
    const long long last = (tile_end * ctas - 1) / total;
    r.helpers = owner ? static_cast<int>((last < ctas - 1 ? last : ctas - 1) - cta) : 0;
    return r;
}

// One arrival on a counter, ordered after every write of the CTA's threads that a barrier
// ordered before it (fence.acq_rel.gpu is cumulative; CUTLASS's generic barrier does the same).
__device__ __forceinline__ void stream_k_arrive(int* flag) {
    const size_t at = __cvta_generic_to_global(flag);
    asm volatile(
        "fence.acq_rel.gpu;\n"
        "red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(at)
        : "memory");
}

__device__ __forceinline__ int stream_k_load_acquire(const int* flag) {
    const size_t at = __cvta_generic_to_global(flag);
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(at) : "memory");
    return v;
}

__device__ __forceinline__ void stream_k_reset(int* flag) {
    const size_t at = __cvta_generic_to_global(flag);
    asm volatile("st.relaxed.gpu.global.b32 [%0], 0;" ::"l"(at) : "memory");
}

// Waits (acquire) until the counter reaches `count`. A counter that never does (a lost arrival,
// one too many, or a CTA that never ran) traps after WAIT_TIMEOUT_NS, or in debug builds
// records what = 3 (stage: the tile) and exits, as mbar_wait does.
__device__ __forceinline__ void stream_k_wait(const int* flag, int count, int tile) {
    if (stream_k_load_acquire(flag) == count) return;
    const uint64_t start = global_timer();
    for (uint32_t spin = 1;; ++spin) {
        __nanosleep(64);
        if (stream_k_load_acquire(flag) == count) return;
        if ((spin & 255) == 0 && global_timer() - start > WAIT_TIMEOUT_NS) {
#if KATO_WGMMA_DEBUG
            if (atomicCAS(&kato_wgmma_timeout[0], 0u, 3u) == 0u) {
                kato_wgmma_timeout[1] = tile;
                kato_wgmma_timeout[2] = count;
                kato_wgmma_timeout[3] = blockIdx.x;
            }
            asm volatile("exit;");
#else
            __trap();
#endif
        }
    }
}
#endif

}  // namespace KATO_NS

#if CLUSTER_M > 1
#define KATO_CLUSTER_DIMS __cluster_dims__(CLUSTER_M, 1, 1)
#elif SPLIT_K > 1
#define KATO_CLUSTER_DIMS __cluster_dims__(SPLIT_K, 1, 1)
#else
#define KATO_CLUSTER_DIMS
#endif

extern "C" __global__ void __launch_bounds__(KATO_NS::kThreads, 1) KATO_CLUSTER_DIMS
    kato_matmul_wgmma(const __grid_constant__ KATO_NS::TensorMap tmap_a,
                      const __grid_constant__ KATO_NS::TensorMap tmap_b,
#if EPILOGUE
                      const __grid_constant__ KATO_NS::TensorMap tmap_c,
#endif
                      KATO_NS::DTYPE* __restrict__ C, int M, int N, int K) {
    using namespace KATO_NS;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t full_bar[STAGES];
    __shared__ __align__(8) uint64_t empty_bar[STAGES];

    // The swizzle pattern is a function of address bits 4-9: stages start 1024-byte aligned.
    // Every CTA computes the same base (same kernel, same static layout), as multicast needs.
    const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int warpgroup = threadIdx.x / 128;
    // A cluster of CLUSTER_M CTAs takes CLUSTER_M vertically adjacent tiles (one cluster tile
    // of CLUSTER_M * BM x BN): they share B, which each CTA loads a 1 / CLUSTER_M share of and
    // multicasts to all. Tile-rows past M still take part (their A is zero-filled, their stores
    // are skipped): the other CTA needs their share of B.
#if SPLIT_K > 1
    // A split-K cluster: every CTA takes the cluster's tile, CTA kslice its kslice-th range of
    // k blocks (the host launches one cluster per tile: the k loop's stage memory is reused
    // for the reduction, which a producer running ahead into a next tile would overwrite).
    const int rank = 0;
    const int kslice = static_cast<int>(cluster_rank());
    const int cluster = blockIdx.x / SPLIT_K;
    const int clusters = gridDim.x / SPLIT_K;
#elif STREAM_K
    // No clusters; the CTAs' ranges (below) take the place of the tile loop's stride.
    const int rank = 0;
#else
    const int rank = static_cast<int>(cluster_rank());
    const int cluster = blockIdx.x / CLUSTER_M;
    const int clusters = gridDim.x / CLUSTER_M;
#endif
    const int tiles_m = (M + BM * CLUSTER_M - 1) / (BM * CLUSTER_M);
    const int tiles_n = (N + BN - 1) / BN;
    const int num_tiles = tiles_m * tiles_n;
#if SPLIT_K > 1
    const int k_all = (K + BK - 1) / BK;
    const int kt_begin = static_cast<int>(static_cast<long long>(k_all) * kslice / SPLIT_K);
    const int k_tiles = static_cast<int>(static_cast<long long>(k_all) * (kslice + 1) / SPLIT_K);
#elif STREAM_K
    // This CTA's range of the tiles x k blocks iteration space (see the header).
    const int k_all = (K + BK - 1) / BK;
    StreamKRange sk;
    {
        const long long total = static_cast<long long>(num_tiles) * k_all;
        // The host's checks keep these; past them a slot or a counter would be shared, or a
        // range empty (its CTA would never arrive): fail the launch instead.
        if (gridDim.x > STREAM_K_CTAS || num_tiles > STREAM_K_MAX_TILES || total < gridDim.x)
            __trap();
        sk = stream_k_range(total, k_all, blockIdx.x, gridDim.x);
    }
#else
    const int kt_begin = 0;
    const int k_tiles = (K + BK - 1) / BK;
#endif

    if (threadIdx.x == 0) {
        tma_prefetch_map(&tmap_a);
        tma_prefetch_map(&tmap_b);
#if EPILOGUE
        tma_prefetch_map(&tmap_c);
#endif
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 1);
            // Every consumer warp of every CTA of the cluster: each CTA writes B into all.
            mbar_init(smem_u32(&empty_bar[s]), 4 * (PINGPONG ? 1 : CONSUMERS) * CLUSTER_M);
        }
        // Make the initialised barriers visible to the async proxy (the TMA unit) and to the
        // other CTAs of the cluster.
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_sync();

    if (warpgroup == 0) {
        // Producer: one thread issues every copy; the others only lend their registers.
        setmaxnreg_dec();
        if (threadIdx.x == 0) {
            int stage = 0;
            uint32_t phase = 0;
#if STREAM_K
            for (int tile = sk.first_tile, kt_begin = sk.first_k; tile <= sk.last_tile;
                 ++tile, kt_begin = 0) {
                const int k_tiles = tile == sk.last_tile ? sk.end_k : k_all;
#else
            for (int tile = cluster; tile < num_tiles; tile += clusters) {
#endif
                int tm, tn;
                tile_coords(tile, tiles_m, tiles_n, tm, tn);
                const int m0 = (tm * CLUSTER_M + rank) * BM, n0 = tn * BN;
                for (int kt = kt_begin; kt < k_tiles; ++kt) {
                    const int k0 = kt * BK;
                    const uint32_t full = smem_u32(&full_bar[stage]);
                    // A fresh barrier counts as having completed the phase before phase 0.
                    mbar_wait(smem_u32(&empty_bar[stage]), phase ^ 1, 1, stage);
                    // The whole stage arrives here: A from this CTA, B in shares from all.
                    mbar_expect_tx(full, kStageBytes);
                    const uint32_t a_dst = smem_base + stage * kStageBytes;
                    const uint32_t b_dst = a_dst + kATileBytes;
#if TRANS_A
                    for (int c = 0; c < BM / 64; ++c)
                        tma_load_2d(a_dst + c * kChunkBytes, &tmap_a, full, m0 + c * 64, k0);
#else
                    tma_load_2d(a_dst, &tmap_a, full, k0, m0);
#endif
#if CLUSTER_M > 1
                    const uint16_t all = (1u << CLUSTER_M) - 1;
#if TRANS_B
                    tma_load_2d_multicast(b_dst + rank * kBRowsPerCta * BK * 2, &tmap_b, full,
                                          k0, n0 + rank * kBRowsPerCta, all);
#else
                    for (int c = rank; c < BN / 64; c += CLUSTER_M)
                        tma_load_2d_multicast(b_dst + c * kChunkBytes, &tmap_b, full,
                                              n0 + c * 64, k0, all);
#endif
#else
#if TRANS_B
                    tma_load_2d(b_dst, &tmap_b, full, k0, n0);
#else
                    for (int c = 0; c < BN / 64; ++c)
                        tma_load_2d(b_dst + c * kChunkBytes, &tmap_b, full, n0 + c * 64, k0);
#endif
#endif
                    if (++stage == STAGES) {
                        stage = 0;
                        phase ^= 1;
                    }
                }
            }
        }
        __syncwarp();
#if SPLIT_K > 1
        // The producer's share of split_k's two cluster barriers (every thread arrives).
        cluster_sync();
        cluster_sync();
#endif
    } else {
        setmaxnreg_inc();
        const int consumer = warpgroup - 1;
        const int warp = (threadIdx.x / 32) % 4;
        const int lane = threadIdx.x % 32;
        // The consumer's rows of a tile: its slice, or with PINGPONG the whole tile.
        const int row_part = PINGPONG ? 0 : consumer;
        int stage = 0;
        uint32_t phase = 0;
        float acc[kMI][kAccPerWgmma];
#if PINGPONG
        int local = -1;  // the CTA's tiles so far; this consumer takes every other one
#endif
#if STREAM_K
        // Segments: k blocks [kt_begin, k_tiles) of each tile of the range.
        for (int tile = sk.first_tile, kt_begin = sk.first_k; tile <= sk.last_tile;
             ++tile, kt_begin = 0) {
            const int k_tiles = tile == sk.last_tile ? sk.end_k : k_all;
#else
        for (int tile = cluster; tile < num_tiles; tile += clusters) {
#endif
#if PINGPONG
            if (((++local) & 1) != consumer) continue;
            {
                // The producer fills the stage ring with every tile's k blocks in turn: this
                // tile's first is ring position local * k_tiles.
                const unsigned long long pos =
                    static_cast<unsigned long long>(local) * static_cast<unsigned>(k_tiles);
                stage = static_cast<int>(pos % STAGES);
                phase = static_cast<uint32_t>((pos / STAGES) & 1);
            }
#endif
            int tm, tn;
            tile_coords(tile, tiles_m, tiles_n, tm, tn);
            tm = tm * CLUSTER_M + rank;
#pragma unroll
            for (int i = 0; i < kMI; ++i)
#pragma unroll
                for (int j = 0; j < kAccPerWgmma; ++j) acc[i][j] = 0.0f;
#if INFLIGHT
            int pending = -1;  // the stage whose wgmmas may still be reading it
#endif
#if PINGPONG
            // The k loops take turns: this one starts once the other consumer's (of the CTA's
            // previous tile) has seen all its stages full. Without the order, a wait on this
            // tile's stage could see the parity of an older fill of the same stage.
            if (local > 0) named_barrier(3 + (1 - consumer), 256);
#endif
            for (int kt = kt_begin; kt < k_tiles; ++kt) {
                mbar_wait(smem_u32(&full_bar[stage]), phase, 0, stage);
                const uint32_t a_tile =
                    smem_base + stage * kStageBytes + row_part * kMI * kChunkBytes;
                const uint32_t b_tile = smem_base + stage * kStageBytes + kATileBytes;
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / 16; ++ks) {
#if TRANS_B
                    const uint64_t db = desc_k_major(b_tile, ks);
#else
                    const uint64_t db = desc_mn_major(b_tile, ks);
#endif
#pragma unroll
                    for (int i = 0; i < kMI; ++i) {
#if TRANS_A
                        const uint64_t da = desc_mn_major(a_tile + i * kChunkBytes, ks);
#else
                        const uint64_t da = desc_k_major(a_tile + i * kChunkBytes, ks);
#endif
                        wgmma_tile<BN>(acc[i], da, db, 1);
                    }
                }
                wgmma_commit();
                // Release a stage once its wgmmas are complete, to every CTA whose producer
                // writes into it (all of the cluster's).
#if INFLIGHT
                wgmma_wait<1>();
                if (pending >= 0 && lane == 0)
                    for (int r = 0; r < CLUSTER_M; ++r)
                        mbar_arrive_cluster(smem_u32(&empty_bar[pending]), r);
                pending = stage;
#else
                wgmma_wait<0>();
                if (lane == 0)
                    for (int r = 0; r < CLUSTER_M; ++r)
                        mbar_arrive_cluster(smem_u32(&empty_bar[stage]), r);
#endif
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
            }
#if PINGPONG
            // Let the other consumer's k loop of the next tile start (if there is one: an
            // arrival nobody waits for would stay pending).
            if (tile + clusters < num_tiles) named_arrive(3 + consumer, 256);
#endif
#if INFLIGHT
            wgmma_wait<0>();
            if (pending >= 0 && lane == 0)
                for (int r = 0; r < CLUSTER_M; ++r)
                    mbar_arrive_cluster(smem_u32(&empty_bar[pending]), r);
#endif
#if STREAM_K
            {
                // Stream-K (see the header): this thread's accumulators, pair v of m64 slice i
                // at float2 (i * kSkVecs + v) * 128 + t of its consumer's part of a slot.
                const int t = threadIdx.x % 128;
                int* const flag = &stream_k_flags[tile * CONSUMERS + consumer];
                if (kt_begin != 0) {
                    // Not the tile's start: partial sums to this CTA's slot, then arrive
                    // (after the whole warpgroup's stores: the barrier, then the release).
                    float2* const slot = stream_k_partials +
                                         static_cast<size_t>(blockIdx.x) * kSkSlotVecs +
                                         consumer * kSkPartVecs + t;
#pragma unroll
                    for (int i = 0; i < kMI; ++i)
#pragma unroll
                        for (int v = 0; v < kSkVecs; ++v)
                            __stcg(slot + (i * kSkVecs + v) * 128,
                                   make_float2(acc[i][2 * v], acc[i][2 * v + 1]));
                    named_barrier(5 + consumer, 128);
                    if (t == 0) stream_k_arrive(flag);
                    continue;
                }
                if (k_tiles != k_all) {
                    // The tile's owner (the range's last segment): the next sk.helpers CTAs
                    // hold the rest of the tile.
                    if (t == 0) {
                        stream_k_wait(flag, sk.helpers, tile);
                        stream_k_reset(flag);  // every arrival is in: ready for the next launch
                    }
                    named_barrier(5 + consumer, 128);
                    const float2* slot = stream_k_partials +
                                         static_cast<size_t>(blockIdx.x) * kSkSlotVecs +
                                         consumer * kSkPartVecs + t;
                    for (int n = 0; n < sk.helpers; ++n) {
                        // L2 loads (.cg): the slots were written by other SMs.
                        slot += kSkSlotVecs;
#pragma unroll
                        for (int i = 0; i < kMI; ++i)
#pragma unroll
                            for (int v = 0; v < kSkVecs; ++v) {
                                const float2 part = __ldcg(slot + (i * kSkVecs + v) * 128);
                                acc[i][2 * v] += part.x;
                                acc[i][2 * v + 1] += part.y;
                            }
                    }
                }
            }
#endif
#if SPLIT_K > 1
            // Split-K reduction through distributed shared memory. Barrier 1: every CTA of the
            // cluster is done with its k loop (its stage memory is free). Each warp sends its
            // accumulators to the CTA that owns its rows (warp w: CTA w % SPLIT_K), slot
            // (source CTA, owned warp), as float4 rows of 32 lanes (512 contiguous bytes).
            // Barrier 2 (release / acquire) makes them visible; the owner then sums the
            // partials in CTA order 0, 1, ..., its own from registers: the same order on
            // every run, whichever CTA finished first.
            const int wg = consumer * 4 + warp;
            const int owner = wg % SPLIT_K;
            const uint32_t owned_base = smem_base + (wg / SPLIT_K) * kWarpAccBytes + lane * 16;
            constexpr int kSlotBytes = kOwnedWarps * kWarpAccBytes;
            constexpr int kVecs = kAccPerWgmma / 4;
            cluster_sync();
            if (kslice != owner) {
                const int slot = kslice < owner ? kslice : kslice - 1;
                const uint32_t dst = map_shared_rank(owned_base + slot * kSlotBytes, owner);
#pragma unroll
                for (int i = 0; i < kMI; ++i)
#pragma unroll
                    for (int q = 0; q < kVecs; ++q)
                        st_cluster_v4(dst + (i * kVecs + q) * 512, acc[i][4 * q],
                                      acc[i][4 * q + 1], acc[i][4 * q + 2], acc[i][4 * q + 3]);
            }
            cluster_sync();
            if (kslice != owner) continue;  // its rows are the owner's to store
#pragma unroll
            for (int i = 0; i < kMI; ++i)
#pragma unroll
                for (int q = 0; q < kVecs; ++q) {
                    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                    for (int src = 0; src < SPLIT_K; ++src) {
                        float4 part;
                        if (src == kslice) {
                            part = make_float4(acc[i][4 * q], acc[i][4 * q + 1],
                                               acc[i][4 * q + 2], acc[i][4 * q + 3]);
                        } else {
                            const int slot = src < kslice ? src : src - 1;
                            part = ld_shared_v4(owned_base + slot * kSlotBytes +
                                                (i * kVecs + q) * 512);
                        }
                        if (src == 0) {
                            sum = part;
                        } else {
                            sum.x += part.x;
                            sum.y += part.y;
                            sum.z += part.z;
                            sum.w += part.w;
                        }
                    }
                    acc[i][4 * q] = sum.x;
                    acc[i][4 * q + 1] = sum.y;
                    acc[i][4 * q + 2] = sum.z;
                    acc[i][4 * q + 3] = sum.w;
                }
#endif
            // Epilogue: fragment j of an m64nN accumulator holds rows warp*16 + lane/4 (+8)
            // and columns j*8 + (lane%4)*2 (+1) of its 64-row slice.
#if EPILOGUE
            // Through shared memory and TMA stores: the consumer goes on to its next tile while
            // the TMA unit writes this one. Row r's 16-byte unit u of a chunk lies at unit
            // u ^ (r % 8) (the 128-byte swizzle), so a warp's 32 words hit 32 banks.
            const bool leader = threadIdx.x % 128 == 0;
            const uint32_t c_tile = smem_base + STAGES * kStageBytes +
                                    consumer * kRowsPerConsumer * BN * 2;
            if (leader) tma_store_wait_read();  // the previous tile's stores have read c_tile
            named_barrier(1 + consumer, 128);
            const int r8 = lane / 4;
#pragma unroll
            for (int i = 0; i < kMI; ++i)
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int r = i * 64 + warp * 16 + r8;
                    const uint32_t at = c_tile + (j / 8) * kCChunkBytes + r * 128 +
                                        (((j % 8) ^ r8) << 4) + (lane % 4) * 4;
                    st_shared_u32(at, pack2(acc[i][4 * j], acc[i][4 * j + 1]));
                    st_shared_u32(at + 8 * 128, pack2(acc[i][4 * j + 2], acc[i][4 * j + 3]));
                }
            fence_proxy_async_smem();
            named_barrier(1 + consumer, 128);
            const int row0 = tm * BM + row_part * kRowsPerConsumer;
            if (leader && row0 < M) {
#pragma unroll
                for (int c = 0; c < BN / 64; ++c)
                    tma_store_2d(&tmap_c, c_tile + c * kCChunkBytes, tn * BN + c * 64, row0);
                tma_store_commit();
            }
#else
            const int row0 = tm * BM + row_part * kRowsPerConsumer + warp * 16 + lane / 4;
            const int col0 = tn * BN + (lane % 4) * 2;
#pragma unroll
            for (int i = 0; i < kMI; ++i)
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int row = row0 + i * 64, col = col0 + j * 8;
                    store_pair(C, M, N, row, col, acc[i][4 * j], acc[i][4 * j + 1]);
                    store_pair(C, M, N, row + 8, col, acc[i][4 * j + 2], acc[i][4 * j + 3]);
                }
#endif
        }
#if EPILOGUE
        if (threadIdx.x % 128 == 0) tma_store_wait_all();
#endif
    }
#if CLUSTER_M > 1
    // No CTA may exit while another can still arrive on its barriers or multicast into it.
    cluster_sync();
#endif
}
