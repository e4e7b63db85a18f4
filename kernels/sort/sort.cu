// Bitonic sort of 32-bit keys (float32 or int32), ascending: the rows of a matrix (sort_rows_kernel)
// or one long array (sort_1d_* kernels: block sorts, global merge passes, block merges).
//
// Tunables arrive as macros (see kernels/sort/__init__.py):
//
//   BLOCK       threads per block of the shared-memory kernels
//   ITEMS       keys per thread; a block holds C = BLOCK * ITEMS keys (a power of two)
//   WARP_SHFL   1: merge strides in [ITEMS, 32 * ITEMS) are exchanged with __shfl_xor_sync in
//               registers; 0: every stride >= ITEMS goes through shared memory
//   SMEM_FUSE   1: one merge stride per barrier in shared memory; 2: two strides per barrier
//               (each thread exchanges groups of 4 keys)
//   MIN_BLOCKS  min-blocks clause of __launch_bounds__ (0 = none)
//   SORT_1D     0: the row-sort entry point; 1: the entry points of the 1-D sort
//
// Keys are mapped to unsigned integers whose order is the key order (floats: flip all bits of
// negatives, the sign bit of the rest; ints: flip the sign bit) and sorted with unsigned
// min/max. -0.0 sorts before +0.0; NaN keys are not supported (positive NaNs would sort after
// +inf, negative ones before -inf).
//
// The network is the "flip" form of bitonic sort: merge k (k = 2, 4, ..., N) first compares i
// with its mirror i ^ (k - 1) in the same k-block, then runs half-cleaners with strides k/4 ... 1,
// and every comparator puts the minimum at the lower index. Sorting a length padded with the
// maximum key therefore never moves a real key into the padding, so padding is virtual: keys
// past the end are read as 0xffffffff and never written.
//
// Layout in a block: thread t holds keys t*ITEMS .. t*ITEMS + ITEMS - 1 of the block's buffer in
// registers ("blocked"); strides < ITEMS are compare-exchanges between registers, strides below
// 32 * ITEMS (WARP_SHFL) are warp shuffles, larger strides are done in shared memory, padded by
// one word every 32 against bank conflicts of the blocked layout.

#ifndef KATO_NS
#define KATO_NS kato_sort
#endif
#ifndef BLOCK
#error "BLOCK must be defined"
#endif
#ifndef ITEMS
#error "ITEMS must be defined"
#endif
#ifndef WARP_SHFL
#define WARP_SHFL 1
#endif
#ifndef SMEM_FUSE
#define SMEM_FUSE 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#ifndef SORT_1D
#define SORT_1D 0
#endif


namespace KATO_NS {

constexpr int kC = BLOCK * ITEMS;
constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v / 2); }
constexpr int kLogItems = ilog2(ITEMS);
constexpr int kLogC = ilog2(kC);
// Strides >= kThr are done in shared memory.
constexpr int kThr = WARP_SHFL ? 32 * ITEMS : ITEMS;
constexpr int kSmemWords = kC + kC / 32;
// Compare-exchanges per thread of one shared-memory stage (C / 2 pairs).
constexpr int kPairIters = ITEMS >= 2 ? ITEMS / 2 : 1;
// Groups of 4 keys per thread of one fused shared-memory stage (C / 4 groups).
constexpr int kQuadIters = ITEMS >= 4 ? ITEMS / 4 : 1;
constexpr unsigned int kMaxKey = 0xffffffffu;

static_assert(BLOCK >= 32 && BLOCK <= 1024 && (BLOCK & (BLOCK - 1)) == 0,
              "BLOCK must be a power of two in [32, 1024]");
static_assert(ITEMS >= 1 && ITEMS <= 64 && (ITEMS & (ITEMS - 1)) == 0,
              "ITEMS must be a power of two");
static_assert(WARP_SHFL == 0 || WARP_SHFL == 1, "WARP_SHFL must be 0 or 1");
static_assert(SMEM_FUSE == 1 || SMEM_FUSE == 2, "SMEM_FUSE must be 1 or 2");

// The key type is a kernel argument (key_float: 1 float, 0 int), applied as a mask, so one
// compiled kernel serves both (the keys are only ever handled as 32-bit patterns).
__device__ __forceinline__ unsigned int float_mask(int key_float) {
  return key_float ? 0xffffffffu : 0u;
}

__device__ __forceinline__ unsigned int to_ord(unsigned int bits, unsigned int fmask) {
  return bits ^ ((static_cast<unsigned int>(static_cast<int>(bits) >> 31) & fmask) | 0x80000000u);
}

