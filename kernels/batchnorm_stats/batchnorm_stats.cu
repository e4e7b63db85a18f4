// BatchNorm training-mode statistics of an NCHW-contiguous tensor x (N, C, H, W), per channel c:
//     mean_c = sum_{n,h,w} x / (N*H*W),   var_c = sum (x - mean_c)^2 / (N*H*W)   (biased)
//     invstd_c = 1 / sqrt(var_c + eps)                    (torch.batch_norm_stats' second output)
// float32 outputs and float32 arithmetic for every element type.
//
// Algorithm: the N*HW elements of a channel are split into SPLIT contiguous ranges (in the
// channel's own order: n-major, then h*w), one block each (grid = C * SPLIT, block b handles
// channel b / SPLIT, range b % SPLIT). Every thread keeps a Welford partial (count, mean, M2),
// updated chunk by chunk (UNROLL vectors loaded at once, then each vector's mean and M2 computed
// exactly from registers and merged with Chan et al.'s formula); partials are merged across lanes (shuffles) and
// warps (shared memory). Everything runs on x - K with the channel's first element as pivot K
// (shifted data: channels like 1e4 + N(0, 1) keep full float32 accuracy).
// Then, with SPLIT == 1 the block writes the outputs itself; otherwise it writes its partial
// (count, mean, M2) to workspace[(c * SPLIT + part) * 3 + {0, 1, 2}] and
//   - two-phase (STRATEGY 0): batchnorm_stats_partial, then batchnorm_stats_finalize (a warp per
//     channel merges the SPLIT partials; SPLIT reaches it through counters[C], which the first
//     block of the partial kernel writes on every call);
//   - single pass (STRATEGY 1): batchnorm_stats_fused: after writing its partial, thread 0 of
//     each block fences and takes a ticket with atomicInc(&counters[c], SPLIT - 1); the block
//     that draws SPLIT - 1 is the last of its channel: its first warp merges the partials (L2
//     loads) and writes the outputs. atomicInc wraps the counter back to 0 on that last ticket,
//     so the counters are 0 again after every call (they must be 0 before the first one).
// Every kernel takes the same arguments:
//     (x, mean, var, invstd, workspace, counters, N, C, HW, eps)
// workspace: C * 256 * 3 floats (SPLIT <= 256); counters: C + 1 unsigned ints.
//
// Tunable parameters (`#define NAME value` before this template; kernels/batchnorm_stats):
//   BLOCK_SIZE  threads per block of the partial/fused kernels: a multiple of 32, <= 1024.
//   VEC         elements per vector load over H*W, VEC * sizeof(DTYPE) <= 16 bytes.
//   PLANE_SPLIT 1 where HW % VEC != 0 (rendered only then): planes start off vector boundaries,
//               each is covered by kato_plane.cuh's slots (a scalar head, whole vectors, a
//               scalar tail); 0: every (n, c) plane is HW / VEC whole vectors.
//   UNROLL      vectors each thread loads per step (in flight together).
//   MIN_BLOCKS  __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS); 0 = no min-blocks clause.
// STRATEGY and SPLIT are not macros: STRATEGY picks the kernels (steps), SPLIT the grid.
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
// Contract (kernels.batchnorm_stats.BatchNormStatsSpec.check): x 16-byte aligned, PLANE_SPLIT 1
// where HW % VEC != 0, grid exactly C * SPLIT blocks (C * SPLIT <= 2^31 - 1), N, C, HW <= 2^30.

#ifndef KATO_NS
#define KATO_NS kato_batchnorm_stats
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_channel.cuh"

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"

#define KATO_STATS_LOAD __ldcs  // x is read once
#if PLANE_SPLIT
#define KATO_STATS_STREAM true
#include "../common/kato_plane.cuh"
#endif
#include "../common/kato_welford.cuh"
#include "../common/kato_channel_stats.cuh"

// One warp merges the `split` partials of channel c and lane 0 writes the outputs. All 32 lanes
// must call it; `Coherent` as merge_partials says. The merge is kato_channel_stats.cuh's
// merge_partials written out: calling it gives the same program but renames registers in the
// finalize kernel's PTX, the text the recorded spaces are carried over by.
template <bool Coherent>
__device__ __forceinline__ void write_merged(const float* __restrict__ ws, int c, int split,
                                             float pivot, float count, float eps,
                                             float* __restrict__ mean_out,
                                             float* __restrict__ var_out,
                                             float* __restrict__ invstd_out) {
  const int lane = threadIdx.x & 31;
  Stats s = empty_stats();
  for (int p = lane; p < split; p += 32) {
    const float* w = ws + (static_cast<size_t>(c) * split + p) * 3;
    Stats o;
    if constexpr (Coherent) {
      o.n = __ldcg(w);
      o.mean = __ldcg(w + 1);
      o.m2 = __ldcg(w + 2);
    } else {
      o.n = w[0];
      o.mean = w[1];
      o.m2 = w[2];
    }
    s = merge(s, o);
  }
  s = warp_allreduce(s);
  if (lane == 0) {
    const float var = fmaxf(s.m2 / count, 0.0f);
    mean_out[c] = pivot + s.mean;
    var_out[c] = var;
    invstd_out[c] = rsqrtf(var + eps);
  }
}

