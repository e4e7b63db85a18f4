// ReLU forward + backward, launched as a pair (kernels/relu/__init__.py's steps()):
//   relu_forward:   y = max(x, 0)                      (MASK 1: also mask bit = x > 0)
//   relu_backward:  dx = dy * (x > 0)                  (MASK 0: reads x; MASK 1: reads the mask)
// Both are exact selections (y is x or +0, dx is dy or +0): no arithmetic on the values.
//
// Tunable parameters arrive as `#define NAME value` lines before this template:
//   MASK        0: plain (backward reads x and dy). 1: bitmask (forward also writes one bit per
//               element, backward reads the bits instead of x: 32x fewer bytes for float32).
//   BLOCK_SIZE  threads per block: a multiple of 32 in [32, 1024].
//   VEC         elements per vector (VEC * sizeof(DTYPE) <= 16 bytes). Any n works: the last,
//               partial vector (n % VEC elements) is loaded and stored element by element.
//   UNROLL      vectors per thread per step of the grid-stride loop, all loaded before use.
// Derived: DTYPE (float, __half, __nv_bfloat16).
//
// Layout: "slots" are vectors of VEC elements, slot s holds elements [s*VEC, s*VEC + VEC);
// nslots = ceil(n / VEC), slot n / VEC is partial when VEC does not divide n. At step k, thread
// g (T threads in the grid) handles slots k*T*UNROLL + u*T + g, u < UNROLL: a warp covers 32
// consecutive slots per u, i.e. 32*VEC elements = VEC mask words.
//
// Mask: bit i of word w is element 32*w + i (word w holds elements [32w, 32w + 32); bits past n
// are 0); ceil(n / 32) words. With G = 32 / VEC lanes per word, lane l's VEC bits sit at bit
// (l % G) * VEC of word (slot / G). VEC 1: the word is __ballot_sync of the predicate. VEC > 1:
// every lane shifts its bits into place and an OR butterfly over the G lanes of its word
// assembles the word (the xor partners of an aligned group stay inside it); the group's first
// lane stores it. The loops are warp-uniform (the bound is tested on the warp's first slot) so
// every lane reaches every ballot/shuffle with the full mask.
//
// Arguments: relu_forward(x, y, mask, n) (MASK 0 ignores `mask`); relu_backward(mask, dy, dx, n)
// for MASK 1, relu_backward(x, dy, dx, n) for MASK 0. All arrays 16-byte aligned (cudaMalloc
// gives 256).

#ifndef MASK
#error "MASK must be defined"
#endif
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE must be defined"
#endif
#ifndef VEC
#error "VEC must be defined"
#endif
#ifndef UNROLL
#define UNROLL 2
#endif
#include "../common/kato_dtype.cuh"

#ifndef KATO_NS
#define KATO_NS kato_relu
#endif

