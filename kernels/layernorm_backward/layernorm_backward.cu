// LayerNorm backward over the last dimension of row-major (rows, cols) matrices, from the
// forward's input x, weight w, per-row mean and rstd (float32, saved by kernels/layernorm's
// forward) and the gradient dy of y = xhat * w + b, xhat = (x - mean) * rstd:
//     g[r, c] = w[c] dy[r, c],   a_r = sum_c g[r, c] / cols,   b_r = sum_c g[r, c] xhat[r, c] / cols
//     dx[r, c] = rstd_r * (g[r, c] - a_r - xhat[r, c] * b_r)
//     dw[c] = sum_r dy[r, c] xhat[r, c],   db[c] = sum_r dy[r, c]
// with float32 arithmetic for every element type. dx is one pass over each row (two sums, one
// reduction); dw and db are column reductions in two stages: every block of layernorm_bwd sums
// the rows it processes into one float32 partial row of 2 * cols floats (dw's columns, then
// db's) in `partials` (writing gridDim.x to *nparts), then layernorm_bwd_reduce sums the
// partial rows in a fixed order (deterministic) and writes dw and db.
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/layernorm_backward/__init__.py renders them; kernels/rowwise.py describes the model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes. Any cols:
//                each row is a scalar head up to the first aligned address, aligned vectors,
//                and a scalar tail; the weight is read as vectors where its address allows.
//   ROW_THREADS  threads sharing one row: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   CACHE        0: the dx pass re-reads x and dy; 1: their vectors are kept in dynamic shared
//                memory; 2: in registers, ITEMS vectors of each per thread.
//   DW_ACC       0: each thread sums dw and db for its own columns in registers (ITEMS vectors
//                each; needs cols % VEC == 0, so that every row has the same head and a thread
//                the same columns in every row); 1: each row group sums them in its own 2 * cols
//                floats of dynamic shared memory (any cols); 2 (ROW_THREADS 0 only): the block
//                sums them straight into its partial row in global memory (any cols, rows too
//                long for shared memory).
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE, IS_HALF, IS_BF16, ITEMS (CACHE 2 or DW_ACC 0), WB_REGS (DW_ACC 0: the weight
//   stays in registers across rows where the launch bounds leave room).
// Fixed by the operator, not tunable:
//   EPILOGUE_RELU 1: the backward of y = relu(layer_norm(x)) (kernels/layernorm_relu_backward):
//                both kernels take the forward's bias after the weight, and every path replaces
//                dy by g = dy * (xhat * w + b > 0), xhat * w + b recomputed in float32 from x,
//                the saved mean and rstd as it reads them (mask_dy), before any sum or dx
//                uses it; dx, dw and db are then layernorm's backward of g. No extra pass:
//                only the bias (a weight-sized vector) is read besides. 0 (the default): plain
//                layernorm backward, the program compiled before the macro existed.
// Launch-only parameters (the spec's steps): SPLIT (stage 1 has at most SPLIT blocks per SM of
// the largest GPU: the number of partial rows) and REDUCE_LANES (blockDim.y of stage 2).
//
// Contract (kernels.layernorm_backward.LayerNormBackwardSpec.check enforces the static part): x,
// dy and dx have base addresses congruent modulo 16 bytes; every pointer is aligned to its
// element size; partials holds gridDim.x (stage 1) rows of 2 * cols floats; dynamic shared
// memory: CACHE 1's rows_per_block * 2 * (cols / VEC) vectors, then (DW_ACC 1, or more than one
// row group per block with DW_ACC 0) rows_per_block * 2 * cols floats; rows < 2^31,
// cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_layernorm_backward
#endif
#ifndef DW_ACC
#define DW_ACC 1
#endif
#ifndef EPILOGUE_RELU
#define EPILOGUE_RELU 0
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors of each array (x, dy, the weight) loaded per thread per step of the streaming passes:
// 16 bytes of each in flight, at most 4 vectors (more spills under a 64-register cap: three
// arrays unpacked to float32 at once).
[[maybe_unused]] constexpr int kUnroll = 16 / kVecBytes < 4 ? 16 / kVecBytes : 4;

static_assert(DW_ACC >= 0 && DW_ACC <= 2, "DW_ACC must be 0, 1 or 2");
static_assert(DW_ACC != 2 || ROW_THREADS == 0, "DW_ACC 2 needs one row group per block");
static_assert(WB_REGS == 0 || DW_ACC == 0, "WB_REGS needs the fixed columns of DW_ACC 0");

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_partials.cuh"
#include "../common/kato_row_cache.cuh"

// Every thread of a row group ends with the row's two sums. Block mode: `red` is this row's
// slot of a double-buffered shared array of float2 (one barrier per row; every warp merges the
// per-warp partials itself, in the same order, so all agree bitwise).
__device__ __forceinline__ void row_sum2(float& a, float& b, float2* red) {
  a = warp_sum<kLanes>(a);
  b = warp_sum<kLanes>(b);
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = make_float2(a, b);
  __syncthreads();
  const int slot = lane & (kWarpsPow2 - 1);
  const float2 p = slot < kWarps ? red[slot] : make_float2(0.0f, 0.0f);
  a = warp_sum<kWarpsPow2>(p.x);
  b = warp_sum<kWarpsPow2>(p.y);
#else
  (void)red;
#endif
}

// Row sums sa += w dy, sb += w dy xhat; column sums dw[j] += dy xhat, db[j] += dy (dw, db: a
// thread's registers or rows of shared or global memory).
template <class DW, class DB>
__device__ __forceinline__ void accumulate(const Raw& xv, const Raw& dv, const Raw& wv, float mu,
                                           float rstd, float& sa, float& sb, DW&& dw, DB&& db) {
  float fx[VEC], fd[VEC], fw[VEC];
  unpack(xv, fx);
  unpack(dv, fd);
  unpack(wv, fw);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float xh = (fx[j] - mu) * rstd;
    const float g = fd[j] * fw[j];
    sa += g;
    sb = fmaf(g, xh, sb);
    dw[j] = fmaf(fd[j], xh, dw[j]);
    db[j] += fd[j];
  }
}

