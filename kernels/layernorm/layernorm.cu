// LayerNorm forward over the last dimension of a row-major (rows, cols) matrix:
//     mean_r = sum_c x[r, c] / cols,   var_r = sum_c (x[r, c] - mean_r)^2 / cols  (biased)
//     rstd_r = 1 / sqrt(var_r + eps),  y[r, c] = (x[r, c] - mean_r) * rstd_r * w[c] + b[c]
// with float32 arithmetic for every element type; mean and rstd are float32 outputs (what a
// backward pass needs), y has the element type.
//
// Statistics are computed in ONE pass over x with Welford/Chan: every thread keeps a partial
// (count, mean, M2) of the elements it has seen (CACHE 2: all of its cached elements at once,
// mean then M2 exactly from registers; streaming: vector by vector, each vector's mean and M2
// exact, merged with Chan et al.'s formula into a partial per unrolled step, which is merged
// into the thread's running partial), and the
// partials are merged across lanes with warp shuffles and across warps through shared memory.
// All of it runs on x - K, where the pivot K is the row's first element (the "shifted data"
// algorithm): for rows like 1e4 + N(0, 1) the partial means are small numbers with small
// rounding errors, so y = ((x - K) - mean_s) * rstd keeps full float32 accuracy, and the mean
// output K + mean_s is rounded once.
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/layernorm/__init__.py renders them):
//   BLOCK_SIZE   threads per block: a multiple of 32, at most 1024 (ROW_THREADS 0 only; warp
//                mode takes the block size from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes.
//   ROW_THREADS  threads sharing one row: 8, 16 or 32 lanes of a warp (32 / ROW_THREADS rows per
//                warp, shuffles only, no block barrier), or 0: the whole block (one row per
//                block at a time; shuffles, then a small shared array across warps).
//   CACHE        0: the statistics pass streams x, the output pass re-reads it (L1/L2 hits if
//                lucky). 1: the row is kept in dynamic shared memory as DTYPE between the passes.
//                2: the row is kept in registers, ITEMS vectors per thread.
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (default BLOCK_SIZE and 0): the spec renders
//                BLOCK_SIZE and MIN_BLOCKS (the space's min-blocks clause) in block mode, the
//                canonical bounds of the config's register cap in warp mode.
// Derived macros (the spec computes them; defaults let the template compile standalone):
//   DTYPE        float, __half or __nv_bfloat16; IS_HALF, IS_BF16 select the headers.
//   ITEMS        CACHE == 2 only: ceil(cols / (threads per row * VEC)); 0 otherwise.
//   WB_REGS      CACHE == 2 only: 1 = weight and bias vectors are loaded into registers once
//                and reused for every row the thread's group processes (the grid-stride loop
//                over rows); 0 = re-read per row (L1 hits). Never with ROW_SPLIT.
//   ROW_SPLIT    1 where cols % VEC != 0: each row is a scalar head up to its first aligned
//                address, aligned vectors, and a scalar tail (kato_rows.cuh; head and tail
//                element t go to thread t of the row group); weight and bias are read as
//                vectors where their address allows. 0 (the default): rows are whole vectors,
//                and the program is the one compiled before ROW_SPLIT existed.
//   ROW_PIECES   1 for few long rows (the spec's GROUP_ROWS 0; ROW_THREADS 0 and CACHE 0 only):
//                each row is cut into parts = gridDim.x / rows contiguous runs of its aligned
//                vectors, a block per piece, in two launches. layernorm_split_stats writes each
//                piece's Welford partial (count, mean, M2 of x - K) to a module workspace;
//                layernorm_fwd then merges its row's partials in a fixed order (every block of a
//                row gets the same bits: deterministic) and writes the piece's y, re-reading x
//                from its end (what the first launch left in L2). A split row's scalar head and
//                tail, and the row's mean and rstd, belong to its first piece. The workspace
//                belongs to the loaded module: launches of one module must not overlap (one
//                stream at a time). 0 (the default): one launch, as before ROW_PIECES existed.
// Fixed by the operator, not tunable:
//   EPILOGUE_RELU 1: y = relu(layer_norm(x)) (kernels/layernorm_relu), applied where every path
//                writes y (normalise and normalise_one); NaN stays NaN, as torch.relu. 0 (the
//                default): plain layernorm, the program compiled before the macro existed.
//
// Contract (kernels.layernorm.LayerNormSpec.check enforces the static part): ROW_SPLIT 0 needs
// every pointer aligned to VEC * sizeof(DTYPE) bytes (cudaMalloc gives 256) and cols % VEC == 0;
// ROW_SPLIT 1 needs x and y congruent modulo VEC * sizeof(DTYPE) bytes, every pointer aligned to
// its element; CACHE == 2
// needs cols <= ITEMS * threads_per_row * VEC, CACHE == 1 needs the launch to pass
// rows_per_block * cols * sizeof(DTYPE) bytes of dynamic shared memory, rows < 2^31,
// cols <= 2^31 - 2^16 (column indices run one unrolled step past cols).
//
// The prelude (macros, thread layout, checks, KATO_LAUNCH_BOUNDS), the vector and element-type
// helpers, row splits, weight loads and the Welford partials come from kernels/common.