namespace KATO_NS {

using T = DTYPE;

constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
constexpr int kLanesPerWord = 32 / VEC;  // G

static_assert(MASK == 0 || MASK == 1, "MASK must be 0 or 1");
static_assert(BLOCK_SIZE % 32 == 0 && BLOCK_SIZE >= 32 && BLOCK_SIZE <= 1024,
              "BLOCK_SIZE must be a multiple of 32 in [32, 1024]");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector must be at most 16 bytes");
static_assert(UNROLL == 1 || UNROLL == 2 || UNROLL == 4 || UNROLL == 8,
              "UNROLL must be 1, 2, 4 or 8");

#include "../common/kato_vec.cuh"

// A vector as 32-bit words in registers (a 2-byte vector sits in the low half of one word).
// Elements are manipulated as bits with shifts and masks only: no memcpy through arrays of
// 16-bit elements, which ptxas would put in local memory.
constexpr int kElemBytes = static_cast<int>(sizeof(T));
constexpr int kWords = kVecBytes >= 4 ? kVecBytes / 4 : 1;
struct Words {
  unsigned int w[4];  // only the first kWords are used (the rest are dead and cost nothing)
};
[[maybe_unused]] __device__ __forceinline__ Words to_words(unsigned short r) {
  return {{r, 0u, 0u, 0u}};
}
[[maybe_unused]] __device__ __forceinline__ Words to_words(unsigned int r) {
  return {{r, 0u, 0u, 0u}};
}
[[maybe_unused]] __device__ __forceinline__ Words to_words(uint2 r) {
  return {{r.x, r.y, 0u, 0u}};
}
[[maybe_unused]] __device__ __forceinline__ Words to_words(uint4 r) {
  return {{r.x, r.y, r.z, r.w}};
}
[[maybe_unused]] __device__ __forceinline__ void from_words(const Words& v, unsigned short& r) {
  r = static_cast<unsigned short>(v.w[0]);
}
[[maybe_unused]] __device__ __forceinline__ void from_words(const Words& v, unsigned int& r) {
  r = v.w[0];
}
[[maybe_unused]] __device__ __forceinline__ void from_words(const Words& v, uint2& r) {
  r = make_uint2(v.w[0], v.w[1]);
}
[[maybe_unused]] __device__ __forceinline__ void from_words(const Words& v, uint4& r) {
  r = make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
}

// Bits of element j (a compile-time constant after unrolling).
__device__ __forceinline__ unsigned int element(const Words& v, int j) {
  if constexpr (kElemBytes == 4) {
    return v.w[j];
  } else {
    return (v.w[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
  }
}

// x > 0 on the bits: the positive numbers are exactly the patterns in (0, +inf] (a set sign bit
// makes a pattern larger than +inf, NaNs are larger too, +0 is 0).
template <class U>
struct PosInf { static constexpr unsigned int bits = 0x7f800000u; };  // float
#if IS_HALF
template <>
struct PosInf<__half> { static constexpr unsigned int bits = 0x7c00u; };
#endif
#if IS_BF16
template <>
struct PosInf<__nv_bfloat16> { static constexpr unsigned int bits = 0x7f80u; };
#endif
constexpr unsigned int kPosInf = PosInf<T>::bits;

// VEC bits: bit j = (element j > 0). Zero bits (missing elements) give 0.
__device__ __forceinline__ unsigned int positive_bits(const Words& v) {
  unsigned int bits = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const unsigned int e = element(v, j);
    bits |= (e != 0u && e <= kPosInf ? 1u : 0u) << j;
  }
  return bits;
}

// Element j of the result = element j of v where bit j is set, else +0 (all bits zero).
__device__ __forceinline__ Words select_bits(Words v, unsigned int bits) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const bool keep = (bits >> j) & 1u;
    if constexpr (kElemBytes == 4) {
      v.w[j] = keep ? v.w[j] : 0u;
    } else {
      v.w[j >> 1] &= keep ? 0xffffffffu : ~(0xffffu << ((j & 1) * 16));
    }
  }
  return v;
}

using Bits = typename RawOf<kElemBytes>::type;  // one element's bits: unsigned short / int

// Slot s of p: a whole vector (s < nfull, streaming load) or the partial last one, element by
// element (missing elements read as zero bits). Callers guarantee s < nslots.
__device__ __forceinline__ Words load_slot(const T* __restrict__ p, long long s, long long nfull,
                                           long long n) {
  if (s < nfull) return to_words(__ldcs(reinterpret_cast<const Raw*>(p) + s));
  Words v = {{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const long long e = s * VEC + j;
    if (e < n) {
      const unsigned int b = reinterpret_cast<const Bits*>(p)[e];
      if constexpr (kElemBytes == 4) {
        v.w[j] = b;
      } else {
        v.w[j >> 1] |= b << ((j & 1) * 16);
      }
    }
  }
  return v;
}

__device__ __forceinline__ void store_slot(T* __restrict__ p, long long s, long long nfull,
                                           long long n, const Words& v) {
  if (s < nfull) {
    Raw r;
    from_words(v, r);
    __stcs(reinterpret_cast<Raw*>(p) + s, r);
    return;
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const long long e = s * VEC + j;
    if (e < n) reinterpret_cast<Bits*>(p)[e] = static_cast<Bits>(element(v, j));
  }
}

// The mask word of this lane's group: every lane of the warp must call it (full-mask ballot /
// shuffles). `bits` are this lane's VEC bits (0 for lanes without a slot).
__device__ __forceinline__ unsigned int assemble_word(unsigned int bits, int lane) {
#if VEC == 1
  (void)lane;
  return __ballot_sync(0xffffffffu, bits != 0u);
#else
  unsigned int word = bits << ((lane % kLanesPerWord) * VEC);
#pragma unroll
  for (int offset = kLanesPerWord / 2; offset > 0; offset >>= 1) {
    word |= __shfl_xor_sync(0xffffffffu, word, offset);
  }
  return word;
#endif
}

}  // namespace KATO_NS

