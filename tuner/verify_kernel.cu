// Compares a kernel's output with the float64 reference (stored as float on the device) and
// counts the elements outside tolerance. NaN and inf outputs (e.g. the poison left in place by a
// kernel that skipped elements) always count as mismatches.
// OUT_T arrives as a preprocessor macro: float, __half or __nv_bfloat16.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(int v) { return (float)v; }

extern "C" __global__ void count_mismatches(const OUT_T* __restrict__ out,
                                            const float* __restrict__ ref,
                                            long long n, float atol, float rtol,
                                            unsigned long long* __restrict__ bad,
                                            float* __restrict__ max_err) {
    unsigned long long local_bad = 0;
    float local_max = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float y = to_float(out[i]);
        float r = ref[i];
        float err = fabsf(y - r);
        bool ok = isfinite(y) && err <= atol + rtol * fabsf(r);
        if (!ok) local_bad++;
        local_max = isfinite(err) ? fmaxf(local_max, err) : INFINITY;
    }
    if (local_bad) atomicAdd(bad, local_bad);
    // max of non-negative floats: compare as ints
    atomicMax((int*)max_err, __float_as_int(local_max));
}