#ifndef KATO_NS
#define KATO_NS kato_layernorm
#endif
#ifndef CACHE
#error "CACHE must be defined"
#endif
#ifndef ROW_SPLIT
#define ROW_SPLIT 0
#endif
#ifndef ROW_PIECES
#define ROW_PIECES 0
#endif
#ifndef EPILOGUE_RELU
#define EPILOGUE_RELU 0
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors loaded per thread per step of the streaming passes (CACHE 0/1): 64 bytes in flight.
[[maybe_unused]] constexpr int kUnroll = 64 / kVecBytes < 8 ? 64 / kVecBytes : 8;

static_assert(CACHE >= 0 && CACHE <= 2, "CACHE must be 0, 1 or 2");
static_assert(CACHE != 2 || (ITEMS >= 1 && ITEMS <= 64), "CACHE 2 needs ITEMS in [1, 64]");
#if ROW_SPLIT
static_assert(VEC > 1 && !WB_REGS, "ROW_SPLIT: rows not whole vectors, a head per row");
#endif
#if ROW_PIECES
static_assert(ROW_THREADS == 0 && CACHE == 0, "ROW_PIECES: a block streams each piece");
#endif

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_welford.cuh"

// All threads of a row group end with the row's statistics. For ROW_THREADS == 0, `red` is this
// row's slot of a double-buffered shared array (see the kernel): one barrier per row.
__device__ __forceinline__ Stats row_allreduce(Stats s, Stats* red) {
  s = warp_allreduce<kLanes>(s);
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  // Every warp merges the per-warp partials itself (broadcast reads, then shuffles): the same
  // data in the same order, so every warp gets the same result, and no second barrier.
  const int slot = lane & (kWarpsPow2 - 1);
  s = warp_allreduce<kWarpsPow2>(slot < kWarps ? red[slot] : empty_stats());
#else
  (void)red;
#endif
  return s;
}

#if EPILOGUE_RELU
// max(v, 0) that keeps a NaN (torch.relu does; fmaxf would turn it into 0).
__device__ __forceinline__ float relu(float v) { return v < 0.0f ? 0.0f : v; }
#endif

// What a row group needs to normalise: (x - K - mean_s) * (rstd * w) + b.
struct RowNorm {
  float pivot;   // K
  float mean_s;  // mean of x - K
  float rstd;
};

__device__ __forceinline__ RowNorm finish(const Stats& s, float pivot, int cols, float eps) {
  RowNorm r;
  r.pivot = pivot;
  r.mean_s = s.mean;
  const float var = fmaxf(s.m2 / static_cast<float>(cols), 0.0f);
  r.rstd = rsqrtf(var + eps);
  return r;
}

