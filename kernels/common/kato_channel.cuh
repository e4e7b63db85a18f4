// What the per-channel templates of an NCHW tensor share before their own code (batchnorm_stats,
// batchnorm, batchnorm_backward: a channel's N * H * W elements split over SPLIT blocks): their
// tunable macros, checked or given their defaults, the element type T, the bytes of a vector,
// the warps of a block, and the checks every one of them makes.
// A fragment included first inside the template's `namespace KATO_NS { ... }` (before
// kato_vec.cuh, which uses T and kVecBytes), after kato_dtype.cuh at file scope:
//   BLOCK_SIZE, VEC  required: threads per block and elements per vector of the channel pass;
//   UNROLL           vectors each thread loads per step (4 unless rendered);
//   MIN_BLOCKS       __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS); 0 (unless rendered) = none;
//   PLANE_SPLIT      1 (rendered only where HW % VEC != 0): the channel pass covers each plane
//                    with kato_plane.cuh's slots (a scalar head and tail); 0, the default: every
//                    plane is HW / VEC whole vectors.
// The macros are directives, so they may stand inside the namespace: the preprocessor gives
// them no scope. No include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

#ifndef BLOCK_SIZE
#error "BLOCK_SIZE must be defined"
#endif
#ifndef VEC
#error "VEC must be defined"
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#ifndef PLANE_SPLIT
#define PLANE_SPLIT 0
#endif

using T = DTYPE;

[[maybe_unused]] constexpr int kVecBytes = VEC * static_cast<int>(sizeof(T));
[[maybe_unused]] constexpr int kWarps = BLOCK_SIZE / 32;
//: Threads per block of the finalize kernel (a warp per channel).
constexpr int kFinalizeThreads = 256;

static_assert(BLOCK_SIZE % 32 == 0 && BLOCK_SIZE >= 32 && BLOCK_SIZE <= 1024,
              "BLOCK_SIZE must be a multiple of 32 in [32, 1024]");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
static_assert(kVecBytes <= 16, "a vector must be at most 16 bytes");
static_assert(UNROLL >= 1 && UNROLL <= 8, "UNROLL must be in [1, 8]");
