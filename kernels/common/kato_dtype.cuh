// The element type macros every template with a DTYPE shares, given their defaults, and the
// CUDA headers of the 16-bit types they name. Included at file scope, before the template's
// `namespace KATO_NS { ... }`:
//   DTYPE              the element type (float unless rendered);
//   IS_HALF, IS_BF16   whether DTYPE may be __half / __nv_bfloat16: a source compiled on its own
//                      (neither defined) includes both headers, a rendered one only its own.
// No include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

#ifndef DTYPE
#define DTYPE float
#endif
#if !defined(IS_HALF) && !defined(IS_BF16)
#define IS_HALF 1
#define IS_BF16 1
#endif
#ifndef IS_HALF
#define IS_HALF 0
#endif
#ifndef IS_BF16
#define IS_BF16 0
#endif

#if IS_HALF
#include <cuda_fp16.h>
#endif
#if IS_BF16
#include <cuda_bf16.h>
#endif
