// BatchNorm training backward of an NCHW-contiguous tensor (N, C, H, W), per channel c, from the
// forward's input x, its saved mean_c and invstd_c (float32, kernels/batchnorm), weight_c and
// the output gradient dy, with n = N*H*W and xhat = (x - mean_c) * invstd_c:
//     dbias_c   = sum_{n,h,w} dy                                                    (float32)
//     dweight_c = sum_{n,h,w} dy * xhat = invstd_c * sum dy * (x - mean_c)          (float32)
//     dx = weight_c * invstd_c * (dy - dbias_c / n - xhat * dweight_c / n)     (element type)
// as torch's autograd of batch_norm(training=True) computes them. float32 arithmetic for every
// element type; plain float32 sums, deterministic: no float atomics, every sum in a fixed order.
//
// Reductions: the n elements of a channel are split into SPLIT contiguous ranges (grid =
// C * SPLIT, as batchnorm_stats.cu); each thread sums its vectors' dy and dy * (x - mean), the
// block reduces its threads' sums with a fixed butterfly, and then
//   - SPLIT 1: the block finishes the channel itself;
//   - else it writes its two sums to workspace[(c * SPLIT + part) * 2 + {0, 1}] and
//     - STRATEGY 0: batchnorm_bwd_finalize (a warp per channel, SPLIT from counters[C], which the
//       first block of batchnorm_bwd_partial writes on every call) sums them, or
//     - STRATEGY 1: the last block of each channel (atomicInc on counters[c], which wraps back
//       to 0: the counters are 0 again after every call) sums them.
//   A warp sums a channel's partials lane l taking l, l + 32, ... in order, then a butterfly:
//   the same order whichever block is last.
// Finishing a channel writes dweight and dbias. dx: APPLY 0: a separate kernel batchnorm_bwd_apply
// (grid C * blocks per channel, any block size up to 1024) reads dweight and dbias back; APPLY 1:
// the block that finished the channel computes all of its dx itself (one launch; the second
// read of x and dy comes from L2 while the channel is in it).
// Every kernel takes the same arguments:
//     (x, dy, mean, invstd, weight, dx, dweight, dbias, workspace, counters, N, C, HW)
// mean, invstd, weight, dweight, dbias: float32, C each. workspace: C * 256 * 2 floats (SPLIT
// <= 256); counters: C + 1 unsigned ints, 0 before the first call.
//
// Tunable parameters (`#define NAME value` before this template; kernels/batchnorm_backward):
//   BLOCK_SIZE  threads per block of the reduction kernels: a multiple of 32, <= 1024.
//   VEC         elements per vector load of the reduction pass.
//   UNROLL      vectors of each array each thread loads per step (both passes).
//   MIN_BLOCKS  __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS) of the reduction kernels; 0 = none.
//   APPLY       0: dx in batchnorm_bwd_apply; 1: in the block that finished the channel.
//   APPLY_VEC   elements per vector of the dx pass.
//   PLANE_SPLIT, APPLY_PLANE_SPLIT  1 (rendered only then) where HW % VEC, HW % APPLY_VEC != 0:
//               that pass covers each (n, c) plane with kato_plane.cuh's slots (a scalar head,
//               whole vectors, a scalar tail), since planes start off vector boundaries.
// STRATEGY, SPLIT and the apply kernel's block size are not macros (steps and grids).
// Derived: DTYPE (float, __half, __nv_bfloat16), IS_HALF, IS_BF16.
// Fixed by the operator, not tunable (kernels/batchnorm_relu_backward): the gradient g that
// enters the formulas above in place of dy,
//   BN_RELU  0 (batchnorm_backward, the default): g = dy;
//            1 (batchnorm_relu_backward, the forward y = relu(bn(x))): g = (bn(x) > 0) ? dy : 0,
//              bn(x) recomputed in float32 as (x - mean_c) * (invstd_c weight_c) + bias_c, bias
//              the argument after weight: (x, dy, mean, invstd, weight, bias, dx, ...);
//            2 (batchnorm_add_relu_backward, y = relu(bn(x) + residual)): g = (y > 0) ? dy : 0
//              from the forward's output y, the argument after dy, and g written to dresidual,
//              the argument after dbias: (x, dy, y, mean, invstd, weight, dx, dweight, dbias,
//              dresidual, workspace, counters, N, C, HW).
//   (torch's threshold_backward: a select, so a NaN dy where the mask is 0 gives 0.)
// Contract (kernels.batchnorm_backward.BatchNormBackwardSpec.check): x, dy and dx 16-byte
// aligned, PLANE_SPLIT and APPLY_PLANE_SPLIT 1 where VEC and APPLY_VEC do not divide HW,
// reduction grid exactly C * SPLIT blocks, apply grid a multiple of C, N, C, HW <= 2^30;
// APPLY 1 needs SPLIT 1 or STRATEGY 1.

