// Residual add fused with LayerNorm over the last dimension of row-major (rows, cols) matrices:
//     s[r, c] = x[r, c] + res[r, c]                      (written out: the next layer's residual)
//     mean_r = sum_c s[r, c] / cols,   var_r = sum_c (s[r, c] - mean_r)^2 / cols  (biased)
//     rstd_r = 1 / sqrt(var_r + eps),  y[r, c] = (s[r, c] - mean_r) * rstd_r * w[c] + b[c]
// with float32 arithmetic for every element type. The sum is rounded to the element type once,
// and the norm is taken of s as stored (what x + res followed by layer_norm computes). mean and
// rstd are float32 outputs (what kernels/layernorm_backward reads, with s as its x). The
// statistics take two reductions per row, the mean first and then the squared deviations from
// it (two-pass: no cancellation), both of s - K with the row's first element K as pivot (the
// sums stay small for rows far from zero), over s kept in registers or shared memory, or
// re-read from global memory (CACHE 0).
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/add_layernorm/__init__.py renders them; kernels/rowwise.py describes the model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes. Any cols:
//                each row is a scalar head up to the first aligned address, aligned vectors,
//                and a scalar tail. Weight and bias are read as vectors where their address
//                allows.
//   ROW_THREADS  threads sharing one row: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   CACHE        0: the variance and output passes re-read s from global memory (the thread's
//                own writes, mostly from L2); 1: s's vectors are kept in dynamic shared memory;
//                2: in registers, ITEMS vectors per thread.
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16, ITEMS (CACHE 2 only),
//   WB_REGS (CACHE 2 with cols % VEC == 0 only: weight and bias stay in registers across rows).
//
// Contract (kernels.add_layernorm.AddLayerNormSpec.check enforces the static part): x, res, s
// and y have base addresses congruent modulo 16 bytes and do not overlap; every pointer is
// aligned to its element size; CACHE 2 needs cols / VEC <= ITEMS * threads_per_row; CACHE 1
// needs rows_per_block * (cols / VEC) vectors of dynamic shared memory; rows < 2^31,
// cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_add_layernorm
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors of x and res (or of s, the weight and the bias) loaded per thread per step of the
// streaming passes: 16 bytes of each in flight, at most 4 vectors (more spills under a
// 64-register cap).
[[maybe_unused]] constexpr int kUnroll = 16 / kVecBytes < 4 ? 16 / kVecBytes : 4;

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_row_walk.cuh"
#include "../common/kato_row_cache.cuh"

// y = ((s - K) - mean_s) * rstd * w + b per vector lane (K: the row's pivot, mean_s: the mean
// of s - K).
__device__ __forceinline__ Raw normalise(const Raw& sv, const Raw& wv, const Raw& bv, float pivot,
                                        float mean_s, float rstd) {
  float f[VEC], w[VEC], b[VEC];
  unpack(sv, f);
  unpack(wv, w);
  unpack(bv, b);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = fmaf(((f[j] - pivot) - mean_s) * rstd, w[j], b[j]);
  return pack(f);
}

// s = x + res, rounded to the element type; s - K (of s as rounded) added to acc.
__device__ __forceinline__ Raw add_rows(const Raw& xv, const Raw& rv, float pivot,
                                        float (&acc)[VEC]) {
  float a[VEC], b[VEC];
  unpack(xv, a);
  unpack(rv, b);
#pragma unroll
  for (int j = 0; j < VEC; ++j) a[j] += b[j];
  const Raw s = pack(a);
  unpack(s, a);
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] += a[j] - pivot;
  return s;
}

// acc += ((s - K) - mean_s)^2 per vector lane.
__device__ __forceinline__ void add_deviations(const Raw& sv, float pivot, float mean_s,
                                               float (&acc)[VEC]) {
  float f[VEC];
  unpack(sv, f);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float d = (f[j] - pivot) - mean_s;
    acc[j] = fmaf(d, d, acc[j]);
  }
}

// One element of s (head or tail), rounded, stored at `out`, returned as a float.
__device__ __forceinline__ float add_elem(const T* x, const T* res, T* out) {
  const T s = to_elem(to_float(__ldg(x)) + to_float(__ldg(res)));
  *out = s;
  return to_float(s);
}

__device__ __forceinline__ float lane_total(const float (&acc)[VEC]) {
  float sum = acc[0];
#pragma unroll
  for (int j = 1; j < VEC; ++j) sum += acc[j];
  return sum;
}

}  // namespace KATO_NS

// Grid: ceil(rows / rows_per_block / GROUP_ROWS) blocks (the spec's launch); any grid is
// correct: every row group loops over rows with a grid stride, uniform per warp in warp mode
// (rows past the end are empty rows that still join the shuffles) and per block in block mode.
extern "C" __global__ void KATO_LAUNCH_BOUNDS add_layernorm_fwd(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ res, const DTYPE* __restrict__ weight,
    const DTYPE* __restrict__ bias, DTYPE* __restrict__ s_out, DTYPE* __restrict__ y,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int rows, int cols, float eps) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;

  [[maybe_unused]] const auto [t, group, groups, first, stride] = kn::row_walk();
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  // Double-buffered per reduction (two per row): a slot is rewritten two reductions later,
  // after the barrier of the one between.
  __shared__ float red[2][kn::kWarps];
#endif

#if CACHE == 1
  extern __shared__ __align__(16) unsigned char kato_smem[];
  Raw* const ss = reinterpret_cast<Raw*>(kato_smem) + static_cast<size_t>(threadIdx.x / P) * (cols / VEC);
#endif

