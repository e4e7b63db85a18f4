// A channel's Welford partials (batchnorm_stats.cu, and batchnorm.cu's statistics): a block's
// partial over part of a channel of an NCHW tensor (through shared memory across the warps),
// the partials of a split channel merged by one warp, and the channel's pivot. A fragment
// included inside the template's `namespace KATO_NS { ... }` after kato_welford.cuh (Stats,
// merge, warp_allreduce, vector_stats), kato_convert.cuh (T, Raw, to_float, unpack) and
// kato_channel.cuh (BLOCK_SIZE, UNROLL, kWarps), and
//   KATO_STATS_LOAD  the load of one vector of x: __ldcs (streaming: x is read once) or __ldg
//                    (x is read again by the normalise pass and should stay in L2);
//   KATO_STATS_STREAM with PLANE_SPLIT (and kato_plane.cuh before this fragment): true for
//                    __ldcs, false for __ldg, the same choice for load_slot.
// No include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

#ifndef KATO_STATS_LOAD
#error "KATO_STATS_LOAD must be defined (__ldcs or __ldg)"
#endif

#if PLANE_SPLIT
// Statistics of the elements [lo, hi) of one slot's VEC values (kato_plane.cuh), exactly as
// vector_stats does for a whole one; an empty slot gives the empty partial.
__device__ __forceinline__ Stats slot_stats(const float (&v)[VEC], int lo, int hi) {
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) sum += k >= lo && k < hi ? v[k] : 0.0f;
  Stats s;
  s.n = static_cast<float>(hi > lo ? hi - lo : 0);
  s.mean = hi - lo == VEC ? sum * (1.0f / VEC) : sum / fmaxf(s.n, 1.0f);
  float m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float d = v[k] - s.mean;
    m2 = k >= lo && k < hi ? fmaf(d, d, m2) : m2;
  }
  s.m2 = m2;
  return s;
}
#endif

// The block's partial over part `part` of `split` of channel c (every thread gets it; one
// barrier). Thread t handles vectors start + t, start + t + BLOCK_SIZE, ... of the channel,
// vector v being element VEC * (v % hwv) of plane (v / hwv, c); with PLANE_SPLIT, hwv is
// plane_slots<VEC>(HW) and vector v is slot v % hwv of that plane.
#if PLANE_SPLIT
__device__ __forceinline__ Stats block_partial(const T* __restrict__ x, int C, int hwv, int N,
                                               int c, int part, int split, float pivot,
                                               Stats* red, int HW) {
#else
__device__ __forceinline__ Stats block_partial(const T* __restrict__ x, int C, int hwv, int N,
                                               int c, int part, int split, float pivot,
                                               Stats* red) {
#endif
#if !PLANE_SPLIT  // the slots load and store through kato_plane.cuh instead
  const Raw* __restrict__ xv = reinterpret_cast<const Raw*>(x);
#endif
  const long long total = static_cast<long long>(N) * hwv;  // vectors in the channel
  // Balanced split without overflow: the first (total % split) parts get one vector more.
  const long long per = total / split;
  const long long extra = total % split;
  const long long start = part * per + (part < extra ? part : extra);
  const long long end = start + per + (part < extra ? 1 : 0);
  long long v = start + threadIdx.x;
  // (n, j) of vector v, then advanced by BLOCK_SIZE = q * hwv + r without dividing again.
  int n = static_cast<int>(v / hwv);
  int j = static_cast<int>(v - static_cast<long long>(n) * hwv);
  const int q = BLOCK_SIZE / hwv;
  const int r = BLOCK_SIZE - q * hwv;

  Stats s = empty_stats();
  while (v < end) {
    Raw buf[UNROLL];
    bool in[UNROLL];
#if PLANE_SPLIT
    int span[UNROLL];  // the slot's elements in the plane: lo | hi << 8
#endif
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      in[u] = v + static_cast<long long>(u) * BLOCK_SIZE < end;
#if PLANE_SPLIT
      if (in[u]) {
        const Slot t = plane_slot<VEC>(n, C, c, HW, j);
        span[u] = t.lo | t.hi << 8;
        buf[u] = load_slot<VEC, KATO_STATS_STREAM>(x, t);
      }
#else
      if (in[u]) {
        buf[u] = KATO_STATS_LOAD(xv + ((static_cast<long long>(n) * C + c) * hwv + j));
      }
#endif
      j += r;
      n += q;
      if (j >= hwv) {
        j -= hwv;
        ++n;
      }
    }
    // One Chan merge per vector (its VEC values' mean and M2 exactly, from registers): only the
    // raw vectors in flight and one vector of floats are live at a time.
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (in[u]) {
        float e[VEC];
        unpack(buf[u], e);
#pragma unroll
        for (int k = 0; k < VEC; ++k) e[k] -= pivot;
#if PLANE_SPLIT
        s = merge(s, slot_stats(e, span[u] & 0xff, span[u] >> 8));
#else
        s = merge(s, vector_stats(e));
#endif
      }
    }
    v += static_cast<long long>(UNROLL) * BLOCK_SIZE;
  }

  s = warp_allreduce(s);
#if BLOCK_SIZE > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  // Every warp merges the per-warp partials in the same order (lanes >= kWarps are empty).
  s = lane < kWarps ? red[lane] : empty_stats();
  s = warp_allreduce(s);
#else
  (void)red;
#endif
  return s;
}

// The `split` partials of channel c merged by one warp (lane l takes l, l + 32, ..., then the
// butterfly): every lane gets the same. All 32 lanes must call it. `Coherent` loads go through
// L2 (ld.global.cg): partials written by other blocks of the same kernel.
template <bool Coherent>
__device__ __forceinline__ Stats merge_partials(const float* __restrict__ partials, int c,
                                                int split) {
  const int lane = threadIdx.x & 31;
  Stats s = empty_stats();
  for (int p = lane; p < split; p += 32) {
    const float* w = partials + (static_cast<size_t>(c) * split + p) * 3;
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
  return warp_allreduce(s);
}

// The pivot K of channel c: its first element (x - K keeps float32's accuracy for channels far
// from 0).
__device__ __forceinline__ float channel_pivot(const T* __restrict__ x, int c, int HW) {
  return to_float(x[static_cast<size_t>(c) * static_cast<size_t>(HW)]);
}
