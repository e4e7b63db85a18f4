// Shared device helpers of Kato's templates, part 1: the vector of VEC elements a thread moves
// as one load or store (2, 4, 8 or 16 bytes of raw bits: every width is one instruction). A
// fragment, not a standalone header: a template includes it inside its own
// `namespace KATO_NS { ... }`, after defining
//   T          the element type (float, __half, __nv_bfloat16, or any other);
//   kVecBytes  VEC * sizeof(T), the bytes of one vector.
// No include guard: a translation unit may hold several renamed copies of a template (KATO_NS
// differs, and so may VEC and T), each with its own copy of these helpers.
//
// OperatorSpec.render (kernels/spec.py) inlines the files of kernels/common in place of their
// `#include` lines, so a rendered source is self-contained (PyCUDA, nvcc, kato_torch, Kernel
// Tuner) and the operator's version hashes them. A template compiled as a file (nvcc
// kernels/<op>/<op>.cu) finds them by the relative path; a copy compiled elsewhere needs
// -I kernels/<op>, or render it instead.
//
// Each file holds what the templates held, in the same order, so that they compile to the same
// code: kato_vec.cuh (this), kato_convert.cuh (element types to and from float32, vectors to
// and from floats), kato_rows.cuh (row-wise helpers). Split along what the templates use, so a
// template includes only what it held and its translation unit stays the same token for token.

template <int Bytes>
struct RawOf;
template <>
struct RawOf<2> { using type = unsigned short; };
template <>
struct RawOf<4> { using type = unsigned int; };
template <>
struct RawOf<8> { using type = uint2; };
template <>
struct RawOf<16> { using type = uint4; };
using Raw = typename RawOf<kVecBytes>::type;
