// Row-group sums and per-column loads of Kato's row-wise templates: every thread of a row group
// (kato_row_layout.cuh's kLanes lanes, or the block) ends with the row's sum, and a per-column
// operand (a weight) is read as vectors where its address allows. A fragment included inside
// the template's `namespace KATO_NS { ... }` after kato_rows.cuh (it uses warp_sum, next_pow2,
// T, VEC, Raw, and kato_row_layout.cuh's kLanes and kWarps); no include guard and inlined by
// OperatorSpec.render, as kato_vec.cuh says.

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
