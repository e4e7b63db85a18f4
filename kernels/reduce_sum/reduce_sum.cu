// Sum over the last dimension of a row-major (rows, cols) matrix:  out[r] = sum_c x[r, c].
// float32 accumulation for every element type; the output is float32 for every input type.
//
// Tunable parameters arrive as `#define NAME value` lines before this template (rendered by
// kernels/reduce_sum/__init__.py):
//   BLOCK_SIZE   threads per block: a multiple of 32 in [32, 1024].
//   ROW_THREADS  threads that share one row: 1, 2, 4, 8, 16 or 32 (an aligned group of lanes
//                of one warp; BLOCK_SIZE / ROW_THREADS rows per block, shuffles only, no
//                barrier; 1: a thread per row, no shuffles at all, for rows of a few elements)
//                or 0 (the whole block per row: shuffles, then a shared array across warps).
//   VEC          elements per vector load; VEC * sizeof(DTYPE) <= 16 bytes.
//   UNROLL       vectors loaded per thread per step (all issued before any is used).
// Derived:
//   ALIGNED_ROWS 1: every row starts on a vector boundary and holds whole vectors (cols % VEC
//                == 0, x 16-byte aligned); 0: any cols and any base address: each row is a
//                scalar head up to the first VEC-aligned element, an aligned vector body and a
//                scalar tail (split_row), so VEC stays free whatever cols is.
//   ROW_SPLIT    1: each row is cut into `parts` contiguous pieces of its vector body, one block
//                per piece (ROW_THREADS must be 0), so a few long rows keep every SM busy; parts
//                = gridDim.x / rows (the spec launches rows * ceil(SPLIT * 132 / rows) blocks).
//                Every block writes its piece's sum to a module workspace and takes a ticket of
//                its row; the row's last block sums the pieces in a fixed order (deterministic,
//                no float atomics) and resets the ticket. The workspace is per loaded module:
//                launches of one module must not overlap (one stream at a time).
// DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
//
// Summation structure (tests/kernels/test_reduce_sum_spec.py models it exactly in numpy):
//   thread t of a row's P threads owns, at step k, the vectors s = k*P*UNROLL + u*P + t for
//   u < UNROLL (vectors >= the body's count contribute 0). Each vector's VEC values are summed
//   pairwise, then the UNROLL vector sums pairwise (see pairwise()); step sums are
//   Kahan-accumulated; the thread's value is sum - compensation, then (ALIGNED_ROWS 0) plus its
//   edge sum (the first piece of a split row only): head element t if t < head, plus tail
//   element t if t < the tail's length, then (P < VEC only) for k = 1, 2, ...: plus head
//   element t + kP, plus tail element t + kP, where they exist. Then a butterfly over the group's lanes (xor P/2 .. 1), or for a block:
//   butterfly over each warp, lane 0s store, warp 0 loads (0 beyond the warp count) and
//   butterflies over 32 lanes. A split row's pieces: lane l of warp 0 adds pieces l, l + 32, ...
//   in order, then a butterfly over 32 lanes.
//
// Arguments: x, out (float[rows]), rows (int), cols (int). x 16-byte aligned where ALIGNED_ROWS.

#ifndef BLOCK_SIZE
#error "BLOCK_SIZE must be defined"
#endif
#ifndef ROW_THREADS
#error "ROW_THREADS must be defined"
#endif
#ifndef VEC
#error "VEC must be defined"
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef ALIGNED_ROWS
#define ALIGNED_ROWS 1
#endif
#ifndef ROW_SPLIT
#define ROW_SPLIT 0
#endif
#include "../common/kato_dtype.cuh"

#ifndef KATO_NS
#define KATO_NS kato_reduce_sum
#endif

