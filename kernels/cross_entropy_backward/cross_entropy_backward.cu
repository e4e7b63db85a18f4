// Cross-entropy backward over the last dimension of row-major (rows, cols) logits:
//     dlogits[r, c] = (exp(x[r, c] - lse_r) - (c == label_r)) * dloss_r
// from the logits, the int64 labels, the forward's float32 lse and the float32 gradient of each
// row's loss (torch's mean reduction: 1 / count on every counted row). Rows whose label is the
// ignore index get zeros; rows whose label is outside [0, cols) get NaN (the forward's NaN loss
// carried on). Float32 arithmetic for every element type. One pass: every element is read once
// and written once, by the same thread, so dlogits may be the logits buffer itself (in place:
// the pointers carry no __restrict__, and no element is read after any write to it).
//
// Tunable parameters arrive as `#define NAME value` lines before this template
// (kernels/cross_entropy_backward/__init__.py renders them; kernels/cross_entropy/model.py
// describes the model):
//   BLOCK_SIZE   threads per block (ROW_THREADS 0 only; warp mode takes it from the launch).
//   VEC          elements per vector load/store; VEC * sizeof(DTYPE) <= 16 bytes. Any cols:
//                each chunk is a scalar head up to its first aligned address, aligned vectors
//                and a scalar tail.
//   ROW_THREADS  threads sharing one chunk: 8, 16 or 32 lanes of a warp, or 0: the whole block.
//   SPLIT        chunks per row, each a work item of its own row group (nothing to merge).
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (the spec renders canonical ones in warp mode).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
//
// Contract (kernels.cross_entropy_backward.CrossEntropyBackwardSpec.check enforces the static
// part): logits and dlogits have base addresses congruent modulo 16 bytes (or are the same);
// labels, lse and dloss hold rows elements; rows < 2^31, cols <= 2^31 - 2^16.

#ifndef KATO_NS
#define KATO_NS kato_cross_entropy_backward
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_row_layout.cuh"

// Vectors loaded per thread per step: 32 bytes in flight, at most 4 vectors.
constexpr int kUnroll = 32 / kVecBytes < 4 ? 32 / kVecBytes : 4;

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_row_sum.cuh"
#include "../common/kato_row_chunks.cuh"

}  // namespace KATO_NS

// Grid: ceil(rows * SPLIT / rows_per_block) blocks (the spec's launch); any grid is correct:
// every row group loops over its work items (row, chunk) with a grid stride. No barriers and no
// shuffles: row groups never wait for each other.
extern "C" __global__ void KATO_LAUNCH_BOUNDS cross_entropy_bwd(
    const DTYPE* logits, const long long* __restrict__ labels, const float* __restrict__ lse,
    const float* __restrict__ dloss, DTYPE* dlogits, int rows, int cols,
    long long ignore_index) {
  namespace kn = KATO_NS;
  using Raw = kn::Raw;
  constexpr int P = kn::kThreadsPerRow;
  constexpr int U = kn::kUnroll;
  constexpr int kStep = P * U;
  const long long items = static_cast<long long>(rows) * SPLIT;

#if ROW_THREADS == 0
  const int t = threadIdx.x;
  const long long first = blockIdx.x;
  const long long stride = gridDim.x;
#else
  const int lane = threadIdx.x & 31;
  const int t = lane & (kn::kLanes - 1);
  const int rows_per_block = static_cast<int>(blockDim.x) / kn::kLanes;
  const long long first = static_cast<long long>(blockIdx.x) * rows_per_block +
                          (threadIdx.x >> 5) * kn::kRowsPerWarp + lane / kn::kLanes;
  const long long stride = static_cast<long long>(gridDim.x) * rows_per_block;
#endif

  for (long long item = first; item < items; item += stride) {
    const int row = static_cast<int>(item / SPLIT);
    int c0, c1;
    kn::chunk_range(static_cast<int>(item % SPLIT), cols, c0, c1);
    const int n_here = c1 - c0;
    const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(cols) + c0;
    const DTYPE* xs = logits + offset;
    DTYPE* ds = dlogits + offset;
    const kn::Split sp = kn::split_row(xs, n_here);
    const Raw* xv = reinterpret_cast<const Raw*>(xs + sp.head);
    Raw* dv = reinterpret_cast<Raw*>(ds + sp.head);
    const int nvec = sp.nvec;
    const int tail_col = sp.tail + t;

    const long long label = __ldg(labels + row);
    if (label == ignore_index || label < 0 || label >= cols) {
      // Ignored: zeros; out of range: NaN. Nothing is read.
      const float fill = label == ignore_index ? 0.0f : __int_as_float(0x7fc00000);
      float f[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = fill;
      const Raw r = kn::pack(f);
      for (int idx = t; idx < nvec; idx += P) __stcs(dv + idx, r);
      if (t < sp.head) ds[t] = kn::to_elem(fill);
      if (tail_col < n_here) ds[tail_col] = kn::to_elem(fill);
      continue;
    }
    const float l = __ldg(lse + row);
    const float g = __ldg(dloss + row);
    // The label's index within this chunk's vector body, -1 where it is not in the body: a
    // 32-bit compare per element below (one select, then the gradient as one FMA).
    const long long in_body = label - c0 - sp.head;
    const int lab = in_body >= 0 && in_body < static_cast<long long>(nvec) * VEC
                        ? static_cast<int>(in_body)
                        : -1;

    // Head and tail first: their elements are this thread's alone, like every vector below.
    if (t < sp.head) {
      const float p = kn::exp_from(kn::to_float(xs[t]), l);
      ds[t] = kn::to_elem((p - (c0 + t == label ? 1.0f : 0.0f)) * g);
    }
    if (tail_col < n_here) {
      const float p = kn::exp_from(kn::to_float(xs[tail_col]), l);
      ds[tail_col] = kn::to_elem((p - (c0 + tail_col == label ? 1.0f : 0.0f)) * g);
    }
    for (int b0 = t; b0 < nvec; b0 += kStep) {
      Raw rv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) rv[u] = __ldcs(xv + idx);  // read once: evict first
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = b0 + u * P;
        if (idx < nvec) {
          float f[VEC];
          kn::unpack(rv[u], f);
          const int at = lab - idx * VEC;
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] = fmaf(kn::exp_from(f[j], l), g, at == j ? -g : 0.0f);
          __stcs(dv + idx, kn::pack(f));
        }
      }
    }
  }
}
