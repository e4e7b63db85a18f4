// Matrix multiplication C = op(A) @ op(B), C (M, N) row-major, float32 accumulation for every
// element type. Layouts (TRANS_A, TRANS_B): A is (M, K) row-major, or (K, M) with TRANS_A (C =
// A^T @ B); B is (K, N), or (N, K) with TRANS_B (C = A @ B^T): the operands of a backward pass
// and of x @ W^T, read in place. M, N and K are kernel arguments: one compile serves every shape
// of one alignment class (ALIGN_*).
//
// Two code paths, chosen by the element type:
//
// * float32 (IS_HALF == IS_BF16 == 0): CUDA cores (FFMA, no TF32). Shared-memory tiles As[k][m]
//   (BK x BM, so that a thread reads its TM rows as float4s) and Bs[k][n] (BK x BN) in every
//   layout; an operand whose global rows run along k (A (M, K), B (N, K)) is transposed by its
//   stores into shared memory. Warp tiling: a warp covers WM x WN of the block tile, its 32 lanes
//   laid out LM x LN (LM = WM / TM, LN = 32 / LM, WN = LN * TN); a lane's TM x TN register tile
//   is split into (TM/4) x (TN/4) sub-tiles of 4 x 4, sub-tile (i, j) at rows i*4*LM + lm*4 and
//   columns j*4*LN + ln*4 of the warp tile, so every shared-memory read is a float4 that the
//   lanes of a quarter-warp take from contiguous addresses (conflict-free) or broadcast.
//   STAGES 1: load, barrier, compute, barrier. STAGES 2: double buffering with a register
//   prefetch of the next tile (its global loads are in flight during the current tile's FFMAs;
//   one barrier per tile). PAD (0 or 4 floats) pads the rows of the transposed tiles against the
//   bank conflicts of the transposing stores.
// * float16 / bfloat16 (IS_HALF or IS_BF16): tensor cores, mma.sync.aligned.m16n8k16 (f32
//   accumulators) with fragments from ldmatrix. Shared tiles keep their operand's global layout
//   (ldmatrix or ldmatrix.trans gives the mma fragments of either). A warp covers WM x WN:
//   (WM/16) x (WN/8) mma tiles. STAGES (2..4) shared-memory stages filled by cp.async (16-byte
//   copies, VEC == 8) or by plain guarded 2-byte loads: synchronous with VEC == 1; for an
//   operand whose rows are not 16-byte aligned (VEC == 8), into registers one tile ahead and
//   stored after the current tile's mma. Shared tiles are stored in 16-byte chunks with an XOR
//   swizzle (see swizzle()) so that the 8 row addresses of every ldmatrix phase fall into 8
//   distinct bank groups. C is written in the input type (as torch).
//
// Both paths: one block per output tile, tiles visited in groups of 8 tile-rows (column-major
// inside a group; see tile_coords) so that blocks running together share A and B panels in L2.
// Loads outside A or B are zero-filled, stores outside C are skipped: any M, N, K >= 1 works.
// A, B and C must start 16-byte aligned (every allocation does).
//
// Tunable parameters (`#define NAME value` lines before this template; kernels/matmul/__init__.py
// renders them and its check() enforces the constraints):
//   BM, BN, BK    block tile.
//   WM, WN        warp tile; threads per block = 32 * (BM / WM) * (BN / WN).
//   TM, TN        float32: thread tile (4 or 8 each). Tensor cores: unused (the spec pins them).
//   VEC           elements per global load and store: float32 4 (float4) or 1; tensor cores 8
//                 (16-byte cp.async) or 1. Any shape: see ALIGN_*.
//   STAGES        float32: 1 or 2 (register prefetch). Tensor cores: 2, 3 or 4 (cp.async).
//   PAD           float32: padding of the transposed tiles' rows in floats (0 or 4). Tensor
//                 cores: 0 (swizzle).
//   MIN_BLOCKS    __launch_bounds__(threads, MIN_BLOCKS); 0 = no min-blocks clause.
//   SPLIT_K       float32 on sm_90 only: 1, or 2..4 CTAs of a cluster per output tile, CTA r
//                 multiplying the r-th contiguous range of k tiles; their partial sums meet
//                 through distributed shared memory and each CTA adds, in rank order (so the
//                 result does not depend on timing), and stores a share of the tile's rows.
//                 For problems of too few tiles to fill the GPU. Absent: 1.
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16; the layout TRANS_A, TRANS_B
// (0 or 1); and from the shape, ALIGN_A, ALIGN_B, ALIGN_C: 1 where that matrix's row pitch is a
// multiple of VEC (its vectors are aligned and entirely inside or outside it: one vector load or
// store each), 0 where it is not (each vector's elements are loaded or stored one by one,
// guarded; the shared-memory side keeps its vectors).
//
// Dynamic shared memory (the launch passes it; no static shared memory at all):
//   float32: STAGES * (BK * (BM + PAD_A) + BK * (BN + PAD_B)) * 4 bytes, PAD_A = PAD unless
//   TRANS_A, PAD_B = PAD if TRANS_B; with SPLIT_K > 1 at least BM * BN * 4 (the partial sums);
//   tensor cores: STAGES * (BM * BK + BK * BN) * 2 bytes.