// dx = rstd (w dy - a - xhat b), with w dy rounded as the row sums saw it (not fused into the
// subtraction): a row of one column, or of equal elements, gives w dy - a = 0 exactly, where an
// fma would leave w dy's rounding error times an rstd of 1 / sqrt(eps).
__device__ __forceinline__ float grad_elem(float x, float d, float w, float mu, float rstd,
                                           float a, float b) {
  const float xh = (x - mu) * rstd;
  const float g = __fmul_rn(d, w);  // never contracted into an fma with the subtraction
  return rstd * fmaf(-xh, b, g - a);
}

#if EPILOGUE_RELU
// The ReLU's mask on dy: g = dy where the forward's pre-activation xhat * w + b, recomputed
// here, is positive, else 0 (torch's threshold_backward(dy, y, 0)). Rounded explicitly (no
// contraction chosen by the compiler), so every pass that re-reads a row masks it alike.
__device__ __forceinline__ float mask_elem(float x, float d, float w, float b, float mu,
                                           float rstd) {
  const float xh = __fmul_rn(__fsub_rn(x, mu), rstd);
  return fmaf(xh, w, b) > 0.0f ? d : 0.0f;
}

__device__ __forceinline__ Raw mask_dy(const Raw& xv, const Raw& dv, const Raw& wv,
                                       const Raw& bv, float mu, float rstd) {
  float fx[VEC], fd[VEC], fw[VEC], fb[VEC];
  unpack(xv, fx);
  unpack(dv, fd);
  unpack(wv, fw);
  unpack(bv, fb);
#pragma unroll
  for (int j = 0; j < VEC; ++j) fd[j] = mask_elem(fx[j], fd[j], fw[j], fb[j], mu, rstd);
  return pack(fd);
}
#endif