__device__ __forceinline__ unsigned int from_ord(unsigned int ord, unsigned int fmask) {
  return ord ^ ((((ord >> 31) - 1u) & fmask) | 0x80000000u);
}

__device__ __forceinline__ int spad(int i) { return i + (i >> 5); }

__device__ __forceinline__ void cas(unsigned int& lo, unsigned int& hi) {
  const unsigned int a = min(lo, hi);
  hi = max(lo, hi);
  lo = a;
}

// Two strides 2^hi and 2^(hi-1) of a merge on the 4 keys of group p, in shared memory. The
// group is the keys the two strides exchange among themselves: lower base i (bits hi-1 and hi
// clear) plus 0 and 2^(hi-1), and either i + 2^hi plus the same (half-cleaner) or, for the
// mirror step of merge 2^(hi+1), the mirrors of the lower two in increasing order.
__device__ __forceinline__ void quad_step(unsigned int* s, int p, int hi, bool mirror) {
  const int lo = hi - 1;
  const int i = ((p >> lo) << (hi + 1)) | (p & ((1 << lo) - 1));
  const int up = mirror ? (i ^ ((1 << (hi + 1)) - 1)) - (1 << lo) : i + (1 << hi);
  const int i0 = spad(i), i1 = spad(i + (1 << lo)), i2 = spad(up), i3 = spad(up + (1 << lo));
  unsigned int g0 = s[i0], g1 = s[i1], g2 = s[i2], g3 = s[i3];
  if (mirror) {
    cas(g0, g3);
    cas(g1, g2);
  } else {
    cas(g0, g2);
    cas(g1, g3);
  }
  cas(g0, g1);
  cas(g2, g3);
  s[i0] = g0;
  s[i1] = g1;
  s[i2] = g2;
  s[i3] = g3;
}

// One bitonic merge of size k (a power of two >= 2) on the block's buffer: strides k/2 (the
// mirror comparison if `flip`, else a half-cleaner) down to 1. `s` is the block's shared buffer;
// on entry and exit the keys are in v (blocked layout). Every thread of the block must call it
// with the same k and flip.
__device__ __forceinline__ void merge(unsigned int (&v)[ITEMS], unsigned int* s, int k,
                                      bool flip) {
  const int t = threadIdx.x;
  int j = k >> 1;
  if (j >= kThr) {
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) s[spad(t * ITEMS + q)] = v[q];
    __syncthreads();
    while (j >= kThr) {
      const bool mirror = flip && 2 * j == k;
#if SMEM_FUSE == 2
      if ((j >> 1) >= kThr) {  // two strides per barrier
        const int hi = __ffs(j) - 1;
#pragma unroll
        for (int u = 0; u < kQuadIters; ++u) {
          const int p = t + u * BLOCK;  // group index in [0, C / 4)
          if (ITEMS >= 4 || p < kC / 4) quad_step(s, p, hi, mirror);
        }
        __syncthreads();
        j >>= 2;
        continue;
      }
#endif
      // Partly unrolled: all pairs of a stage are independent, but fully unrolled loads of
      // ITEMS keys next to the ITEMS register keys made ptxas spill (512 x 16).
#pragma unroll 4
      for (int u = 0; u < kPairIters; ++u) {
        const int p = t + u * BLOCK;  // pair index in [0, C / 2)
        if (ITEMS >= 2 || p < kC / 2) {
          const int lo = ((p & ~(j - 1)) << 1) | (p & (j - 1));  // a zero bit inserted at j
          const int hi = mirror ? (lo ^ (2 * j - 1)) : (lo + j);
          const unsigned int a = s[spad(lo)];
          const unsigned int b = s[spad(hi)];
          if (a > b) {
            s[spad(lo)] = b;
            s[spad(hi)] = a;
          }
        }
      }
      __syncthreads();
      j >>= 1;
    }
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) v[q] = s[spad(t * ITEMS + q)];
  }
