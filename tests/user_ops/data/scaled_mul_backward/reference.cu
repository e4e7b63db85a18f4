extern "C" __global__ void scaled_mul_backward_reference(float *grad_a, float *grad_b,
                                                         const float *grad_y, const float *a,
                                                         const float *b, float alpha, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        grad_a[i] = alpha * grad_y[i] * b[i];
        grad_b[i] = alpha * grad_y[i] * a[i];
    }
}
