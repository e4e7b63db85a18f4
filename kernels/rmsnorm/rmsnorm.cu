// RMSNorm forward over the last dimension of a row-major (rows, cols) matrix:
//     rstd_r = 1 / sqrt(sum_c x[r, c]^2 / cols + eps),   y[r, c] = x[r, c] * rstd_r * w[c]
// with float32 arithmetic for every element type; rstd is a float32 output (what the backward
// pass reads), y has the element type. One reduction per row (the sum of squares, in float32
// partials per vector lane, then shuffles and a shared array across warps).
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/rmsnorm/__init__.py renders them; kernels/rowwise.py describes the model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes. Any cols:
//                each row is a scalar head up to the first aligned address, aligned vectors,
//                and a scalar tail. The weight is read as vectors where its address allows
//                (same alignment as the row's vectors), element by element where not.
//   ROW_THREADS  threads sharing one row: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   CACHE        0: the output pass re-reads x; 1: x's vectors are kept in dynamic shared
//                memory; 2: in registers, ITEMS vectors per thread.
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16, ITEMS (CACHE 2 only),
//   WB_REGS (CACHE 2 with cols % VEC == 0 only: every row has the same head, so a thread's
//   columns are the same in every row and the weight stays in registers across rows).
//
// Contract (kernels.rmsnorm.RMSNormSpec.check enforces the static part): x and y have base
// addresses congruent modulo 16 bytes; every pointer is aligned to its element size; CACHE 2
// needs cols / VEC <= ITEMS * threads_per_row; CACHE 1 needs rows_per_block * (cols / VEC)
// vectors of dynamic shared memory; rows < 2^31, cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_rmsnorm
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors of x (and as many of the weight) loaded per thread per step of the streaming passes:
// 32 bytes of x in flight, at most 4 vectors (more spills under a 64-register cap).
[[maybe_unused]] constexpr int kUnroll = 32 / kVecBytes < 4 ? 32 / kVecBytes : 4;

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_row_walk.cuh"
#include "../common/kato_row_cache.cuh"

__device__ __forceinline__ Raw normalise(const Raw& xv, const Raw& wv, float rstd) {
  float f[VEC], w[VEC];
  unpack(xv, f);
  unpack(wv, w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = (f[j] * rstd) * w[j];
  return pack(f);
}

__device__ __forceinline__ void add_squares(const Raw& xv, float (&acc)[VEC]) {
  float f[VEC];
  unpack(xv, f);
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = fmaf(f[j], f[j], acc[j]);
}

}  // namespace KATO_NS

// Grid: ceil(rows / rows_per_block / GROUP_ROWS) blocks (the spec's launch); any grid is
// correct: every row group loops over rows with a grid stride, uniform per warp in warp mode
// (rows past the end are empty rows that still join the shuffles) and per block in block mode.
extern "C" __global__ void KATO_LAUNCH_BOUNDS rmsnorm_fwd(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ weight, DTYPE* __restrict__ y,
    float* __restrict__ rstd_out, int rows, int cols, float eps) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;

  [[maybe_unused]] const auto [t, group, groups, first, stride] = kn::row_walk();
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  __shared__ float red[2][kn::kWarps];
#endif

#if CACHE == 1
  extern __shared__ __align__(16) unsigned char kato_smem[];
  Raw* const sx = reinterpret_cast<Raw*>(kato_smem) + static_cast<size_t>(threadIdx.x / P) * (cols / VEC);
#endif

#if CACHE == 2 && WB_REGS
  // cols % VEC == 0: every row has row 0's head, so the thread's weight vectors are the same in
  // every row it normalises.
  const kn::Split sp0 = kn::split_row(x, cols);
  const bool w_vec0 = kn::cols_aligned(weight, sp0.head);
  Raw wr[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int idx = t + i * P;
    if (idx < sp0.nvec) wr[i] = kn::load_cols(weight, sp0.head + idx * VEC, w_vec0);
  }
#endif

  int parity = 0;
  for (long long base = first; base < rows; base += stride, parity ^= 1) {
    const long long row = base + group;
    const bool valid = row < rows;
    const int n_here = valid ? cols : 0;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
    const DTYPE* __restrict__ xr = x + offset;
    DTYPE* __restrict__ yr = y + offset;
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    float* const slot = red[parity];
#else
    float* const slot = nullptr;
#endif
    const kn::Split sp = kn::split_row(xr, n_here);
    const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(xr + sp.head);
    Raw* __restrict__ yv = reinterpret_cast<Raw*>(yr + sp.head);
    const int nvec = sp.nvec;
    const bool w_vec = kn::cols_aligned(weight, sp.head);

    const bool has_head = t < sp.head;
    const int tail_col = sp.tail + t;
    const bool has_tail = tail_col < n_here;
    const float hx = has_head ? kn::to_float(__ldg(xr + t)) : 0.0f;
    const float tx = has_tail ? kn::to_float(__ldg(xr + tail_col)) : 0.0f;
    float acc[VEC];
    acc[0] = fmaf(hx, hx, tx * tx);
#pragma unroll
    for (int j = 1; j < VEC; ++j) acc[j] = 0.0f;

#if CACHE == 2
    Raw r[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) r[i] = __ldcs(xv + idx);
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (t + i * P < nvec) kn::add_squares(r[i], acc);
    }
#else
    constexpr int U = kn::kUnroll;
    constexpr int kStep = P * U;
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) r[u] = __ldg(xv + idx);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if CACHE == 1
          sx[idx] = r[u];  // the same thread reads it back in the output pass: no barrier
#endif
          kn::add_squares(r[u], acc);
        }
      }
    }
#endif
    float ss = acc[0];
#pragma unroll
    for (int j = 1; j < VEC; ++j) ss += acc[j];
    ss = kn::row_sum(ss, slot);
    const float rstd = rsqrtf(ss / static_cast<float>(cols) + eps);

#if CACHE == 2
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
#if WB_REGS
        const Raw wi = wr[i];
#else
        const Raw wi = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
#endif
        __stcs(yv + idx, kn::normalise(r[i], wi, rstd));
      }
    }
#else
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw r[U], wi[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if CACHE == 1
          r[u] = sx[idx];
#else
          r[u] = __ldcs(xv + idx);  // last use of x: evict first
#endif
          wi[u] = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) __stcs(yv + idx, kn::normalise(r[u], wi[u], rstd));
      }
    }
#endif
    if (has_head) yr[t] = kn::to_elem((hx * rstd) * kn::to_float(__ldg(weight + t)));
    if (has_tail) {
      yr[tail_col] = kn::to_elem((tx * rstd) * kn::to_float(__ldg(weight + tail_col)));
    }
    if (valid && t == 0) rstd_out[row] = rstd;
  }
  (void)parity;
}