__device__ __forceinline__ Raw normalise(const Raw& xv, const Raw& wv, const Raw& bv,
                                         const RowNorm& rn) {
  float f[VEC], w[VEC], b[VEC];
  unpack(xv, f);
  unpack(wv, w);
  unpack(bv, b);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = fmaf((f[j] - rn.pivot) - rn.mean_s, rn.rstd * w[j], b[j]);
#if EPILOGUE_RELU
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = relu(f[j]);
#endif
  return pack(f);
}

#if ROW_SPLIT
// Statistics of a thread's head and tail elements of x - K (each one present or not), exactly.
__device__ __forceinline__ Stats edge_stats(bool has_a, float a, bool has_b, float b) {
  Stats s;
  s.n = static_cast<float>(has_a) + static_cast<float>(has_b);
  s.mean = ((has_a ? a : 0.0f) + (has_b ? b : 0.0f)) / fmaxf(s.n, 1.0f);
  const float da = has_a ? a - s.mean : 0.0f;
  const float db = has_b ? b - s.mean : 0.0f;
  s.m2 = fmaf(da, da, db * db);
  return s;
}

// y of one head or tail element: x at column c, the row's statistics.
__device__ __forceinline__ T normalise_one(float x, const T* __restrict__ w,
                                           const T* __restrict__ b, int c, const RowNorm& rn) {
#if EPILOGUE_RELU
  return to_elem(relu(fmaf((x - rn.pivot) - rn.mean_s, rn.rstd * to_float(__ldg(w + c)),
                           to_float(__ldg(b + c)))));
#else
  return to_elem(fmaf((x - rn.pivot) - rn.mean_s, rn.rstd * to_float(__ldg(w + c)),
                      to_float(__ldg(b + c))));
#endif
}
#endif

#if ROW_PIECES
// Split rows: the partials workspace, one per piece, sized for the largest grid the spec
// launches (MIN_BLOCKS <= 2 blocks per SM of 132: rows * parts <= 2 * 132). Written by
// layernorm_split_stats, read by the layernorm_fwd launched after it on the same stream.
constexpr int kSplitPieces = 2 * 132;
__device__ Stats split_partials[kSplitPieces];

// Vectors a block covers per step of a piece (kUnroll per thread, as the streaming passes).
constexpr int kSplitStep = BLOCK_SIZE * kUnroll;

// Pieces per row as launched: gridDim.x / rows, within [1, kSplitPieces / rows]. Both launches
// derive it from the same grid, so they agree on it whatever the grid.
__device__ __forceinline__ int split_parts(int rows) {
  int parts = static_cast<int>(gridDim.x) / rows;
  const int room = kSplitPieces / rows;
  parts = parts < room ? parts : room;
  return parts < 1 ? 1 : parts;
}

// One block's piece of a row: its run of the row's aligned vectors (lengths differ by one
// vector at most), starting at column col of the row.
struct Piece {
  const Raw* x;
  Raw* y;
  int col;
  int nvec;
};

__device__ __forceinline__ Piece piece_of(const T* x, T* y, size_t offset, int cols, int part,
                                          int parts) {
#if ROW_SPLIT
  const Split split = split_row(x + offset, cols);
  const int head = split.head;
  const int nvec = split.nvec;
#else
  const int head = 0;
  const int nvec = cols / VEC;
#endif
  const int lo = static_cast<int>(static_cast<long long>(nvec) * part / parts);
  const int hi = static_cast<int>(static_cast<long long>(nvec) * (part + 1) / parts);
  Piece p;
  p.x = reinterpret_cast<const Raw*>(x + offset + head) + lo;
  p.y = reinterpret_cast<Raw*>(y + offset + head) + lo;
  p.col = head + lo * VEC;
  p.nvec = hi - lo;
  return p;
}

