// Welford partials of the templates that take a mean and a variance in one pass (layernorm over
// a row; batchnorm_stats.cu and batchnorm.cu over a channel, with kato_channel_stats.cuh): a
// partial's count, mean and M2 of some elements, merged with Chan's formula, by a butterfly over
// a group of lanes, and one vector's statistics exactly. A fragment included inside the
// template's `namespace KATO_NS { ... }` after kato_vec.cuh (it uses VEC); no include guard and
// inlined by OperatorSpec.render, as kato_vec.cuh says.

// A Welford partial of some elements of x - K: count (float, exact to 2^24), mean, M2.
struct Stats {
  float n;
  float mean;
  float m2;
};

__device__ __forceinline__ Stats empty_stats() {
  Stats s;
  s.n = 0.0f;
  s.mean = 0.0f;
  s.m2 = 0.0f;
  return s;
}

// Chan et al.: a merged with b; an empty side is the identity (never divides by zero).
__device__ __forceinline__ Stats merge(const Stats& a, const Stats& b) {
  const float n = a.n + b.n;
  const float f = __fdividef(b.n, fmaxf(n, 1.0f));  // nb / n
  const float delta = b.mean - a.mean;
  Stats r;
  r.n = n;
  r.mean = fmaf(delta, f, a.mean);
  // + delta^2 * na * nb / n, the small terms first: a thread's running M2 grows to ~n times
  // each vector's, and adding a vector's M2 to it alone rounds with a bias where the inputs are
  // quantized (float16 values: a vector's M2 has few fraction bits, the same ones every time).
  // With 25088 elements per thread (256x64x112x112, 128 threads, SPLIT 1) that bias reached
  // 1.06e-5 of the variance; in this order 2.5e-7 (a float32 emulation of the thread loop).
  r.m2 = a.m2 + fmaf(delta * delta, a.n * f, b.m2);
  return r;
}

// Butterfly all-reduce over aligned groups of `Width` lanes (all 32 must call it). The lower
// lane of each pair is the left operand, so partners compute bitwise identical merges: every
// lane of a group ends with the same.
template <int Width = 32>
__device__ __forceinline__ Stats warp_allreduce(Stats s) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset >>= 1) {
    Stats o;
    o.n = __shfl_xor_sync(0xffffffffu, s.n, offset);
    o.mean = __shfl_xor_sync(0xffffffffu, s.mean, offset);
    o.m2 = __shfl_xor_sync(0xffffffffu, s.m2, offset);
    const bool lower = (lane & offset) == 0;
    // Operands ordered by lane first, then one merge (not two merges and a select).
    Stats left, right;
    left.n = lower ? s.n : o.n;
    left.mean = lower ? s.mean : o.mean;
    left.m2 = lower ? s.m2 : o.m2;
    right.n = lower ? o.n : s.n;
    right.mean = lower ? o.mean : s.mean;
    right.m2 = lower ? o.m2 : s.m2;
    s = merge(left, right);
  }
  return s;
}

// Statistics of one vector of values (all valid), exactly: the mean, then M2 about it.
__device__ __forceinline__ Stats vector_stats(const float (&v)[VEC]) {
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) sum += v[k];
  Stats s;
  s.n = static_cast<float>(VEC);
  s.mean = sum * (1.0f / VEC);
  float m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float d = v[k] - s.mean;
    m2 = fmaf(d, d, m2);
  }
  s.m2 = m2;
  return s;
}
