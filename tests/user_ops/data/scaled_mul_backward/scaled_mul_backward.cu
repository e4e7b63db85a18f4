__global__ void scaled_mul_backward(float *grad_a, float *grad_b, const float *grad_y,
                                    const float *a, const float *b, float alpha, int n) {
    int base = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
#pragma unroll
    for (int t = 0; t < tile_size_x; t++) {
        int i = base + t * block_size_x;
        if (i < n) {
            float g = alpha * grad_y[i];
            grad_a[i] = g * b[i];
            grad_b[i] = g * a[i];
        }
    }
}
