// Shared device helpers, part 2 (see kato_vec.cuh): element types to and from float32 by
// overload on the type (a wrong IS_HALF / IS_BF16 fails to compile, never converts wrongly;
// pairs convert in one instruction on sm_80+), and a vector of VEC elements to and from VEC
// floats. Included inside the template's namespace after kato_vec.cuh (it uses T, VEC, Raw),
// with cuda_fp16.h / cuda_bf16.h included as IS_HALF / IS_BF16 say.

[[maybe_unused]] __device__ __forceinline__ float to_float(float v) { return v; }
[[maybe_unused]] __device__ __forceinline__ void from_float(float v, float& out) { out = v; }
[[maybe_unused]] __device__ __forceinline__ void from_float2(float a, float b, float* out) {
  out[0] = a;
  out[1] = b;
}
#if IS_HALF
[[maybe_unused]] __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
[[maybe_unused]] __device__ __forceinline__ void from_float(float v, __half& out) {
  out = __float2half_rn(v);
}
[[maybe_unused]] __device__ __forceinline__ void from_float2(float a, float b, __half* out) {
  const __half2 h = __floats2half2_rn(a, b);
  __builtin_memcpy(out, &h, sizeof(h));
}
#endif
#if IS_BF16
[[maybe_unused]] __device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
[[maybe_unused]] __device__ __forceinline__ void from_float(float v, __nv_bfloat16& out) {
  out = __float2bfloat16_rn(v);
}
[[maybe_unused]] __device__ __forceinline__ void from_float2(float a, float b,
                                                             __nv_bfloat16* out) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  __builtin_memcpy(out, &h, sizeof(h));
}
#endif

__device__ __forceinline__ void unpack(const Raw& r, float (&f)[VEC]) {
  T t[VEC];
  __builtin_memcpy(t, &r, sizeof(Raw));
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = to_float(t[j]);
}

__device__ __forceinline__ Raw pack(const float (&f)[VEC]) {
  T t[VEC];
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) from_float2(f[j], f[j + 1], &t[j]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_float(f[j], t[j]);
  }
  Raw r;
  __builtin_memcpy(&r, t, sizeof(Raw));
  return r;
}
