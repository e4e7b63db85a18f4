// Compares a kernel's output with the reference and counts the elements outside tolerance.
// OUT_T arrives as a preprocessor macro: float, __half, __nv_bfloat16, int, unsigned int or
// unsigned char. Floating-point outputs are compared with a float copy of the float64 reference
// (REF_T float) within atol + rtol * |ref|; an output equal to the reference always passes (so
// +-inf outputs can match), and NaN or inf otherwise count as mismatches (e.g. the poison left in
// place by a kernel that skipped elements). Integer outputs are compared exactly with a
// reference of their own type (REF_T = OUT_T, OUT_IS_INT 1).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef REF_T
#define REF_T float
#endif
#ifndef OUT_IS_INT
#define OUT_IS_INT 0
#endif

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(int v) { return (float)v; }
__device__ __forceinline__ float to_float(unsigned int v) { return (float)v; }
__device__ __forceinline__ float to_float(unsigned char v) { return (float)v; }

extern "C" __global__ void count_mismatches(const OUT_T* __restrict__ out,
                                            const REF_T* __restrict__ ref,
                                            long long n, float atol, float rtol,
                                            unsigned long long* __restrict__ bad,
                                            float* __restrict__ max_err) {
    unsigned long long local_bad = 0;
    float local_max = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
#if OUT_IS_INT
        bool ok = out[i] == ref[i];
        float err = ok ? 0.0f : fabsf(to_float(out[i]) - to_float(ref[i]));
        if (!ok && err == 0.0f) err = 1.0f;  // distinct values that round to the same float
#else
        float y = to_float(out[i]);
        float r = ref[i];
        float err = y == r ? 0.0f : fabsf(y - r);
        bool ok = y == r || (isfinite(y) && err <= atol + rtol * fabsf(r));
#endif
        if (!ok) local_bad++;
        local_max = isfinite(err) ? fmaxf(local_max, err) : INFINITY;
    }
    if (local_bad) atomicAdd(bad, local_bad);
    // max of non-negative floats: compare as ints
    atomicMax((int*)max_err, __float_as_int(local_max));
}
