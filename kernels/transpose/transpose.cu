// Transpose of a row-major (rows, cols) matrix x into the row-major (cols, rows) matrix y,
// through a TILE x TILE tile in shared memory. Tunables arrive as macros (see
// kernels/transpose/__init__.py for the parameter space and its constraints):
//
//   TILE        tile edge in elements (16, 32, 64)
//   VEC         elements per global vector load/store (a vector is at most 16 bytes)
//   RPT         vectors each thread loads (and stores) per tile: the block is
//               (TILE / VEC) x (TILE / RPT) threads
//   SMEM        shared-memory layout: 0 plain, 1 one padding word per tile row, 2 XOR swizzle
//   MIN_BLOCKS  min-blocks clause of __launch_bounds__ (0 = none; with SKEW 1, one block)
//   HINTS       cache hints of the global loads and stores (issue 31): 0 streaming both
//               (__ldcs / __stcs: evict-first), 1 streaming loads and plain write-back stores,
//               2 plain both (read-only __ldg loads, default L2 eviction; write-back stores).
//               Where rows start mid 32-byte sector, the sector at a tile boundary is written
//               half by one block and half by its neighbour; the hypothesis 1 and 2 test:
//               evict-first writes it back half valid before the other half arrives.
//   SKEW        1: output-aligned ("skewed") tiles, for output rows that start mid 32-byte
//               sector (rows * element bytes no multiple of 32; issue 31). 0 (the default):
//               the program compiled before SKEW existed. Below.
// Derived macro (the spec computes it):
//   ALIGNED     0 where rows % VEC != 0 or cols % VEC != 0 (issue 31): input and output rows
//               start at offsets from a vector boundary that vary by row, so each tile row is
//               read as the aligned vectors covering it (one more vector where it is
//               misaligned, elements outside the tile or the matrix dropped) and written as its
//               whole aligned vectors with an element-by-element head and tail. 1 (the
//               default): every vector is aligned, and the program is the one compiled before
//               ALIGNED existed. SKEW 1 renders ALIGNED 0 on every shape.
//
// SKEW 1: with the tiles above, where output rows start mid sector, every 32-byte sector at a
// tile's edge in the output is written partly by one block and partly by its neighbour, in
// stores split at the sector boundary. SKEW 1 moves each output row's tile boundaries onto
// sector boundaries of the flat output array instead: with s = (address of y[c][0] in elements)
// mod V (V = elements per 32-byte sector, 8 or 16), the block of tile row r0 writes output
// columns [r0 - s, r0 + TILE - s) of output row c, clipped to [0, rows), the last tile row on
// to rows. These slices partition every output row, each sector inside a row is written whole
// by one block in aligned vectors, and only the sectors holding a row's end and the next row's
// start are shared. The block loads input rows r0 - (V - 1) .. r0 + TILE - 1 (V - 1 "halo" rows
// above the tile; they are also the tile above's rows) as the split path loads rows, into a
// shared tile of TILE + V - 1 rows of single elements. Interior tiles (not in the first or last
// tile row or the last tile column) need no bounds checks; the others (a few percent of a large
// matrix) are read element by element in a second loop over the tiles.
//
// Shared memory holds 32-bit words ("units") for 4-byte elements and, for 2-byte elements with
// VEC >= 2, packed pairs: the unit at (p, c) is (x[2p][c], x[2p+1][c]), a 2x2 sub-block already
// transposed in registers with __byte_perm. One unit is then two consecutive elements of the
// output row c, so both the global loads and the global stores are vectors and every shared
// memory access is a 32-bit word. 2-byte elements with VEC == 1 or ALIGNED 0 keep single
// 16-bit units (E == 1): pairs need rows r and r+1 at the same offset from a vector boundary.
//
// Preconditions (kernels.transpose.TransposeSpec.check enforces the static part): ALIGNED 1
// needs rows % VEC == 0 and cols % VEC == 0 (every vector is aligned and entirely inside or
// outside the matrix), RPT % E == 0, x and y aligned to VEC elements (cudaMalloc gives 256
// bytes); ALIGNED 0 needs x and y aligned to one element only (offsets come from the addresses),
// and so does SKEW 1 (any shape is correct; the spec offers it where rows start mid sector).
//
// Tiles are numbered row-major over the (ceil(rows/TILE), ceil(cols/TILE)) tile grid and the
// 1-D grid loops over them with a grid stride, so any grid size is correct (no grid.y limit).

