// Shared device helpers of Kato's row-wise templates (one row per warp, group of lanes or
// block): a float back to the element type, a row split into an aligned vector body with
// scalar head and tail, and a butterfly sum over a group of lanes. A fragment included inside
// the template's `namespace KATO_NS { ... }` after kato_convert.cuh (it uses T, VEC
// and from_float); no include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

__device__ __forceinline__ T to_elem(float v) {
  T out;
  from_float(v, out);
  return out;
}

// A row of n elements at p: a scalar head [0, head) up to the first VEC-aligned address, nvec
// aligned vectors from head on, and a scalar tail [tail, n) of fewer than VEC elements.
struct Split {
  int head;
  int nvec;
  int tail;
};

__device__ __forceinline__ Split split_row(const T* p, int n) {
  const int mis = static_cast<int>((reinterpret_cast<size_t>(p) / sizeof(T)) % VEC);
  int head = mis == 0 ? 0 : VEC - mis;
  head = head < n ? head : n;
  Split s;
  s.head = head;
  s.nvec = (n - head) / VEC;
  s.tail = head + s.nvec * VEC;
  return s;
}

// Butterfly sum over aligned groups of Width lanes: every lane of a group ends with the same
// bits (a + b == b + a). All 32 lanes must call it (full mask).
template <int Width>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }
