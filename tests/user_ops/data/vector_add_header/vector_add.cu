#include "add.cuh"
#include "stride.h"  // twice: its guard keeps one copy

__global__ void vector_add(float *c, const float *a, const float *b, int n) {
    int base = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
#pragma unroll
    for (int t = 0; t < tile_size_x; t++) {
        add_at(c, a, b, base + t * ELEMENT_STRIDE, n);
    }
}
