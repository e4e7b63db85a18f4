// BatchNorm training forward of an NCHW-contiguous tensor x (N, C, H, W), per channel c:
//     mean_c, var_c (biased) over the N*H*W elements of the channel, invstd_c = 1/sqrt(var_c+eps)
//     y = (x - mean_c) * invstd_c * weight_c + bias_c                        (element type)
//     running_mean_c <- (1 - momentum) running_mean_c + momentum mean_c
//     running_var_c  <- (1 - momentum) running_var_c + momentum var_c n / (n - 1)   (unbiased)
// as torch.nn.functional.batch_norm(training=True) does; mean and invstd (float32) are saved
// for the backward (kernels/batchnorm_backward). float32 arithmetic for every element type.
//
// Statistics: batchnorm_stats.cu's Welford partials (kernels/common/kato_welford.cuh and
// kato_channel_stats.cuh, with x read by __ldg: the normalise pass reads it again and should
// find it in L2), SPLIT blocks
// per channel (grid = C * SPLIT), merged either by a finalize kernel (STRATEGY 0) or by the last
// block of each channel, found with atomicInc on counters[c] (STRATEGY 1; the counter wraps
// back to 0, so counters are 0 again after every call). The thread that merges a channel writes
// mean, invstd, the running statistics and the channel's coefficients
//     y = (x - pivot) * scale + shift,  scale = invstd * weight,  shift = bias - (mean - pivot) * scale
// where pivot is the channel's first element (x - pivot is exact for offset channels, so y
// keeps float32 accuracy whatever the channel's mean).
// Normalise: APPLY 0: a separate kernel batchnorm_fwd_apply (grid C * blocks per channel, any
// block size up to 1024, from the launch) reads the coefficients from workspace[2c, 2c+1];
// APPLY 1: the block that finished the channel (the only one with SPLIT 1, else the last one)
// normalises the whole channel itself (coefficients in shared memory): one launch, and x's
// second read comes from L2 while the channel is in it.
// Every kernel takes the same arguments:
//     (x, weight, bias, running_mean_in, running_var_in, y, mean, invstd, running_mean,
//      running_var, workspace, counters, N, C, HW, eps, momentum)
// weight, bias, running statistics, mean, invstd: float32, C each. running_mean may be the same
// buffer as running_mean_in (and running_var as running_var_in): an in-place update, each
// element read and then written by one thread. workspace: 2 * C + C * 256 * 3 floats (the
// coefficients, then one (count, mean, M2) partial per block); counters: C + 1 unsigned ints.
//
// Tunable parameters (`#define NAME value` before this template; kernels/batchnorm):
//   BLOCK_SIZE  threads per block of the statistics kernels: a multiple of 32, <= 1024.
//   VEC         elements per vector load of the statistics pass.
//   UNROLL      vectors each thread loads per step (both passes).
//   MIN_BLOCKS  __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS) of the statistics kernels; 0 = none.
//   APPLY       0: normalise in batchnorm_fwd_apply; 1: in the block that finished the channel.
//   APPLY_VEC   elements per vector of the normalise pass.
//   PLANE_SPLIT, APPLY_PLANE_SPLIT  1 (rendered only then) where HW % VEC, HW % APPLY_VEC != 0:
//               that pass covers each (n, c) plane with kato_plane.cuh's slots (a scalar head,
//               whole vectors, a scalar tail), since planes start off vector boundaries.
// STRATEGY, SPLIT and the apply kernel's block size are not macros (steps and grids).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
// Fixed by the operator, not tunable (kernels/batchnorm_relu):
//   BN_RELU     0 (batchnorm, the default): y as above; 1 (batchnorm_relu): y = relu(bn(x));
//               2 (batchnorm_add_relu): y = relu(bn(x) + residual), residual an NCHW tensor of
//               x's shape and type, the kernels' second argument (after x). Roundings as
//               torch's unfused relu(bn(x) + r): bn(x) (float32) rounded to the element type,
//               the residual added in float32, the sum rounded to the element type (relu is
//               exact). relu keeps NaN (v < 0 ? 0 : v, as torch's).
// Contract (kernels.batchnorm.BatchNormSpec.check): x and y 16-byte aligned, PLANE_SPLIT and
// APPLY_PLANE_SPLIT 1 where VEC and APPLY_VEC do not divide HW, statistics grid exactly C * SPLIT blocks, apply grid a multiple of C,
// N, C, HW <= 2^30, N * HW >= 2; APPLY 1 needs SPLIT 1 or STRATEGY 1.

