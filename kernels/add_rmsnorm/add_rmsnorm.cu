// Residual add fused with RMSNorm over the last dimension of row-major (rows, cols) matrices:
//     s[r, c] = x[r, c] + res[r, c]                      (written out: the next layer's residual)
//     rstd_r = 1 / sqrt(sum_c s[r, c]^2 / cols + eps),   y[r, c] = s[r, c] * rstd_r * w[c]
// with float32 arithmetic for every element type. The sum is rounded to the element type once,
// and the norm is taken of s as stored (exactly what x + res followed by rms_norm computes, and
// what the backward pass, given the stored s, differentiates). rstd is a float32 output (what
// kernels/rmsnorm_backward reads), s and y have the element type. One reduction per row.
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/add_rmsnorm/__init__.py renders them; kernels/rowwise.py describes the model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes. Any cols:
//                each row is a scalar head up to the first aligned address, aligned vectors,
//                and a scalar tail. The weight is read as vectors where its address allows.
//   ROW_THREADS  threads sharing one row: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   CACHE        0: the output pass re-reads s from global memory (the thread's own writes,
//                mostly from L2); 1: s's vectors are kept in dynamic shared memory; 2: in
//                registers, ITEMS vectors per thread.
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16, ITEMS (CACHE 2 only),
//   WB_REGS (CACHE 2 with cols % VEC == 0 only: the weight stays in registers across rows).
//
// Contract (kernels.add_rmsnorm.AddRMSNormSpec.check enforces the static part): x, res, s and y
// have base addresses congruent modulo 16 bytes and do not overlap; every pointer is aligned to
// its element size; CACHE 2 needs cols / VEC <= ITEMS * threads_per_row; CACHE 1 needs
// rows_per_block * (cols / VEC) vectors of dynamic shared memory; rows < 2^31,
// cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_add_rmsnorm
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors of x and res (and as many of the weight) loaded per thread per step of the streaming
// passes: 16 bytes of each in flight, at most 4 vectors (more spills under a 64-register cap).
[[maybe_unused]] constexpr int kUnroll = 16 / kVecBytes < 4 ? 16 / kVecBytes : 4;

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_row_walk.cuh"
#include "../common/kato_row_cache.cuh"

__device__ __forceinline__ Raw normalise(const Raw& sv, const Raw& wv, float rstd) {
  float f[VEC], w[VEC];
  unpack(sv, f);
  unpack(wv, w);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = (f[j] * rstd) * w[j];
  return pack(f);
}

// s = x + res, rounded to the element type; its squares (of s as rounded) added to acc.
__device__ __forceinline__ Raw add_rows(const Raw& xv, const Raw& rv, float (&acc)[VEC]) {
  float a[VEC], b[VEC];
  unpack(xv, a);
  unpack(rv, b);
#pragma unroll
  for (int j = 0; j < VEC; ++j) a[j] += b[j];
  const Raw s = pack(a);
  unpack(s, a);
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = fmaf(a[j], a[j], acc[j]);
  return s;
}

// One element of s (head or tail), rounded, stored at `out`, returned as a float.
__device__ __forceinline__ float add_elem(const T* x, const T* res, T* out) {
  const T s = to_elem(to_float(__ldg(x)) + to_float(__ldg(res)));
  *out = s;
  return to_float(s);
}

}  // namespace KATO_NS

// Grid: ceil(rows / rows_per_block / GROUP_ROWS) blocks (the spec's launch); any grid is
// correct: every row group loops over rows with a grid stride, uniform per warp in warp mode
// (rows past the end are empty rows that still join the shuffles) and per block in block mode.
extern "C" __global__ void KATO_LAUNCH_BOUNDS add_rmsnorm_fwd(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ res, const DTYPE* __restrict__ weight,
    DTYPE* __restrict__ s_out, DTYPE* __restrict__ y, float* __restrict__ rstd_out, int rows,
    int cols, float eps) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;

  [[maybe_unused]] const auto [t, group, groups, first, stride] = kn::row_walk();
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  __shared__ float red[2][kn::kWarps];
#endif

#if CACHE == 1
  extern __shared__ __align__(16) unsigned char kato_smem[];
  Raw* const ss = reinterpret_cast<Raw*>(kato_smem) + static_cast<size_t>(threadIdx.x / P) * (cols / VEC);
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
    const DTYPE* __restrict__ rr = res + offset;
    DTYPE* __restrict__ sr = s_out + offset;
    DTYPE* __restrict__ yr = y + offset;
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    float* const slot = red[parity];
#else
    float* const slot = nullptr;
#endif
    const kn::Split sp = kn::split_row(xr, n_here);
    const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(xr + sp.head);
    const Raw* __restrict__ rv = reinterpret_cast<const Raw*>(rr + sp.head);
    Raw* __restrict__ sv = reinterpret_cast<Raw*>(sr + sp.head);
    Raw* __restrict__ yv = reinterpret_cast<Raw*>(yr + sp.head);
    const int nvec = sp.nvec;
    const bool w_vec = kn::cols_aligned(weight, sp.head);

    const bool has_head = t < sp.head;
    const int tail_col = sp.tail + t;
    const bool has_tail = tail_col < n_here;
    const float hs = has_head ? kn::add_elem(xr + t, rr + t, sr + t) : 0.0f;
    const float ts = has_tail ? kn::add_elem(xr + tail_col, rr + tail_col, sr + tail_col) : 0.0f;
    float acc[VEC];
    acc[0] = fmaf(hs, hs, ts * ts);
#pragma unroll
    for (int j = 1; j < VEC; ++j) acc[j] = 0.0f;

#if CACHE == 2
    Raw rs[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
        rs[i] = kn::add_rows(__ldcs(xv + idx), __ldcs(rv + idx), acc);
        sv[idx] = rs[i];
      }
    }
#else
    constexpr int U = kn::kUnroll;
    constexpr int kStep = P * U;
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw ra[U], rb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
          ra[u] = __ldcs(xv + idx);  // x and res are read once
          rb[u] = __ldcs(rv + idx);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
          const Raw s = kn::add_rows(ra[u], rb[u], acc);
          sv[idx] = s;
#if CACHE == 1
          ss[idx] = s;  // the same thread reads it back in the output pass: no barrier
#endif
        }
      }
    }
#endif
    float sum = acc[0];
#pragma unroll
    for (int j = 1; j < VEC; ++j) sum += acc[j];
    sum = kn::row_sum(sum, slot);
    const float rstd = rsqrtf(sum / static_cast<float>(cols) + eps);

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
        __stcs(yv + idx, kn::normalise(rs[i], wi, rstd));
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
          r[u] = ss[idx];
#else
          r[u] = sv[idx];  // this thread's own store (a coherent load, not the read-only path)
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
    if (has_head) yr[t] = kn::to_elem((hs * rstd) * kn::to_float(__ldg(weight + t)));
    if (has_tail) {
      yr[tail_col] = kn::to_elem((ts * rstd) * kn::to_float(__ldg(weight + tail_col)));
    }
    if (valid && t == 0) rstd_out[row] = rstd;
  }
  (void)parity;
}