namespace KATO_NS {

using T = DTYPE;

constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
constexpr int kWarps = BLOCK_SIZE / 32;
#if ROW_THREADS == 0
constexpr int kRowThreads = BLOCK_SIZE;
#else
constexpr int kRowThreads = ROW_THREADS;
#endif
constexpr int kRowsPerBlock = BLOCK_SIZE / kRowThreads;

static_assert(BLOCK_SIZE % 32 == 0 && BLOCK_SIZE >= 32 && BLOCK_SIZE <= 1024,
              "BLOCK_SIZE must be a multiple of 32 in [32, 1024]");
static_assert(ROW_THREADS == 0 || ROW_THREADS == 1 || ROW_THREADS == 2 || ROW_THREADS == 4 ||
                  ROW_THREADS == 8 || ROW_THREADS == 16 || ROW_THREADS == 32,
              "ROW_THREADS must be 0 (block), 1, 2, 4, 8, 16 or 32");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector must be at most 16 bytes");
static_assert(UNROLL == 1 || UNROLL == 2 || UNROLL == 4 || UNROLL == 8,
              "UNROLL must be 1, 2, 4 or 8");
static_assert(ROW_SPLIT == 0 || ROW_THREADS == 0, "a split row needs a block per piece");

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_pairwise.cuh"

// This thread's compensated sum of a row's vectors t, t + P, ... (P = kRowThreads) below nvec.
__device__ __forceinline__ float thread_row_sum(const Raw* __restrict__ xr, int nvec, int t) {
  float s = 0.0f;
  float c = 0.0f;
  for (int base = t; base < nvec; base += kRowThreads * UNROLL) {
    Raw r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int idx = base + u * kRowThreads;
      if (idx < nvec) r[u] = __ldcs(xr + idx);
    }
    float v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float f[VEC];
      if (base + u * kRowThreads < nvec) {
        unpack(r[u], f);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = 0.0f;
      }
      v[u] = vector_sum(f);
    }
    kahan_add(s, c, pairwise(v));
  }
  return s - c;
}

#if !ALIGNED_ROWS || ROW_SPLIT
// Thread t's share of piece `part` of `parts` of a row of n elements at xr: its compensated sum
// of the piece's contiguous run of body vectors, plus (first piece only) head and tail elements
// t, t + P, ... where they exist (head and tail are shorter than VEC: one each unless P < VEC).
// The edge elements are loaded first, so one float, not their addresses, lives across the loop.
__device__ __forceinline__ float piece_sum(const T* __restrict__ xr, int n, int part, int parts,
                                           int t) {
  const Split sp = split_row(xr, n);
  float edge = 0.0f;
  if (part == 0) {
    if (t < sp.head) edge = to_float(xr[t]);
    if (t < n - sp.tail) edge += to_float(xr[sp.tail + t]);
    if constexpr (kRowThreads < VEC) {
      // Fewer threads than a vector's elements: each takes every P-th one of the edges too.
#pragma unroll
      for (int k = 1; k < (VEC + kRowThreads - 1) / kRowThreads; ++k) {
        const int e = t + k * kRowThreads;
        if (e < sp.head) edge += to_float(xr[e]);
        if (e < n - sp.tail) edge += to_float(xr[sp.tail + e]);
      }
    }
  }
  const int chunk = (sp.nvec + parts - 1) / parts;
  const int lo = min(part * chunk, sp.nvec);
  const int hi = min(lo + chunk, sp.nvec);
  return thread_row_sum(reinterpret_cast<const Raw*>(xr + sp.head) + lo, hi - lo, t) + edge;
}
#endif

#if ROW_SPLIT
// The split path's workspace, sized for the largest split the spec launches: fewer than
// 8 * 132 rows, rows * parts < 2 * 8 * 132 pieces. Zero at module load; each row's last
// block resets its ticket, so it is zero again between launches.
constexpr int kSplitRows = 8 * 132;
constexpr int kSplitPieces = 2 * kSplitRows;
__device__ float split_partials[kSplitPieces];
__device__ unsigned int split_tickets[kSplitRows];
#endif

}  // namespace KATO_NS

#if defined(MIN_BLOCKS) && MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)
#elif !ALIGNED_ROWS || ROW_SPLIT
// Without a minimum, ptxas aims some of these (1024 threads, 8-byte vectors) at two resident
// blocks, 32 registers, and spills; one block per SM lets it use the 64 it may.
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, 1)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE)
#endif

