// Shared device helpers, part 4 (see kato_vec.cuh): rows that are not whole vectors (issue 31).
// A row of n elements at x is a scalar head [0, head) up to its first VEC-aligned address,
// aligned vectors [head, tail), and a scalar tail [tail, n) of fewer than VEC elements; with
// cols % VEC != 0 every row has its own head. Column-indexed arrays (a weight) are read as
// vectors where their address allows and element by element where not. A fragment included
// inside the template's namespace after kato_convert.cuh (it uses T, VEC and Raw), under the
// template's `#if ROW_SPLIT`, so that a template whose rows are whole vectors preprocesses to
// what it was before.

struct RowSplit {
  int head;
  int tail;
};

__device__ __forceinline__ RowSplit row_split(const T* x, int n) {
  const int mis = static_cast<int>((reinterpret_cast<size_t>(x) / sizeof(T)) % VEC);
  RowSplit s;
  s.head = mis == 0 ? 0 : (VEC - mis < n ? VEC - mis : n);
  s.tail = s.head + (n - s.head) / VEC * VEC;
  return s;
}

// Whether the VEC elements of w from column c on form one aligned vector.
__device__ __forceinline__ bool cols_aligned(const T* w, int c) {
  return (reinterpret_cast<size_t>(w) / sizeof(T) + static_cast<size_t>(c)) % VEC == 0;
}

// The VEC elements of w from column c on: one vector load where aligned, else VEC loads.
__device__ __forceinline__ Raw load_cols(const T* __restrict__ w, int c, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const Raw*>(w + c));
  T t[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) t[j] = __ldg(w + c + j);
  Raw r;
  __builtin_memcpy(&r, t, sizeof(Raw));
  return r;
}
