// LSD radix sort of 32-bit keys (float32 or int32), ascending, optionally with an int32 payload
// (PAIRS): the radix path of sort_1d and the whole of sort_1d_pairs. Onesweep design: one read
// of the keys builds the histograms of every digit; then one scatter pass per digit, in which
// each tile ranks its keys stably, publishes its per-digit counts and finds the counts of the
// tiles before it by decoupled look-back.
//
// Tunables arrive as macros (see kernels/sort/radix.py):
//
//   BLOCK       threads per block of the scatter passes (a multiple of 64)
//   ITEMS       keys per thread; a tile is T = BLOCK * ITEMS keys
//   RADIX_BITS  digit width (4..8); the passes are ceil(32 / RADIX_BITS), the last one narrower
//   PAIRS       0: keys only; 1: an int32 value travels with every key
//   MIN_BLOCKS  min-blocks clause of __launch_bounds__ (0 = none)
//   RANK        how a warp's lanes with the same digit find each other when ranking (see
//               radix_pass): 0 (default, the space's "match"): __match_any_sync; 1 ("ballot"):
//               one __ballot_sync per digit bit; 2 ("atomic"): atomicOr into a shared word per
//               warp and digit
//   HIST        how radix_histogram reads and counts the keys: 0 (default, the space's
//               "scalar"): a 4-byte load per thread per step into one block histogram; 1
//               ("vec4"): 16-byte loads, kHistVecs of them per thread per step (a scalar head up
//               to the first 16-byte boundary and a scalar tail); 2 ("vec4_split4"): as 1, into
//               four copies of the block histogram, lane l counting in copy l % 4
//   SMEM_*      word offsets of radix_pass's dynamic shared memory regions and SMEM_WORDS,
//               their total (derived from the others by radix.py, not tunables)
//   SEGMENTED   0 (default): one array of n keys; 1: every row of a (rows, n) matrix sorted on
//               its own (sort's ALGO=radix; keys only), see "Rows" below
//
// One call is: radix_init (zero the histograms, tile counters and look-back buffer 0),
// radix_histogram (every digit's global counts, one read of the input keys), then radix_pass for
// pass = 0 .. passes-1, ping-ponging between the output and a scratch buffer so that the last
// pass writes the output. Nothing is carried from one call to the next: the init kernel resets
// all of it.
//
// Keys are mapped to unsigned integers whose order is the key order (floats: flip all bits of
// negatives, the sign bit of the rest; ints: flip the sign bit): -0.0 sorts before +0.0. Every
// pass is stable (equal digits keep their order), so the sort is stable: equal keys keep their
// input order, and so do their values.
//
// Look-back: tile t of a pass takes its tile id from an atomic counter (so every tile it waits
// for has started and will finish), publishes for each digit a status word (flag in bits 31:30:
// 1 = this tile's count, 2 = inclusive prefix over tiles 0..t; count in bits 29:0, hence n <
// 2^30), then walks back over tiles t-1, t-2, ... adding counts until it meets an inclusive
// prefix. Tile 0 publishes its inclusive prefix at once, so every walk ends. A walk that spins
// far longer than any tile takes (a bug, never the design) gives up instead of hanging the GPU,
// and the scatter never writes outside the output (__trap would do, but made ptxas spill).
// Passes alternate between two look-back buffers: pass p clears buffer (p+1)%2 (the previous
// pass's, finished) for pass p+1, each tile its own row.
//
// Rows (SEGMENTED): the kernels take the row length n and the number of rows, and every row is
// an independent sort of n keys at x + row * n. The tiles of all rows are numbered row by row
// (tiles_of(n) per row, one launch of rows * tiles_of(n) blocks, one tile counter per pass as
// before), so the tiles a tile waits for in its look-back, those of its row before it, have
// smaller ids and have started; a row's first tile publishes its prefix at once, so walks stop
// at the row's start. Scratch by rows: each row's digit histograms (kPasses * kRadix words,
// rows of them), and look-back buffers of rows * tiles_of(n) tiles each. The histogram kernel
// counts chunks of kSegChunk keys of one row per block step, adding into that row's histogram.