#ifndef KATO_NS
#define KATO_NS kato_batchnorm_backward
#endif
#ifndef BN_RELU
#define BN_RELU 0
#endif
#if BN_RELU != 0 && BN_RELU != 1 && BN_RELU != 2
#error "BN_RELU must be 0, 1 or 2"
#endif
// The relu mask's parameter of block_sums and apply_part, and its argument in a kernel
// (BN_RELU 1 and 2 only; see ReluMask).
#if BN_RELU == 1
#define KATO_BN_MASK_PARAM , ReluMask mask
#define KATO_BN_MASK_ARG(c) , kb::ReluMask{invstd[c] * weight[c], bias[c]}
#elif BN_RELU == 2
#define KATO_BN_MASK_PARAM , ReluMask mask
#define KATO_BN_MASK_ARG(c) , kb::ReluMask{y, dresidual}
#else
#define KATO_BN_MASK_PARAM
#define KATO_BN_MASK_ARG(c)
#endif
#include "../common/kato_dtype.cuh"

namespace KATO_NS {

#include "../common/kato_channel.cuh"
#include "../common/kato_channel_apply.cuh"

#include "../common/kato_vec.cuh"
#include "../common/kato_convert.cuh"
#if PLANE_SPLIT || APPLY_PLANE_SPLIT
#include "../common/kato_plane.cuh"
#endif

// Vectors of V elements (VEC for the sums, APPLY_VEC for dx), unlike kato_convert.cuh's (VEC only).
template <int V>
__device__ __forceinline__ void unpack(const typename RawOf<V * sizeof(T)>::type& r,
                                       float (&f)[V]) {
  T t[V];
  __builtin_memcpy(t, &r, sizeof(t));
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = to_float(t[j]);
}

template <int V>
__device__ __forceinline__ typename RawOf<V * sizeof(T)>::type pack(const float (&f)[V]) {
  T t[V];
#pragma unroll
  for (int j = 0; j < V; ++j) from_float(f[j], t[j]);
  typename RawOf<V * sizeof(T)>::type r;
  __builtin_memcpy(&r, t, sizeof(t));
  return r;
}

// The two sums of a channel: dy, and dy * (x - mean).
struct Sums {
  float dy;
  float dyx;
};

#if BN_RELU == 1
// relu's mask recomputed from x: bn(x) = (x - mean) * a + b > 0, a = invstd weight, b = bias.
struct ReluMask {
  float a;
  float b;
};
#elif BN_RELU == 2
// relu's mask from the forward's output y (y > 0); g is written to dresidual by the dx pass.
struct ReluMask {
  const T* __restrict__ y;
  T* __restrict__ dresidual;
};
#endif

// Butterfly all-reduce over the 32 lanes (all must call it): float addition is commutative, so
// partners compute bitwise identical sums and every lane ends with the same.
__device__ __forceinline__ Sums warp_allreduce(Sums s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    s.dy += __shfl_xor_sync(0xffffffffu, s.dy, offset);
    s.dyx += __shfl_xor_sync(0xffffffffu, s.dyx, offset);
  }
  return s;
}

