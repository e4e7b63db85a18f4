// The row cache of the row-wise templates that keep a row between their reduction and output
// passes: CACHE 0 streams it twice, 1 keeps its vectors in dynamic shared memory, 2 in
// registers (ITEMS vectors per thread and array). A fragment included inside the template's
// `namespace KATO_NS { ... }` after kato_row_layout.cuh (it checks that file's ITEMS); no
// include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.
//   CACHE  required.

#ifndef CACHE
#error "CACHE must be defined"
#endif
static_assert(CACHE >= 0 && CACHE <= 2, "CACHE must be 0, 1 or 2");
static_assert(CACHE != 2 || (ITEMS >= 1 && ITEMS <= 64), "CACHE 2 needs ITEMS in [1, 64]");