#ifndef KATO_NS
#define KATO_NS kato_radix
#endif
#ifndef BLOCK
#error "BLOCK must be defined"
#endif
#ifndef ITEMS
#error "ITEMS must be defined"
#endif
#ifndef RADIX_BITS
#error "RADIX_BITS must be defined"
#endif
#ifndef PAIRS
#define PAIRS 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#ifndef RANK
#define RANK 0
#endif
#ifndef HIST
#define HIST 0
#endif
#ifndef SEGMENTED
#define SEGMENTED 0
#endif
// (A preprocessor check: the 1-D programs' translation units stay what they were.)
#if SEGMENTED != 0 && (SEGMENTED != 1 || PAIRS != 0)
#error "SEGMENTED must be 0, or 1 with PAIRS 0 (rows of keys only)"
#endif
#if !defined(SMEM_KEYS) || !defined(SMEM_VALS) || !defined(SMEM_WARP) || !defined(SMEM_COUNT) || \
    !defined(SMEM_START) || !defined(SMEM_GLOBAL) || !defined(SMEM_BASE) ||                     \
    !defined(SMEM_TILE) || !defined(SMEM_WORDS)
#error "the SMEM_* layout macros must be defined (kernels/sort/radix.py: shared_layout)"
#endif

namespace KATO_NS {

constexpr int kRadix = 1 << RADIX_BITS;
constexpr int kPasses = (32 + RADIX_BITS - 1) / RADIX_BITS;
constexpr int kTile = BLOCK * ITEMS;
constexpr int kWarps = BLOCK / 32;
constexpr int kWarpKeys = 32 * ITEMS;
// The init and histogram kernels' block (fixed: one read of the keys, far from the scatter
// passes' cost).
constexpr int kAuxBlock = 256;
constexpr unsigned int kFlagCount = 1u << 30;
constexpr unsigned int kFlagPrefix = 2u << 30;
constexpr unsigned int kValueMask = (1u << 30) - 1u;
// About a second of polling one status word: no tile takes a millisecond.
constexpr unsigned int kSpinLimit = 1u << 22;

static_assert(RADIX_BITS >= 4 && RADIX_BITS <= 8, "RADIX_BITS must be in [4, 8]");
static_assert(BLOCK >= 64 && BLOCK <= 1024 && BLOCK % 64 == 0,
              "BLOCK must be a multiple of 64 in [64, 1024]");
static_assert(ITEMS >= 1 && ITEMS <= 32, "ITEMS must be in [1, 32]");
static_assert(PAIRS == 0 || PAIRS == 1, "PAIRS must be 0 or 1");
static_assert(RANK >= 0 && RANK <= 2, "RANK must be 0 (match), 1 (ballot) or 2 (atomic)");
static_assert(HIST >= 0 && HIST <= 2, "HIST must be 0 (scalar), 1 (vec4) or 2 (vec4_split4)");

// Dynamic shared memory of radix_pass, in 32-bit words: the tile's keys (and values) in digit
// order, the per-warp digit counters, four per-digit arrays (tile counts, starts in the tile,
// global starts, scatter bases) and the tile id. The offsets come from the host
// (kernels/sort/radix.py: shared_layout), which launches exactly SMEM_WORDS words, so kernel
// and launch cannot disagree; the asserts check that each region holds what is indexed in it.
constexpr int kSmemKeys = SMEM_KEYS;
constexpr int kSmemVals = SMEM_VALS;
constexpr int kSmemWarp = SMEM_WARP;
constexpr int kSmemCount = SMEM_COUNT;
constexpr int kSmemStart = SMEM_START;
constexpr int kSmemGlobal = SMEM_GLOBAL;
constexpr int kSmemBase = SMEM_BASE;
constexpr int kSmemTile = SMEM_TILE;
constexpr int kSmemWords = SMEM_WORDS;
static_assert(kSmemKeys >= 0, "SMEM_KEYS must not be negative");
static_assert(kSmemVals - kSmemKeys >= kTile, "SMEM_KEYS: no room for the tile's keys");
static_assert(kSmemWarp - kSmemVals >= (PAIRS ? kTile : 0),
              "SMEM_VALS: no room for the tile's values");
static_assert(kSmemCount - kSmemWarp >= kWarps * kRadix,
              "SMEM_WARP: no room for a counter per warp and digit");
static_assert(kSmemStart - kSmemCount >= kRadix, "SMEM_COUNT: no room for a word per digit");
static_assert(kSmemGlobal - kSmemStart >= kRadix, "SMEM_START: no room for a word per digit");
static_assert(kSmemBase - kSmemGlobal >= kRadix, "SMEM_GLOBAL: no room for a word per digit");
static_assert(kSmemTile - kSmemBase >= kRadix, "SMEM_BASE: no room for a word per digit");
static_assert(kSmemWords - kSmemTile >= 1, "SMEM_TILE: no room for the tile id");
static_assert(kSmemWords * 4 <= 227 * 1024, "the tile does not fit in shared memory");
#if RANK == 2
// RANK 2 ranks with two buffers of a peers word per warp and digit, in the keys' region (free
// until the keys are stored in digit order, after the ranking).
constexpr int kMatchWords = 2 * kWarps * kRadix;
static_assert(kSmemVals - kSmemKeys >= kMatchWords,
              "SMEM_KEYS: no room for the ranking's peers words (RANK 2)");
#endif

__device__ __forceinline__ unsigned int float_mask(int key_float) {
  return key_float ? 0xffffffffu : 0u;
}

__device__ __forceinline__ unsigned int to_ord(unsigned int bits, unsigned int fmask) {
  return bits ^ ((static_cast<unsigned int>(static_cast<int>(bits) >> 31) & fmask) | 0x80000000u);
}

__device__ __forceinline__ unsigned int from_ord(unsigned int ord, unsigned int fmask) {
  return ord ^ ((((ord >> 31) - 1u) & fmask) | 0x80000000u);
}

__device__ __forceinline__ unsigned int digit_of(unsigned int key, int shift) {
  return (key >> shift) & static_cast<unsigned int>(kRadix - 1);
}

// Status words are polled by other blocks while their owner writes them: volatile accesses
// (relaxed at system scope on sm_70+, never cached in L1, every poll a load of its own). The
// value travels in the word itself, so no fence is needed. (Inline-PTX ld/st.relaxed.gpu made
// ptxas spill the key arrays of several tile shapes.)
__device__ __forceinline__ unsigned int load_status(const unsigned int* p) {
  return *static_cast<const volatile unsigned int*>(p);
}

__device__ __forceinline__ void store_status(unsigned int* p, unsigned int v) {
  *static_cast<volatile unsigned int*>(p) = v;
}

__device__ __forceinline__ long long tiles_of(long long n) { return (n + kTile - 1) / kTile; }

// Exclusive prefix sum of kRadix words (in: shared or global, out: shared), by one whole warp.
__device__ __forceinline__ void warp_exclusive_scan(const unsigned int* in, unsigned int* out) {
  constexpr int kPer = kRadix >= 32 ? kRadix / 32 : 1;
  const int lane = threadIdx.x & 31;
  unsigned int v[kPer];
  unsigned int sum = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = lane * kPer + j;
    v[j] = i < kRadix ? in[i] : 0u;
    sum += v[j];
  }
  unsigned int inclusive = sum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned int t = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += t;
  }
  unsigned int run = inclusive - sum;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = lane * kPer + j;
    if (i < kRadix) out[i] = run;
    run += v[j];
  }
}

}  // namespace KATO_NS