// Vectors [start, end) of part `part` of `split` of a channel of N * hwv vectors: the balanced
// split without overflow (the first total % split parts get one vector more).
struct Range {
  long long start;
  long long end;
};

__device__ __forceinline__ Range part_range(int N, int hwv, int part, int split) {
  const long long total = static_cast<long long>(N) * hwv;
  const long long per = total / split;
  const long long extra = total % split;
  Range r;
  r.start = part * per + (part < extra ? part : extra);
  r.end = r.start + per + (part < extra ? 1 : 0);
  return r;
}

// The block's sums over part `part` of `split` of channel c (every thread gets them; one
// barrier). Thread t handles vectors start + t, start + t + BLOCK_SIZE, ... of the channel,
// vector v being element VEC * (v % hwv) of plane (v / hwv, c); with PLANE_SPLIT, hwv is
// plane_slots<VEC>(HW) and vector v is slot v % hwv of that plane (its elements outside the
// plane load as zeros: a zero dy adds nothing to either sum).
#if PLANE_SPLIT
__device__ __forceinline__ Sums block_sums(const T* __restrict__ x, const T* __restrict__ dy,
                                           int C, int hwv, int N, int c, int part, int split,
                                           float mean, Sums* red, int HW KATO_BN_MASK_PARAM) {
#else
__device__ __forceinline__ Sums block_sums(const T* __restrict__ x, const T* __restrict__ dy,
                                           int C, int hwv, int N, int c, int part, int split,
                                           float mean, Sums* red KATO_BN_MASK_PARAM) {
#endif
  using Raw = typename RawOf<kVecBytes>::type;
#if !PLANE_SPLIT  // the slots load and store through kato_plane.cuh instead
  const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(x);
  const Raw* __restrict__ gv = reinterpret_cast<const Raw*>(dy);
#if BN_RELU == 2
  const Raw* __restrict__ yv = reinterpret_cast<const Raw*>(mask.y);
#endif
#endif
  const Range range = part_range(N, hwv, part, split);
  long long v = range.start + threadIdx.x;
  int n = static_cast<int>(v / hwv);
  int j = static_cast<int>(v - static_cast<long long>(n) * hwv);
  const int q = BLOCK_SIZE / hwv;
  const int r = BLOCK_SIZE - q * hwv;
  Sums s;
  s.dy = 0.0f;
  s.dyx = 0.0f;
  while (v < range.end) {
    Raw bx[UNROLL], bg[UNROLL];
#if BN_RELU == 2
    Raw by[UNROLL];
#endif
    bool in[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      in[u] = v + static_cast<long long>(u) * BLOCK_SIZE < range.end;
#if PLANE_SPLIT
      if (in[u]) {
        const Slot t = plane_slot<VEC>(n, C, c, HW, j);
        bx[u] = load_slot<VEC, false>(x, t);
        bg[u] = load_slot<VEC, false>(dy, t);
#if BN_RELU == 2
        by[u] = load_slot<VEC, false>(mask.y, t);
#endif
      }
#else
      if (in[u]) {
        const long long at = (static_cast<long long>(n) * C + c) * hwv + j;
        bx[u] = __ldg(xv + at);
        bg[u] = __ldg(gv + at);
#if BN_RELU == 2
        by[u] = __ldg(yv + at);
#endif
      }
#endif
      j += r;
      n += q;
      if (j >= hwv) {
        j -= hwv;
        ++n;
      }
    }
    // A vector's own sums first, then one add each: the running sums take n / VEC additions.
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (in[u]) {
        float ex[VEC], eg[VEC];
        unpack<VEC>(bx[u], ex);
        unpack<VEC>(bg[u], eg);
#if BN_RELU == 1
#pragma unroll
        for (int k = 0; k < VEC; ++k) eg[k] = fmaf(ex[k] - mean, mask.a, mask.b) > 0.0f ? eg[k] : 0.0f;
#elif BN_RELU == 2
        float ey[VEC];
        unpack<VEC>(by[u], ey);
#pragma unroll
        for (int k = 0; k < VEC; ++k) eg[k] = ey[k] > 0.0f ? eg[k] : 0.0f;
#endif
        float sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          sg += eg[k];
          sgx = fmaf(eg[k], ex[k] - mean, sgx);
        }
        s.dy += sg;
        s.dyx += sgx;
      }
    }
    v += static_cast<long long>(UNROLL) * BLOCK_SIZE;
  }

  s = warp_allreduce(s);