#ifndef KATO_NS
#define KATO_NS kato_batchnorm
#endif
#ifndef BN_RELU
#define BN_RELU 0
#endif
#if BN_RELU != 0 && BN_RELU != 1 && BN_RELU != 2
#error "BN_RELU must be 0, 1 or 2"
#endif
// The residual's parameter and argument of apply_part (BN_RELU 2 only).
#if BN_RELU == 2
#define KATO_BN_RES_PARAM const T *__restrict__ residual,
#define KATO_BN_RES_ARG residual,
#define KATO_BN_RES_KERNEL_PARAM const DTYPE *__restrict__ residual,
#else
#define KATO_BN_RES_PARAM
#define KATO_BN_RES_ARG
#define KATO_BN_RES_KERNEL_PARAM
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_channel.cuh"
#include "../common/kato_channel_apply.cuh"

//: The most partials per channel (SPLIT <= 256): the workspace's layout.
constexpr int kMaxSplit = 256;

#include "../common/kato_vec.cuh"
using ApplyRaw = typename RawOf<kApplyBytes>::type;
#include "../common/kato_convert.cuh"
#if PLANE_SPLIT || APPLY_PLANE_SPLIT
#include "../common/kato_plane.cuh"
#endif

// x is read with __ldg: the normalise pass reads it again and should find it in L2.
#define KATO_STATS_LOAD __ldg
#if PLANE_SPLIT
#define KATO_STATS_STREAM false
#endif
#include "../common/kato_welford.cuh"
#include "../common/kato_channel_stats.cuh"

// Everything that follows from channel c's merged statistics s (about `pivot`), by one thread:
// the saved mean and invstd, the running statistics, and the coefficients (scale, shift) of
// y = (x - pivot) * scale + shift into coef[0], coef[1].
__device__ __forceinline__ void finish_channel(
    const Stats& s, int c, float pivot, int N, int HW, float eps, float momentum,
    const float* __restrict__ weight, const float* __restrict__ bias, const float* rm_in,
    const float* rv_in, float* __restrict__ mean_out, float* __restrict__ invstd_out,
    float* rm_out, float* rv_out, float* coef) {
  const double n = static_cast<double>(N) * static_cast<double>(HW);
  const float var = fmaxf(s.m2 / static_cast<float>(n), 0.0f);
  const float inv = rsqrtf(var + eps);
  const float mean = pivot + s.mean;
  mean_out[c] = mean;
  invstd_out[c] = inv;
  const float unbias = static_cast<float>(n / (n - 1.0));  // n >= 2 (the spec's contract)
  const float rm = rm_in[c];
  const float rv = rv_in[c];
  rm_out[c] = fmaf(momentum, mean - rm, rm);
  rv_out[c] = fmaf(momentum, var * unbias - rv, rv);
  const float scale = inv * weight[c];
  coef[0] = scale;
  coef[1] = fmaf(-s.mean, scale, bias[c]);
}

__device__ __forceinline__ void unpack_apply(const ApplyRaw& r, float (&f)[APPLY_VEC]) {
  T t[APPLY_VEC];
  __builtin_memcpy(t, &r, sizeof(ApplyRaw));
#pragma unroll
  for (int j = 0; j < APPLY_VEC; ++j) f[j] = to_float(t[j]);
}

