extern "C" __global__ void scaled_mul_reference(float *y, const float *a, const float *b,
                                                float alpha, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = alpha * a[i] * b[i];
    }
}
