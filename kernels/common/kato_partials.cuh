// Column sums in two stages, as the norm backward templates take them (rmsnorm_backward: dw;
// layernorm_backward: dw and db side by side): stage 1 (the template's) sums each block's rows
// into one float32 partial row, stage 2 (here) adds the partial rows column by column in a
// fixed order (deterministic). A fragment included inside the template's
// `namespace KATO_NS { ... }` after kato_rows.cuh (it uses T and to_elem); no include guard and
// inlined by OperatorSpec.render, as kato_vec.cuh says. Index is the column index's type (int,
// or long long for 2 * cols columns): each template keeps its own, so it compiles as it did.

// Stage 2 over *nparts partial rows of width = kParts * cols floats (kParts 1: dw; 2: dw's
// columns, then db's), by blocks of (32, L) threads on 32-column tiles with a grid stride:
// thread (c, l) sums partial rows l, l + L, ... of column c (coalesced across c) into
// sums[l][c], then lane l = 0 adds the L sums in order and writes column c to out[c] (c < cols)
// or next[c - cols]. `sums` is the kernel's own __shared__ array (its PTX name stays the
// kernel's).
template <class Index, int kParts>
__device__ __forceinline__ void reduce_partials(const float* __restrict__ partials,
                                                const int* __restrict__ nparts, int cols,
                                                float (&sums)[32][33], T* __restrict__ out,
                                                T* __restrict__ next) {
  const int lanes = static_cast<int>(blockDim.y);
  const int n = *nparts;
  const Index width = kParts * static_cast<Index>(cols);
  for (long long c0 = static_cast<long long>(blockIdx.x) * 32; c0 < width;
       c0 += static_cast<long long>(gridDim.x) * 32) {
    const Index c = static_cast<Index>(c0) + static_cast<Index>(threadIdx.x);
    float sum = 0.0f;
    if (c < width) {
#pragma unroll 4
      for (int p = threadIdx.y; p < n; p += lanes) {
        sum += __ldcs(partials + static_cast<size_t>(p) * static_cast<size_t>(width) + c);
      }
    }
    sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < width) {
      float total = sums[0][threadIdx.x];
      for (int l = 1; l < lanes; ++l) total += sums[l][threadIdx.x];
      if (c < cols) {
        out[c] = to_elem(total);
      } else {
        next[c - cols] = to_elem(total);
      }
    }
    __syncthreads();  // sums is rewritten by the next tile
  }
}