#if defined(MIN_BLOCKS) && MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE)
#endif

// Any grid works (grid-stride loops); the spec launches min(BLOCKS_PER_SM * 132, needed) blocks.
extern "C" __global__ void KATO_LAUNCH_BOUNDS relu_forward(const DTYPE* __restrict__ x,
                                                           DTYPE* __restrict__ y,
                                                           unsigned int* __restrict__ mask,
                                                           long long n) {
  namespace ns = KATO_NS;
  const long long nfull = n / VEC;
  const long long nslots = (n + VEC - 1) / VEC;
  const long long threads = static_cast<long long>(gridDim.x) * BLOCK_SIZE;
  const int lane = threadIdx.x & 31;
  // The first slot of this thread's warp: every lane tests the loop bound on it (warp-uniform).
  const long long warp_first = static_cast<long long>(blockIdx.x) * BLOCK_SIZE + (threadIdx.x - lane);
  for (long long first = warp_first; first < nslots; first += threads * UNROLL) {
    ns::Words r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long s = first + u * threads + lane;
      if (s < nslots) r[u] = ns::load_slot(x, s, nfull, n);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long s = first + u * threads + lane;
      const bool has_slot = s < nslots;
      const unsigned int bits = has_slot ? ns::positive_bits(r[u]) : 0u;
      if (has_slot) ns::store_slot(y, s, nfull, n, ns::select_bits(r[u], bits));
#if MASK == 1
      const unsigned int word = ns::assemble_word(bits, lane);  // all lanes
      if (has_slot && lane % ns::kLanesPerWord == 0) mask[s / ns::kLanesPerWord] = word;
#endif
    }
  }
#if MASK == 0
  (void)mask;
#endif
}

// MASK 1: relu_backward(mask, dy, dx, n); MASK 0: relu_backward(x, dy, dx, n). The first
// argument is what the forward saved (kato_torch passes only that).
#if MASK == 1
extern "C" __global__ void KATO_LAUNCH_BOUNDS relu_backward(const unsigned int* __restrict__ mask,
                                                            const DTYPE* __restrict__ dy,
                                                            DTYPE* __restrict__ dx,
                                                            long long n) {
#else
extern "C" __global__ void KATO_LAUNCH_BOUNDS relu_backward(const DTYPE* __restrict__ x,
                                                            const DTYPE* __restrict__ dy,
                                                            DTYPE* __restrict__ dx,
                                                            long long n) {
#endif
  namespace ns = KATO_NS;
  const long long nfull = n / VEC;
  const long long nslots = (n + VEC - 1) / VEC;
  const long long threads = static_cast<long long>(gridDim.x) * BLOCK_SIZE;
  const long long g = static_cast<long long>(blockIdx.x) * BLOCK_SIZE + threadIdx.x;
  // No warp collectives here: a per-thread loop bound is fine.
  for (long long first = g; first < nslots; first += threads * UNROLL) {
    ns::Words r[UNROLL];
    unsigned int bits[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long s = first + u * threads;
      bits[u] = 0u;
      if (s < nslots) {
        r[u] = ns::load_slot(dy, s, nfull, n);
#if MASK == 1
        const unsigned int word = __ldcs(mask + s / ns::kLanesPerWord);
        bits[u] = (word >> ((s % ns::kLanesPerWord) * VEC)) & ((1u << VEC) - 1u);
#else
        bits[u] = ns::positive_bits(ns::load_slot(x, s, nfull, n));
#endif
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long s = first + u * threads;
      if (s < nslots) ns::store_slot(dx, s, nfull, n, ns::select_bits(r[u], bits[u]));
    }
  }
}
