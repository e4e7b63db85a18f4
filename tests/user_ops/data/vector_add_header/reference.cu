#include "add.cuh"

extern "C" __global__ void vector_add_reference(float *c, const float *a, const float *b, int n) {
    add_at(c, a, b, blockIdx.x * blockDim.x + threadIdx.x, n);
}
