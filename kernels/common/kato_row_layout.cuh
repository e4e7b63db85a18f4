// What every row-wise template shares before its own code (rows of a row-major (rows, cols)
// matrix, one row per group of lanes or per block): its tunable macros, checked or given their
// defaults, and how its threads share a row (the element type T, the bytes of a vector, the
// threads of a row group, its warps and lanes), with the checks every one of them makes.
// A fragment included first inside the template's `namespace KATO_NS { ... }` (before
// kato_vec.cuh, which uses T and kVecBytes), after kato_dtype.cuh and the template's own macros
// (CACHE, SPLIT, DW_ACC, ...) at file scope; the template's own constants and checks follow it.
//   VEC, ROW_THREADS  required (ROW_THREADS: 4, 8, 16 or 32 lanes of a warp, or 0); BLOCK_SIZE
//                too for ROW_THREADS 0 (the block is one row group);
//   LB_THREADS, LB_MIN_BLOCKS  __launch_bounds__ (BLOCK_SIZE and 0 unless rendered), which
//                the kernels take as KATO_LAUNCH_BOUNDS;
//   ITEMS, WB_REGS  the register cache's vectors per thread and weight-in-registers switch
//                (1 and 0 unless rendered; a template without CACHE 2 never reads them).
// The macros are directives, so they may stand inside the namespace: the preprocessor gives
// them no scope. No include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

#ifndef VEC
#error "VEC must be defined"
#endif
#ifndef ROW_THREADS
#error "ROW_THREADS must be defined"
#endif
#if ROW_THREADS == 0 && !defined(BLOCK_SIZE)
#error "BLOCK_SIZE must be defined for ROW_THREADS 0"
#endif
#ifndef LB_THREADS
#define LB_THREADS BLOCK_SIZE
#endif
#ifndef LB_MIN_BLOCKS
#define LB_MIN_BLOCKS 0
#endif
// The row kernels' __launch_bounds__ (a directive: it stands outside the namespace too).
#if LB_MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(LB_THREADS, LB_MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(LB_THREADS)
#endif
#ifndef ITEMS
#define ITEMS 1
#endif
#ifndef WB_REGS
#define WB_REGS 0
#endif

using T = DTYPE;
constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
#if ROW_THREADS == 0
constexpr int kThreadsPerRow = BLOCK_SIZE;
constexpr int kWarps = BLOCK_SIZE / 32;
static_assert(BLOCK_SIZE % 32 == 0 && BLOCK_SIZE >= 32 && BLOCK_SIZE <= 1024,
              "BLOCK_SIZE must be a multiple of 32 in [32, 1024]");
#else
constexpr int kThreadsPerRow = ROW_THREADS;
[[maybe_unused]] constexpr int kWarps = 1;
#endif
constexpr int kLanes = kThreadsPerRow < 32 ? kThreadsPerRow : 32;
[[maybe_unused]] constexpr int kRowsPerWarp = 32 / kLanes;

static_assert(LB_THREADS % 32 == 0 && LB_THREADS >= 32 && LB_THREADS <= 1024,
              "LB_THREADS must be a multiple of 32 in [32, 1024]");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector must be at most 16 bytes");
static_assert(ROW_THREADS == 0 || ROW_THREADS == 4 || ROW_THREADS == 8 || ROW_THREADS == 16 ||
                  ROW_THREADS == 32,
              "ROW_THREADS must be 0 (block), 4, 8, 16 or 32");
static_assert(kThreadsPerRow >= VEC, "head and tail need one thread per element");