// The thread's Welford partial of x - pivot over vectors t, t + BLOCK_SIZE, ... of a piece:
// the CACHE 0 statistics pass (a merge per vector into the step's partial, one per step into
// the running one). Loads keep the default caching: the second launch reads the piece again.
__device__ __forceinline__ Stats piece_stats(const Raw* __restrict__ xr, int nvec, int t,
                                             float pivot) {
  Stats s = empty_stats();
  for (int b0 = t; b0 < nvec; b0 += kSplitStep) {
    Raw r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = b0 + u * BLOCK_SIZE;
      if (idx < nvec) r[u] = __ldg(xr + idx);
    }
    Stats st = empty_stats();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (b0 + u * BLOCK_SIZE < nvec) {
        float f[VEC];
        unpack(r[u], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] -= pivot;
        st = merge(st, vector_stats(f));
      }
    }
    s = merge(s, st);
  }
  return s;
}

// y of vectors t, t + BLOCK_SIZE, ... of a piece, the last step first: the first launch read
// every piece front to back, so the ends of the pieces are what L2 holds. Weight and bias of
// the piece's columns: vector loads where their address allows (always without ROW_SPLIT).
__device__ __forceinline__ void piece_apply(const Piece& p, const T* __restrict__ weight,
                                            const T* __restrict__ bias, int t,
                                            const RowNorm& rn) {
#if ROW_SPLIT
  const bool w_vec = cols_aligned(weight, p.col);
  const bool b_vec = cols_aligned(bias, p.col);
#endif
  for (int step = (p.nvec + kSplitStep - 1) / kSplitStep - 1; step >= 0; --step) {
    const int b0 = step * kSplitStep + t;
    Raw r[kUnroll], wi[kUnroll], bi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = b0 + u * BLOCK_SIZE;
      if (idx < p.nvec) {
        r[u] = __ldcs(p.x + idx);  // last use of x: evict first
#if ROW_SPLIT
        wi[u] = load_cols(weight, p.col + idx * VEC, w_vec);
        bi[u] = load_cols(bias, p.col + idx * VEC, b_vec);
#else
        wi[u] = __ldg(reinterpret_cast<const Raw*>(weight + p.col) + idx);
        bi[u] = __ldg(reinterpret_cast<const Raw*>(bias + p.col) + idx);
#endif
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = b0 + u * BLOCK_SIZE;
      if (idx < p.nvec) __stcs(p.y + idx, normalise(r[u], wi[u], bi[u], rn));
    }
  }
}
#endif  // ROW_PIECES

}  // namespace KATO_NS

#if !ROW_PIECES
// Grid: ceil(rows / rows_per_block / GROUP_ROWS) blocks (the spec's launch); any grid is
// correct: every row group loops over rows with a grid stride. In warp mode the loop is uniform
// per warp (rows past the end are processed as empty rows and not stored), so the full-mask
// shuffles always have all 32 lanes; in block mode it is uniform per block (barriers).
extern "C" __global__ void KATO_LAUNCH_BOUNDS layernorm_fwd(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ weight, const DTYPE* __restrict__ bias,
    DTYPE* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int rows,
    int cols, float eps) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;
  const int nvec = cols / VEC;
  const Raw* __restrict__ wv = reinterpret_cast<const Raw*>(weight);
  const Raw* __restrict__ bv = reinterpret_cast<const Raw*>(bias);
#if ROW_SPLIT
  // Split rows read weight and bias through load_cols; nvec is the CACHE 1 row slots' stride.
  (void)wv;
  (void)bv;
  (void)nvec;
#endif

#if ROW_THREADS == 0
  const int t = threadIdx.x;
  const int group = 0;
  const long long first = blockIdx.x;
  const long long stride = gridDim.x;
#if BLOCK_SIZE > 32
  __shared__ kn::Stats red[2][kn::kWarps];
#endif
#else
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int t = lane & (kn::kLanes - 1);
  const int group = lane / kn::kLanes;  // row group within the warp
  // Rows per block from the launch (blockDim.x <= LB_THREADS, a multiple of 32).
  const int rows_per_block = static_cast<int>(blockDim.x) / kn::kLanes;
  // 64-bit: blockIdx.x * rows_per_block can pass INT_MAX on the last blocks.
  const long long first =
      static_cast<long long>(blockIdx.x) * rows_per_block + warp * kn::kRowsPerWarp;
  const long long stride = static_cast<long long>(gridDim.x) * rows_per_block;
