// Softmax backward over the last dimension of row-major (rows, cols) matrices:
//     dot_r = sum_c y[r, c] * dy[r, c],   dx[r, c] = y[r, c] * (dy[r, c] - dot_r)
// (y the forward's output, dy the gradient of y) with float32 arithmetic for every element type.
// One reduction per row: the row is read once for dot_r and once more for dx (from registers,
// shared memory or L2, by CACHE).
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/softmax_backward/__init__.py renders them; kernels/rowwise.py describes the model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes. Any cols:
//                each row is a scalar head up to the first aligned address, aligned vectors,
//                and a scalar tail.
//   ROW_THREADS  threads sharing one row: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   CACHE        0: the dx pass re-reads y and dy; 1: their vectors are kept in dynamic shared
//                memory; 2: in registers, ITEMS vectors of each per thread.
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16, ITEMS (CACHE 2 only).
//
// Contract (kernels.softmax_backward.SoftmaxBackwardSpec.check enforces the static part): y, dy
// and dx have base addresses congruent modulo 16 bytes and aligned to sizeof(DTYPE); CACHE 2
// needs cols / VEC <= ITEMS * threads_per_row; CACHE 1 needs rows_per_block * 2 * (cols / VEC)
// vectors of dynamic shared memory; rows < 2^31, cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_softmax_backward
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors of each array loaded per thread per step of the streaming passes: 32 bytes of each in
// flight, at most 4 vectors (more spills under a 64-register cap with two arrays).
[[maybe_unused]] constexpr int kUnroll = 32 / kVecBytes < 4 ? 32 / kVecBytes : 4;

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_row_walk.cuh"
#include "../common/kato_row_cache.cuh"

__device__ __forceinline__ Raw grad(const Raw& yv, const Raw& dyv, float dot) {
  float fy[VEC], fd[VEC];
  unpack(yv, fy);
  unpack(dyv, fd);
#pragma unroll
  for (int j = 0; j < VEC; ++j) fy[j] = fy[j] * (fd[j] - dot);
  return pack(fy);
}

}  // namespace KATO_NS

// Grid: ceil(rows / rows_per_block) blocks (the spec's launch); any grid is correct: every row
// group loops over rows with a grid stride, uniform per warp in warp mode (rows past the end are
// empty rows that still join the shuffles) and per block in block mode (barriers).
extern "C" __global__ void KATO_LAUNCH_BOUNDS softmax_backward_kernel(
    const DTYPE* __restrict__ y, const DTYPE* __restrict__ dy, DTYPE* __restrict__ dx, int rows,
    int cols) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;

  [[maybe_unused]] const auto [t, group, groups, first, stride] = kn::row_walk();
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  __shared__ float red[2][kn::kWarps];
#endif

#if CACHE == 1
  extern __shared__ __align__(16) unsigned char kato_smem[];
  // Row group g owns slots [2g, 2g + 2) of cols / VEC vectors each: its y, then its dy.
  const int cap = cols / VEC;
  Raw* const sy = reinterpret_cast<Raw*>(kato_smem) + static_cast<size_t>(threadIdx.x / P) * 2 * cap;
  Raw* const sdy = sy + cap;
#endif

  int parity = 0;
  for (long long base = first; base < rows; base += stride, parity ^= 1) {
    const long long row = base + group;
    const bool valid = row < rows;
    const int n_here = valid ? cols : 0;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
    const DTYPE* __restrict__ yr = y + offset;
    const DTYPE* __restrict__ dyr = dy + offset;
    DTYPE* __restrict__ dxr = dx + offset;
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    float* const slot = red[parity];
#else
    float* const slot = nullptr;
#endif
    const kn::Split sp = kn::split_row(yr, n_here);
    const Raw* __restrict__ yv = reinterpret_cast<const Raw*>(yr + sp.head);
    const Raw* __restrict__ dyv = reinterpret_cast<const Raw*>(dyr + sp.head);
    Raw* __restrict__ dxv = reinterpret_cast<Raw*>(dxr + sp.head);
    const int nvec = sp.nvec;

    // Head element t and tail element sp.tail + t (each part has fewer than VEC <= P elements).
    const bool has_head = t < sp.head;
    const int tail_col = sp.tail + t;
    const bool has_tail = tail_col < n_here;
    float hy = 0.0f, hdy = 0.0f, ty = 0.0f, tdy = 0.0f;
    if (has_head) {
      hy = kn::to_float(__ldg(yr + t));
      hdy = kn::to_float(__ldg(dyr + t));
    }
    if (has_tail) {
      ty = kn::to_float(__ldg(yr + tail_col));
      tdy = kn::to_float(__ldg(dyr + tail_col));
    }
    // One partial per vector lane keeps the dependency chains short.
    float acc[VEC];
    acc[0] = fmaf(hy, hdy, ty * tdy);
#pragma unroll
    for (int j = 1; j < VEC; ++j) acc[j] = 0.0f;

#if CACHE == 2
    Raw ry[ITEMS], rd[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
        ry[i] = __ldcs(yv + idx);
        rd[i] = __ldcs(dyv + idx);
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (t + i * P < nvec) {
        float fy[VEC], fd[VEC];
        kn::unpack(ry[i], fy);
        kn::unpack(rd[i], fd);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = fmaf(fy[j], fd[j], acc[j]);
      }
    }
#else
    constexpr int U = kn::kUnroll;
    constexpr int kStep = P * U;
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw ry[U], rd[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
          ry[u] = __ldg(yv + idx);
          rd[u] = __ldg(dyv + idx);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if CACHE == 1
          sy[idx] = ry[u];  // the same thread reads them back in the dx pass: no barrier
          sdy[idx] = rd[u];
#endif
          float fy[VEC], fd[VEC];
          kn::unpack(ry[u], fy);
          kn::unpack(rd[u], fd);
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[j] = fmaf(fy[j], fd[j], acc[j]);
        }
      }
    }
#endif
    float dot = acc[0];
#pragma unroll
    for (int j = 1; j < VEC; ++j) dot += acc[j];
    dot = kn::row_sum(dot, slot);

#if CACHE == 2
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) __stcs(dxv + idx, kn::grad(ry[i], rd[i], dot));
    }
#else
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw ry[U], rd[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if CACHE == 1
          ry[u] = sy[idx];
          rd[u] = sdy[idx];
#else
          ry[u] = __ldcs(yv + idx);  // last use: evict first
          rd[u] = __ldcs(dyv + idx);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) __stcs(dxv + idx, kn::grad(ry[u], rd[u], dot));
      }
    }
#endif
    if (has_head) dxr[t] = kn::to_elem(hy * (hdy - dot));
    if (has_tail) dxr[tail_col] = kn::to_elem(ty * (tdy - dot));
  }
  (void)parity;
}