#ifndef KATO_NS
#define KATO_NS kato_matmul
#endif
#ifndef BM
#error "BM must be defined"
#endif
#ifndef BN
#error "BN must be defined"
#endif
#ifndef BK
#error "BK must be defined"
#endif
#ifndef WM
#error "WM must be defined"
#endif
#ifndef WN
#error "WN must be defined"
#endif
#ifndef TM
#define TM 8
#endif
#ifndef TN
#define TN 8
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef PAD
#define PAD 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#ifndef TRANS_A
#define TRANS_A 0
#endif
#ifndef TRANS_B
#define TRANS_B 0
#endif
#ifndef ALIGN_A
#define ALIGN_A 1
#endif
#ifndef ALIGN_B
#define ALIGN_B 1
#endif
#ifndef ALIGN_C
#define ALIGN_C 1
#endif
#ifndef SPLIT_K
#define SPLIT_K 1
#endif
// IS_HALF and IS_BF16 pick the code path (at most one is set), so a source compiled on its own
// is float32, not kato_dtype.cuh's "both headers".
#if !defined(IS_HALF) && !defined(IS_BF16)
#define IS_HALF 0
#define IS_BF16 0
#endif
#include "../common/kato_dtype.cuh"

#define KATO_THREADS (32 * (BM / WM) * (BN / WN))
#if MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(KATO_THREADS, MIN_BLOCKS)
#elif TRANS_A || TRANS_B || !(ALIGN_A && ALIGN_B && ALIGN_C)
// Without a min-blocks clause, ptxas (sm_80, sm_90) holds some tiles of the transposed layouts and
// of unaligned shapes far below their register cap and spills; one block per SM gives it the whole
// cap, as check() models. (A @ B at aligned shapes keeps the clause-free form it was tuned with.)
#define KATO_LAUNCH_BOUNDS __launch_bounds__(KATO_THREADS, 1)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(KATO_THREADS)
#endif

