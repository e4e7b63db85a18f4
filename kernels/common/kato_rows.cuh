// Shared device helpers of Kato's row-wise templates (one row per warp, group of lanes or
// block): a float back to the element type, a row split into an aligned vector body with
// scalar head and tail, a butterfly sum over a group of lanes and a row group's sum, and a
// per-column operand (a weight) read as vectors where its address allows. A fragment included
// inside the template's `namespace KATO_NS { ... }` after kato_convert.cuh (it uses T, VEC,
// Raw, from_float, and kato_row_layout.cuh's kLanes and kWarps); no include guard and inlined
// by OperatorSpec.render, as kato_vec.cuh says.

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
[[maybe_unused]] constexpr int kWarpsPow2 = next_pow2(kWarps);

// Every thread of a row group ends with the row's sum. Block mode: `red` is this row's slot of
// a double-buffered shared array (one barrier per row; every warp merges the per-warp partials
// itself, in the same order, so all agree bitwise).
__device__ __forceinline__ float row_sum(float s, float* red) {
  s = warp_sum<kLanes>(s);
#if ROW_THREADS == 0 && BLOCK_SIZE > 32
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  const int slot = lane & (kWarpsPow2 - 1);
  s = warp_sum<kWarpsPow2>(slot < kWarps ? red[slot] : 0.0f);
#else
  (void)red;
#endif
  return s;
}

// The VEC weights of columns [c, c + VEC): one vector load where w + c is aligned, else VEC
// element loads (the weight's alignment relative to the row's vectors differs per row when
// cols % VEC != 0).
__device__ __forceinline__ Raw load_cols(const T* __restrict__ w, int c, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const Raw*>(w + c));
  T t[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) t[j] = __ldg(w + c + j);
  Raw r;
  __builtin_memcpy(&r, t, sizeof(Raw));
  return r;
}

__device__ __forceinline__ bool cols_aligned(const T* w, int c) {
  return (reinterpret_cast<size_t>(w) / sizeof(T) + static_cast<size_t>(c)) % VEC == 0;
}