// An explicit minimum of one block: with __launch_bounds__(BLOCK) alone ptxas aimed below
// the cap for some tile shapes (40 registers at 512 threads, 128 at 128) and spilled.
#if MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK, MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK, 1)
#endif

#if SEGMENTED
namespace KATO_NS {
// Keys of one row the histogram kernel counts per block step (a multiple of 4: the vector
// loads' alignment repeats every chunk); the host sizes the grid for it (radix.py:
// SEG_HIST_CHUNK), and any grid is correct.
constexpr int kSegChunk = 16384;
static_assert(kSegChunk % 4 == 0, "chunks must keep the rows' 16-byte alignment");
constexpr int kHistCopies = HIST == 2 ? 4 : 1;
constexpr int kHistBins = kPasses * kRadix;
constexpr int kHistVecs = 4;
static_assert(kHistBins * kHistCopies * 4 <= 48 * 1024, "the histogram copies exceed 48 KiB");

__device__ __forceinline__ void hist_count(unsigned int* counts, unsigned int key) {
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    atomicAdd(&counts[(p * kRadix + digit_of(key, p * RADIX_BITS)) * kHistCopies], 1u);
  }
}
}  // namespace KATO_NS

// Zeroes every row's histograms (rows x passes x radix words), the per-pass tile counters and
// look-back buffer 0 (rows x tiles x radix words). Block kAuxBlock (256), grid (any).
extern "C" __global__ void __launch_bounds__(KATO_NS::kAuxBlock)
    radix_init(unsigned int* __restrict__ hist, unsigned int* __restrict__ counters,
               unsigned int* __restrict__ status, long long n, long long rows) {
  using namespace KATO_NS;
  const long long words = rows * tiles_of(n) * kRadix;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (long long i = first; i < words; i += stride) status[i] = 0u;
  for (long long i = first; i < rows * kHistBins; i += stride) hist[i] = 0u;
  if (first < kPasses) counters[first] = 0u;
}

