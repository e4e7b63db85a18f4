// How a thread of a row-wise kernel walks the rows (kato_row_layout.cuh's row groups: kLanes
// lanes of a warp, kRowsPerWarp rows per warp, or the whole block for ROW_THREADS 0): its index
// in its row group, its group's offset from each step's first row, the row groups of a block,
// and the grid-stride walk (first row, rows per step). Every row group of a warp steps together
// (rows past the end are empty rows that still join the shuffles). A fragment included inside
// the template's `namespace KATO_NS { ... }` after kato_row_layout.cuh; no include guard and
// inlined by OperatorSpec.render, as kato_vec.cuh says. The kernels take it apart with a
// structured binding: the same values as the locals they declared, the same code (sm_90 PTX;
// the norm backwards keep their own walk, as their register-cached configs compiled otherwise).

struct RowWalk {
  int t;             // this thread within its row group
  int group;         // its row group's offset from the step's first row
  int groups;        // row groups per block (1 in block mode)
  long long first;   // the walk's first row (of the warp's groups in warp mode)
  long long stride;  // rows per step of the walk
};

__device__ __forceinline__ RowWalk row_walk() {
  RowWalk w;
#if ROW_THREADS == 0
  w.t = threadIdx.x;
  w.group = 0;
  w.groups = 1;
  w.first = blockIdx.x;
  w.stride = gridDim.x;
#else
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  w.t = lane & (kLanes - 1);
  w.group = lane / kLanes;
  w.groups = static_cast<int>(blockDim.x) / kLanes;
  w.first = static_cast<long long>(blockIdx.x) * w.groups + warp * kRowsPerWarp;
  w.stride = static_cast<long long>(gridDim.x) * w.groups;
#endif
  return w;
}
