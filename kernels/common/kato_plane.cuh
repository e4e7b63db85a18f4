// Shared device helpers (issue 31): the (n, c) planes of an NCHW tensor whose H*W is not a
// multiple of the vector width V. Plane p = n * C + c starts at element p * HW, off a V-element
// boundary for most p. It is covered by plane_slots<V>(HW) aligned slots of V elements from the
// boundary at or before its start; slot j holds the plane's elements [lo, hi) of its V: the first
// slot is the plane's scalar head, the last its tail (or nothing, where the plane ended in the
// slot before), every other slot a whole aligned vector. A whole slot is one vector access, any
// other one access per element of the plane in it: no access leaves the plane, and every
// element of the plane is in exactly one slot. A fragment included inside the template's
// namespace after kato_convert.cuh (it uses T and RawOf), under the template's
// `#if PLANE_SPLIT || APPLY_PLANE_SPLIT`, so that a template whose planes are whole vectors
// preprocesses to what it was before. No include guard and inlined by OperatorSpec.render, as
// kato_vec.cuh says.

// Slots per plane: planes start at multiples of g = gcd(HW, V) modulo V (g is HW's lowest set
// bit, capped at V: V is a power of two), so a plane's head is at most V - g elements and its
// elements span at most ceil((HW + V - g) / V) slots. HW % V == 0 gives HW / V.
template <int V>
__device__ __forceinline__ int plane_slots(int HW) {
  const int low = HW & -HW;
  const int g = low < V ? low : V;
  return (HW + 2 * V - g - 1) / V;
}

// Slot j of plane (n, c): its first element e0 (a multiple of V) and the plane's elements in
// it, [lo, hi) of its V (empty where hi <= lo).
struct Slot {
  long long e0;
  int lo;
  int hi;
};

template <int V>
__device__ __forceinline__ Slot plane_slot(int n, int C, int c, int HW, int j) {
  const long long s = (static_cast<long long>(n) * C + c) * HW;
  Slot t;
  t.e0 = s - (s & (V - 1)) + static_cast<long long>(j) * V;
  const long long lo = s - t.e0;
  const long long hi = s + HW - t.e0;
  t.lo = lo > 0 ? static_cast<int>(lo) : 0;
  t.hi = hi < V ? (hi > 0 ? static_cast<int>(hi) : 0) : V;
  return t;
}

__device__ __forceinline__ bool slot_whole(const Slot& t, int v) { return t.lo == 0 && t.hi == v; }

// The slot's V elements of p: one vector load where the slot is whole, else a load per element
// of the plane and zero bits (0 in every element type) for the others. Stream: __ldcs (read
// once), else __ldg (read again later: kept in L2).
template <int V, bool Stream>
__device__ __forceinline__ typename RawOf<V * sizeof(T)>::type load_slot(const T* __restrict__ p,
                                                                         const Slot& t) {
  using R = typename RawOf<V * sizeof(T)>::type;
  if (slot_whole(t, V)) {
    const R* a = reinterpret_cast<const R*>(p + t.e0);
    if constexpr (Stream) {
      return __ldcs(a);
    } else {
      return __ldg(a);
    }
  }
  T e[V];
  __builtin_memset(e, 0, sizeof(e));
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (k >= t.lo && k < t.hi) {
      if constexpr (Stream) {
        e[k] = __ldcs(p + t.e0 + k);
      } else {
        e[k] = __ldg(p + t.e0 + k);
      }
    }
  }
  R r;
  __builtin_memcpy(&r, e, sizeof(R));
  return r;
}

// The slot's elements of the plane from r into p (streaming stores): one vector store where the
// slot is whole, else a store per element of the plane.
template <int V>
__device__ __forceinline__ void store_slot(T* __restrict__ p, const Slot& t,
                                           const typename RawOf<V * sizeof(T)>::type& r) {
  using R = typename RawOf<V * sizeof(T)>::type;
  if (slot_whole(t, V)) {
    __stcs(reinterpret_cast<R*>(p + t.e0), r);
    return;
  }
  T e[V];
  __builtin_memcpy(e, &r, sizeof(R));
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (k >= t.lo && k < t.hi) __stcs(p + t.e0 + k, e[k]);
  }
}