#if BLOCK_SIZE > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  // Every warp sums the per-warp sums in the same order (lanes >= kWarps add zeros).
  if (lane < kWarps) {
    s = red[lane];
  } else {
    s.dy = 0.0f;
    s.dyx = 0.0f;
  }
  s = warp_allreduce(s);
#else
  (void)red;
#endif
  return s;
}

// The `split` partial sums of channel c summed by one warp (lane l takes l, l + 32, ... in
// order, then the butterfly): every lane gets the same. All 32 lanes must call it. `Coherent`
// loads go through L2 (ld.global.cg): partials written by other blocks of the same kernel.
template <bool Coherent>
__device__ __forceinline__ Sums sum_partials(const float* __restrict__ ws, int c, int split) {
  const int lane = threadIdx.x & 31;
  Sums s;
  s.dy = 0.0f;
  s.dyx = 0.0f;
  for (int p = lane; p < split; p += 32) {
    const float* w = ws + (static_cast<size_t>(c) * split + p) * 2;
    if constexpr (Coherent) {
      s.dy += __ldcg(w);
      s.dyx += __ldcg(w + 1);
    } else {
      s.dy += w[0];
      s.dyx += w[1];
    }
  }
  return warp_allreduce(s);
}

// The coefficients of dx = dy * k + (x - mean) * kx + k0 for channel c.
struct Coef {
  float k;
  float kx;
  float k0;
};

__device__ __forceinline__ Coef dx_coef(float dweight, float dbias, float invstd, float weight,
                                        int N, int HW) {
  const float inv_n = static_cast<float>(1.0 / (static_cast<double>(N) * HW));
  Coef f;
  f.k = weight * invstd;
  f.k0 = -f.k * (dbias * inv_n);
  f.kx = -f.k * invstd * (dweight * inv_n);
  return f;
}

