// What the two cross-entropy templates (cross_entropy, cross_entropy_backward) share: rows split
// into SPLIT column chunks, each a work item of its own row group, and exp of a logit relative
// to a row's max or lse. A fragment included inside the template's `namespace KATO_NS { ... }`
// after kato_rows.cuh:
//   SPLIT  chunks per row, a power of two in [1, 64] (1 unless rendered).
// No include guard and inlined by OperatorSpec.render, as kato_vec.cuh says.

#ifndef SPLIT
#define SPLIT 1
#endif
static_assert(SPLIT >= 1 && SPLIT <= 64 && (SPLIT & (SPLIT - 1)) == 0,
              "SPLIT must be a power of two in [1, 64]");

constexpr float kLog2e = 1.4426950408889634f;

// exp(x - m) as exp2 of the difference taken first: x - m is exact for nearby values, so a large
// common offset (logits around 100) costs no accuracy.
__device__ __forceinline__ float exp_from(float x, float m) { return exp2f((x - m) * kLog2e); }

// Column range [c0, c1) of chunk `chunk` of a row of cols: chunks of ceil(cols / SPLIT) columns
// rounded up to a multiple of 8 (trailing chunks may be short or empty).
__device__ __forceinline__ void chunk_range(int chunk, int cols, int& c0, int& c1) {
  if (SPLIT == 1) {
    c0 = 0;
    c1 = cols;
    return;
  }
  const int per = ((cols + SPLIT - 1) / SPLIT + 7) & ~7;
  const long long lo = static_cast<long long>(chunk) * per;
  const long long hi = lo + per;
  c0 = lo < cols ? static_cast<int>(lo) : cols;
  c1 = hi < cols ? static_cast<int>(hi) : cols;
}