// Every row's digit counts for every pass: hist[(row * passes + p) * radix + d]. Block
// kAuxBlock (256), grid (any): block steps over the (row, chunk) items, rows * ceil(n /
// kSegChunk) of them, each counted into shared memory (HIST: as the 1-D kernels, the vector
// loads with a scalar head and tail per chunk) and added to its row's histogram, one atomic per
// nonzero bin.
extern "C" __global__ void __launch_bounds__(KATO_NS::kAuxBlock)
    radix_histogram(const unsigned int* __restrict__ x, long long n, long long rows,
                    unsigned int* __restrict__ hist, int key_float) {
  using namespace KATO_NS;
  __shared__ __align__(16) unsigned int s_hist[kHistBins * kHistCopies];
  const unsigned int fmask = float_mask(key_float);
  unsigned int* const counts = s_hist + threadIdx.x % kHistCopies;
  const long long chunks = (n + kSegChunk - 1) / kSegChunk;
  const int g = threadIdx.x;
  const int step = blockDim.x;
  for (long long item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
    const long long row = item / chunks;
    const long long first = (item - row * chunks) * kSegChunk;
    const int m = n - first < kSegChunk ? static_cast<int>(n - first) : kSegChunk;
    const unsigned int* const keys = x + row * n + first;
    for (int i = g; i < kHistBins * kHistCopies; i += step) s_hist[i] = 0u;
    __syncthreads();
#if HIST == 0
    for (int i = g; i < m; i += step) hist_count(counts, to_ord(keys[i], fmask));
#else
    // The keys before the chunk's first 16-byte boundary (0..3), whole vectors, the keys after
    // them (0..3), as in the 1-D kernel with the block for the grid.
    const unsigned int misaligned =
        static_cast<unsigned int>(reinterpret_cast<unsigned long long>(keys)) & 15u;
    const int head_keys = static_cast<int>(((16u - misaligned) & 15u) >> 2);
    const int head = head_keys < m ? head_keys : m;
    const int vecs = (m - head) >> 2;
    const int body_end = head + 4 * vecs;
    if (g < head) hist_count(counts, to_ord(keys[g], fmask));
    if (g < m - body_end) hist_count(counts, to_ord(keys[body_end + g], fmask));
    const uint4* const xv = reinterpret_cast<const uint4*>(keys + head);
    int v = g;
    for (; v + (kHistVecs - 1) * step < vecs; v += kHistVecs * step) {
      uint4 q[kHistVecs];
#pragma unroll
      for (int u = 0; u < kHistVecs; ++u) q[u] = __ldg(xv + v + u * step);
#pragma unroll
      for (int u = 0; u < kHistVecs; ++u) {
        hist_count(counts, to_ord(q[u].x, fmask));
        hist_count(counts, to_ord(q[u].y, fmask));
        hist_count(counts, to_ord(q[u].z, fmask));
        hist_count(counts, to_ord(q[u].w, fmask));
      }
    }
    for (; v < vecs; v += step) {
      const uint4 q = __ldg(xv + v);
      hist_count(counts, to_ord(q.x, fmask));
      hist_count(counts, to_ord(q.y, fmask));
      hist_count(counts, to_ord(q.z, fmask));
      hist_count(counts, to_ord(q.w, fmask));
    }
#endif
    __syncthreads();
    unsigned int* const row_hist = hist + row * kHistBins;
    for (int i = g; i < kHistBins; i += step) {
      unsigned int c = 0;
#pragma unroll
      for (int copy = 0; copy < kHistCopies; ++copy) c += s_hist[i * kHistCopies + copy];
      if (c) atomicAdd(&row_hist[i], c);
    }
    __syncthreads();  // the counts are read before the next item clears them
  }
}
#else
// Zeroes the histograms (passes x radix words), the per-pass tile counters and look-back buffer
// 0 (tiles x radix words). Block kAuxBlock (256), grid (any).
extern "C" __global__ void __launch_bounds__(KATO_NS::kAuxBlock)
    radix_init(unsigned int* __restrict__ hist, unsigned int* __restrict__ counters,
               unsigned int* __restrict__ status, long long n) {
  using namespace KATO_NS;
  const long long words = tiles_of(n) * kRadix;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (long long i = first; i < words; i += stride) status[i] = 0u;
  for (long long i = first; i < kPasses * kRadix; i += stride) hist[i] = 0u;
  if (first < kPasses) counters[first] = 0u;
}