#ifndef KATO_NS
#define KATO_NS kato_transpose
#endif
#ifndef TILE
#error "TILE must be defined"
#endif
#ifndef VEC
#error "VEC must be defined"
#endif
#ifndef RPT
#error "RPT must be defined"
#endif
#ifndef SMEM
#define SMEM 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#ifndef ELEM_BYTES
#define ELEM_BYTES 4
#endif
#ifndef ALIGNED
#define ALIGNED 1
#endif
#ifndef HINTS
#define HINTS 0
#endif
#ifndef SKEW
#define SKEW 0
#endif
#if SKEW && ALIGNED
#error "SKEW 1 takes every offset from the addresses: render it with ALIGNED 0"
#endif
#if HINTS < 0 || HINTS > 2
#error "HINTS must be 0, 1 or 2"
#endif

// Every global load and store goes through these: HINTS 0 expands to the intrinsics the kernel
// always used, so its program is unchanged.
#if HINTS == 2
#define KATO_LOAD(p) __ldg(p)
#else
#define KATO_LOAD(p) __ldcs(p)
#endif
#if HINTS == 0
#define KATO_STORE(p, v) __stcs(p, v)
#else
#define KATO_STORE(p, v) KATO_NS::store_plain(p, v)
#endif

// Only bits move: elements are handled as unsigned integers of their size, so float16 and
// bfloat16 share one compiled kernel (and no CUDA half headers are needed).
#if ELEM_BYTES == 2
#define KATO_ELEM unsigned short
#else
#define KATO_ELEM unsigned int
#endif

