// Cross-entropy forward over the last dimension of row-major (rows, cols) logits with int64
// labels: per row
//     lse_r  = log(sum_c exp(x[r, c]))                       (float32, saved for the backward)
//     loss_r = lse_r - x[r, label_r]                         (float32)
// loss_r = 0 where label_r == ignore_index; NaN where label_r is outside [0, cols) and not the
// ignore index (x is never read there). Float32 arithmetic for every element type.
//
// One pass over each row: every thread keeps an online (max m, sum s of exp(x - m)) pair over
// its elements, rescaling s when m grows (s a compensated sum of per-step sums); the pairs are
// merged by shuffles (and a shared array across warps). SPLIT > 1 splits each row into SPLIT chunks handled by separate row groups: the
// main kernel writes each chunk's (m, s) to `partials` (chunk-major: partials[chunk * rows +
// row]) and cross_entropy_combine merges them per row, so a few long rows still fill the GPU.
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/cross_entropy/__init__.py renders them; kernels/cross_entropy/model.py describes the
// model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load; VEC * sizeof(DTYPE) <= 16 bytes. Any cols: each
//                chunk is a scalar head up to its first aligned address, aligned vectors and a
//                scalar tail.
//   ROW_THREADS  threads sharing one chunk: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   SPLIT        chunks per row (1: the main kernel finishes each row itself).
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
//
// Contract (kernels.cross_entropy.CrossEntropySpec.check enforces the static part): logits
// aligned to sizeof(DTYPE), labels to 8 bytes; partials holds SPLIT * rows float2 (unused with
// SPLIT 1); rows < 2^31, cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_cross_entropy
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors loaded per thread per step: 32 bytes in flight, at most 4 vectors; one rescale of the
// running sum per step.
constexpr int kUnroll = 32 / kVecBytes < 4 ? 32 / kVecBytes : 4;

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_row_chunks.cuh"
#include "../common/kato_row_walk.cuh"

// The max exp_from takes: a max of -inf (nothing seen yet, or a row of -inf) is replaced by 0
// so that -inf - -inf never makes a NaN.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.0f : m; }

// s = s * r + step with Neumaier's compensation `comp` (rescaled with s): a thread adds one
// step sum per U vectors, thousands in a long row, and 16-bit logits repeat a few values, so a
// plain float32 running sum drifts one way (4e-5 relative over 16032 bfloat16 terms, seen on the
// H200); compensated, the error is the step sums' (at most 32 terms) and the merges'.
__device__ __forceinline__ void add_compensated(float& s, float& comp, float r, float step) {
  s *= r;
  comp *= r;
  const float total = s + step;
  comp += (fmaxf(s, step) - total) + fminf(s, step);
  s = total;
}

// Merge (m2, s2) into (m, s). Commutative bit for bit: s * a + s2 * b == s2 * b + s * a.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  const float mb = safe_max(mm);
  s = s * exp_from(m, mb) + s2 * exp_from(m2, mb);
  m = mm;
}

// Butterfly merge over aligned groups of Width lanes: every lane of a group ends with the same
// bits. All 32 lanes must call it (full mask).
template <int Width>
__device__ __forceinline__ void warp_merge(float& m, float& s) {
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge(m, s, m2, s2);
  }
}

// Every thread of a row group ends with the group's (m, s). Block mode: `red` is this item's
// slot of a double-buffered shared array (one barrier per item; every warp merges the per-warp
// pairs itself, in the same order, so all agree bitwise).
__device__ __forceinline__ void group_merge(float& m, float& s, float2* red) {
  warp_merge<kLanes>(m, s);
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = make_float2(m, s);
  __syncthreads();
  const int slot = lane & (kWarpsPow2 - 1);
  const float2 p = slot < kWarps ? red[slot] : make_float2(-INFINITY, 0.0f);
  m = p.x;
  s = p.y;
  warp_merge<kWarpsPow2>(m, s);
#else
  (void)red;
#endif
}

// The row's loss from its lse: 0 for the ignore index, NaN for a label outside [0, cols).
__device__ __forceinline__ float row_loss(const T* x, long long label, int cols,
                                          long long ignore_index, float lse) {
  if (label == ignore_index) return 0.0f;
  if (label < 0 || label >= cols) return __int_as_float(0x7fc00000);  // quiet NaN
  return lse - to_float(x[label]);
}

}  // namespace KATO_NS