// dx over part `part` of `split` of channel c (APPLY_VEC-vectors, the balanced split of
// part_range), by `threads` threads numbered `tid`. With APPLY_PLANE_SPLIT the vectors are
// kato_plane.cuh's slots (hwv = plane_slots<APPLY_VEC>(HW)).
#if APPLY_PLANE_SPLIT
__device__ __forceinline__ void apply_part(const T* __restrict__ x, const T* __restrict__ dy,
                                           T* __restrict__ dx, int C, int hwv, int N, int c,
                                           int part, int split, float mean, Coef f, int tid,
                                           int threads, int HW KATO_BN_MASK_PARAM) {
#else
__device__ __forceinline__ void apply_part(const T* __restrict__ x, const T* __restrict__ dy,
                                           T* __restrict__ dx, int C, int hwv, int N, int c,
                                           int part, int split, float mean, Coef f, int tid,
                                           int threads KATO_BN_MASK_PARAM) {
#endif
  using Raw = typename RawOf<kApplyBytes>::type;
#if !APPLY_PLANE_SPLIT  // the slots load and store through kato_plane.cuh instead
  const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(x);
  const Raw* __restrict__ gv = reinterpret_cast<const Raw*>(dy);
  Raw* __restrict__ ov = reinterpret_cast<Raw*>(dx);
#if BN_RELU == 2
  const Raw* __restrict__ yv = reinterpret_cast<const Raw*>(mask.y);
  Raw* __restrict__ rv = reinterpret_cast<Raw*>(mask.dresidual);
#endif
#endif
  const Range range = part_range(N, hwv, part, split);
  long long v = range.start + tid;
  int n = static_cast<int>(v / hwv);
  int j = static_cast<int>(v - static_cast<long long>(n) * hwv);
  const int q = threads / hwv;
  const int r = threads - q * hwv;
  while (v < range.end) {
    Raw bx[UNROLL], bg[UNROLL];
#if BN_RELU == 2
    Raw by[UNROLL];
#endif
#if APPLY_PLANE_SPLIT
    Slot at[UNROLL];  // past the range: an empty slot
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      at[u] = v + static_cast<long long>(u) * threads < range.end
                  ? plane_slot<APPLY_VEC>(n, C, c, HW, j)
                  : Slot{0, 0, 0};
      if (at[u].hi > at[u].lo) {
        bx[u] = load_slot<APPLY_VEC, true>(x, at[u]);
        bg[u] = load_slot<APPLY_VEC, true>(dy, at[u]);
#if BN_RELU == 2
        by[u] = load_slot<APPLY_VEC, true>(mask.y, at[u]);
#endif
      }
#else
    long long at[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      at[u] = v + static_cast<long long>(u) * threads < range.end
                  ? (static_cast<long long>(n) * C + c) * hwv + j
                  : -1;
      if (at[u] >= 0) {
        bx[u] = __ldcs(xv + at[u]);
        bg[u] = __ldcs(gv + at[u]);
#if BN_RELU == 2
        by[u] = __ldcs(yv + at[u]);
#endif
      }
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
        float ex[APPLY_VEC], eg[APPLY_VEC];
        unpack<APPLY_VEC>(bx[u], ex);
        unpack<APPLY_VEC>(bg[u], eg);
#if BN_RELU == 1
#pragma unroll
        for (int k = 0; k < APPLY_VEC; ++k) {
          eg[k] = fmaf(ex[k] - mean, mask.a, mask.b) > 0.0f ? eg[k] : 0.0f;
        }
#elif BN_RELU == 2
        float ey[APPLY_VEC];
        unpack<APPLY_VEC>(by[u], ey);
#pragma unroll
        for (int k = 0; k < APPLY_VEC; ++k) eg[k] = ey[k] > 0.0f ? eg[k] : 0.0f;
#if APPLY_PLANE_SPLIT
        store_slot<APPLY_VEC>(mask.dresidual, at[u], pack<APPLY_VEC>(eg));  // dresidual = g
#else
        __stcs(rv + at[u], pack<APPLY_VEC>(eg));  // dresidual = g (exact: dy's values or 0)
#endif
#endif
#pragma unroll
        for (int k = 0; k < APPLY_VEC; ++k) eg[k] = fmaf(eg[k], f.k, fmaf(ex[k] - mean, f.kx, f.k0));
#if APPLY_PLANE_SPLIT
        store_slot<APPLY_VEC>(dx, at[u], pack<APPLY_VEC>(eg));
#else
        __stcs(ov + at[u], pack<APPLY_VEC>(eg));
#endif
      }
    }
    v += static_cast<long long>(UNROLL) * threads;
  }
}

}  // namespace KATO_NS

#if BN_RELU == 1
#define KATO_BN_BWD_PARAMS                                                                   \
  const DTYPE *__restrict__ x, const DTYPE *__restrict__ dy, const float *__restrict__ mean,     \
      const float *__restrict__ invstd, const float *__restrict__ weight,                        \
      const float *__restrict__ bias, DTYPE *__restrict__ dx, float *__restrict__ dweight,       \
      float *__restrict__ dbias, float *__restrict__ workspace, unsigned int *counters, int N,   \
      int C, int HW
#elif BN_RELU == 2
#define KATO_BN_BWD_PARAMS                                                                   \
  const DTYPE *__restrict__ x, const DTYPE *__restrict__ dy, const DTYPE *__restrict__ y,        \
      const float *__restrict__ mean, const float *__restrict__ invstd,                          \
      const float *__restrict__ weight, DTYPE *__restrict__ dx, float *__restrict__ dweight,     \
      float *__restrict__ dbias, DTYPE *__restrict__ dresidual, float *__restrict__ workspace,    \
      unsigned int *counters, int N, int C, int HW