namespace KATO_NS {

using T = KATO_ELEM;

constexpr int kElemBytes = static_cast<int>(sizeof(T));
// Elements per shared-memory unit: 2 when 2-byte elements are packed in pairs.
constexpr int kE = (kElemBytes == 2 && VEC >= 2 && ALIGNED) ? 2 : 1;
constexpr int kBX = TILE / VEC;                   // threads along a tile row (vectors per row)
constexpr int kBY = TILE / RPT;                   // thread rows
constexpr int kThreads = kBX * kBY;
#if SKEW
constexpr int kV = 32 / kElemBytes;               // elements of a 32-byte sector
constexpr int kHalo = kV - 1;                     // input rows above the tile (see the header)
constexpr int kUnitRows = TILE + kHalo;           // rows of the shared tile (single elements)
#else
constexpr int kUnitRows = TILE / kE;              // unit rows of the shared tile
#endif
constexpr int kPad = SMEM == 1 ? 1 : 0;
constexpr int kVecBytes = VEC * kElemBytes;
#if ALIGNED
constexpr int kUnitsPerVec = VEC / kE;            // units of one global vector
#endif

static_assert(TILE == 16 || TILE == 32 || TILE == 64, "TILE must be 16, 32 or 64");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector is at most 16 bytes");
static_assert(RPT >= 1 && TILE % RPT == 0 && TILE % VEC == 0, "RPT and VEC must divide TILE");
static_assert(RPT % kE == 0, "packed pairs need an even RPT");
static_assert(kThreads >= 32 && kThreads <= 1024, "32..1024 threads per block");
static_assert(SMEM >= 0 && SMEM <= 2, "SMEM must be 0, 1 or 2");
#if SKEW
static_assert(kV >= VEC && TILE % kV == 0, "vectors and tiles are whole within sectors");
static_assert(kE == 1, "SKEW 1 keeps single elements in shared memory");
// Tile rows each thread loads (RPT and the halo's share), and the rows whose misaligned edge
// vector it also moves (VEC 1 has none: its offsets are 0).
constexpr int kLoads = (kUnitRows + kBY - 1) / kBY;
constexpr int kEdges = (kUnitRows + kThreads - 1) / kThreads;
#elif !ALIGNED
static_assert(VEC > 1, "ALIGNED 0 is for rows that are not whole vectors");
// Rows of the tile whose misaligned edge vector each thread also moves (at most 2: 32+ threads).
constexpr int kEdges = (TILE + kThreads - 1) / kThreads;
#endif

// A shared-memory unit: a 32-bit word, or one 16-bit element (E == 1 with 2-byte elements).
template <int Bytes>
struct UnitOf;
template <>
struct UnitOf<2> { using type = unsigned short; };
template <>
struct UnitOf<4> { using type = unsigned int; };
using Unit = typename UnitOf<kE * kElemBytes>::type;

#include "../common/kato_vec.cuh"

#if HINTS != 0
// Plain (weak, write-back) global stores of one vector in one instruction, written as __stcs is
// but without .cs: an assignment lets the compiler split a vector assembled by memcpy into
// 32-bit stores, and __stwb's st.global.wb becomes a strong store (STG.E.STRONG.SM on sm_90).
// The CPU emulation (no __CUDA_ARCH__) assigns.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void store_plain(unsigned short* p, unsigned short v) {
  asm("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}
__device__ __forceinline__ void store_plain(unsigned int* p, unsigned int v) {
  asm("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_plain(uint2* p, uint2 v) {
  asm("st.global.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void store_plain(uint4* p, uint4 v) {
  asm("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
      : "memory");
}
#else
template <class V>
__device__ __forceinline__ void store_plain(V* p, V v) {
  *p = v;
}
#endif
#endif

// Physical column of unit (p, c) in the shared tile.
__device__ __forceinline__ int phys(int p, int c) {
#if SMEM == 2
  return c ^ (p & (TILE - 1));
#else
  (void)p;
  return c;
#endif
}

__device__ __forceinline__ unsigned int perm(unsigned int a, unsigned int b, unsigned int s) {
  return __byte_perm(a, b, s);
}

#if !ALIGNED
// The aligned vector x[a .. a + VEC) of which the elements at tile columns j0 + j in
// [0, lim) are needed: one vector load where it lies inside the matrix's n elements, else only
// the needed elements (never reading outside x).
__device__ __forceinline__ Raw load(const T* __restrict__ x, long long a, long long n, int j0,
                                    int lim) {
  Raw r;
  if (a >= 0 && a + VEC <= n) return KATO_LOAD(reinterpret_cast<const Raw*>(x + a));
  T e[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) e[j] = (j0 + j >= 0 && j0 + j < lim) ? KATO_LOAD(x + a + j) : T(0);
  __builtin_memcpy(&r, e, sizeof(Raw));
  return r;
}

// Writes the elements of vector v at tile columns j0 + j in [0, lim) into tile row p.
template <class Row>
__device__ __forceinline__ void put(Row& row, int p, const Raw& v, int j0, int lim) {
  Unit u[VEC];
  __builtin_memcpy(u, &v, sizeof(Raw));
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    if (j0 + j >= 0 && j0 + j < lim) row[phys(p, j0 + j)] = u[j];
  }
}

// Stores tile rows q .. q + VEC - 1 of tile column cl that lie in [0, lim) to out[q ..], one
// element at a time (a vector's head or tail outside the tile belongs to another block).
template <class Tile>
__device__ __forceinline__ void store_elements(T* out, Tile& tile, int cl, int q, int lim) {
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    if (q + m >= 0 && q + m < lim) KATO_STORE(out + q + m, tile[q + m][phys(q + m, cl)]);
  }
}

#if SKEW
// Elements from the Bytes-aligned address at or before p to p (Bytes a power of 2).
__device__ __forceinline__ int offset(const T* p, int bytes) {
  return static_cast<int>(reinterpret_cast<size_t>(p) & (bytes - 1)) / kElemBytes;
}

// The aligned vector holding *p.
__device__ __forceinline__ const Raw* vector_at(const T* p) {
  return reinterpret_cast<const Raw*>(reinterpret_cast<size_t>(p) & ~size_t(kVecBytes - 1));
}

// Whether the tile at (r0, c0) is neither in the first or last tile row nor in the last tile
// column: all of its rows, halo and columns are inside the matrix, and every aligned vector
// holding one of its elements is inside x (rows above and below, columns on the right).
__device__ __forceinline__ bool interior(long long r0, long long c0, int rows, int cols) {
  return r0 != 0 && r0 + TILE < rows && c0 + TILE < cols;
}

// Writes the elements of vector v at tile columns j0 + j >= 0 into tile row p (the others
// belong to the tile on the left; j0 + VEC <= TILE).
template <class Row>
__device__ __forceinline__ void put_from(Row& row, int p, const Raw& v, int j0) {
  Unit u[VEC];
  __builtin_memcpy(u, &v, sizeof(Raw));
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    if (j0 + j >= 0) row[phys(p, j0 + j)] = u[j];
  }
}

// Stores tile rows p .. p + VEC - 1 of tile column cl to the aligned vector at out.
template <class Tile>
__device__ __forceinline__ void store_vector(T* out, Tile& tile, int cl, int p) {
  Unit u[VEC];
#pragma unroll
  for (int m = 0; m < VEC; ++m) u[m] = tile[p + m][phys(p + m, cl)];
  Raw r;
  __builtin_memcpy(&r, u, sizeof(Raw));
  KATO_STORE(reinterpret_cast<Raw*>(out), r);
}

// Stores out[q .. q + VEC) (tile rows kHalo + q .. of tile column cl) where it lies in
// [lo, hi), lo >= -kHalo and hi <= TILE: one aligned vector where all of it does, else the
// elements that do, one by one.
template <class Tile>
__device__ __forceinline__ void store_slice(T* out, Tile& tile, int cl, int q, int lo, int hi) {
  Unit u[VEC];
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    const int p = kHalo + q + m;
    u[m] = q + m >= lo && q + m < hi ? tile[p][phys(p, cl)] : Unit(0);
  }
  if (q >= lo && q + VEC <= hi) {
    Raw r;
    __builtin_memcpy(&r, u, sizeof(Raw));
    KATO_STORE(reinterpret_cast<Raw*>(out + q), r);
  } else {
#pragma unroll
    for (int m = 0; m < VEC; ++m) {
      if (q + m >= lo && q + m < hi) KATO_STORE(out + q + m, u[m]);
    }
  }
}
#endif
#endif

}  // namespace KATO_NS

