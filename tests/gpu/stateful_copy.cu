// A float32 copy whose faulty modes depend on state left in device buffers, for the backend's
// verification tests only (never registered in the service). One block, grid-stride loop.
//   MODE 0: correct; also writes x to scratch.
//   MODE 1: correct on the first call only: it sets counter and never resets it, and a call
//           that finds counter set writes nothing (a kernel that does not leave its scratch
//           ready for the next call).
//   MODE 2: copies scratch instead of x: correct only while scratch holds what MODE 0 left.
extern "C" __global__ void stateful_copy(const float* __restrict__ x, float* __restrict__ y,
                                         float* __restrict__ scratch,
                                         unsigned int* __restrict__ counter, int n) {
    __shared__ unsigned int seen;
    if (threadIdx.x == 0) seen = *counter;
    __syncthreads();
#if MODE == 1
    if (seen != 0) return;
#endif
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
#if MODE == 2
        y[i] = scratch[i];
#else
        y[i] = x[i];
        scratch[i] = x[i];
#endif
    }
    __syncthreads();
#if MODE == 1
    if (threadIdx.x == 0) *counter = 1;
#endif
}
