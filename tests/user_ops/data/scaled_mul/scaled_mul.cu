__global__ void scaled_mul(float *y, const float *a, const float *b, float alpha, int n) {
    int base = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
#pragma unroll
    for (int t = 0; t < tile_size_x; t++) {
        int i = base + t * block_size_x;
        if (i < n) {
            y[i] = alpha * a[i] * b[i];
        }
    }
}