__device__ __forceinline__ Raw grad(const Raw& xv, const Raw& dv, const Raw& wv, float mu,
                                    float rstd, float a, float b) {
  float fx[VEC], fd[VEC], fw[VEC];
  unpack(xv, fx);
  unpack(dv, fd);
  unpack(wv, fw);
#pragma unroll
  for (int j = 0; j < VEC; ++j) fx[j] = grad_elem(fx[j], fd[j], fw[j], mu, rstd, a, b);
  return pack(fx);
}

}  // namespace KATO_NS

// Stage 1. Grid: min(ceil(rows / rows_per_block), SPLIT * 132) blocks (the spec's launch); any
// grid is correct (grid-stride over rows, uniform per warp in warp mode and per block in block
// mode) as long as partials has gridDim.x rows.
extern "C" __global__ void KATO_LAUNCH_BOUNDS layernorm_bwd(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ weight,
#if EPILOGUE_RELU
    const DTYPE* __restrict__ bias,
#endif
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
    const DTYPE* __restrict__ dy, DTYPE* __restrict__ dx, DTYPE* __restrict__ dweight,
    DTYPE* __restrict__ dbias, float* __restrict__ partials, int* __restrict__ nparts, int rows,
    int cols) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;
  (void)dweight, (void)dbias;
  if (blockIdx.x == 0 && threadIdx.x == 0) *nparts = static_cast<int>(gridDim.x);
  const size_t width = 2 * static_cast<size_t>(cols);  // a partial row: dw's, then db's columns

#if ROW_THREADS == 0
  const int t = threadIdx.x;
  const int group = 0;
  constexpr int groups = 1;
  const long long first = blockIdx.x;
  const long long stride = gridDim.x;
#if BLOCK_SIZE > 32
  __shared__ float2 red[2][kn::kWarps];
#endif
#else
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int t = lane & (kn::kLanes - 1);
  const int group = lane / kn::kLanes;
  const int groups = static_cast<int>(blockDim.x) / kn::kLanes;  // row groups per block
  const long long first = static_cast<long long>(blockIdx.x) * groups + warp * kn::kRowsPerWarp;
  const long long stride = static_cast<long long>(gridDim.x) * groups;
#endif
  const int slot_index = static_cast<int>(threadIdx.x) / P;  // this row group within the block
  (void)groups, (void)slot_index;  // unused by some variants

#if CACHE == 1 || DW_ACC == 1 || (DW_ACC == 0 && ROW_THREADS != 0)
  extern __shared__ __align__(16) unsigned char kato_smem[];
#endif
#if CACHE == 1
  const int cap = cols / VEC;
  Raw* const sx = reinterpret_cast<Raw*>(kato_smem) + static_cast<size_t>(slot_index) * 2 * cap;
  Raw* const sdy = sx + cap;
  float* const dw_smem = reinterpret_cast<float*>(reinterpret_cast<Raw*>(kato_smem) +
                                                  static_cast<size_t>(groups) * 2 * cap);
#elif DW_ACC == 1 || (DW_ACC == 0 && ROW_THREADS != 0)
  float* const dw_smem = reinterpret_cast<float*>(kato_smem);
#endif
#if DW_ACC == 1
  // This row group's dw and db rows, zeroed before any group adds to them.
  float* const dw_row = dw_smem + static_cast<size_t>(slot_index) * width;
  float* const db_row = dw_row + cols;
  for (size_t c = threadIdx.x; c < groups * width; c += blockDim.x) dw_smem[c] = 0.0f;
  __syncthreads();
#elif DW_ACC == 2
  // The block's partial row is its accumulator (plain loads and stores: __syncthreads orders
  // them between the threads of the block, as it does shared memory).
  float* const dw_row = partials + static_cast<size_t>(blockIdx.x) * width;
  float* const db_row = dw_row + cols;
  for (size_t c = threadIdx.x; c < width; c += blockDim.x) dw_row[c] = 0.0f;
  __syncthreads();