__device__ __forceinline__ ApplyRaw pack_apply(const float (&f)[APPLY_VEC]) {
  T t[APPLY_VEC];
#pragma unroll
  for (int j = 0; j < APPLY_VEC; ++j) from_float(f[j], t[j]);
  ApplyRaw r;
  __builtin_memcpy(&r, t, sizeof(ApplyRaw));
  return r;
}

// y = (x - pivot) * scale + shift over part `part` of `split` of channel c (the same balanced
// split into APPLY_VEC-vectors as block_partial's), by `threads` threads numbered `tid`. With
// APPLY_PLANE_SPLIT the vectors are kato_plane.cuh's slots (hwv = plane_slots<APPLY_VEC>(HW)).
#if APPLY_PLANE_SPLIT
__device__ __forceinline__ void apply_part(const T* __restrict__ x, KATO_BN_RES_PARAM T* __restrict__ y, int C,
                                           int hwv, int N, int c, int part, int split,
                                           float pivot, float scale, float shift, int tid,
                                           int threads, int HW) {
#else
__device__ __forceinline__ void apply_part(const T* __restrict__ x, KATO_BN_RES_PARAM T* __restrict__ y, int C,
                                           int hwv, int N, int c, int part, int split,
                                           float pivot, float scale, float shift, int tid,
                                           int threads) {
#endif
#if !APPLY_PLANE_SPLIT  // the slots load and store through kato_plane.cuh instead
  const ApplyRaw* __restrict__ xv = reinterpret_cast<const ApplyRaw*>(x);
  ApplyRaw* __restrict__ yv = reinterpret_cast<ApplyRaw*>(y);
#if BN_RELU == 2
  const ApplyRaw* __restrict__ rv = reinterpret_cast<const ApplyRaw*>(residual);
#endif
#endif
  const long long total = static_cast<long long>(N) * hwv;
  const long long per = total / split;
  const long long extra = total % split;
  const long long start = part * per + (part < extra ? part : extra);
  const long long end = start + per + (part < extra ? 1 : 0);
  long long v = start + tid;
  int n = static_cast<int>(v / hwv);
  int j = static_cast<int>(v - static_cast<long long>(n) * hwv);
  const int q = threads / hwv;
  const int r = threads - q * hwv;
  while (v < end) {
    ApplyRaw buf[UNROLL];
#if BN_RELU == 2
    ApplyRaw rbuf[UNROLL];
#endif
#if APPLY_PLANE_SPLIT
    Slot at[UNROLL];  // past the range: an empty slot
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      at[u] = v + static_cast<long long>(u) * threads < end
                  ? plane_slot<APPLY_VEC>(n, C, c, HW, j)
                  : Slot{0, 0, 0};
      if (at[u].hi > at[u].lo) buf[u] = load_slot<APPLY_VEC, true>(x, at[u]);
#if BN_RELU == 2
      if (at[u].hi > at[u].lo) rbuf[u] = load_slot<APPLY_VEC, true>(residual, at[u]);
#endif
#else
    long long at[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      at[u] = v + static_cast<long long>(u) * threads < end
                  ? (static_cast<long long>(n) * C + c) * hwv + j
                  : -1;
      if (at[u] >= 0) buf[u] = __ldcs(xv + at[u]);
#if BN_RELU == 2
      if (at[u] >= 0) rbuf[u] = __ldcs(rv + at[u]);
#endif
#endif
      j += r;
      n += q;
      if (j >= hwv) {
        j -= hwv;
        ++n;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#if APPLY_PLANE_SPLIT
      if (at[u].hi > at[u].lo) {
#else
      if (at[u] >= 0) {
#endif
        float e[APPLY_VEC];
        unpack_apply(buf[u], e);
#pragma unroll
        for (int k = 0; k < APPLY_VEC; ++k) e[k] = fmaf(e[k] - pivot, scale, shift);
#if BN_RELU == 2
        // bn(x) rounded to the element type before the add, as torch's unfused sequence
        // (batch norm's output, then add): the same values as the model without fusion.
        float r[APPLY_VEC];
        unpack_apply(rbuf[u], r);
#pragma unroll
        for (int k = 0; k < APPLY_VEC; ++k) {
          T t;
          from_float(e[k], t);
          e[k] = to_float(t) + r[k];
        }
#endif
#if BN_RELU != 0
#pragma unroll
        for (int k = 0; k < APPLY_VEC; ++k) e[k] = e[k] < 0.0f ? 0.0f : e[k];
#endif
#if APPLY_PLANE_SPLIT
        store_slot<APPLY_VEC>(y, at[u], pack_apply(e));
#else
        __stcs(yv + at[u], pack_apply(e));
#endif
      }
    }
    v += static_cast<long long>(UNROLL) * threads;
  }
}

}  // namespace KATO_NS

#define KATO_BN_FWD_PARAMS                                                                  \
  const DTYPE *__restrict__ x, KATO_BN_RES_KERNEL_PARAM const float *__restrict__ weight,       \
      const float *__restrict__ bias,                                                          \
      const float *running_mean_in, const float *running_var_in, DTYPE *__restrict__ y,         \
      float *__restrict__ mean_out, float *__restrict__ invstd_out, float *running_mean,        \
      float *running_var, float *__restrict__ workspace, unsigned int *counters, int N, int C,   \
      int HW, float eps, float momentum

// Statistics, phase 1 (and, with SPLIT == 1, the whole channel: its results, and with APPLY 1
// its normalisation). Grid: exactly C * SPLIT blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS batchnorm_fwd_partial(KATO_BN_FWD_PARAMS) {
  namespace kb = KATO_NS;
  __shared__ kb::Stats red[kb::kWarps];
  __shared__ float coef_s[2];
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
  if (split == 1) {  // uniform per launch
    if (threadIdx.x == 0) {
      kb::finish_channel(s, c, pivot, N, HW, eps, momentum, weight, bias, running_mean_in,
                         running_var_in, mean_out, invstd_out, running_mean, running_var,
                         APPLY ? coef_s : workspace + 2 * static_cast<size_t>(c));
    }
#if APPLY
    __syncthreads();
#if APPLY_PLANE_SPLIT
    kb::apply_part(x, KATO_BN_RES_ARG y, C, kb::plane_slots<APPLY_VEC>(HW), N, c, 0, 1, pivot,
                   coef_s[0], coef_s[1], static_cast<int>(threadIdx.x), BLOCK_SIZE, HW);
#else
    kb::apply_part(x, KATO_BN_RES_ARG y, C, HW / APPLY_VEC, N, c, 0, 1, pivot, coef_s[0], coef_s[1],
                   static_cast<int>(threadIdx.x), BLOCK_SIZE);
#endif
#endif
    return;
  }
  if (threadIdx.x != 0) return;
  float* w = workspace + 2 * static_cast<size_t>(C) + (static_cast<size_t>(c) * split + part) * 3;
  w[0] = s.n;
  w[1] = s.mean;
  w[2] = s.m2;
  if (blockIdx.x == 0) counters[C] = static_cast<unsigned int>(split);  // for the finalize step
}

// Statistics, phase 2: a warp per channel merges its SPLIT partials (SPLIT from counters[C])
// and writes the channel's results. Grid: any (grid-stride over channels), 256 threads.
extern "C" __global__ void __launch_bounds__(256) batchnorm_fwd_finalize(KATO_BN_FWD_PARAMS) {
  namespace kb = KATO_NS;
  constexpr int kWarpsPerBlock = kb::kFinalizeThreads / 32;
  const int split = static_cast<int>(counters[C]);
  const float* partials = workspace + 2 * static_cast<size_t>(C);
  const int warp = threadIdx.x >> 5;
  // The loop bound depends on the warp only: all 32 lanes iterate together (full-mask shuffles).
  for (long long c = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp; c < C;
       c += static_cast<long long>(gridDim.x) * kWarpsPerBlock) {
    const int ch = static_cast<int>(c);
    const kb::Stats s = kb::merge_partials<false>(partials, ch, split);
    if ((threadIdx.x & 31) == 0) {
      kb::finish_channel(s, ch, kb::channel_pivot(x, ch, HW), N, HW, eps, momentum, weight, bias,
                         running_mean_in, running_var_in, mean_out, invstd_out, running_mean,
                         running_var, workspace + 2 * static_cast<size_t>(ch));
    }
  }
}

// Statistics in one pass: partials, then the last block of each channel merges them and
// finishes the channel (and with APPLY 1 normalises all of it). Grid: exactly C * SPLIT blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS batchnorm_fwd_fused(KATO_BN_FWD_PARAMS) {
  namespace kb = KATO_NS;
  __shared__ kb::Stats red[kb::kWarps];
  __shared__ float coef_s[2];
  __shared__ bool is_last;
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
  const float pivot = kb::channel_pivot(x, c, HW);
#if PLANE_SPLIT
  kb::Stats s =
      kb::block_partial(x, C, kb::plane_slots<VEC>(HW), N, c, part, split, pivot, red, HW);
#else
  kb::Stats s = kb::block_partial(x, C, HW / VEC, N, c, part, split, pivot, red);
#endif
  float* coef = APPLY ? coef_s : workspace + 2 * static_cast<size_t>(c);
  if (split > 1) {  // uniform per launch
    float* partials = workspace + 2 * static_cast<size_t>(C);
    if (threadIdx.x == 0) {
      float* w = partials + (static_cast<size_t>(c) * split + part) * 3;
      __stcg(w, s.n);
      __stcg(w + 1, s.mean);
      __stcg(w + 2, s.m2);
      __threadfence();  // the partial is visible device-wide before the ticket is taken
      const unsigned int ticket = atomicInc(counters + c, static_cast<unsigned int>(split - 1));
      is_last = ticket == static_cast<unsigned int>(split - 1);
    }
    __syncthreads();  // not divergent: every thread of the block reaches it
    if (!is_last) return;  // uniform per block
    if (threadIdx.x < 32) {
      __threadfence();
      s = kb::merge_partials<true>(partials, c, split);
    }
  }
  if (threadIdx.x == 0) {
    kb::finish_channel(s, c, pivot, N, HW, eps, momentum, weight, bias, running_mean_in,
                       running_var_in, mean_out, invstd_out, running_mean, running_var, coef);
  }
#if APPLY
  __syncthreads();
#if APPLY_PLANE_SPLIT
  kb::apply_part(x, KATO_BN_RES_ARG y, C, kb::plane_slots<APPLY_VEC>(HW), N, c, 0, 1, pivot,
                 coef_s[0], coef_s[1], static_cast<int>(threadIdx.x), BLOCK_SIZE, HW);
#else
  kb::apply_part(x, KATO_BN_RES_ARG y, C, HW / APPLY_VEC, N, c, 0, 1, pivot, coef_s[0], coef_s[1],
                 static_cast<int>(threadIdx.x), BLOCK_SIZE);
#endif
#endif
}

// The normalise pass (APPLY 0): block b normalises part b % (gridDim.x / C) of channel b / that.
// Grid: a multiple of C blocks of up to 1024 threads. Empty with APPLY 1 (never launched).
extern "C" __global__ void __launch_bounds__(1024) batchnorm_fwd_apply(KATO_BN_FWD_PARAMS) {
#if APPLY == 0
  namespace kb = KATO_NS;
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
  const float* coef = workspace + 2 * static_cast<size_t>(c);
#if APPLY_PLANE_SPLIT
  kb::apply_part(x, KATO_BN_RES_ARG y, C, kb::plane_slots<APPLY_VEC>(HW), N, c, part, split,
                 kb::channel_pivot(x, c, HW), coef[0], coef[1], static_cast<int>(threadIdx.x),
                 static_cast<int>(blockDim.x), HW);
#else
  kb::apply_part(x, KATO_BN_RES_ARG y, C, HW / APPLY_VEC, N, c, part, split, kb::channel_pivot(x, c, HW), coef[0],
                 coef[1], static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
#endif
#endif
}