// Every pass's digit counts of the n input keys: hist[p * radix + d]. Block kAuxBlock (256),
// grid (any, grid stride); per-block counts in shared memory, then one atomic per nonzero bin.
#if HIST == 0
extern "C" __global__ void __launch_bounds__(KATO_NS::kAuxBlock)
    radix_histogram(const unsigned int* __restrict__ x, long long n,
                    unsigned int* __restrict__ hist, int key_float) {
  using namespace KATO_NS;
  __shared__ unsigned int s_hist[kPasses * kRadix];
  for (int i = threadIdx.x; i < kPasses * kRadix; i += blockDim.x) s_hist[i] = 0u;
  __syncthreads();
  const unsigned int fmask = float_mask(key_float);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const unsigned int key = to_ord(x[i], fmask);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      atomicAdd(&s_hist[p * kRadix + digit_of(key, p * RADIX_BITS)], 1u);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kPasses * kRadix; i += blockDim.x) {
    if (s_hist[i]) atomicAdd(&hist[i], s_hist[i]);
  }
}
#else
namespace KATO_NS {
// HIST 1 and 2: copies of the block histogram (HIST 2: lane l counts in copy l % 4, so lanes
// of a warp whose keys share a digit mostly add to different words) interleaved, bin b's
// copies in words b * kHistCopies ..: the copies of a bin sit in different banks.
constexpr int kHistCopies = HIST == 2 ? 4 : 1;
constexpr int kHistBins = kPasses * kRadix;
// 16-byte vectors a thread loads per step, all issued before any is counted: 64 bytes in
// flight per thread (the scalar kernel had 4, and waited for each).
constexpr int kHistVecs = 4;
static_assert(kHistBins * kHistCopies * 4 <= 48 * 1024, "the histogram copies exceed 48 KiB");

__device__ __forceinline__ void hist_count(unsigned int* counts, unsigned int key) {
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    atomicAdd(&counts[(p * kRadix + digit_of(key, p * RADIX_BITS)) * kHistCopies], 1u);
  }
}
}  // namespace KATO_NS

extern "C" __global__ void __launch_bounds__(KATO_NS::kAuxBlock)
    radix_histogram(const unsigned int* __restrict__ x, long long n,
                    unsigned int* __restrict__ hist, int key_float) {
  using namespace KATO_NS;
  __shared__ __align__(16) unsigned int s_hist[kHistBins * kHistCopies];
  for (int i = threadIdx.x; i < kHistBins * kHistCopies; i += blockDim.x) s_hist[i] = 0u;
  __syncthreads();
  const unsigned int fmask = float_mask(key_float);
  unsigned int* const counts = s_hist + threadIdx.x % kHistCopies;
  const long long threads = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  // x is 4-byte aligned: the keys before its first 16-byte boundary (0..3, the head), the
  // whole vectors, and the keys after them (0..3, the tail) go one each to the grid's first
  // threads.
  const unsigned int misaligned =
      static_cast<unsigned int>(reinterpret_cast<unsigned long long>(x)) & 15u;
  const long long head_keys = static_cast<long long>(((16u - misaligned) & 15u) >> 2);
  const long long head = head_keys < n ? head_keys : n;
  const long long vecs = (n - head) >> 2;
  const long long body_end = head + 4 * vecs;
  if (g < head) hist_count(counts, to_ord(x[g], fmask));
  if (g < n - body_end) hist_count(counts, to_ord(x[body_end + g], fmask));
  const uint4* const xv = reinterpret_cast<const uint4*>(x + head);
  long long v = g;
  for (; v + (kHistVecs - 1) * threads < vecs; v += kHistVecs * threads) {
    uint4 q[kHistVecs];
#pragma unroll
    for (int u = 0; u < kHistVecs; ++u) q[u] = __ldg(xv + v + u * threads);
#pragma unroll
    for (int u = 0; u < kHistVecs; ++u) {
      hist_count(counts, to_ord(q[u].x, fmask));
      hist_count(counts, to_ord(q[u].y, fmask));
      hist_count(counts, to_ord(q[u].z, fmask));
      hist_count(counts, to_ord(q[u].w, fmask));
    }
  }
  for (; v < vecs; v += threads) {
    const uint4 q = __ldg(xv + v);
    hist_count(counts, to_ord(q.x, fmask));
    hist_count(counts, to_ord(q.y, fmask));
    hist_count(counts, to_ord(q.z, fmask));
    hist_count(counts, to_ord(q.w, fmask));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kHistBins; i += blockDim.x) {
    unsigned int c = 0;
#pragma unroll
    for (int k = 0; k < kHistCopies; ++k) c += s_hist[i * kHistCopies + k];
    if (c) atomicAdd(&hist[i], c);
  }
}
#endif
#endif  // SEGMENTED