#endif

#if DW_ACC == 0
  // cols % VEC == 0: every row has row 0's head, so the thread owns the same columns (head
  // element t, body vectors t + i * P, tail element) in every row and sums dw, db for them here.
  const kn::Split sp0 = kn::split_row(x, cols);
  float dwr[ITEMS][VEC], dbr[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) dwr[i][j] = dbr[i][j] = 0.0f;
  }
  float dw_head = 0.0f, dw_tail = 0.0f, db_head = 0.0f, db_tail = 0.0f;
#if WB_REGS
  const bool w_vec0 = kn::cols_aligned(weight, sp0.head);
  Raw wr[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int idx = t + i * P;
    if (idx < sp0.nvec) wr[i] = kn::load_cols(weight, sp0.head + idx * VEC, w_vec0);
  }
#endif
#endif

  int parity = 0;
  for (long long base = first; base < rows; base += stride, parity ^= 1) {
    const long long row = base + group;
    const bool valid = row < rows;
    const int n_here = valid ? cols : 0;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
    const DTYPE* __restrict__ xr = x + offset;
    const DTYPE* __restrict__ dyr = dy + offset;
    DTYPE* __restrict__ dxr = dx + offset;
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    float2* const slot = red[parity];
#else
    float2* const slot = nullptr;
#endif
    const float mu = valid ? __ldg(mean_in + row) : 0.0f;
    const float r = valid ? __ldg(rstd_in + row) : 0.0f;
    const kn::Split sp = kn::split_row(xr, n_here);
    const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(xr + sp.head);
    const Raw* __restrict__ dyv = reinterpret_cast<const Raw*>(dyr + sp.head);
    Raw* __restrict__ dxv = reinterpret_cast<Raw*>(dxr + sp.head);
    const int nvec = sp.nvec;
    const bool w_vec = kn::cols_aligned(weight, sp.head);
#if EPILOGUE_RELU
    const bool b_vec = kn::cols_aligned(bias, sp.head);
#endif

    const bool has_head = t < sp.head;
    const int tail_col = sp.tail + t;
    const bool has_tail = tail_col < n_here;
    // Absent head and tail elements are x = mu, dy = 0: they add nothing to any sum.
    float hx = mu, hd = 0.0f, hw = 0.0f, tx = mu, td = 0.0f, tw = 0.0f;
    if (has_head) {
      hx = kn::to_float(__ldg(xr + t));
      hd = kn::to_float(__ldg(dyr + t));
      hw = kn::to_float(__ldg(weight + t));
#if EPILOGUE_RELU
      hd = kn::mask_elem(hx, hd, hw, kn::to_float(__ldg(bias + t)), mu, r);
#endif
    }
    if (has_tail) {
      tx = kn::to_float(__ldg(xr + tail_col));
      td = kn::to_float(__ldg(dyr + tail_col));
      tw = kn::to_float(__ldg(weight + tail_col));
#if EPILOGUE_RELU
      td = kn::mask_elem(tx, td, tw, kn::to_float(__ldg(bias + tail_col)), mu, r);
#endif
    }
    const float hxh = (hx - mu) * r, txh = (tx - mu) * r;
    float sa = fmaf(hd, hw, td * tw);
    float sb = fmaf(hd * hw, hxh, (td * tw) * txh);
#if DW_ACC == 0
    dw_head = fmaf(hd, hxh, dw_head);
    dw_tail = fmaf(td, txh, dw_tail);
    db_head += hd;
    db_tail += td;
#else
    if (has_head) {
      dw_row[t] = fmaf(hd, hxh, dw_row[t]);
      db_row[t] += hd;
    }
    if (has_tail) {
      dw_row[tail_col] = fmaf(td, txh, dw_row[tail_col]);
      db_row[tail_col] += td;
    }
#endif

#if CACHE == 2 || DW_ACC == 0
    // Pass 1 over ITEMS vectors per thread (compile-time indices: registers stay registers).
#if CACHE == 2
    Raw rx[ITEMS], rd[ITEMS];
#endif
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
#if CACHE == 2
        rx[i] = __ldcs(xv + idx);
        rd[i] = __ldcs(dyv + idx);
        const Raw xi = rx[i];
        Raw di = rd[i];
#else
        const Raw xi = __ldg(xv + idx);
        Raw di = __ldg(dyv + idx);
#if CACHE == 1 && !EPILOGUE_RELU
        sx[idx] = xi;  // the same thread reads them back in the dx pass: no barrier
        sdy[idx] = di;
#endif
#endif
#if WB_REGS
        const Raw wi = wr[i];
#else
        const Raw wi = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
#endif
#if EPILOGUE_RELU
        // The masked dy is what the cache keeps: the dx pass reads g, not dy.
        di = kn::mask_dy(xi, di, wi, kn::load_cols(bias, sp.head + idx * VEC, b_vec), mu, r);
#if CACHE == 2
        rd[i] = di;
#elif CACHE == 1
        sx[idx] = xi;
        sdy[idx] = di;
#endif
#endif
#if DW_ACC == 0
        kn::accumulate(xi, di, wi, mu, r, sa, sb, dwr[i], dbr[i]);
#else
        const int c = sp.head + idx * VEC;
        kn::accumulate(xi, di, wi, mu, r, sa, sb, dw_row + c, db_row + c);
#endif
      }
    }