// Grid: ceil(rows / (BLOCK_SIZE / P)) blocks (capped at 2^31 - 1); rows are visited with a grid
// stride, so any grid is correct.
extern "C" __global__ void KATO_LAUNCH_BOUNDS reduce_sum_kernel(const DTYPE* __restrict__ x,
                                                                float* __restrict__ out,
                                                                int rows, int cols) {
  namespace ns = KATO_NS;
  using Raw = ns::Raw;
#if ROW_SPLIT
  // Pieces of rows: item = row * parts + part, blocks visit items with a grid stride (the spec
  // launches one block per item); any grid is correct.
  __shared__ float red[2][ns::kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int parts = static_cast<int>(gridDim.x) / rows;
  parts = parts < 1 ? 1 : parts;
  parts = parts > ns::kSplitPieces / rows ? ns::kSplitPieces / rows : parts;
  const long long items = static_cast<long long>(rows) * parts;
  int parity = 0;
  for (long long item = blockIdx.x; item < items; item += gridDim.x, parity ^= 1) {
    const int row = static_cast<int>(item / parts);
    const int part = static_cast<int>(item - static_cast<long long>(row) * parts);
    const DTYPE* xr = x + static_cast<size_t>(row) * static_cast<size_t>(cols);
    float v = ns::piece_sum(xr, cols, part, parts, threadIdx.x);
    v = ns::warp_sum<32>(v);
    if constexpr (ns::kWarps > 1) {
      if (lane == 0) red[parity][warp] = v;
      __syncthreads();
      if (warp == 0) {
        v = lane < ns::kWarps ? red[parity][lane] : 0.0f;
        v = ns::warp_sum<32>(v);
      }
    }
    int last = 0;
    if (threadIdx.x == 0) {
      ns::split_partials[item] = v;
      __threadfence();  // the piece's sum is visible device-wide before the ticket is taken
      last = atomicAdd(&ns::split_tickets[row], 1u) == static_cast<unsigned int>(parts - 1);
    }
    // Block-uniform: every thread learns whether this block took the row's last ticket.
    if (__syncthreads_or(last)) {
      __threadfence();  // acquire side: every piece of the row is visible
      if (warp == 0) {
        const float* pieces = ns::split_partials + static_cast<long long>(row) * parts;
        float acc = 0.0f;
        for (int i = lane; i < parts; i += 32) acc += __ldcg(pieces + i);
        acc = ns::warp_sum<32>(acc);
        if (lane == 0) {
          out[row] = acc;
          ns::split_tickets[row] = 0;  // ready for the next launch
        }
      }
    }
  }
#else
#if ALIGNED_ROWS
  const int nvec = cols / VEC;
#endif
#if ROW_THREADS == 0
  __shared__ float red[2][ns::kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int parity = 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(cols);
#if ALIGNED_ROWS
    float v = ns::thread_row_sum(reinterpret_cast<const Raw*>(x + offset), nvec, threadIdx.x);
#else
    float v = ns::piece_sum(x + offset, cols, 0, 1, threadIdx.x);
#endif
    v = ns::warp_sum<32>(v);
    if constexpr (ns::kWarps > 1) {
      // Double-buffered: a warp can only write red[parity] again two rows later, after the
      // next row's barrier, which warp 0 reaches only once it has read this row's slots.
      if (lane == 0) red[parity][warp] = v;
      __syncthreads();
      if (warp == 0) {
        v = lane < ns::kWarps ? red[parity][lane] : 0.0f;
        v = ns::warp_sum<32>(v);
      }
    }
    if (threadIdx.x == 0) out[row] = v;
  }
  (void)parity;
  (void)warp;
#else
  // Loop bounds are warp-uniform (the warp's first row), so every lane reaches every shuffle;
  // groups whose row is past the end sum nothing and store nothing.
  constexpr int kRowsPerWarp = 32 / ns::kRowThreads;
  const int lane = threadIdx.x & 31;
  const int t = lane % ns::kRowThreads;
  const long long stride = static_cast<long long>(gridDim.x) * ns::kRowsPerBlock;
  for (long long first = static_cast<long long>(blockIdx.x) * ns::kRowsPerBlock +
                         (threadIdx.x >> 5) * kRowsPerWarp;
       first < rows; first += stride) {
    const long long row = first + lane / ns::kRowThreads;
    const bool valid = row < rows;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
#if ALIGNED_ROWS
    float v = ns::thread_row_sum(reinterpret_cast<const Raw*>(x + offset), valid ? nvec : 0, t);
#else
    float v = ns::piece_sum(x + offset, valid ? cols : 0, 0, 1, t);
#endif
    v = ns::warp_sum<ns::kRowThreads>(v);
    if (valid && t == 0) out[row] = v;
  }
#endif
#endif
}
