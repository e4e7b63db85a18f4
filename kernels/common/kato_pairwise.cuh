// The summation steps of the sum templates (reduce_sum over rows, reduce_sum_all over a whole
// array): a step's UNROLL vectors of VEC values summed pairwise, and the step sums added with
// Kahan compensation. A fragment included inside the template's `namespace KATO_NS { ... }`
// (it uses VEC and UNROLL); no include guard and inlined by OperatorSpec.render, as
// kato_vec.cuh says.

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

// Kahan step: (s, c) += v. No multiplications, so nothing can be contracted into an FMA, and
// nvcc does not reassociate float arithmetic without fast-math.
__device__ __forceinline__ void kahan_add(float& s, float& c, float v) {
  const float y = v - c;
  const float t = s + y;
  c = (t - s) - y;
  s = t;
}