#endif

#if CACHE == 1
  extern __shared__ __align__(16) unsigned char kato_smem[];
  // Row group g of the block owns row slot g: (threadIdx.x / P) * nvec vectors in.
  Raw* const srow = reinterpret_cast<Raw*>(kato_smem) + static_cast<size_t>(threadIdx.x / P) * nvec;
#endif

#if CACHE == 2 && WB_REGS
  // The columns a thread touches are the same in every row: weight and bias stay in registers.
  Raw wr[ITEMS], br[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int idx = t + i * P;
    if (idx < nvec) {
      wr[i] = __ldg(wv + idx);
      br[i] = __ldg(bv + idx);
    }
  }
#endif

  int parity = 0;
  for (long long base = first; base < rows; base += stride, parity ^= 1) {
    const long long row = base + group;
    const bool valid = row < rows;
    // An empty row past the end: no loads, no stores, but it joins the shuffles.
#if ROW_SPLIT
    const int cols_here = valid ? cols : 0;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
    const kn::Split split = kn::split_row(x + offset, cols_here);
    const int n_here = split.nvec;
    const Raw* __restrict__ xr = reinterpret_cast<const Raw*>(x + offset + split.head);
    Raw* __restrict__ yr = reinterpret_cast<Raw*>(y + offset + split.head);
    const bool w_vec = kn::cols_aligned(weight, split.head);
    const bool b_vec = kn::cols_aligned(bias, split.head);
    const bool has_head = t < split.head;
    const bool has_tail = split.tail + t < cols_here;
    const float hx = has_head ? kn::to_float(__ldg(x + offset + t)) : 0.0f;
    const float tx = has_tail ? kn::to_float(__ldg(x + offset + split.tail + t)) : 0.0f;
#else
    const int n_here = valid ? nvec : 0;
    const size_t offset = valid ? static_cast<size_t>(row) * static_cast<size_t>(cols) : 0;
    const Raw* __restrict__ xr = reinterpret_cast<const Raw*>(x + offset);
    Raw* __restrict__ yr = reinterpret_cast<Raw*>(y + offset);
#endif
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
    kn::Stats* const slot = red[parity];
#else
    kn::Stats* const slot = nullptr;
#endif
    // Pivot K: the row's first element (a broadcast load every thread of the group makes).
    float pivot = 0.0f;
#if ROW_SPLIT
    if (valid) pivot = kn::to_float(__ldg(x + offset));
#else
    if (valid) {
      float f0[VEC];
      kn::unpack(__ldg(xr), f0);
      pivot = f0[0];
    }
#endif

#if CACHE == 2
    Raw r[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < n_here) r[i] = __ldcs(xr + idx);
    }
    // The thread's partial over all its cached elements, exactly: the mean of x - K, then M2
    // about it (two passes over registers; unpacking again is cheaper than holding floats).
    float sum = 0.0f;
    int count = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (t + i * P < n_here) {
        float f[VEC];
        kn::unpack(r[i], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += f[j] - pivot;
        count += VEC;
      }
    }
    kn::Stats s;
    s.n = static_cast<float>(count);
    s.mean = __fdividef(sum, fmaxf(s.n, 1.0f));
    float m2 = 0.0f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (t + i * P < n_here) {
        float f[VEC];
        kn::unpack(r[i], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = (f[j] - pivot) - s.mean;
          m2 = fmaf(d, d, m2);
        }
      }
    }
    s.m2 = m2;
#if ROW_SPLIT
    s = kn::merge(s, kn::edge_stats(has_head, hx - pivot, has_tail, tx - pivot));