// Grid: ceil(rows * SPLIT / rows_per_block) blocks (the spec's launch); any grid is correct:
// every row group loops over its work items (row, chunk) with a grid stride, uniform per warp in
// warp mode (items past the end are empty and still join the shuffles) and per block in block
// mode (barriers).
extern "C" __global__ void KATO_LAUNCH_BOUNDS cross_entropy_fwd(
    const DTYPE* __restrict__ logits, const long long* __restrict__ labels,
    float* __restrict__ loss, float* __restrict__ lse, float2* __restrict__ partials, int rows,
    int cols, long long ignore_index) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;
  constexpr int U = kn::kUnroll;
  constexpr int kStep = P * U;
  const long long items = static_cast<long long>(rows) * SPLIT;

  [[maybe_unused]] const auto [t, group, groups, first, stride] = kn::row_walk();
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  __shared__ float2 red[2][kn::kWarps];
#endif

  int parity = 0;
  for (long long base = first; base < items; base += stride, parity ^= 1) {
    const long long item = base + group;
    const bool valid = item < items;
    const int row = valid ? static_cast<int>(item / SPLIT) : 0;
    const int chunk = valid ? static_cast<int>(item % SPLIT) : 0;
    int c0 = 0, c1 = 0;
    if (valid) kn::chunk_range(chunk, cols, c0, c1);
    const int n_here = c1 - c0;
    const DTYPE* __restrict__ xr = logits + static_cast<size_t>(row) * static_cast<size_t>(cols);
    const DTYPE* __restrict__ xs = xr + c0;
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    float2* const slot = red[parity];
#else
    float2* const slot = nullptr;
#endif
    const kn::Split sp = kn::split_row(xs, n_here);
    const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(xs + sp.head);
    const int nvec = sp.nvec;

    // Head element t and tail element sp.tail + t (each part has fewer than VEC <= P elements).
    float m = -INFINITY, s = 0.0f, comp = 0.0f;
    if (t < sp.head) {
      m = kn::to_float(__ldg(xs + t));
      s = 1.0f;
    }
    const int tail_col = sp.tail + t;
    if (tail_col < n_here) kn::merge(m, s, kn::to_float(__ldg(xs + tail_col)), 1.0f);

    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw rv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) rv[u] = __ldcs(xv + idx);  // read once: evict first
      }
      float f[U][VEC];
      float step_max = m;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (b0 + u * P < nvec) {
          kn::unpack(rv[u], f[u]);
#pragma unroll
          for (int j = 0; j < VEC; ++j) step_max = fmaxf(step_max, f[u][j]);
        }
      }
      const float mb = kn::safe_max(step_max);
      float step = 0.0f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (b0 + u * P < nvec) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) step += kn::exp_from(f[u][j], mb);
        }
      }
      const float r = kn::exp_from(m, mb);
      kn::add_compensated(s, comp, r, step);
      m = step_max;
    }
    s += comp;
    kn::group_merge(m, s, slot);

    if (valid && t == 0) {
#if SPLIT == 1
      const float l = m + logf(s);
      lse[row] = l;
      loss[row] = kn::row_loss(xr, __ldg(labels + row), cols, ignore_index, l);
#else
      partials[static_cast<size_t>(chunk) * rows + row] = make_float2(m, s);
#endif
    }
  }
  (void)parity;
  (void)loss;
  (void)lse;
  (void)partials;
  (void)labels;
  (void)ignore_index;
}

// SPLIT > 1 only: a thread per row merges the row's SPLIT chunk pairs in chunk order and writes
// lse and loss. Grid: ceil(rows / 256) blocks of 256 (grid stride over rows).
extern "C" __global__ void __launch_bounds__(256) cross_entropy_combine(
    const DTYPE* __restrict__ logits, const long long* __restrict__ labels,
    float* __restrict__ loss, float* __restrict__ lse, const float2* __restrict__ partials,
    int rows, int cols, long long ignore_index) {
  namespace kn = KATO_NS;
  for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(r);
    float m = -INFINITY, s = 0.0f;
#pragma unroll 4
    for (int c = 0; c < SPLIT; ++c) {
      const float2 p = partials[static_cast<size_t>(c) * rows + row];
      kn::merge(m, s, p.x, p.y);
    }
    const float l = m + logf(s);
    lse[row] = l;
    const DTYPE* xr = logits + static_cast<size_t>(row) * static_cast<size_t>(cols);
    loss[row] = kn::row_loss(xr, __ldg(labels + row), cols, ignore_index, l);
  }
}
