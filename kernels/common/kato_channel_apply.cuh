// The elementwise pass of batchnorm and batchnorm_backward (y, or dx, from the channel's
// coefficients): its macros and checks, and these templates' KATO_LAUNCH_BOUNDS. A fragment
// included inside the template's `namespace KATO_NS { ... }` right after kato_channel.cuh:
//   APPLY      0: the pass is its own kernel; 1: the block that finished the channel runs it;
//   APPLY_VEC  elements per vector of the pass (VEC unless rendered);
//   APPLY_PLANE_SPLIT  1 (rendered only where HW % APPLY_VEC != 0): the pass covers each plane
//              with kato_plane.cuh's slots; 0, the default: HW / APPLY_VEC whole vectors a plane.
// No include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

#ifndef APPLY
#define APPLY 0
#endif
#ifndef APPLY_VEC
#define APPLY_VEC VEC
#endif
#ifndef APPLY_PLANE_SPLIT
#define APPLY_PLANE_SPLIT 0
#endif

[[maybe_unused]] constexpr int kApplyBytes = APPLY_VEC * static_cast<int>(sizeof(T));

static_assert(APPLY_VEC == 1 || APPLY_VEC == 2 || APPLY_VEC == 4 || APPLY_VEC == 8,
              "APPLY_VEC must be 1, 2, 4 or 8");
static_assert(kApplyBytes <= 16, "a vector must be at most 16 bytes");
static_assert(APPLY == 0 || APPLY == 1, "APPLY must be 0 or 1");

// Without MIN_BLOCKS, one resident block is promised explicitly: with __launch_bounds__(B) alone
// ptxas may aim at two (64 registers for B = 512) and spill.
#if MIN_BLOCKS > 0
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)
#else
#define KATO_LAUNCH_BOUNDS __launch_bounds__(BLOCK_SIZE, 1)
#endif