#endif
    s = kn::row_allreduce(s, slot);
    const kn::RowNorm rn = kn::finish(s, pivot, cols, eps);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int idx = t + i * P;
      if (idx < n_here) {
#if ROW_SPLIT
        const Raw wi = kn::load_cols(weight, split.head + idx * VEC, w_vec);
        const Raw bi = kn::load_cols(bias, split.head + idx * VEC, b_vec);
#elif WB_REGS
        const Raw wi = wr[i];
        const Raw bi = br[i];
#else
        const Raw wi = __ldg(wv + idx);
        const Raw bi = __ldg(bv + idx);
#endif
        __stcs(yr + idx, kn::normalise(r[i], wi, bi, rn));
      }
    }
#else   // CACHE 0 or 1: stream the row, kUnroll vectors per thread per step.
    constexpr int U = kn::kUnroll;
    constexpr int kStep = P * U;
    kn::Stats s = kn::empty_stats();
    for (int b0 = t; b0 < n_here; b0 += kStep) {
      Raw r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < n_here) r[u] = __ldg(xr + idx);
      }
      // One Chan merge per vector (its mean and M2 exactly from registers) into the step's
      // partial, then one merge of that into the thread's running partial: only the raw vectors
      // in flight and one vector of floats are live at a time. Merging every vector straight
      // into the running partial made a long row's variance drift: with 2^20 columns and 8
      // threads per row (131072 merges each) the float32 rounding of the running mean and M2
      // added up to 1.4e-5 of rstd, past its tolerance; merged per step it stays near 4e-7
      // (tests/kernels/test_layernorm_emulation.py).
      kn::Stats st = kn::empty_stats();
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < n_here) {
#if CACHE == 1
          srow[idx] = r[u];  // the same thread reads it back in the output pass: no barrier
#endif
          float f[VEC];
          kn::unpack(r[u], f);
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] -= pivot;
          st = kn::merge(st, kn::vector_stats(f));
        }
      }
      s = kn::merge(s, st);
    }
#if ROW_SPLIT
    s = kn::merge(s, kn::edge_stats(has_head, hx - pivot, has_tail, tx - pivot));
#endif
    s = kn::row_allreduce(s, slot);
    const kn::RowNorm rn = kn::finish(s, pivot, cols, eps);
    for (int b0 = t; b0 < n_here; b0 += kStep) {
      Raw r[U], wi[U], bi[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < n_here) {
#if CACHE == 1
          r[u] = srow[idx];
#else
          r[u] = __ldcs(xr + idx);  // last use of x: evict first
#endif
#if ROW_SPLIT
          wi[u] = kn::load_cols(weight, split.head + idx * VEC, w_vec);
          bi[u] = kn::load_cols(bias, split.head + idx * VEC, b_vec);
#else
          wi[u] = __ldg(wv + idx);
          bi[u] = __ldg(bv + idx);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < n_here) __stcs(yr + idx, kn::normalise(r[u], wi[u], bi[u], rn));
      }
    }
#endif  // CACHE
#if ROW_SPLIT
    if (has_head) y[offset + t] = kn::normalise_one(hx, weight, bias, t, rn);
    if (has_tail) {
      y[offset + split.tail + t] = kn::normalise_one(tx, weight, bias, split.tail + t, rn);
    }
#endif
    if (valid && t == 0) {
      mean_out[row] = rn.pivot + rn.mean_s;
      rstd_out[row] = rn.rstd;
    }
  }
  (void)parity;
}
#else  // ROW_PIECES: a block per piece of a row, two launches

