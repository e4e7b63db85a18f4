// Sum of all n elements of a 1-D array into one float32:  out[0] = sum_i x[i].
// float32 accumulation for every element type; the output is float32 for every input type.
//
// Tunable parameters arrive as `#define NAME value` lines before this template (rendered by
// kernels/reduce_sum_all/__init__.py):
//   BLOCK_SIZE  threads per block: a multiple of 32 in [32, 1024].
//   VEC         elements per vector load; VEC * sizeof(DTYPE) <= 16 bytes. Any n works: the
//               n % VEC elements after the last whole vector are added by the first threads.
//   UNROLL      vectors loaded per thread per step of the grid-stride loop (all loads of a
//               step are issued before any is used: UNROLL * VEC * sizeof(DTYPE) bytes in
//               flight per thread).
//   FINISH      how the per-block partial sums become one number:
//               0: two-phase. Every block writes its partial to partials[blockIdx.x]; a second
//                  kernel (reduce_sum_all_finish, one block) sums them. Deterministic.
//               1: atomic. A first kernel (reduce_sum_all_init) zeroes out[0]; every block
//                  atomicAdds its partial into it. Not deterministic (order of the atomics).
//               2: last block done. Blocks write partials, __threadfence(), take a ticket from
//                  counter[0]; the block that takes the last ticket sums the partials (same
//                  tree as FINISH 0, so bit-identical to it) and resets the counter to 0.
// The grid size (BLOCKS_PER_SM in the spec) is launch geometry only: it is not in the source.
//
// Summation structure (tests/kernels/test_reduce_sum_all_spec.py models it exactly in numpy):
//   1. Thread g (global index, T = gridDim.x * BLOCK_SIZE threads) owns, at step k, the vector
//      slots s = k*T*UNROLL + u*T + g for u < UNROLL (slots >= n / VEC contribute 0). Its
//      VEC values of each vector are summed pairwise, then the UNROLL vector sums pairwise
//      (see pairwise()), and the step sum is added to the thread's running sum with Kahan compensation.
//      The thread's value is sum - compensation; thread g < n % VEC then adds x[n/VEC*VEC + g].
//   2. Warp: butterfly (xor 16, 8, 4, 2, 1). Block: lane 0 of each warp stores its warp sum;
//      warp 0 loads them (0 beyond the warp count) and does the butterfly again.
//   3. Grid: thread t of the finishing block sums partials t, t + BLOCK_SIZE, ... serially,
//      then step 2's block reduction (FINISH 0 and 2); FINISH 1 uses atomicAdd instead.
// The error is therefore about (log2(UNROLL*VEC) + 2 + log2(BLOCK_SIZE) + grid/BLOCK_SIZE
// + log2(BLOCK_SIZE)) roundings of the running magnitude, not n as in a serial float sum.
//
// Arguments: x, out (float[1]), partials (float[>= grid]), counter (unsigned int[2]: [0] the
// last-block ticket, 0 between launches; [1] the partial count written by block 0 for the
// finish kernel), n (long long). x must be 16-byte aligned (cudaMalloc gives 256).

#ifndef BLOCK_SIZE
#error "BLOCK_SIZE must be defined"
#endif
#ifndef VEC
#error "VEC must be defined"
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef FINISH
#define FINISH 0
#endif
#include "../common/kato_dtype.cuh"

#ifndef KATO_NS
#define KATO_NS kato_reduce_sum_all
#endif

namespace KATO_NS {

using T = DTYPE;

constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
constexpr int kWarps = BLOCK_SIZE / 32;

static_assert(BLOCK_SIZE % 32 == 0 && BLOCK_SIZE >= 32 && BLOCK_SIZE <= 1024,
              "BLOCK_SIZE must be a multiple of 32 in [32, 1024]");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector must be at most 16 bytes");
static_assert(UNROLL == 1 || UNROLL == 2 || UNROLL == 4 || UNROLL == 8,
              "UNROLL must be 1, 2, 4 or 8");
static_assert(FINISH >= 0 && FINISH <= 2, "FINISH must be 0, 1 or 2");

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#include "../common/kato_rows.cuh"
#include "../common/kato_pairwise.cuh"

// Block sum; the result is valid in warp 0 (every lane of it). `red` holds kWarps floats.
// Contains one __syncthreads(): call it from block-uniform control flow only.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum<32>(v);
  if constexpr (kWarps == 1) {
    return v;
  } else {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float w = 0.0f;
    if (warp == 0) {
      w = lane < kWarps ? red[lane] : 0.0f;
      w = warp_sum<32>(w);
    }
    return w;
  }
}