// One digit pass: keys_in (the input keys on pass 0, mapped to ordered form as they are read)
// scattered stably by digit `pass` into keys_out (mapped back on the last pass), values with
// them. Block BLOCK, grid exactly ceil(n / T) (every tile id is taken once), dynamic shared
// memory SMEM_WORDS * 4 bytes. status holds the two look-back buffers of tiles x radix words.
// SEGMENTED: n is the row length, the grid exactly rows * ceil(n / T), the buffers rows * tiles
// x radix words each, hist a histogram per row.
extern "C" __global__ void KATO_LAUNCH_BOUNDS radix_pass(const unsigned int* __restrict__ keys_in,
                                                         unsigned int* __restrict__ keys_out,
#if PAIRS
                                                         const int* __restrict__ vals_in,
                                                         int* __restrict__ vals_out,
#endif
                                                         long long n,
#if SEGMENTED
                                                         long long rows,
#endif
                                                         const unsigned int* __restrict__ hist,
                                                         unsigned int* __restrict__ counters,
                                                         unsigned int* __restrict__ status,
                                                         int pass, int key_float) {
  using namespace KATO_NS;
  extern __shared__ __align__(16) unsigned int kato_smem[];
  unsigned int* const s_keys = kato_smem + kSmemKeys;
  unsigned int* const s_warp = kato_smem + kSmemWarp;
  unsigned int* const s_count = kato_smem + kSmemCount;
  unsigned int* const s_start = kato_smem + kSmemStart;
  unsigned int* const s_global = kato_smem + kSmemGlobal;
  unsigned int* const s_base = kato_smem + kSmemBase;
#if PAIRS
  int* const s_vals = reinterpret_cast<int*>(kato_smem + kSmemVals);
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const unsigned int fmask = float_mask(key_float);
  const int shift = pass * RADIX_BITS;
  const bool first_pass = pass == 0;
  const bool last_pass = pass == kPasses - 1;
  const long long tiles = tiles_of(n);

  if (tid == 0) kato_smem[kSmemTile] = atomicAdd(&counters[pass], 1u);
  for (int i = tid; i < kWarps * kRadix; i += BLOCK) s_warp[i] = 0u;
#if RANK == 2
  for (int i = tid; i < kMatchWords; i += BLOCK) s_keys[i] = 0u;
#endif
  __syncthreads();
#if SEGMENTED
  // The block's tile of all rows -> its row and its tile in the row; the row's keys, histogram
  // and look-back words, from which on the row is sorted as one array of n keys. A 32-bit
  // division (rows * tiles < 2^31: radix.py checks it): the 64-bit one made ptxas spill the keys
  // of some tile shapes (512 x 20, 1024 x 16 with RANK 1).
  const unsigned int row_tiles = static_cast<unsigned int>(tiles);
  const unsigned int row32 = kato_smem[kSmemTile] / row_tiles;
  const long long row = row32;
  const long long tile = kato_smem[kSmemTile] - row32 * row_tiles;
  const long long tile_first = tile * kTile;
  keys_in += row * n;
  keys_out += row * n;
  hist += row * (kPasses * kRadix);
  unsigned int* const status_now = status + ((pass & 1) * rows + row) * tiles * kRadix;
  unsigned int* const status_next = status + (((pass + 1) & 1) * rows + row) * tiles * kRadix;
#else
  const long long tile = kato_smem[kSmemTile];
  const long long tile_first = tile * kTile;
  unsigned int* const status_now = status + (pass & 1) * tiles * kRadix;
  unsigned int* const status_next = status + ((pass + 1) & 1) * tiles * kRadix;
#endif

  // Load: warp w holds keys w*32*ITEMS .. of the tile, item i of lane l is key i*32 + l of
  // the warp's run, so ranking items in order i = 0, 1, .. and lanes in order keeps the tile's
  // key order (stability).
  const long long warp_first = tile_first + warp * kWarpKeys;
  // Keys of the warp's run that exist (0 .. 32 * ITEMS): the bounds checks in 32 bits.
  const long long warp_left = n - warp_first;
  const int warp_valid =
      warp_left <= 0 ? 0 : (warp_left < kWarpKeys ? static_cast<int>(warp_left) : kWarpKeys);
  unsigned int keys[ITEMS];
  unsigned int rank[ITEMS];
#if PAIRS
  int vals[ITEMS];
#endif
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int at = i * 32 + lane;
    unsigned int key = 0xffffffffu;
#if PAIRS
    vals[i] = 0;
#endif
    if (at < warp_valid) {
      key = keys_in[warp_first + at];
      if (first_pass) key = to_ord(key, fmask);
#if PAIRS
      vals[i] = vals_in[warp_first + at];
#endif
    }
    keys[i] = key;
  }

  // Rank within the warp: lanes with the same digit find each other (their peers mask: by
  // match.any, RANK 0; by a vote per digit bit, RANK 1; by ORs into a shared word, RANK 2), the
  // lowest of them bumps the warp's counter for that digit. Keys past n never count among a
  // valid key's peers (RANK 0: they take the digit kRadix and match only each other) and
  // touch no counter.
  unsigned int* const warp_count = s_warp + warp * kRadix;
  const unsigned int lanes_below = (1u << lane) - 1u;
