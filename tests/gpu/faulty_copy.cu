// A copy kernel with planted faults, for the fault-isolation GPU test only (never registered
// in the service). MODE 0 copies correctly; the others fault in thread 0 of block 0:
//   1: out-of-bounds write far outside any allocation (illegal address, sticky error)
//   2: an infinite loop (the launch never completes: the parent's trial timeout kills it)
//   3: __trap() (unspecified launch failure, sticky error)
//   4: a misaligned 4-byte store (misaligned address, sticky error)
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE)
faulty_copy(const float* __restrict__ x, float* __restrict__ y, int n) {
    const int i = blockIdx.x * BLOCK_SIZE + threadIdx.x;
#if MODE == 1
    if (i == 0) y[(size_t)1 << 40] = 1.0f;  // 4 TiB past y
#elif MODE == 2
    // The condition reads global memory through a volatile pointer on every iteration (x[0] is
    // never NaN, so it always holds): the compiler may not assume the loop ends and remove it,
    // as it did with a volatile local.
    if (i == 0) {
        const volatile float* spin = x;
        while (spin[0] == spin[0]) {
        }
    }
#elif MODE == 3
    if (i == 0) __trap();
#elif MODE == 4
    if (i == 0) *reinterpret_cast<float*>(reinterpret_cast<char*>(y) + 2) = 1.0f;
#endif
    if (i < n) y[i] = x[i];
}