#else
#define KATO_BN_BWD_PARAMS                                                                   \
  const DTYPE *__restrict__ x, const DTYPE *__restrict__ dy, const float *__restrict__ mean,     \
      const float *__restrict__ invstd, const float *__restrict__ weight, DTYPE *__restrict__ dx, \
      float *__restrict__ dweight, float *__restrict__ dbias, float *__restrict__ workspace,      \
      unsigned int *counters, int N, int C, int HW
#endif

// Reductions, phase 1 (and, with SPLIT == 1, the whole channel: dweight, dbias, and with
// APPLY 1 its dx). Grid: exactly C * SPLIT blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS batchnorm_bwd_partial(KATO_BN_BWD_PARAMS) {
  namespace kb = KATO_NS;
  __shared__ kb::Sums red[kb::kWarps];
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
  const float mu = mean[c];
#if PLANE_SPLIT
  const kb::Sums s = kb::block_sums(x, dy, C, kb::plane_slots<VEC>(HW), N, c, part, split, mu,
                                    red, HW KATO_BN_MASK_ARG(c));
#else
  const kb::Sums s = kb::block_sums(x, dy, C, HW / VEC, N, c, part, split, mu, red KATO_BN_MASK_ARG(c));
#endif
  if (split == 1) {  // uniform per launch; every thread holds the block's sums
    const float dw = s.dyx * invstd[c];
    if (threadIdx.x == 0) {
      dweight[c] = dw;
      dbias[c] = s.dy;
    }
#if APPLY
#if APPLY_PLANE_SPLIT
    kb::apply_part(x, dy, dx, C, kb::plane_slots<APPLY_VEC>(HW), N, c, 0, 1, mu,
                   kb::dx_coef(dw, s.dy, invstd[c], weight[c], N, HW),
                   static_cast<int>(threadIdx.x), BLOCK_SIZE, HW KATO_BN_MASK_ARG(c));
#else
    kb::apply_part(x, dy, dx, C, HW / APPLY_VEC, N, c, 0, 1, mu,
                   kb::dx_coef(dw, s.dy, invstd[c], weight[c], N, HW),
                   static_cast<int>(threadIdx.x), BLOCK_SIZE KATO_BN_MASK_ARG(c));
#endif
#endif
    return;
  }
  if (threadIdx.x != 0) return;
  float* w = workspace + (static_cast<size_t>(c) * split + part) * 2;
  w[0] = s.dy;
  w[1] = s.dyx;
  if (blockIdx.x == 0) counters[C] = static_cast<unsigned int>(split);  // for the finalize step
}

// Reductions, phase 2: a warp per channel sums its SPLIT partials (SPLIT from counters[C]).
// Grid: any (grid-stride over channels), 256 threads.
extern "C" __global__ void __launch_bounds__(256) batchnorm_bwd_finalize(KATO_BN_BWD_PARAMS) {
  namespace kb = KATO_NS;
  constexpr int kWarpsPerBlock = kb::kFinalizeThreads / 32;
  const int split = static_cast<int>(counters[C]);
  const int warp = threadIdx.x >> 5;
  // The loop bound depends on the warp only: all 32 lanes iterate together (full-mask shuffles).
  for (long long c = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp; c < C;
       c += static_cast<long long>(gridDim.x) * kWarpsPerBlock) {
    const int ch = static_cast<int>(c);
    const kb::Sums s = kb::sum_partials<false>(workspace, ch, split);
    if ((threadIdx.x & 31) == 0) {
      dweight[ch] = s.dyx * invstd[ch];
      dbias[ch] = s.dy;
    }
  }
}