#if RANK == 0
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const bool valid = i * 32 + lane < warp_valid;
    const unsigned int d = valid ? digit_of(keys[i], shift) : static_cast<unsigned int>(kRadix);
    const unsigned int peers = __match_any_sync(0xffffffffu, d);
    const unsigned int before = peers & lanes_below;
    const unsigned int base = valid ? warp_count[d] : 0u;
    __syncwarp();
    if (valid && before == 0) warp_count[d] = base + __popc(peers);
    __syncwarp();
    rank[i] = base + __popc(before);
  }
#elif RANK == 1
  // Peers from votes, every item's first (independent of the counters, so the votes of many
  // items are in flight at once), kept in rank[] until the counter updates below. Of the lanes
  // that hold a key of item i (lanes 0 .. warp_valid - 32 i - 1: keys past n never match), those
  // that agree with this lane on every digit bit. A lane past n votes with its padding key and
  // gets peers it never uses.
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int held = warp_valid - i * 32;
    unsigned int peers = held >= 32 ? 0xffffffffu : (held > 0 ? (1u << held) - 1u : 0u);
    const unsigned int d = digit_of(keys[i], shift);
#pragma unroll
    for (int b = 0; b < RADIX_BITS; ++b) {
      const unsigned int bit = (d >> b) & 1u;
      // The lanes whose bit b is this lane's: the vote, or its complement for a 0 bit.
      peers &= __ballot_sync(0xffffffffu, bit) ^ (bit - 1u);
    }
    rank[i] = peers;
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const bool valid = i * 32 + lane < warp_valid;
    const unsigned int d = digit_of(keys[i], shift);
    const unsigned int peers = rank[i];
    const unsigned int before = peers & lanes_below;
    const unsigned int base = valid ? warp_count[d] : 0u;
    __syncwarp();
    if (valid && before == 0) warp_count[d] = base + __popc(peers);
    __syncwarp();
    rank[i] = base + __popc(before);
  }