// SKEW 1 without MIN_BLOCKS declares one block: with no min-blocks clause ptxas picks an
// occupancy of its own and spilled a few bytes to reach it in about 2% of the SKEW 1 variants.
#if MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(KATO_NS::kThreads, MIN_BLOCKS)
#elif SKEW
#define KATO_LAUNCH_BOUNDS __launch_bounds__(KATO_NS::kThreads, 1)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(KATO_NS::kThreads)
#endif

// Block: (TILE / VEC, TILE / RPT, 1). Grid: (any, 1, 1); the kernel loops over the tiles.
extern "C" __global__ void KATO_LAUNCH_BOUNDS transpose_kernel(const KATO_ELEM* __restrict__ x,
                                                               KATO_ELEM* __restrict__ y, int rows,
                                                               int cols) {
  namespace kt = KATO_NS;
  using Unit = kt::Unit;
  using Raw = kt::Raw;
#if ALIGNED
  constexpr int E = kt::kE;
  constexpr int NU = kt::kUnitsPerVec;
#endif
  __shared__ __align__(16) Unit tile[kt::kUnitRows][TILE + kt::kPad];

  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const long long tiles_c = (cols + TILE - 1) / TILE;
  const long long tiles_r = (rows + TILE - 1) / TILE;
  const long long ntiles = tiles_r * tiles_c;
#if !ALIGNED
#if !SKEW
  const long long n = static_cast<long long>(rows) * cols;
  const long long xbase = static_cast<long long>(reinterpret_cast<size_t>(x) / sizeof(KATO_ELEM));
  const long long ybase = static_cast<long long>(reinterpret_cast<size_t>(y) / sizeof(KATO_ELEM));
#endif
  const int tid = ty * kt::kBX + tx;
#endif

  for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const long long r0 = (t / tiles_c) * TILE;  // first input row of the tile
    const long long c0 = (t % tiles_c) * TILE;  // first input column of the tile

#if ALIGNED
    // Load: thread (tx, ty) reads the vector at columns c0 + tx*VEC of E rows per unit row
    // p = ty + k * kBY; all loads are issued before any shared-memory store.
    const long long col = c0 + tx * VEC;
    Raw v[RPT];
#pragma unroll
    for (int k = 0; k < RPT / E; ++k) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const long long row = r0 + static_cast<long long>(ty + k * kt::kBY) * E + e;
        if (row < rows && col < cols) {
          v[k * E + e] = KATO_LOAD(reinterpret_cast<const Raw*>(x + row * cols + col));
        }
      }
    }
