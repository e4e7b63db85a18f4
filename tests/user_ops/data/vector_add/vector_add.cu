__global__ void vector_add(float *c, const float *a, const float *b, int n) {
    int base = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
#pragma unroll
    for (int t = 0; t < tile_size_x; t++) {
        int i = base + t * block_size_x;
        if (i < n) {
            c[i] = a[i] + b[i];
        }
    }
}