// Launch 1 of 2: each block's piece's Welford partial of x - K (K the row's first element),
// merged over the block, to split_partials[row * parts + part]; the first piece also takes a
// split row's head and tail. Items (row * parts + part) are visited with a grid stride: the
// spec launches one block per item; any grid is correct as long as launch 2 has the same.
extern "C" __global__ void KATO_LAUNCH_BOUNDS layernorm_split_stats(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ weight, const DTYPE* __restrict__ bias,
    DTYPE* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int rows,
    int cols, float eps) {
  namespace kn = KATO_NS;
  (void)weight;
  (void)bias;
  (void)mean_out;
  (void)rstd_out;
  (void)eps;
#if BLOCK_SIZE > 32
  __shared__ kn::Stats red[2][kn::kWarps];
#endif
  const int t = threadIdx.x;
  const int parts = kn::split_parts(rows);
  const long long items = static_cast<long long>(rows) * parts;
  int parity = 0;
  for (long long item = blockIdx.x; item < items; item += gridDim.x, parity ^= 1) {
    const long long row = item / parts;
    const int part = static_cast<int>(item - row * parts);
#if BLOCK_SIZE > 32
    kn::Stats* const slot = red[parity];
#else
    kn::Stats* const slot = nullptr;
#endif
    const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(cols);
    const float pivot = kn::to_float(__ldg(x + offset));
    const kn::Piece p = kn::piece_of(x, y, offset, cols, part, parts);
    kn::Stats s = kn::piece_stats(p.x, p.nvec, t, pivot);
#if ROW_SPLIT
    if (part == 0) {  // block-uniform
      const kn::Split split = kn::split_row(x + offset, cols);
      const bool has_head = t < split.head;
      const bool has_tail = split.tail + t < cols;
      const float hx = has_head ? kn::to_float(__ldg(x + offset + t)) : 0.0f;
      const float tx = has_tail ? kn::to_float(__ldg(x + offset + split.tail + t)) : 0.0f;
      s = kn::merge(s, kn::edge_stats(has_head, hx - pivot, has_tail, tx - pivot));
    }
#endif
    s = kn::row_allreduce(s, slot);
    if (t == 0) kn::split_partials[item] = s;
  }
  (void)parity;
}

// Launch 2 of 2: every block merges its row's partials (thread t: pieces t, t + BLOCK_SIZE, ...
// in order, then the block's merges, so every block of a row gets the same bits) and writes y
// for its piece; the first piece also a split row's head and tail, and the row's mean and rstd.
extern "C" __global__ void KATO_LAUNCH_BOUNDS layernorm_fwd(
    const DTYPE* __restrict__ x, const DTYPE* __restrict__ weight, const DTYPE* __restrict__ bias,
    DTYPE* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int rows,
    int cols, float eps) {
  namespace kn = KATO_NS;
#if BLOCK_SIZE > 32
  __shared__ kn::Stats red[2][kn::kWarps];
#endif
  const int t = threadIdx.x;
  const int parts = kn::split_parts(rows);
  const long long items = static_cast<long long>(rows) * parts;
  int parity = 0;
  for (long long item = blockIdx.x; item < items; item += gridDim.x, parity ^= 1) {
    const long long row = item / parts;
    const int part = static_cast<int>(item - row * parts);
#if BLOCK_SIZE > 32
    kn::Stats* const slot = red[parity];
#else
    kn::Stats* const slot = nullptr;
#endif
    const kn::Stats* const partials = kn::split_partials + (item - part);
    kn::Stats s = kn::empty_stats();
    for (int i = t; i < parts; i += BLOCK_SIZE) s = kn::merge(s, partials[i]);
    s = kn::row_allreduce(s, slot);
    const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(cols);
    const float pivot = kn::to_float(__ldg(x + offset));
    const kn::RowNorm rn = kn::finish(s, pivot, cols, eps);
    const kn::Piece p = kn::piece_of(x, y, offset, cols, part, parts);
    kn::piece_apply(p, weight, bias, t, rn);
    if (part == 0) {  // block-uniform
#if ROW_SPLIT
      const kn::Split split = kn::split_row(x + offset, cols);
      if (t < split.head) {
        y[offset + t] = kn::normalise_one(kn::to_float(__ldg(x + offset + t)), weight, bias, t, rn);
      }
      const int c = split.tail + t;
      if (c < cols) {
        y[offset + c] = kn::normalise_one(kn::to_float(__ldg(x + offset + c)), weight, bias, c, rn);
      }
#endif
      if (t == 0) {
        mean_out[row] = rn.pivot + rn.mean_s;
        rstd_out[row] = rn.rstd;
      }
    }
  }
  (void)parity;
}
#endif  // ROW_PIECES