#pragma unroll
    for (int k = 0; k < RPT / E; ++k) {
      const int p = ty + k * kt::kBY;
      Unit u[VEC];
      if constexpr (E == 1) {
        __builtin_memcpy(u, &v[k], sizeof(Raw));
      } else {
        // Rows 2p (a) and 2p+1 (b): unit j = (a[j], b[j]), element pairs from 32-bit words.
        unsigned int a[NU], b[NU];
        __builtin_memcpy(a, &v[2 * k], sizeof(Raw));
        __builtin_memcpy(b, &v[2 * k + 1], sizeof(Raw));
#pragma unroll
        for (int m = 0; m < NU; ++m) {
          u[2 * m] = kt::perm(a[m], b[m], 0x5410);
          u[2 * m + 1] = kt::perm(a[m], b[m], 0x7632);
        }
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) tile[p][kt::phys(p, tx * VEC + j)] = u[j];
    }
    __syncthreads();

    // Store: output row c0 + cl (= input column), output columns r0 + tx*VEC .. + VEC - 1,
    // which are the units p = tx*NU .. tx*NU + NU - 1 of tile column cl.
    const long long out_col = r0 + tx * VEC;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int cl = ty + i * kt::kBY;
      const long long out_row = c0 + cl;
      Unit u[NU];
#pragma unroll
      for (int m = 0; m < NU; ++m) {
        const int p = tx * NU + m;
        u[m] = tile[p][kt::phys(p, cl)];
      }
      if (out_row < cols && out_col < rows) {
        Raw r;
        __builtin_memcpy(&r, u, sizeof(Raw));
        KATO_STORE(reinterpret_cast<Raw*>(y + out_row * rows + out_col), r);
      }
    }
#elif SKEW
    // Tile row p is input row r0 - kHalo + p (p < kUnitRows). Output row c0 + cl starts s
    // elements past a sector boundary; this block writes its columns r0 + q for q in
    // [-s, TILE - s) (the last tile row on to rows: at most s more, within one sector),
    // clipped to [0, rows). Here only interior tiles (block-uniform; the others after the loop):
    // every row and column inside the matrix and every aligned vector holding one of their
    // elements inside x, so the tile rows are read as the split path reads them (below) with
    // no bounds to check, and thread tx writes the whole aligned vector at q = tx*VEC - s.
    if (!kt::interior(r0, c0, rows, cols)) continue;
    // Row k of this thread is tile row ty + k*kBY, kBY rows of x further each; its offset from
    // a vector boundary (mis) comes from its address. Likewise output row i, kBY further each,
    // and its offset s from a sector boundary (r0 is a multiple of the sector).
    const KATO_ELEM* xr = x + (r0 - kt::kHalo + ty) * cols + c0;
    const long long xstep = static_cast<long long>(kt::kBY) * cols;
    Raw v[kt::kLoads];