#if WARP_SHFL
  const int lane = t & 31;
  for (; j >= ITEMS; j >>= 1) {  // partner in lane ^ m of the same warp (j < 32 * ITEMS)
    const int m = j >> kLogItems;
    const bool lower = (lane & m) == 0;
    if (flip && 2 * j == k) {
      // Mirror: key (t, q) pairs with (t ^ (2m - 1), ITEMS - 1 - q).
      const int mf = 2 * m - 1;
      if constexpr (ITEMS == 1) {
        const unsigned int o = __shfl_xor_sync(0xffffffffu, v[0], mf);
        v[0] = lower ? min(v[0], o) : max(v[0], o);
      } else {
#pragma unroll
        for (int q = 0; q < ITEMS / 2; ++q) {
          const unsigned int a = v[q];
          const unsigned int b = v[ITEMS - 1 - q];
          const unsigned int oa = __shfl_xor_sync(0xffffffffu, b, mf);  // partner of a
          const unsigned int ob = __shfl_xor_sync(0xffffffffu, a, mf);  // partner of b
          v[q] = lower ? min(a, oa) : max(a, oa);
          v[ITEMS - 1 - q] = lower ? min(b, ob) : max(b, ob);
        }
      }
    } else {
#pragma unroll
      for (int q = 0; q < ITEMS; ++q) {
        const unsigned int o = __shfl_xor_sync(0xffffffffu, v[q], m);
        v[q] = lower ? min(v[q], o) : max(v[q], o);
      }
    }
  }
#endif
  // Here j = min(k / 2, ITEMS / 2): the remaining strides are inside each thread.
#pragma unroll
  for (int J = ITEMS / 2; J >= 1; J >>= 1) {
    if (J <= j) {
      if (flip && 2 * J == k) {
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
          if ((q & J) == 0) cas(v[q], v[q ^ (2 * J - 1)]);
        }
      } else {
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
          if ((q & J) == 0) cas(v[q], v[q ^ J]);
        }
      }
    }
  }
}

// Sorts (full = true: merges 2 .. 2^log2n with mirrors) or merges (full = false: one
// half-cleaner merge of size C, for the 1-D sort after its global passes) every segment of
// `seg` keys of x into y. Segment r holds keys r*seg .. r*seg + seg - 1 of the n keys (the last
// one may be short); it is padded virtually to 2^log2n <= C keys, and a block holds
// C / 2^log2n segments per iteration of its grid-stride loop. x and y may alias (the block
// reads all of its keys before it writes any).
__device__ __forceinline__ void sort_segments(const unsigned int* x, unsigned int* y,
                                              long long n, int seg, int log2n, bool full,
                                              unsigned int fmask) {
  extern __shared__ __align__(16) unsigned int kato_smem[];
  unsigned int* const s = kato_smem;
  const int t = threadIdx.x;
  const int nseg_pad = 1 << log2n;
  const int per_block = kC >> log2n;
  const long long nsegs = (n + seg - 1) / seg;
  const long long ngroups = (nsegs + per_block - 1) / per_block;
  unsigned int v[ITEMS];
  for (long long g = blockIdx.x; g < ngroups; g += gridDim.x) {
    const long long first = g * per_block;
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const int i = t + u * BLOCK;
      const long long r = first + (i >> log2n);
      const int c = i & (nseg_pad - 1);
      const long long idx = r * seg + c;
      unsigned int key = kMaxKey;
      if (c < seg && idx < n) key = to_ord(x[idx], fmask);
      s[spad(i)] = key;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) v[q] = s[spad(t * ITEMS + q)];
    if (full) {
      for (int k = 2; k <= nseg_pad; k <<= 1) merge(v, s, k, true);
    } else {
      merge(v, s, nseg_pad, false);
    }
    // An opaque copy of the thread index: the store addresses are recomputed here instead of
    // being kept live (2 registers per key) across the whole sort.
    int t2 = t;
    asm volatile("" : "+r"(t2));
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) s[spad(t2 * ITEMS + q)] = v[q];
    __syncthreads();
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const int i = t2 + u * BLOCK;
      const long long r = first + (i >> log2n);
      const int c = i & (nseg_pad - 1);
      const long long idx = r * seg + c;
      if (c < seg && idx < n) y[idx] = from_ord(s[spad(i)], fmask);
    }
    __syncthreads();  // the next group overwrites the buffer
  }
}

