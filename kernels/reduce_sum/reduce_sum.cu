// Sum over the last dimension of a row-major (rows, cols) matrix:  out[r] = sum_c x[r, c].
// float32 accumulation for every element type; the output is float32 for every input type.
//
// Tunable parameters arrive as `#define NAME value` lines before this template (rendered by
// kernels/reduce_sum/__init__.py):
//   BLOCK_SIZE   threads per block: a multiple of 32 in [32, 1024].
//   ROW_THREADS  threads that share one row: 8, 16 or 32 (an aligned group of lanes of one
//                warp; BLOCK_SIZE / ROW_THREADS rows per block, shuffles only, no barrier) or 0
//                (the whole block per row: shuffles, then a shared array across warps).
//   VEC          elements per vector load; VEC * sizeof(DTYPE) <= 16 bytes; cols % VEC == 0
//                (every row starts on a vector boundary).
//   UNROLL       vectors loaded per thread per step (all issued before any is used).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
//
// Summation structure (tests/kernels/test_reduce_sum_spec.py models it exactly in numpy):
//   thread t of a row's P threads owns, at step k, the vectors s = k*P*UNROLL + u*P + t for
//   u < UNROLL (vectors >= cols / VEC contribute 0). Each vector's VEC values are summed
//   pairwise, then the UNROLL vector sums pairwise (see pairwise()); step sums are
//   Kahan-accumulated; the
//   thread's value is sum - compensation. Then a butterfly over the group's lanes (xor P/2 .. 1),
//   or for a block: butterfly over each warp, lane 0s store, warp 0 loads (0 beyond the warp
//   count) and butterflies over 32 lanes.
//
// Arguments: x, out (float[rows]), rows (int), cols (int). x 16-byte aligned.

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
#ifndef DTYPE
#define DTYPE float
#endif
#if !defined(IS_HALF) && !defined(IS_BF16)
#define IS_HALF 1
#define IS_BF16 1
#endif
#ifndef IS_HALF
#define IS_HALF 0
#endif
#ifndef IS_BF16
#define IS_BF16 0
#endif

#if IS_HALF
#include <cuda_fp16.h>
#endif
#if IS_BF16
#include <cuda_bf16.h>
#endif

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
static_assert(ROW_THREADS == 0 || ROW_THREADS == 8 || ROW_THREADS == 16 || ROW_THREADS == 32,
              "ROW_THREADS must be 0 (block), 8, 16 or 32");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector must be at most 16 bytes");
static_assert(UNROLL == 1 || UNROLL == 2 || UNROLL == 4 || UNROLL == 8,
              "UNROLL must be 1, 2, 4 or 8");

#include "../common/kato_vec.cuh"

[[maybe_unused]] __device__ __forceinline__ float to_float(float v) { return v; }
#if IS_HALF
[[maybe_unused]] __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
#endif
#if IS_BF16
[[maybe_unused]] __device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
#endif

__device__ __forceinline__ void unpack(const Raw& r, float* f) {
  T t[VEC];
  __builtin_memcpy(t, &r, sizeof(Raw));
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = to_float(t[j]);
}

// Pairwise sum of the UNROLL*VEC values of one step, f[u][j] = element j of vector u: first
// within each vector (f[u][j] += f[u][j + w], w = VEC/2 .. 1), then across vectors (f[u][0] +=
// f[u + w][0], w = UNROLL/2 .. 1). Vector by vector, so at most one unpacked vector plus UNROLL
// partial sums are live next to the raw loads (no spills at UNROLL 8 x 16 bytes).
__device__ __forceinline__ float vector_sum(float (&f)[VEC]) {
#pragma unroll
  for (int w = VEC / 2; w > 0; w >>= 1) {
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      if (j < w) f[j] += f[j + w];
    }
  }
  return f[0];
}

__device__ __forceinline__ float pairwise(float (&v)[UNROLL]) {
#pragma unroll
  for (int w = UNROLL / 2; w > 0; w >>= 1) {
#pragma unroll
    for (int u = 0; u < (UNROLL + 1) / 2; ++u) {
      if (u < w) v[u] += v[u + w];
    }
  }
  return v[0];
}

// Kahan step (s, c) += v. No multiplications: nothing to contract into an FMA.
__device__ __forceinline__ void kahan_add(float& s, float& c, float v) {
  const float y = v - c;
  const float t = s + y;
  c = (t - s) - y;
  s = t;
}

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

// Butterfly over aligned groups of Width lanes; all 32 lanes must call it.
template <int Width>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

}  // namespace KATO_NS

#if defined(MIN_BLOCKS) && MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)
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
  const int nvec = cols / VEC;
#if ROW_THREADS == 0
  __shared__ float red[2][ns::kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int parity = 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(cols);
    float v = ns::thread_row_sum(reinterpret_cast<const Raw*>(x + offset), nvec, threadIdx.x);
    v = ns::group_sum<32>(v);
    if constexpr (ns::kWarps > 1) {
      // Double-buffered: a warp can only write red[parity] again two rows later, after the
      // next row's barrier, which warp 0 reaches only once it has read this row's slots.
      if (lane == 0) red[parity][warp] = v;
      __syncthreads();
      if (warp == 0) {
        v = lane < ns::kWarps ? red[parity][lane] : 0.0f;
        v = ns::group_sum<32>(v);
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
    float v = ns::thread_row_sum(reinterpret_cast<const Raw*>(x + offset), valid ? nvec : 0, t);
    v = ns::group_sum<ns::kRowThreads>(v);
    if (valid && t == 0) out[row] = v;
  }
#endif
}