#pragma unroll
    for (int k = 0; k < kt::kLoads; ++k) {
      if (ty + k * kt::kBY < kt::kUnitRows) v[k] = KATO_LOAD(kt::vector_at(xr + k * xstep) + tx);
    }
    Raw w[kt::kEdges];
#pragma unroll
    for (int k = 0; k < kt::kEdges; ++k) {
      const int p = tid + k * kt::kThreads;
      const KATO_ELEM* row = x + (r0 - kt::kHalo + p) * cols + c0;
      if (p < kt::kUnitRows && kt::offset(row, kt::kVecBytes) != 0) {
        w[k] = KATO_LOAD(kt::vector_at(row) + TILE / VEC);
      }
    }
#pragma unroll
    for (int k = 0; k < kt::kLoads; ++k) {
      const int p = ty + k * kt::kBY;
      const int mis = kt::offset(xr + k * xstep, kt::kVecBytes);
      if (p < kt::kUnitRows) kt::put_from(tile[p], p, v[k], tx * VEC - mis);
    }
#pragma unroll
    for (int k = 0; k < kt::kEdges; ++k) {
      const int p = tid + k * kt::kThreads;
      const int mis = kt::offset(x + (r0 - kt::kHalo + p) * cols + c0, kt::kVecBytes);
      if (p < kt::kUnitRows && mis != 0) kt::put(tile[p], p, w[k], TILE - mis, TILE);
    }
    __syncthreads();

    KATO_ELEM* const yr = y + (c0 + ty) * rows + r0;
    const long long ystep = static_cast<long long>(kt::kBY) * rows;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      KATO_ELEM* const row = yr + i * ystep;
      const int q = tx * VEC - kt::offset(row, 32);
      kt::store_vector(row + q, tile, ty + i * kt::kBY, kt::kHalo + q);
    }
#else
    // Load: tile row p is x[r0 + p][c0 .. c0 + lim_c), which starts `mis` elements past a
    // vector boundary; thread tx reads the aligned vector holding tile columns tx*VEC - mis ..
    // tx*VEC - mis + VEC - 1, and the vector after the last (tile columns TILE - mis ..) is an
    // edge, read by thread `tid` for tile rows tid, tid + kThreads, ...
    const int lim_r = static_cast<int>(rows - r0 < TILE ? rows - r0 : TILE);
    const int lim_c = static_cast<int>(cols - c0 < TILE ? cols - c0 : TILE);
    Raw v[RPT];
    int mis[RPT];
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
      const int p = ty + k * kt::kBY;
      const long long g = (r0 + p) * cols + c0;
      mis[k] = static_cast<int>((xbase + g) & (VEC - 1));
      if (p < lim_r && tx * VEC - mis[k] < lim_c) v[k] = kt::load(x, g - mis[k] + tx * VEC, n,
                                                                    tx * VEC - mis[k], lim_c);
    }
    Raw w[kt::kEdges];
    int wmis[kt::kEdges];
#pragma unroll
    for (int k = 0; k < kt::kEdges; ++k) {
      const int p = tid + k * kt::kThreads;
      const long long g = (r0 + p) * cols + c0;
      wmis[k] = static_cast<int>((xbase + g) & (VEC - 1));
      if (p < lim_r && wmis[k] != 0 && TILE - wmis[k] < lim_c) {
        w[k] = kt::load(x, g - wmis[k] + TILE, n, TILE - wmis[k], lim_c);
      }
    }
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
      const int p = ty + k * kt::kBY;
      if (p < lim_r) kt::put(tile[p], p, v[k], tx * VEC - mis[k], lim_c);
    }