#else
  // Peers from shared words: every lane with a key ORs its bit into its digit's word and reads
  // the word back; the lowest peer clears it with its counter update. Items alternate between
  // two buffers of words (zeroed above), so one __syncwarp after the ORs and one after the
  // reads order everything: the clears and counter updates of item i come before item i + 1's
  // first __syncwarp, hence before its counter reads and before item i + 2's ORs into the
  // same buffer. Lanes past n touch no word.
  unsigned int* const warp_match = s_keys + warp * kRadix;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const bool valid = i * 32 + lane < warp_valid;
    const unsigned int d = digit_of(keys[i], shift);
    unsigned int* const match = warp_match + (i & 1) * kWarps * kRadix + d;
    if (valid) atomicOr(match, 1u << lane);
    __syncwarp();
    const unsigned int peers = valid ? *match : 0u;
    const unsigned int before = peers & lanes_below;
    const unsigned int base = valid ? warp_count[d] : 0u;
    __syncwarp();
    if (valid && before == 0) {
      warp_count[d] = base + __popc(peers);
      *match = 0u;
    }
    rank[i] = base + __popc(before);
  }
#endif
  __syncthreads();

  // Per digit: warp counters -> exclusive offsets over warps, the tile's count published.
  for (int d = tid; d < kRadix; d += BLOCK) {
    unsigned int run = 0;
#pragma unroll 4
    for (int w = 0; w < kWarps; ++w) {
      const unsigned int c = s_warp[w * kRadix + d];
      s_warp[w * kRadix + d] = run;
      run += c;
    }
    s_count[d] = run;
    store_status(&status_now[tile * kRadix + d], (tile == 0 ? kFlagPrefix : kFlagCount) | run);
    if (pass + 1 < kPasses) status_next[tile * kRadix + d] = 0u;
  }
  __syncthreads();
  if (warp == 0) warp_exclusive_scan(s_count, s_start);          // digit starts in the tile
  if (warp == 1) warp_exclusive_scan(hist + pass * kRadix, s_global);  // digit starts overall
  __syncthreads();

  // Keys (and values) into shared memory in digit order, stable. Done before the look-back so
  // that the keys' registers are free while it polls (and its predecessors get more time).
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (i * 32 + lane < warp_valid) {
      const unsigned int d = digit_of(keys[i], shift);
      const unsigned int pos = s_start[d] + warp_count[d] + rank[i];
      s_keys[pos] = keys[i];
#if PAIRS
      s_vals[pos] = vals[i];
#endif
    }
  }

  // Look-back: the count of each digit in tiles 0 .. tile-1.
  for (int d = tid; d < kRadix; d += BLOCK) {
    unsigned int before = 0;
    if (tile > 0) {
      long long j = tile - 1;
      // Bounded: a predecessor that never publishes is a bug, and giving up beats hanging the
      // GPU. The result is then wrong (the scatter's bounds check keeps it inside the output),
      // so verification fails the config.
      unsigned int flag, polls = 0;
      do {
        const unsigned int s = load_status(&status_now[j * kRadix + d]);
        flag = s & ~kValueMask;
        if (flag != 0u) before += s & kValueMask;
        if (flag == kFlagCount) --j;
      } while (flag != kFlagPrefix && ++polls < kSpinLimit);
      store_status(&status_now[tile * kRadix + d], kFlagPrefix | (before + s_count[d]));
    }
    // Key k of digit d at position j of the tile's digit-ordered keys goes to
    // global start of d + keys of d in earlier tiles + (j - start of d in the tile); modulo
    // 2^32, which is exact since every position is below 2^30.
    s_base[d] = s_global[d] + before - s_start[d];
  }
  __syncthreads();

  // Scatter: consecutive positions of one digit go to consecutive addresses.
  const long long left = n - tile_first;
  const int count = left < kTile ? static_cast<int>(left) : kTile;
  const unsigned int n32 = static_cast<unsigned int>(n);  // n < 2^30
  for (int j = tid; j < count; j += BLOCK) {
    const unsigned int key = s_keys[j];
    const unsigned int pos = s_base[digit_of(key, shift)] + static_cast<unsigned int>(j);
    if (pos >= n32) continue;  // only after a look-back that gave up (never when correct)
    keys_out[pos] = last_pass ? from_ord(key, fmask) : key;
#if PAIRS
    vals_out[pos] = s_vals[j];
#endif
  }
}