#if CACHE == 2 && WB_REGS
  // cols % VEC == 0: every row has row 0's head, so the thread's weight and bias vectors are
  // the same in every row it normalises.
  const kn::Split sp0 = kn::split_row(x, cols);
  const bool w_vec0 = kn::cols_aligned(weight, sp0.head);
  const bool b_vec0 = kn::cols_aligned(bias, sp0.head);
  Raw wr[ITEMS], br[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int idx = t + i * P;
    if (idx < sp0.nvec) {
      wr[i] = kn::load_cols(weight, sp0.head + idx * VEC, w_vec0);
      br[i] = kn::load_cols(bias, sp0.head + idx * VEC, b_vec0);
    }
  }
#endif

  for (long long base = first; base < rows; base += stride) {
    const long long row = base + group;
    const bool valid = row < rows;
    const int n_here = valid ? cols : 0;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
    const DTYPE* __restrict__ xr = x + offset;
    const DTYPE* __restrict__ rr = res + offset;
    DTYPE* __restrict__ sr = s_out + offset;
    DTYPE* __restrict__ yr = y + offset;
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    float* const slot0 = red[0];
    float* const slot1 = red[1];
#else
    float* const slot0 = nullptr;
    float* const slot1 = nullptr;
#endif
    const kn::Split sp = kn::split_row(xr, n_here);
    const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(xr + sp.head);
    const Raw* __restrict__ rv = reinterpret_cast<const Raw*>(rr + sp.head);
    Raw* __restrict__ sv = reinterpret_cast<Raw*>(sr + sp.head);
    Raw* __restrict__ yv = reinterpret_cast<Raw*>(yr + sp.head);
    const int nvec = sp.nvec;
    const bool w_vec = kn::cols_aligned(weight, sp.head);
    const bool b_vec = kn::cols_aligned(bias, sp.head);

    const bool has_head = t < sp.head;
    const int tail_col = sp.tail + t;
    const bool has_tail = tail_col < n_here;
    // The pivot K: the row's first element of s, as every thread computes it. Sums of s - K
    // stay small for rows far from zero (1e3 + N(0, 8): a plain float32 sum of s loses the
    // mean to ~1e-4 there), and s - K is exact for elements within a factor 2 of K.
    const float pivot =
        valid ? kn::to_float(kn::to_elem(kn::to_float(__ldg(xr)) + kn::to_float(__ldg(rr))))
              : 0.0f;
    const float hs = has_head ? kn::add_elem(xr + t, rr + t, sr + t) : pivot;
    const float ts = has_tail ? kn::add_elem(xr + tail_col, rr + tail_col, sr + tail_col) : pivot;
    float acc[VEC];
    acc[0] = (hs - pivot) + (ts - pivot);
#pragma unroll
    for (int j = 1; j < VEC; ++j) acc[j] = 0.0f;

    // Pass 1: s = x + res, written out and cached; its sum.
#if CACHE == 2
    Raw rs[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
        rs[i] = kn::add_rows(__ldcs(xv + idx), __ldcs(rv + idx), pivot, acc);
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
          const Raw s = kn::add_rows(ra[u], rb[u], pivot, acc);
          sv[idx] = s;
#if CACHE == 1
          ss[idx] = s;  // the same thread reads it back in the later passes: no barrier
#endif
        }
      }
    }
#endif
    const float mean_s = kn::row_sum(kn::lane_total(acc), slot0) / static_cast<float>(cols);

    // Pass 2: the squared deviations from the mean (absent head and tail elements add 0).
    const float hd = has_head ? (hs - pivot) - mean_s : 0.0f;
    const float td = has_tail ? (ts - pivot) - mean_s : 0.0f;
    acc[0] = fmaf(hd, hd, td * td);
#pragma unroll
    for (int j = 1; j < VEC; ++j) acc[j] = 0.0f;
#if CACHE == 2
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (t + i * P < nvec) kn::add_deviations(rs[i], pivot, mean_s, acc);
    }
#else
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
#if CACHE == 1
        if (idx < nvec) r[u] = ss[idx];
#else
        if (idx < nvec) r[u] = sv[idx];  // this thread's own store (a coherent load)
#endif
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (b0 + u * P < nvec) kn::add_deviations(r[u], pivot, mean_s, acc);
      }
    }
#endif
    const float var = kn::row_sum(kn::lane_total(acc), slot1) / static_cast<float>(cols);
    const float rstd = rsqrtf(var + eps);

    // Pass 3: y.
#if CACHE == 2
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
#if WB_REGS
        const Raw wi = wr[i], bi = br[i];
#else
        const Raw wi = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
        const Raw bi = kn::load_cols(bias, sp.head + idx * VEC, b_vec);
#endif
        __stcs(yv + idx, kn::normalise(rs[i], wi, bi, pivot, mean_s, rstd));
      }
    }
#else
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw r[U], wi[U], bi[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if CACHE == 1
          r[u] = ss[idx];
#else
          r[u] = sv[idx];
#endif
          wi[u] = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
          bi[u] = kn::load_cols(bias, sp.head + idx * VEC, b_vec);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
          __stcs(yv + idx, kn::normalise(r[u], wi[u], bi[u], pivot, mean_s, rstd));
        }
      }
    }
#endif
    if (has_head) {
      const float w = kn::to_float(__ldg(weight + t)), b = kn::to_float(__ldg(bias + t));
      yr[t] = kn::to_elem(fmaf(hd * rstd, w, b));
    }
    if (has_tail) {
      const float w = kn::to_float(__ldg(weight + tail_col));
      const float b = kn::to_float(__ldg(bias + tail_col));
      yr[tail_col] = kn::to_elem(fmaf(td * rstd, w, b));
    }
    if (valid && t == 0) {
      mean_out[row] = pivot + mean_s;
      rstd_out[row] = rstd;
    }
  }
}