#else   // streaming passes with dw, db in shared or global memory
    constexpr int U = kn::kUnroll;
    constexpr int kStep = P * U;
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw rx[U], rd[U], rw[U];
#if EPILOGUE_RELU
      Raw rb[U];
#endif
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
          rx[u] = __ldg(xv + idx);
          rd[u] = __ldg(dyv + idx);
          rw[u] = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
#if EPILOGUE_RELU
          rb[u] = kn::load_cols(bias, sp.head + idx * VEC, b_vec);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if EPILOGUE_RELU
          rd[u] = kn::mask_dy(rx[u], rd[u], rw[u], rb[u], mu, r);
#endif
#if CACHE == 1
          sx[idx] = rx[u];
          sdy[idx] = rd[u];
#endif
          const int c = sp.head + idx * VEC;
          kn::accumulate(rx[u], rd[u], rw[u], mu, r, sa, sb, dw_row + c, db_row + c);
        }
      }
    }
#endif
#if DW_ACC != 0 && ROW_THREADS != 0
    __syncwarp();  // the next row's columns go to other lanes of the group
#endif
    kn::row_sum2(sa, sb, slot);
    const float inv_cols = 1.0f / static_cast<float>(cols);
    const float a = sa * inv_cols, b = sb * inv_cols;

#if CACHE == 2 || DW_ACC == 0
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < nvec) {
#if CACHE == 2
        const Raw xi = rx[i], di = rd[i];
#elif CACHE == 1
        const Raw xi = sx[idx], di = sdy[idx];
#else
        const Raw xi = __ldcs(xv + idx);
        Raw di = __ldcs(dyv + idx);
#endif
#if WB_REGS
        const Raw wi = wr[i];
#else
        const Raw wi = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
#endif
#if EPILOGUE_RELU && CACHE == 0
        di = kn::mask_dy(xi, di, wi, kn::load_cols(bias, sp.head + idx * VEC, b_vec), mu, r);
#endif
        __stcs(dxv + idx, kn::grad(xi, di, wi, mu, r, a, b));
      }
    }
#else
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw rx[U], rd[U], rw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
#if CACHE == 1
          rx[u] = sx[idx];
          rd[u] = sdy[idx];
#else
          rx[u] = __ldcs(xv + idx);  // last use: evict first
          rd[u] = __ldcs(dyv + idx);