// One global pass of the 1-D sort: F consecutive strides 2^hi .. 2^(hi-F+1) (all >= C) of the
// merge of size 2^(hi+1) when `flip` (its first stride is the mirror), else of a later part of a
// merge. Each thread loads the 2^F keys of a group that these strides only exchange among
// themselves, runs the F steps in registers and writes them back.
template <int F>
__device__ __forceinline__ void global_pass(unsigned int* y, long long n, int hi, int flip,
                                            unsigned int fmask) {
  constexpr int G = 1 << F;
  constexpr int H = G / 2;
  const int lo = hi - F + 1;
  const long long blocks = (n + (1LL << (hi + 1)) - 1) >> (hi + 1);
  const long long ngroups = blocks << (hi + 1 - F);
  const long long low_mask = (1LL << lo) - 1;
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < ngroups;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = ((p >> lo) << (hi + 1)) | (p & low_mask);  // bits lo..hi zero
    long long idx[G];
    if (flip) {
      // Lower half: i + a*2^lo; upper half: the mirrors, in increasing index order.
      const long long ub = (i ^ ((1LL << (hi + 1)) - 1)) - (static_cast<long long>(H - 1) << lo);
#pragma unroll
      for (int a = 0; a < H; ++a) {
        idx[a] = i + (static_cast<long long>(a) << lo);
        idx[H + a] = ub + (static_cast<long long>(a) << lo);
      }
    } else {
#pragma unroll
      for (int a = 0; a < G; ++a) idx[a] = i + (static_cast<long long>(a) << lo);
    }
    unsigned int g[G];
#pragma unroll
    for (int a = 0; a < G; ++a) g[a] = idx[a] < n ? to_ord(y[idx[a]], fmask) : kMaxKey;
    if (flip) {
#pragma unroll
      for (int a = 0; a < H; ++a) cas(g[a], g[G - 1 - a]);
    } else {
#pragma unroll
      for (int a = 0; a < G; ++a) {
        if ((a & H) == 0) cas(g[a], g[a | H]);
      }
    }
#pragma unroll
    for (int b = H / 2; b >= 1; b >>= 1) {
#pragma unroll
      for (int a = 0; a < G; ++a) {
        if ((a & b) == 0) cas(g[a], g[a | b]);
      }
    }
#pragma unroll
    for (int a = 0; a < G; ++a) {
      if (idx[a] < n) y[idx[a]] = from_ord(g[a], fmask);
    }
  }
}

}  // namespace KATO_NS

#if MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK, MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK)
#endif

#if !SORT_1D
// Rows: block (BLOCK), dynamic shared memory (C + C/32) * 4 bytes, grid (any): a block sorts
// C / next_pow2(cols) rows per iteration. Needs next_pow2(cols) <= C. Keys are float32
// (key_float 1) or int32 (0) bit patterns.
extern "C" __global__ void KATO_LAUNCH_BOUNDS sort_rows_kernel(const unsigned int* __restrict__ x,
                                                               unsigned int* __restrict__ y,
                                                               int rows, int cols,
                                                               int key_float) {
  const int log2n = cols <= 1 ? 0 : 32 - __clz(cols - 1);
  KATO_NS::sort_segments(x, y, static_cast<long long>(rows) * cols, cols, log2n, true,
                         KATO_NS::float_mask(key_float));
}
#else
// 1-D, step 1: sort segments of 2^log2seg <= C keys (log2seg = log2 C when n > C).
extern "C" __global__ void KATO_LAUNCH_BOUNDS sort_1d_block(const unsigned int* __restrict__ x,
                                                            unsigned int* __restrict__ y,
                                                            long long n, int log2seg,
                                                            int key_float) {
  KATO_NS::sort_segments(x, y, n, 1 << log2seg, log2seg, true, KATO_NS::float_mask(key_float));
}

// 1-D, after the global passes of a merge: strides C/2 .. 1 in every C-key chunk, in place.
extern "C" __global__ void KATO_LAUNCH_BOUNDS sort_1d_merge(unsigned int* y, long long n,
                                                            int key_float) {
  KATO_NS::sort_segments(y, y, n, KATO_NS::kC, KATO_NS::kLogC, false,
                         KATO_NS::float_mask(key_float));
}

// 1-D global passes of 1, 2 or 3 strides; block 256 threads, grid (any).
extern "C" __global__ void __launch_bounds__(256) sort_1d_global1(unsigned int* y, long long n,
                                                                  int hi, int flip,
                                                                  int key_float) {
  KATO_NS::global_pass<1>(y, n, hi, flip, KATO_NS::float_mask(key_float));
}
extern "C" __global__ void __launch_bounds__(256) sort_1d_global2(unsigned int* y, long long n,
                                                                  int hi, int flip,
                                                                  int key_float) {
  KATO_NS::global_pass<2>(y, n, hi, flip, KATO_NS::float_mask(key_float));
}
extern "C" __global__ void __launch_bounds__(256) sort_1d_global3(unsigned int* y, long long n,
                                                                  int hi, int flip,
                                                                  int key_float) {
  KATO_NS::global_pass<3>(y, n, hi, flip, KATO_NS::float_mask(key_float));
}
#endif