#pragma unroll
    for (int k = 0; k < kt::kEdges; ++k) {
      const int p = tid + k * kt::kThreads;
      if (p < lim_r && wmis[k] != 0) kt::put(tile[p], p, w[k], TILE - wmis[k], lim_c);
    }
    __syncthreads();

    // Store: output row c0 + cl is y[c0 + cl][r0 .. r0 + lim_r), `ms` elements past a vector
    // boundary; thread tx writes the aligned vector holding tile rows tx*VEC - ms .., whole
    // where it lies inside the tile and the matrix, else element by element (never an element
    // of another tile), and the edge after the last as with the loads.
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int cl = ty + i * kt::kBY;
      const long long g = (c0 + cl) * rows + r0;
      const int ms = static_cast<int>((ybase + g) & (VEC - 1));
      const int q = tx * VEC - ms;  // tile row of the vector's first element
      if (cl < lim_c && q < lim_r) {
        if (q >= 0 && q + VEC <= lim_r) {
          Unit u[VEC];
#pragma unroll
          for (int m = 0; m < VEC; ++m) u[m] = tile[q + m][kt::phys(q + m, cl)];
          Raw r;
          __builtin_memcpy(&r, u, sizeof(Raw));
          KATO_STORE(reinterpret_cast<Raw*>(y + g + q), r);
        } else {
          kt::store_elements(y + g, tile, cl, q, lim_r);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kt::kEdges; ++k) {
      const int cl = tid + k * kt::kThreads;
      const long long g = (c0 + cl) * rows + r0;
      const int ms = static_cast<int>((ybase + g) & (VEC - 1));
      if (cl < lim_c && ms != 0 && TILE - ms < lim_r) {
        kt::store_elements(y + g, tile, cl, TILE - ms, lim_r);
      }
    }
#endif
    __syncthreads();  // the next tile overwrites the shared tile
  }
#if SKEW
  // The other tiles, in a loop of their own (one loop holding both paths kept the rare path's
  // values in registers through the common one): rows and columns clipped to the matrix, read
  // element by element; the slices' vectors written whole but at the output rows' ends.
  for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const long long r0 = (t / tiles_c) * TILE;
    const long long c0 = (t % tiles_c) * TILE;
    if (kt::interior(r0, c0, rows, cols)) continue;
    const int lim_c = static_cast<int>(cols - c0 < TILE ? cols - c0 : TILE);
    const int p_lo = r0 < kt::kHalo ? static_cast<int>(kt::kHalo - r0) : 0;
    const int p_hi = static_cast<int>(rows - r0 < TILE ? rows - r0 : TILE) + kt::kHalo;
    for (int e = tid; e < kt::kUnitRows * TILE; e += kt::kThreads) {
      const int p = e / TILE;
      const int j = e % TILE;
      if (p >= p_lo && p < p_hi && j < lim_c) {
        tile[p][kt::phys(p, j)] = KATO_LOAD(x + (r0 - kt::kHalo + p) * cols + c0 + j);
      }
    }
    __syncthreads();

    // Per output row, TILE / VEC vector slots, and kV / VEC more on the last tile row; the
    // slice's columns q are in [lo, hi).
    constexpr int kSlots = TILE / VEC + kt::kV / VEC;
    const int slots = r0 + TILE >= rows ? kSlots : TILE / VEC;
    const int lo = static_cast<int>(r0 < kt::kHalo ? -r0 : -kt::kHalo);
    const int hi = static_cast<int>(rows - r0 < TILE ? rows - r0 : TILE);
#pragma unroll 1
    for (int u = tid; u < TILE * kSlots; u += kt::kThreads) {
      const int cl = u / kSlots;
      const int slot = u % kSlots;
      if (cl < lim_c && slot < slots) {
        KATO_ELEM* const row = y + (c0 + cl) * rows + r0;
        kt::store_slice(row, tile, cl, slot * VEC - kt::offset(row, 32), lo, hi);
      }
    }
    __syncthreads();
  }
#endif
}