// Reductions in one pass: partials, then the last block of each channel sums them and writes
// dweight and dbias (and with APPLY 1 all of the channel's dx). Grid: exactly C * SPLIT blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS batchnorm_bwd_fused(KATO_BN_BWD_PARAMS) {
  namespace kb = KATO_NS;
  __shared__ kb::Sums red[kb::kWarps];
  __shared__ kb::Sums total;
  __shared__ bool is_last;
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
  const float mu = mean[c];
#if PLANE_SPLIT
  kb::Sums s = kb::block_sums(x, dy, C, kb::plane_slots<VEC>(HW), N, c, part, split, mu, red,
                              HW KATO_BN_MASK_ARG(c));
#else
  kb::Sums s = kb::block_sums(x, dy, C, HW / VEC, N, c, part, split, mu, red KATO_BN_MASK_ARG(c));
#endif
  if (split > 1) {  // uniform per launch
    if (threadIdx.x == 0) {
      float* w = workspace + (static_cast<size_t>(c) * split + part) * 2;
      __stcg(w, s.dy);
      __stcg(w + 1, s.dyx);
      __threadfence();  // the partial is visible device-wide before the ticket is taken
      const unsigned int ticket = atomicInc(counters + c, static_cast<unsigned int>(split - 1));
      is_last = ticket == static_cast<unsigned int>(split - 1);
    }
    __syncthreads();  // not divergent: every thread of the block reaches it
    if (!is_last) return;  // uniform per block
    if (threadIdx.x < 32) {
      __threadfence();
      s = kb::sum_partials<true>(workspace, c, split);
      if (threadIdx.x == 0) total = s;
    }
#if APPLY
    __syncthreads();
    s = total;
#endif
  }
  const float dw = s.dyx * invstd[c];
  if (threadIdx.x == 0) {
    dweight[c] = dw;
    dbias[c] = s.dy;
  }
#if APPLY
#if APPLY_PLANE_SPLIT
  kb::apply_part(x, dy, dx, C, kb::plane_slots<APPLY_VEC>(HW), N, c, 0, 1, mu,
                 kb::dx_coef(dw, s.dy, invstd[c], weight[c], N, HW), static_cast<int>(threadIdx.x),
                 BLOCK_SIZE, HW KATO_BN_MASK_ARG(c));
#else
  kb::apply_part(x, dy, dx, C, HW / APPLY_VEC, N, c, 0, 1, mu,
                 kb::dx_coef(dw, s.dy, invstd[c], weight[c], N, HW), static_cast<int>(threadIdx.x),
                 BLOCK_SIZE KATO_BN_MASK_ARG(c));
#endif
#endif
}

// The dx pass (APPLY 0): block b computes part b % (gridDim.x / C) of channel b / that, after
// the reductions wrote dweight and dbias. Grid: a multiple of C blocks of up to 1024 threads.
// Empty with APPLY 1 (never launched).
extern "C" __global__ void __launch_bounds__(1024) batchnorm_bwd_apply(KATO_BN_BWD_PARAMS) {
#if APPLY == 0
  namespace kb = KATO_NS;
  const int split = static_cast<int>(gridDim.x / static_cast<unsigned>(C));
  const int c = static_cast<int>(blockIdx.x / static_cast<unsigned>(split));
  const int part = static_cast<int>(blockIdx.x - static_cast<unsigned>(c) * split);
#if APPLY_PLANE_SPLIT
  kb::apply_part(x, dy, dx, C, kb::plane_slots<APPLY_VEC>(HW), N, c, part, split, mean[c],
                 kb::dx_coef(dweight[c], dbias[c], invstd[c], weight[c], N, HW),
                 static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x),
                 HW KATO_BN_MASK_ARG(c));
#else
  kb::apply_part(x, dy, dx, C, HW / APPLY_VEC, N, c, part, split, mean[c],
                 kb::dx_coef(dweight[c], dbias[c], invstd[c], weight[c], N, HW),
                 static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x) KATO_BN_MASK_ARG(c));
#endif
#endif
}