namespace KATO_NS {

using T = DTYPE;

constexpr int kThreads = KATO_THREADS;
constexpr int kWarpsN = BN / WN;
constexpr int kGroupM = 8;

static_assert(BM % WM == 0 && BN % WN == 0, "warp tiles must divide the block tile");
static_assert(kThreads >= 32 && kThreads <= 1024, "threads per block out of range");
static_assert(!(IS_HALF && IS_BF16), "IS_HALF and IS_BF16 are exclusive");
static_assert(SPLIT_K >= 1 && SPLIT_K <= 4, "SPLIT_K must be 1..4");
static_assert(SPLIT_K == 1 || !(IS_HALF || IS_BF16), "SPLIT_K > 1 is the float32 path's");

// Output tile of this block. blockIdx.y is a group of kGroupM tile-rows; blockIdx.x runs over
// the group's tiles column-major, so that the blocks running at the same time share a few A and
// B panels in L2. Blocks past the end of the last (smaller) group return at once (uniformly, before
// any barrier). No runtime division: ptxas turns a 32-bit division by a variable into a called
// subroutine that spills, and x / rows with rows in 1..kGroupM is unrolled into divisions by
// constants.
__device__ __forceinline__ bool tile_coords(int tiles_m, int tiles_n, int& tm, int& tn) {
  const int first_m = static_cast<int>(blockIdx.y) * kGroupM;
  const int rows = min(tiles_m - first_m, kGroupM);
  // A split-K cluster's SPLIT_K CTAs (consecutive in x) share one tile.
  const unsigned x = blockIdx.x / SPLIT_K;
  if (x >= static_cast<unsigned>(rows * tiles_n)) return false;
  unsigned q = x;
#pragma unroll
  for (int d = 2; d <= kGroupM; ++d) {
    if (rows == d) q = x / static_cast<unsigned>(d);
  }
  tm = first_m + static_cast<int>(x - q * static_cast<unsigned>(rows));
  tn = static_cast<int>(q);
  return true;
}

#if !(IS_HALF || IS_BF16)
// ------------------------------------------------------------------------------------------------
// float32 on CUDA cores
// ------------------------------------------------------------------------------------------------

constexpr int kLM = WM / TM;  // lanes along M in a warp
constexpr int kLN = 32 / kLM;  // lanes along N
// Shared tiles are As[k][m] and Bs[k][n] in every layout (one inner loop). An operand whose rows
// run along k in global memory (A of TRANS_A == 0, B of TRANS_B == 1) is transposed by its stores
// into shared memory; only those tiles take the PAD (against the stores' bank conflicts).
constexpr int kAsLd = BM + (TRANS_A ? 0 : PAD);  // row stride of As[k][m]
constexpr int kBsLd = BN + (TRANS_B ? PAD : 0);  // row stride of Bs[k][n]
constexpr int kAsSize = BK * kAsLd;
constexpr int kBsSize = BK * kBsLd;

static_assert(TM % 4 == 0 && TN % 4 == 0, "TM and TN must be multiples of 4");
static_assert(WM % TM == 0 && 32 % kLM == 0 && kLN * TN == WN, "warp layout: WN = TN*32/(WM/TM)");
static_assert(VEC == 1 || VEC == 4, "float32 VEC must be 1 or 4");
static_assert(BK % VEC == 0 && BN % VEC == 0, "VEC must divide BK and BN");
static_assert(PAD % 4 == 0, "PAD keeps As and Bs rows 16-byte aligned");
static_assert(STAGES == 1 || STAGES == 2, "float32 STAGES must be 1 or 2");

template <int V>
struct VecOf { using type = float; };
template <>
struct VecOf<4> { using type = float4; };
using Vec = typename VecOf<VEC>::type;

// A tile of ROWS x COLS elements as stored in global memory (row-major), read as vectors of VEC
// consecutive columns; vector idx is row idx / kPerRow, columns (idx % kPerRow) * VEC.
template <int ROWS, int COLS>
struct Tile {
  static constexpr int kPerRow = COLS / VEC;
  static constexpr int kVecs = ROWS * kPerRow;
  static constexpr int kLoads = (kVecs + kThreads - 1) / kThreads;  // per thread
};
// The A tile: BM rows of BK (A is (M, K)) or, with TRANS_A, BK rows of BM (A is (K, M)); the B
// tile: BK rows of BN (B is (K, N)) or, with TRANS_B, BN rows of BK (B is (N, K)).
using ATile = Tile<TRANS_A ? BK : BM, TRANS_A ? BM : BK>;
using BTile = Tile<TRANS_B ? BN : BK, TRANS_B ? BK : BN>;
constexpr int kALoads = ATile::kLoads;
constexpr int kBLoads = BTile::kLoads;

__device__ __forceinline__ void set_zero(float4& v) { v = make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void set_zero(float& v) { v = 0.f; }

// The first `valid` elements at p, one load each (a row whose pitch is not a multiple of 4
// floats: its vectors are not 16-byte aligned); the rest stay zero.
__device__ __forceinline__ void load_guarded(float4& v, const float* p, int valid) {
  if (valid > 0) v.x = __ldg(p);
  if (valid > 1) v.y = __ldg(p + 1);
  if (valid > 2) v.z = __ldg(p + 2);
  if (valid > 3) v.w = __ldg(p + 3);
}
__device__ __forceinline__ void load_guarded(float& v, const float* p, int valid) {
  if (valid > 0) v = __ldg(p);
}

// Global -> registers: the tile at (r0, c0) of a row-major rows x cols matrix (row pitch cols),
// zero outside it. ALIGNED (cols % VEC == 0, 16-byte aligned base): a vector is entirely inside
// or outside the matrix and aligned, one vector load; otherwise its elements load one by one.
template <class Shape, bool ALIGNED>
__device__ __forceinline__ void load_tile(const float* __restrict__ src, int rows, int cols,
                                          int r0, int c0, int tid, Vec (&reg)[Shape::kLoads]) {
#pragma unroll
  for (int i = 0; i < Shape::kLoads; ++i) {
    const int idx = tid + i * kThreads;
    set_zero(reg[i]);
    if (Shape::kVecs % kThreads == 0 || idx < Shape::kVecs) {
      const int r = idx / Shape::kPerRow;
      const int c = (idx % Shape::kPerRow) * VEC;
      const int gr = r0 + r;
      const int gc = c0 + c;
      if (ALIGNED) {
        if (gr < rows && gc < cols) {
          reg[i] = __ldg(reinterpret_cast<const Vec*>(src + static_cast<long long>(gr) * cols + gc));
        }
      } else if (gr < rows) {
        load_guarded(reg[i], src + static_cast<long long>(gr) * cols + gc, cols - gc);
      }
    }
  }
}

// Element (r, c..c+VEC-1) of a tile into dst[r][c..] (as is) or dst[c..][r] (TRANSPOSE).
__device__ __forceinline__ void put(float* dst, int ld, int r, int c, const float4& v,
                                    bool transpose) {
  if (transpose) {
    dst[(c + 0) * ld + r] = v.x;
    dst[(c + 1) * ld + r] = v.y;
    dst[(c + 2) * ld + r] = v.z;
    dst[(c + 3) * ld + r] = v.w;
  } else {
    *reinterpret_cast<float4*>(dst + r * ld + c) = v;
  }
}
__device__ __forceinline__ void put(float* dst, int ld, int r, int c, float v, bool transpose) {
  dst[transpose ? c * ld + r : r * ld + c] = v;
}

// Registers -> shared: the tile into dst with row stride LD, transposed if TRANSPOSE.
template <class Shape, bool TRANSPOSE, int LD>
__device__ __forceinline__ void store_tile(float* __restrict__ dst, int tid,
                                           const Vec (&reg)[Shape::kLoads]) {
#pragma unroll
  for (int i = 0; i < Shape::kLoads; ++i) {
    const int idx = tid + i * kThreads;
    if (Shape::kVecs % kThreads == 0 || idx < Shape::kVecs) {
      put(dst, LD, idx / Shape::kPerRow, (idx % Shape::kPerRow) * VEC, reg[i], TRANSPOSE);
    }
  }
}

// Global -> registers: the A tile of rows m0.. and k0.. and the B tile of k0.. and columns n0..
__device__ __forceinline__ void load_tiles(const float* __restrict__ A, const float* __restrict__ B,
                                           int M, int N, int K, int m0, int n0, int k0, int tid,
                                           Vec (&ra)[kALoads], Vec (&rb)[kBLoads]) {
  if (TRANS_A) {
    load_tile<ATile, ALIGN_A != 0>(A, K, M, k0, m0, tid, ra);
  } else {
    load_tile<ATile, ALIGN_A != 0>(A, M, K, m0, k0, tid, ra);
  }
  if (TRANS_B) {
    load_tile<BTile, ALIGN_B != 0>(B, N, K, n0, k0, tid, rb);
  } else {
    load_tile<BTile, ALIGN_B != 0>(B, K, N, k0, n0, tid, rb);
  }
}

// Registers -> shared: As[k][m], Bs[k][n].
__device__ __forceinline__ void store_tiles(float* __restrict__ As, float* __restrict__ Bs,
                                            int tid, const Vec (&ra)[kALoads],
                                            const Vec (&rb)[kBLoads]) {
  store_tile<ATile, TRANS_A == 0, kAsLd>(As, tid, ra);
  store_tile<BTile, TRANS_B != 0, kBsLd>(Bs, tid, rb);
}

// acc += As^T-tile x Bs-tile for this thread's TM x TN outputs. a_off / b_off: the thread's first
// row of As / column of Bs (warp offset + lane offset).
__device__ __forceinline__ void compute_tile(const float* __restrict__ As,
                                             const float* __restrict__ Bs, int a_off, int b_off,
                                             float (&acc)[TM][TN]) {
#pragma unroll
  for (int k = 0; k < BK; ++k) {
    float a[TM];
    float b[TN];
#pragma unroll
    for (int i = 0; i < TM / 4; ++i) {
      const float4 v = *reinterpret_cast<const float4*>(As + k * kAsLd + a_off + i * 4 * kLM);
      a[i * 4 + 0] = v.x;
      a[i * 4 + 1] = v.y;
      a[i * 4 + 2] = v.z;
      a[i * 4 + 3] = v.w;
    }
#pragma unroll
    for (int j = 0; j < TN / 4; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(Bs + k * kBsLd + b_off + j * 4 * kLN);
      b[j * 4 + 0] = v.x;
      b[j * 4 + 1] = v.y;
      b[j * 4 + 2] = v.z;
      b[j * 4 + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
}

#if SPLIT_K > 1
// --- split-K clusters (sm_90) ----------------------------------------------------------------
__device__ __forceinline__ int cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return static_cast<int>(rank);
}

// Every thread of every CTA of the cluster; releases this CTA's shared-memory writes to the
// others and acquires theirs.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The float4 at shared-memory address `addr` of CTA `rank` of the cluster.
__device__ __forceinline__ float4 ld_cluster_v4(unsigned addr, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// The cluster's partial sums of this thread's TM x TN outputs: each CTA puts its accumulators in
// its own shared memory (slot (i, j4) of thread tid at [(i * TN / 4 + j4) * kThreads + tid]: a
// warp reads 512 consecutive bytes); then CTA `kslice` adds, in rank order, the rows i of the
// thread tile with i % SPLIT_K == kslice into acc, the rows it stores.
__device__ __forceinline__ void split_k_reduce(float* smem, int tid, int kslice,
                                               float (&acc)[TM][TN]) {
  __syncthreads();  // every warp is done reading the stage buffers, reused here
  float4* red = reinterpret_cast<float4*>(smem);
#pragma unroll
  for (int i = 0; i < TM; ++i) {
#pragma unroll
    for (int j = 0; j < TN / 4; ++j) {
      red[(i * (TN / 4) + j) * kThreads + tid] =
          make_float4(acc[i][j * 4 + 0], acc[i][j * 4 + 1], acc[i][j * 4 + 2], acc[i][j * 4 + 3]);
    }
  }
  cluster_sync();
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(red));
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    if (i % SPLIT_K != kslice) continue;
#pragma unroll
    for (int j = 0; j < TN / 4; ++j) {
      const unsigned addr = base + ((i * (TN / 4) + j) * kThreads + tid) * 16u;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int q = 0; q < SPLIT_K; ++q) {
        const float4 v = ld_cluster_v4(addr, q);
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      }
      acc[i][j * 4 + 0] = sum.x;
      acc[i][j * 4 + 1] = sum.y;
      acc[i][j * 4 + 2] = sum.z;
      acc[i][j * 4 + 3] = sum.w;
    }
  }
}
#endif

__device__ __forceinline__ void matmul(const float* __restrict__ A, const float* __restrict__ B,
                                       float* __restrict__ C, int M, int N, int K,
                                       float* smem) {
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int lm = lane / kLN;
  const int ln = lane % kLN;
  const int a_off = (warp / kWarpsN) * WM + lm * 4;  // first row of the thread in the tile
  const int b_off = (warp % kWarpsN) * WN + ln * 4;  // first column
  const int tiles_m = (M + BM - 1) / BM;
  const int tiles_n = (N + BN - 1) / BN;
  const int k_tiles = (K + BK - 1) / BK;

  int tm, tn;
  if (!tile_coords(tiles_m, tiles_n, tm, tn)) return;
  {
    const int m0 = tm * BM;
    const int n0 = tn * BN;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    }
    Vec ra[kALoads];
    Vec rb[kBLoads];

#if SPLIT_K > 1
    // This CTA's contiguous range of k tiles (check() keeps every range non-empty).
    const int kslice = cluster_rank();
    const int k_begin = k_tiles * kslice / SPLIT_K;
    const int k_end = k_tiles * (kslice + 1) / SPLIT_K;
#else
    const int k_begin = 0;
    const int k_end = k_tiles;
#endif
#if STAGES == 2
    load_tiles(A, B, M, N, K, m0, n0, k_begin * BK, tid, ra, rb);
    store_tiles(smem, smem + kAsSize, tid, ra, rb);
    __syncthreads();
    for (int kt = k_begin; kt < k_end; ++kt) {
      const int buf = (kt - k_begin) & 1;
      const bool more = kt + 1 < k_end;  // uniform across the block
      if (more) load_tiles(A, B, M, N, K, m0, n0, (kt + 1) * BK, tid, ra, rb);
      const float* As = smem + buf * (kAsSize + kBsSize);
      compute_tile(As, As + kAsSize, a_off, b_off, acc);
      if (more) {
        float* next = smem + (buf ^ 1) * (kAsSize + kBsSize);
        store_tiles(next, next + kAsSize, tid, ra, rb);
      }
      __syncthreads();  // next buffer written; this buffer free for the tile after next
    }
#else
    for (int kt = k_begin; kt < k_end; ++kt) {
      load_tiles(A, B, M, N, K, m0, n0, kt * BK, tid, ra, rb);
      store_tiles(smem, smem + kAsSize, tid, ra, rb);
      __syncthreads();
      compute_tile(smem, smem + kAsSize, a_off, b_off, acc);
      __syncthreads();
    }
#endif

#if SPLIT_K > 1
    split_k_reduce(smem, tid, kslice, acc);
#endif
    // Epilogue: sub-tile (i/4, j/4) row i%4 of the thread -> C, guarded (with SPLIT_K, the rows
    // this CTA summed).
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#if SPLIT_K > 1
      if (i % SPLIT_K != kslice) continue;
#endif
      const int gm = m0 + a_off + (i / 4) * 4 * kLM + i % 4;
      if (gm >= M) continue;
      float* crow = C + static_cast<long long>(gm) * N;
#pragma unroll
      for (int j = 0; j < TN / 4; ++j) {
        const int gn = n0 + b_off + j * 4 * kLN;
#if VEC == 4 && ALIGN_C
        // N % 4 == 0 and gn % 4 == 0: the 4 columns are all inside or all outside.
        if (gn < N) {
          *reinterpret_cast<float4*>(crow + gn) = make_float4(
              acc[i][j * 4 + 0], acc[i][j * 4 + 1], acc[i][j * 4 + 2], acc[i][j * 4 + 3]);
        }
#else
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          if (gn + jj < N) crow[gn + jj] = acc[i][j * 4 + jj];
        }
#endif
      }
    }
#if SPLIT_K > 1
    cluster_sync();  // the other CTAs read this one's partial sums until here
#endif
  }
}