// Sum of `count` partials by the whole block (thread t: t, t + BLOCK_SIZE, ... serially, then
// block_sum). Reads through L2 (ld.global.cg): partials written by other blocks of this launch
// are not in this SM's L1. Result valid in warp 0.
__device__ __forceinline__ float sum_partials(const float* partials, int count, float* red) {
  float acc = 0.0f;
  for (int i = threadIdx.x; i < count; i += BLOCK_SIZE) acc += __ldcg(partials + i);
  return block_sum(acc, red);
}

}  // namespace KATO_NS

#if defined(MIN_BLOCKS) && MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE)
#endif

// Any grid works (grid-stride loop); the spec launches min(BLOCKS_PER_SM * 132, blocks needed).
extern "C" __global__ void KATO_LAUNCH_BOUNDS reduce_sum_all_kernel(
    const DTYPE* __restrict__ x, float* __restrict__ out, float* __restrict__ partials,
    unsigned int* __restrict__ counter, long long n) {
  namespace ns = KATO_NS;
  using Raw = ns::Raw;
  __shared__ float red[ns::kWarps];  // block_sum scratch (reused by the last block, FINISH 2)

  const long long nvec = n / VEC;
  const long long threads = static_cast<long long>(gridDim.x) * BLOCK_SIZE;
  const long long g = static_cast<long long>(blockIdx.x) * BLOCK_SIZE + threadIdx.x;
  const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(x);

  float s = 0.0f;
  float c = 0.0f;
  for (long long base = g; base < nvec; base += threads * UNROLL) {
    Raw r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long slot = base + u * threads;
      if (slot < nvec) r[u] = __ldcs(xv + slot);
    }
    float v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float f[VEC];
      if (base + u * threads < nvec) {
        ns::unpack(r[u], f);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = 0.0f;
      }
      v[u] = ns::vector_sum(f);
    }
    ns::kahan_add(s, c, ns::pairwise(v));
  }
  float v = s - c;
  const long long tail = n - nvec * VEC;  // < VEC
  if (g < tail) v += ns::to_float(x[nvec * VEC + g]);

  v = ns::block_sum(v, red);

#if FINISH == 1
  if (threadIdx.x == 0) atomicAdd(out, v);
  (void)partials;
  (void)counter;
#else
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = v;
    if (blockIdx.x == 0) counter[1] = gridDim.x;  // for reduce_sum_all_finish
  }
  (void)out;
#if FINISH == 2
  int last = 0;
  if (threadIdx.x == 0) {
    __threadfence();  // the partial is visible device-wide before the ticket is taken
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  // A barrier that also broadcasts "this block took the last ticket": block-uniform branch.
  // (It also orders warp 0's reads of `red` above before block_sum reuses it below.)
  if (__syncthreads_or(last)) {
    __threadfence();  // acquire side: every other block's partial is visible
    const float total = ns::sum_partials(partials, static_cast<int>(gridDim.x), red);
    if (threadIdx.x == 0) {
      out[0] = total;
      counter[0] = 0;  // ready for the next launch
    }
  }
#endif
#endif
}

// FINISH 0, second step: one block of BLOCK_SIZE threads sums the counter[1] partials.
extern "C" __global__ void KATO_LAUNCH_BOUNDS reduce_sum_all_finish(
    const float* __restrict__ partials, float* __restrict__ out,
    const unsigned int* __restrict__ counter) {
  namespace ns = KATO_NS;
  __shared__ float red[ns::kWarps];
  const float total = ns::sum_partials(partials, static_cast<int>(counter[1]), red);
  if (threadIdx.x == 0) out[0] = total;
}

// FINISH 1, first step: out[0] = 0 before the blocks' atomicAdds (launch 1 block of 1 thread).
extern "C" __global__ void reduce_sum_all_init(float* __restrict__ out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = 0.0f;
}