#endif
          rw[u] = kn::load_cols(weight, sp.head + idx * VEC, w_vec);
#if EPILOGUE_RELU && CACHE == 0
          rd[u] = kn::mask_dy(rx[u], rd[u], rw[u], kn::load_cols(bias, sp.head + idx * VEC, b_vec),
                              mu, r);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) __stcs(dxv + idx, kn::grad(rx[u], rd[u], rw[u], mu, r, a, b));
      }
    }
#endif
    if (has_head) dxr[t] = kn::to_elem(kn::grad_elem(hx, hd, hw, mu, r, a, b));
    if (has_tail) dxr[tail_col] = kn::to_elem(kn::grad_elem(tx, td, tw, mu, r, a, b));
  }
  (void)parity;

  // This block's partial row: dw's cols floats, then db's (DW_ACC 2: already summed in place).
#if DW_ACC != 2
  float* __restrict__ out = partials + static_cast<size_t>(blockIdx.x) * width;
#endif
#if DW_ACC == 0 && ROW_THREADS == 0
  // One row group per block: its registers are the partial.
  float* __restrict__ out_b = out + cols;
  if (t < sp0.head) {
    out[t] = dw_head;
    out_b[t] = db_head;
  }
  if (sp0.tail + t < cols) {
    out[sp0.tail + t] = dw_tail;
    out_b[sp0.tail + t] = db_tail;
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int idx = t + i * P;
    if (idx < sp0.nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        out[sp0.head + idx * VEC + j] = dwr[i][j];
        out_b[sp0.head + idx * VEC + j] = dbr[i][j];
      }
    }
  }
#elif DW_ACC == 1 || ROW_THREADS != 0
#if DW_ACC == 0
  // Several row groups: each writes its sums to its own shared rows (every column of a row is
  // owned by one thread of each group), then the block adds the rows in group order.
  float* const dw_row = dw_smem + static_cast<size_t>(slot_index) * width;
  float* const db_row = dw_row + cols;
  if (t < sp0.head) {
    dw_row[t] = dw_head;
    db_row[t] = db_head;
  }
  if (sp0.tail + t < cols) {
    dw_row[sp0.tail + t] = dw_tail;
    db_row[sp0.tail + t] = db_tail;
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int idx = t + i * P;
    if (idx < sp0.nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        dw_row[sp0.head + idx * VEC + j] = dwr[i][j];
        db_row[sp0.head + idx * VEC + j] = dbr[i][j];
      }
    }
  }
#endif
  __syncthreads();
  for (size_t c = threadIdx.x; c < width; c += blockDim.x) {
    float sum = dw_smem[c];
    for (int g = 1; g < groups; ++g) sum += dw_smem[static_cast<size_t>(g) * width + c];
    out[c] = sum;
  }
#endif
}

// Stage 2. Grid: ceil(2 * cols / 32) blocks of (32, L) threads, L <= 32 (any grid is correct:
// the blocks loop over 32-column tiles of the 2 * cols partial columns with a grid stride);
// kato_partials.cuh's reduce_partials, writing dw[c] (c < cols) or db[c - cols].
extern "C" __global__ void __launch_bounds__(1024) layernorm_bwd_reduce(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ weight,
#if EPILOGUE_RELU
    const DTYPE* __restrict__ bias,
#endif
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
    const DTYPE* __restrict__ dy, DTYPE* __restrict__ dx, DTYPE* __restrict__ dweight,
    DTYPE* __restrict__ dbias, const float* __restrict__ partials,
    const int* __restrict__ nparts, int rows, int cols) {
  namespace kn = KATO_NS;
  (void)x, (void)weight, (void)mean_in, (void)rstd_in, (void)dy, (void)dx, (void)rows;
#if EPILOGUE_RELU
  (void)bias;
#endif
  __shared__ float sums[32][33];
  kn::reduce_partials<long long, 2>(partials, nparts, cols, sums, dweight, dbias);
}