#else
// ------------------------------------------------------------------------------------------------
// float16 / bfloat16 on tensor cores
// ------------------------------------------------------------------------------------------------

constexpr int kMI = WM / 16;  // mma tiles per warp along M
constexpr int kNI = WN / 8;  // along N
// Shared tiles keep the global layout of their operand: As is [BM][BK] (A is (M, K)) or, with
// TRANS_A, [BK][BM] (A is (K, M)), read by ldmatrix (.trans for [BK][BM]); Bs is [BK][BN] (B is
// (K, N)) or, with TRANS_B, [BN][BK] (B is (N, K)), read by ldmatrix.trans ([BK][BN]) or plain.
constexpr int kALd = TRANS_A ? BM : BK;  // elements per As row
constexpr int kBLd = TRANS_B ? BK : BN;  // per Bs row
constexpr int kCA = kALd / 8;  // 16-byte chunks per As row
constexpr int kCB = kBLd / 8;  // per Bs row
constexpr int kAsSize = BM * BK;  // elements per stage
constexpr int kBsSize = BK * BN;

static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must be a multiple of 16 x 16");
static_assert(BK % 16 == 0 && BK >= 16, "BK must be a multiple of 16");
static_assert(BM % 64 == 0 && BN % 64 == 0, "BM and BN must be multiples of 64");
static_assert((kCA & (kCA - 1)) == 0 && (kCB & (kCB - 1)) == 0, "chunks per row: powers of 2");
static_assert(VEC == 1 || VEC == 8, "tensor-core VEC must be 1 or 8");
static_assert(STAGES >= 2 && STAGES <= 4, "tensor-core STAGES must be 2..4");