__device__ __forceinline__ void write_final(const Stats& s, int c, float pivot, float count,
                                            float eps, float* __restrict__ mean_out,
                                            float* __restrict__ var_out,
                                            float* __restrict__ invstd_out) {
  const float var = fmaxf(s.m2 / count, 0.0f);
  mean_out[c] = pivot + s.mean;
  var_out[c] = var;
  invstd_out[c] = rsqrtf(var + eps);
}

// Elements per channel as a float (exact up to 2^24, correctly rounded beyond).
__device__ __forceinline__ float channel_count(int N, int HW) {
  return static_cast<float>(static_cast<double>(N) * static_cast<double>(HW));
}

}  // namespace KATO_NS

#if MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE)
#endif

// Two-phase, phase 1 (and the whole call when SPLIT == 1). Grid: exactly C * SPLIT blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS batchnorm_stats_partial(
    const DTYPE* __restrict__ x, float* __restrict__ mean_out, float* __restrict__ var_out,
    float* __restrict__ invstd_out, float* __restrict__ workspace, unsigned int* counters, int N,
    int C, int HW, float eps) {
  namespace kb = KATO_NS;
  __shared__ kb::Stats red[kb::kWarps];
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
  const float pivot = kb::channel_pivot(x, c, HW);
#if PLANE_SPLIT
  const kb::Stats s =
      kb::block_partial(x, C, kb::plane_slots<VEC>(HW), N, c, part, split, pivot, red, HW);
#else
  const kb::Stats s = kb::block_partial(x, C, HW / VEC, N, c, part, split, pivot, red);
#endif
  if (threadIdx.x != 0) return;
  if (split == 1) {
    kb::write_final(s, c, pivot, kb::channel_count(N, HW), eps, mean_out, var_out, invstd_out);
    return;
  }
  float* w = workspace + (static_cast<size_t>(c) * split + part) * 3;
  w[0] = s.n;
  w[1] = s.mean;
  w[2] = s.m2;
  if (blockIdx.x == 0) counters[C] = static_cast<unsigned int>(split);  // for the finalize step
}

// Two-phase, phase 2: a warp per channel merges its SPLIT partials (SPLIT from counters[C]).
// Grid: ceil(C / 8) blocks of 256 threads (any grid works: grid-stride over channels).
extern "C" __global__ void __launch_bounds__(256) batchnorm_stats_finalize(
    const DTYPE* __restrict__ x, float* __restrict__ mean_out, float* __restrict__ var_out,
    float* __restrict__ invstd_out, float* __restrict__ workspace, unsigned int* counters, int N,
    int C, int HW, float eps) {
  namespace kb = KATO_NS;
  constexpr int kWarpsPerBlock = kb::kFinalizeThreads / 32;
  const int split = static_cast<int>(counters[C]);
  const float count = kb::channel_count(N, HW);
  const int warp = threadIdx.x >> 5;
  // The loop bound depends on the warp only: all 32 lanes iterate together (full-mask shuffles).
  for (long long c = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp; c < C;
       c += static_cast<long long>(gridDim.x) * kWarpsPerBlock) {
    const int ch = static_cast<int>(c);
    kb::write_merged<false>(workspace, ch, split, kb::channel_pivot(x, ch, HW), count, eps,
                            mean_out, var_out, invstd_out);
  }
}

// Single pass: partials, then the last block of each channel merges them (see the top).
// Grid: exactly C * SPLIT blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS batchnorm_stats_fused(
    const DTYPE* __restrict__ x, float* __restrict__ mean_out, float* __restrict__ var_out,
    float* __restrict__ invstd_out, float* __restrict__ workspace, unsigned int* counters, int N,
    int C, int HW, float eps) {
  namespace kb = KATO_NS;
  __shared__ kb::Stats red[kb::kWarps];
  __shared__ bool is_last;
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
  const float pivot = kb::channel_pivot(x, c, HW);
#if PLANE_SPLIT
  const kb::Stats s =
      kb::block_partial(x, C, kb::plane_slots<VEC>(HW), N, c, part, split, pivot, red, HW);
#else
  const kb::Stats s = kb::block_partial(x, C, HW / VEC, N, c, part, split, pivot, red);
#endif
  const float count = kb::channel_count(N, HW);
  if (split == 1) {  // uniform per launch
    if (threadIdx.x == 0) kb::write_final(s, c, pivot, count, eps, mean_out, var_out, invstd_out);
    return;
  }
  if (threadIdx.x == 0) {
    float* w = workspace + (static_cast<size_t>(c) * split + part) * 3;
    __stcg(w, s.n);
    __stcg(w + 1, s.mean);
    __stcg(w + 2, s.m2);
    __threadfence();  // the partial is visible device-wide before the ticket is taken
    const unsigned int ticket = atomicInc(counters + c, static_cast<unsigned int>(split - 1));
    is_last = ticket == static_cast<unsigned int>(split - 1);
  }
  __syncthreads();  // not divergent: every thread of the block reaches it
  if (is_last && threadIdx.x < 32) {
    __threadfence();
    kb::write_merged<true>(workspace, c, split, pivot, count, eps, mean_out, var_out,
                           invstd_out);
  }
}