// Physical 16-byte chunk of logical chunk c in row r of a tile with C chunks per row (a power of
// two). Rows are C * 16 bytes; ldmatrix reads 8 consecutive rows at one logical chunk per phase,
// and (r * C + swizzle(r, c)) mod 8 must differ for those 8 rows: C >= 8 XORs with r mod 8
// (rows are whole 128-byte lines), C == 4 or 2 XORs with the row's index inside the group of
// 8 / C rows that share a 128-byte line.
template <int C>
__device__ __forceinline__ int swizzle(int r, int c) {
  if constexpr (C >= 8) {
    return c ^ (r & 7);
  } else {
    return c ^ ((r / (8 / C)) & (C - 1));
  }
}

// KATO_EMULATION: the CPU emulation of tests/kernels/test_matmul_compile.py supplies host
// versions of the PTX below (kato_emu_*); nvcc never defines it.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
#ifdef KATO_EMULATION
  return kato_emu_smem_offset(p);
#else
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
#endif
}

// 16-byte global -> shared copy; src_bytes == 0 zero-fills (src is then not read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
#ifdef KATO_EMULATION
  kato_emu_cp_async16(dst, src, src_bytes);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifndef KATO_EMULATION
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef KATO_EMULATION
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
#ifdef KATO_EMULATION
  kato_emu_ldmatrix_x4(r, addr, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
#ifdef KATO_EMULATION
  kato_emu_ldmatrix_x4(r, addr, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
#ifdef KATO_EMULATION
  kato_emu_mma16816<T>(c, a, b0, b1);
#elif IS_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Global -> shared: the ROWS x COLS tile at (r0, c0) of a row-major rows x cols matrix (row pitch
// cols) into dst[ROWS][COLS], swizzled by 16-byte chunk; zeros outside the matrix.
template <int ROWS, int COLS, bool ALIGNED>
__device__ __forceinline__ void load_tile(const unsigned short* __restrict__ src, int rows,
                                          int cols, int r0, int c0, unsigned short* dst,
                                          int tid) {
  constexpr int kC = COLS / 8;
#if VEC == 8
  constexpr int kChunks = ROWS * kC;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    if (kChunks % kThreads == 0 || idx < kChunks) {
      const int r = idx / kC;
      const int c = idx % kC;
      const int gr = r0 + r;
      const int gc = c0 + c * 8;
      if (ALIGNED) {
        // cols % 8 == 0: a chunk is entirely inside or outside, and 16-byte aligned.
        const bool ok = gr < rows && gc < cols;
        const unsigned short* p = ok ? src + static_cast<long long>(gr) * cols + gc : src;
        cp_async16(smem_u32(dst + r * COLS + swizzle<kC>(r, c) * 8), p, ok ? 16 : 0);
      } else {
        // Rows not 16-byte aligned: the chunk's elements load one by one (synchronously) and
        // go to shared memory as one 16-byte store.
        const unsigned short* p = src + static_cast<long long>(gr) * cols + gc;
        unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (gr < rows && gc + e < cols) w[e / 2] |= static_cast<unsigned>(p[e]) << (16 * (e % 2));
        }
        *reinterpret_cast<uint4*>(dst + r * COLS + swizzle<kC>(r, c) * 8) =
            make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
#else
  // Scalar, synchronous: consecutive threads take consecutive columns of a row.
  constexpr int kElems = ROWS * COLS;
#pragma unroll 4
  for (int idx = tid; idx < kElems; idx += kThreads) {
    const int r = idx / COLS;
    const int c = idx % COLS;
    const int gr = r0 + r;
    const int gc = c0 + c;
    unsigned short v = 0;
    if (gr < rows && gc < cols) v = src[static_cast<long long>(gr) * cols + gc];
    dst[r * COLS + swizzle<kC>(r, c / 8) * 8 + c % 8] = v;
  }
#endif
}

// One stage: the A tile of rows m0.. and k0.. and the B tile of k0.. and columns n0.., in their
// global layouts (see kALd, kBLd).
__device__ __forceinline__ void load_stage(const unsigned short* __restrict__ A,
                                           const unsigned short* __restrict__ B,
                                           unsigned short* As, unsigned short* Bs, int M, int N,
                                           int K, int m0, int n0, int k0, int tid) {
  if (TRANS_A) {
    load_tile<BK, BM, ALIGN_A != 0>(A, K, M, k0, m0, As, tid);
  } else {
    load_tile<BM, BK, ALIGN_A != 0>(A, M, K, m0, k0, As, tid);
  }
  if (TRANS_B) {
    load_tile<BN, BK, ALIGN_B != 0>(B, N, K, n0, k0, Bs, tid);
  } else {
    load_tile<BK, BN, ALIGN_B != 0>(B, K, N, k0, n0, Bs, tid);
  }
}

#if VEC == 8 && !(ALIGN_A && ALIGN_B)
// An operand whose rows are not 16-byte aligned, in the main loop: its elements for stage
// kt + STAGES - 1 are loaded into registers before stage kt is multiplied and stored after it,
// so that their latency overlaps the mma's as cp.async's does (the prologue loads them at once).
template <int ROWS, int COLS>
struct Staged {
  static constexpr int kC = COLS / 8;
  static constexpr int kChunks = ROWS * kC;
  static constexpr int kPer = (kChunks + kThreads - 1) / kThreads;  // chunks per thread
};
template <bool TRANSPOSED>
using StagedA = Staged<TRANSPOSED ? BK : BM, TRANSPOSED ? BM : BK>;
template <bool TRANSPOSED>
using StagedB = Staged<TRANSPOSED ? BN : BK, TRANSPOSED ? BK : BN>;
using SA = StagedA<TRANS_A != 0>;
using SB = StagedB<TRANS_B != 0>;

// The 8 elements of each of the thread's chunks (zero outside the matrix), one load each.
template <class S>
__device__ __forceinline__ void fetch_chunks(const unsigned short* __restrict__ src, int rows,
                                             int cols, int r0, int c0, int tid,
                                             unsigned short (&reg)[S::kPer][8]) {
#pragma unroll
  for (int i = 0; i < S::kPer; ++i) {
    const int idx = tid + i * kThreads;
    const int gr = r0 + idx / S::kC;
    const int gc = c0 + (idx % S::kC) * 8;
    const bool row_ok = (S::kChunks % kThreads == 0 || idx < S::kChunks) && gr < rows;
    const unsigned short* p = src + static_cast<long long>(gr) * cols + gc;
#pragma unroll
    for (int e = 0; e < 8; ++e) reg[i][e] = row_ok && gc + e < cols ? p[e] : 0;
  }
}

// The fetched chunks into dst[ROWS][COLS], one 16-byte store each, swizzled as load_tile's.
template <class S, int COLS>
__device__ __forceinline__ void put_chunks(unsigned short* dst, int tid,
                                           const unsigned short (&reg)[S::kPer][8]) {
#pragma unroll
  for (int i = 0; i < S::kPer; ++i) {
    const int idx = tid + i * kThreads;
    if (S::kChunks % kThreads == 0 || idx < S::kChunks) {
      const int r = idx / S::kC;
      const int c = idx % S::kC;
      unsigned w[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        w[h] = static_cast<unsigned>(reg[i][2 * h]) | (static_cast<unsigned>(reg[i][2 * h + 1]) << 16);
      }
      *reinterpret_cast<uint4*>(dst + r * COLS + swizzle<S::kC>(r, c) * 8) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Stage k0..: cp.async for the aligned operand, registers for the unaligned one(s).
__device__ __forceinline__ void issue_stage(const unsigned short* __restrict__ A,
                                            const unsigned short* __restrict__ B,
                                            unsigned short* As, unsigned short* Bs, int M, int N,
                                            int K, int m0, int n0, int k0, int tid,
                                            unsigned short (&ra)[SA::kPer][8],
                                            unsigned short (&rb)[SB::kPer][8]) {
  if (ALIGN_A) {
    if (TRANS_A) {
      load_tile<BK, BM, true>(A, K, M, k0, m0, As, tid);
    } else {
      load_tile<BM, BK, true>(A, M, K, m0, k0, As, tid);
    }
  } else if (TRANS_A) {
    fetch_chunks<SA>(A, K, M, k0, m0, tid, ra);
  } else {
    fetch_chunks<SA>(A, M, K, m0, k0, tid, ra);
  }
  if (ALIGN_B) {
    if (TRANS_B) {
      load_tile<BN, BK, true>(B, N, K, n0, k0, Bs, tid);
    } else {
      load_tile<BK, BN, true>(B, K, N, k0, n0, Bs, tid);
    }
  } else if (TRANS_B) {
    fetch_chunks<SB>(B, N, K, n0, k0, tid, rb);
  } else {
    fetch_chunks<SB>(B, K, N, k0, n0, tid, rb);
  }
}

__device__ __forceinline__ void finish_stage(unsigned short* As, unsigned short* Bs, int tid,
                                             const unsigned short (&ra)[SA::kPer][8],
                                             const unsigned short (&rb)[SB::kPer][8]) {
  if (!ALIGN_A) put_chunks<SA, TRANS_A ? BM : BK>(As, tid, ra);
  if (!ALIGN_B) put_chunks<SB, TRANS_B ? BK : BN>(Bs, tid, rb);
}
#endif

// acc += this warp's WM x WN block of As x Bs (one stage).
__device__ __forceinline__ void compute_stage(const unsigned short* As, const unsigned short* Bs,
                                              int wm0, int wn0, int lane,
                                              float (&acc)[kMI][kNI][4]) {
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    unsigned a[kMI][4];
    unsigned b[kNI][2];
#pragma unroll
    for (int i = 0; i < kMI; ++i) {
      if (TRANS_A) {
        // As[k][m]: matrix q of lanes 8q.. is k 8 * (q / 2).. at m 8 * (q % 2).., transposed.
        const int q = lane >> 3;
        const int r = kk * 16 + (q >> 1) * 8 + (lane & 7);
        const int c = (wm0 + i * 16) / 8 + (q & 1);
        ldmatrix_x4_trans(a[i], smem_u32(As + r * kALd + swizzle<kCA>(r, c) * 8));
      } else {
        // lanes 0-15: rows 0-15 at k 0-7; lanes 16-31: rows 0-15 at k 8-15 -> a0..a3.
        const int r = wm0 + i * 16 + (lane & 15);
        const int c = kk * 2 + (lane >> 4);
        ldmatrix_x4(a[i], smem_u32(As + r * kALd + swizzle<kCA>(r, c) * 8));
      }
    }
#pragma unroll
    for (int j = 0; j < kNI / 2; ++j) {
      unsigned q[4];
      if (TRANS_B) {
        // Bs[n][k]: matrix p of lanes 8p.. is n 8 * (p / 2).. at k 8 * (p % 2).., not transposed.
        const int p = lane >> 3;
        const int r = wn0 + j * 16 + (p >> 1) * 8 + (lane & 7);
        const int c = kk * 2 + (p & 1);
        ldmatrix_x4(q, smem_u32(Bs + r * kBLd + swizzle<kCB>(r, c) * 8));
      } else {
        // lanes 0-7: k 0-7, lanes 8-15: k 8-15 of n-tile 2j; lanes 16-31: the same of 2j+1.
        const int r = kk * 16 + (lane & 15);
        const int c = (wn0 + j * 16) / 8 + (lane >> 4);
        ldmatrix_x4_trans(q, smem_u32(Bs + r * kBLd + swizzle<kCB>(r, c) * 8));
      }
      b[2 * j][0] = q[0];
      b[2 * j][1] = q[1];
      b[2 * j + 1][0] = q[2];
      b[2 * j + 1][1] = q[3];
    }
#pragma unroll
    for (int i = 0; i < kMI; ++i) {
#pragma unroll
      for (int j = 0; j < kNI; ++j) mma16816(acc[i][j], a[i], b[j][0], b[j][1]);
    }
  }
}

__device__ __forceinline__ void store_pair(T* C, long long offset, float x, float y) {
#if IS_BF16
  *reinterpret_cast<__nv_bfloat162*>(C + offset) = __floats2bfloat162_rn(x, y);
#else
  *reinterpret_cast<__half2*>(C + offset) = __floats2half2_rn(x, y);
#endif
}

__device__ __forceinline__ void store_one(T* C, long long offset, float x) {
#if IS_BF16
  C[offset] = __float2bfloat16_rn(x);
#else
  C[offset] = __float2half_rn(x);
#endif
}

__device__ __forceinline__ void matmul(const T* __restrict__ A_, const T* __restrict__ B_,
                                       T* __restrict__ C, int M, int N, int K,
                                       unsigned short* smem) {
  const unsigned short* A = reinterpret_cast<const unsigned short*>(A_);
  const unsigned short* B = reinterpret_cast<const unsigned short*>(B_);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wm0 = (warp / kWarpsN) * WM;
  const int wn0 = (warp % kWarpsN) * WN;
  const int tiles_m = (M + BM - 1) / BM;
  const int tiles_n = (N + BN - 1) / BN;
  const int k_tiles = (K + BK - 1) / BK;

  int tm, tn;
  if (!tile_coords(tiles_m, tiles_n, tm, tn)) return;
  {
    const int m0 = tm * BM;
    const int n0 = tn * BN;

    float acc[kMI][kNI][4];
#pragma unroll
    for (int i = 0; i < kMI; ++i) {
#pragma unroll
      for (int j = 0; j < kNI; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
      }
    }

    // Prologue: stages 0 .. STAGES-2 in flight (one commit group each, empty past the end).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < k_tiles) {
        unsigned short* As = smem + s * (kAsSize + kBsSize);
        load_stage(A, B, As, As + kAsSize, M, N, K, m0, n0, s * BK, tid);
      }
      cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      // Groups committed: STAGES-1 + kt; at most STAGES-2 pending -> group kt has landed.
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile kt visible to all; stage (kt-1) % STAGES no longer read
      const int pf = kt + STAGES - 1;
#if VEC == 8 && !(ALIGN_A && ALIGN_B)
      unsigned short* next = smem + (pf % STAGES) * (kAsSize + kBsSize);
      unsigned short ra[SA::kPer][8];
      unsigned short rb[SB::kPer][8];
      if (pf < k_tiles) issue_stage(A, B, next, next + kAsSize, M, N, K, m0, n0, pf * BK, tid, ra, rb);
#else
      if (pf < k_tiles) {
        unsigned short* As = smem + (pf % STAGES) * (kAsSize + kBsSize);
        load_stage(A, B, As, As + kAsSize, M, N, K, m0, n0, pf * BK, tid);
      }
#endif
      cp_async_commit();
      const unsigned short* As = smem + (kt % STAGES) * (kAsSize + kBsSize);
      compute_stage(As, As + kAsSize, wm0, wn0, lane, acc);
#if VEC == 8 && !(ALIGN_A && ALIGN_B)
      // Stage pf was last read in iteration kt - 1 (before this iteration's barrier) and is next
      // read in iteration pf > kt (after the next barrier).
      if (pf < k_tiles) finish_stage(next, next + kAsSize, tid, ra, rb);
#endif
    }
    cp_async_wait<0>();  // only empty groups can be pending here

    // Epilogue: c0,c1 at (row g, cols 2*tig, +1), c2,c3 at (row g + 8, same cols).
    const int g = lane >> 2;
    const int tig = lane & 3;
#pragma unroll
    for (int i = 0; i < kMI; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int gm = m0 + wm0 + i * 16 + g + h * 8;
        if (gm >= M) continue;
        const long long row = static_cast<long long>(gm) * N;
#pragma unroll
        for (int j = 0; j < kNI; ++j) {
          const int gn = n0 + wn0 + j * 8 + tig * 2;
#if VEC == 8 && ALIGN_C
          // N even and gn even: both columns inside or both outside; 4-byte aligned.
          if (gn < N) store_pair(C, row + gn, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
#else
          if (gn < N) store_one(C, row + gn, acc[i][j][2 * h]);
          if (gn + 1 < N) store_one(C, row + gn + 1, acc[i][j][2 * h + 1]);
#endif
        }
      }
    }
  }
}

#endif

}  // namespace KATO_NS

#if SPLIT_K > 1
#define KATO_CLUSTER_DIMS __cluster_dims__(SPLIT_K, 1, 1)
#else
#define KATO_CLUSTER_DIMS
#endif

extern "C" __global__ void KATO_LAUNCH_BOUNDS KATO_CLUSTER_DIMS
matmul_kernel(const DTYPE* __restrict__ A, const DTYPE* __restrict__ B, DTYPE* __restrict__ C,
              int M, int N, int K) {
  extern __shared__ __align__(16) unsigned char kato_smem[];
#if IS_HALF || IS_BF16
  KATO_NS::matmul(A, B, C, M, N, K, reinterpret_cast<unsigned short*>(kato_smem));
#else
  KATO_NS::matmul(A, B, C, M, N, K, reinterpret_cast<float*>(kato_smem));
#endif
}
