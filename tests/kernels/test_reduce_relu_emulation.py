"""reduce_sum, reduce_sum_all and relu run on the CPU: the real templates, every step of
``spec.steps()`` with its grid and block, through tests/kernels/cuda_emulation.py (one fiber per
CUDA thread, barriers for __syncthreads and warp collectives).

This module adds what these kernels use on top of that harness's emulation: ``__ballot_sync``,
``__syncthreads_or``, ``atomicAdd`` (float and unsigned), ``__threadfence`` and ``__ldcg``.
Grids are capped at a few blocks, so grid-stride loops, the grid-level finishes (two-phase,
atomic, last block done), tails (n % VEC, n % 32), idle lanes in partial warps and rows past
the end all run. The relu mask is compared exactly with ``pack_mask`` for MASK=1.
"""

from __future__ import annotations

import shutil

import cuda_emulation
import numpy as np
import pytest
from cuda_emulation import Case, cuda_include_dir, run_cases
from kato.kernels import DTYPES, get_operator
from kato.kernels.relu import ReluSpec, pack_mask

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include_dir() is None, reason="needs g++ and CUDA headers"
)

EXTRA = r"""
#include <atomic>
#include <mutex>
inline unsigned __ballot_sync(unsigned, int pred) {
  const unsigned lane = lane_id();
  this_warp->lanes[lane] = pred ? 1ull : 0ull;
  this_warp->sync.arrive_and_wait();
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (this_warp->lanes[l] ? 1u : 0u) << l;
  this_warp->sync.arrive_and_wait();
  return r;
}
inline std::atomic<int> emu_or_flag{0};
inline int __syncthreads_or(int p) {
  __syncthreads();
  if (p) emu_or_flag.store(1);
  __syncthreads();
  const int r = emu_or_flag.load();
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) emu_or_flag.store(0);
  return r;
}
inline std::mutex emu_atomic_mutex;
inline float atomicAdd(float* p, float v) {
  std::lock_guard<std::mutex> lock(emu_atomic_mutex);
  const float old = *p; *p = old + v; return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  std::lock_guard<std::mutex> lock(emu_atomic_mutex);
  const unsigned old = *p; *p = old + v; return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class V> inline V __ldcg(const V* p) { return *p; }
"""


class ReluWithMask(ReluSpec):
    """relu whose problems also check the mask words (for MASK=1 cases only)."""

    def make_problem(self, shape, dtype, rng):
        p = super().make_problem(shape, dtype, rng)
        p.outputs.append(3)
        p.references.append(pack_mask(p.args[0].astype(np.float64) > 0))
        return p


def _vecs(dtype):
    return [v for v in (1, 2, 4, 8) if v * DTYPES[dtype][2] <= 16]


def reduce_sum_all_cases() -> list[Case]:
    spec = get_operator("reduce_sum_all")
    cases, k = [], 0
    for dtype in spec.dtypes:
        for n in (1, 7, 33, 1000, 65537):
            for finish in (0, 1, 2):
                vecs = [v for v in spec.params["VEC"] if v * DTYPES[dtype][2] <= 16]
                config = {
                    "BLOCK_SIZE": spec.params["BLOCK_SIZE"][k % 4],
                    "VEC": vecs[k % len(vecs)],
                    "UNROLL": spec.params["UNROLL"][k % 3],
                    "BLOCKS_PER_SM": 1,
                    "FINISH": finish,
                }
                cases.append(Case(spec, config, (n,), dtype, grid_cap=1 + k % 3))
                k += 1
    return cases


#: reduce_sum's row lengths: aligned and odd, rows of a few elements (the case of 1, 2 and 4
#: threads per row, issue 31) with odd row counts, and long ones.
REDUCE_SUM_SHAPES = (
    (1, 1),
    (3, 7),
    (37, 8),
    (5, 40),
    (33, 3),
    (67, 5),
    (19, 31),
    (9, 136),
    (2, 4104),
    (5, 4097),
    (4, 13),
)


def reduce_sum_cases() -> list[Case]:
    """Every row strategy (every ROW_THREADS) at aligned and odd row lengths (every VEC: rows
    off a vector boundary have a scalar head and tail, which a group smaller than VEC takes in
    turns; every other such case with x shifted off a 16-byte boundary), and split rows: with
    the grid capped (a block does several pieces), and one case at the spec's own grid (a block
    per piece, 66 pieces a row)."""
    spec = get_operator("reduce_sum")
    cases, k = [], 0
    for dtype in spec.dtypes:
        for shape in REDUCE_SUM_SHAPES:
            for row_threads in spec.params["ROW_THREADS"]:
                vecs = _vecs(dtype)
                config = {
                    "BLOCK_SIZE": spec.params["BLOCK_SIZE"][k % 4] if row_threads else 128 << k % 3,
                    "ROW_THREADS": row_threads,
                    "VEC": vecs[k % len(vecs)],
                    "UNROLL": spec.params["UNROLL"][k % 3],
                    "SPLIT": 0,
                }
                offset = (1 + k % 3) * (k % 2) if shape[1] % config["VEC"] else 0
                cases.append(Case(spec, config, shape, dtype, grid_cap=1 + k % 2, offset=offset))
                k += 1
        for shape, vec, cap in (((1, 17001), 1, 3), ((2, 70011), 4, 5), ((3, 36864), 2, 7)):
            vec = min(vec, 16 // DTYPES[dtype][2])
            config = {"BLOCK_SIZE": 128, "ROW_THREADS": 0, "VEC": vec, "UNROLL": 2, "SPLIT": 1}
            assert spec.check(config, shape, dtype) is None
            cases.append(Case(spec, config, shape, dtype, grid_cap=cap))
    config = {"BLOCK_SIZE": 128, "ROW_THREADS": 0, "VEC": 2, "UNROLL": 2, "SPLIT": 1}
    cases.append(Case(spec, config, (2, 17001), "float16"))
    return cases


def relu_cases() -> list[Case]:
    spec = ReluWithMask()
    plain = get_operator("relu")
    cases, k = [], 0
    for dtype in spec.dtypes:
        for n in (1, 33, 1000, 4099):
            for mask in (0, 1):
                for vec in _vecs(dtype):
                    config = {
                        "MASK": mask,
                        "BLOCK_SIZE": spec.params["BLOCK_SIZE"][k % 2],
                        "VEC": vec,
                        "UNROLL": spec.params["UNROLL"][k % 4],
                        "BLOCKS_PER_SM": 2,
                    }
                    cases.append(
                        Case(spec if mask else plain, config, (n,), dtype, grid_cap=1 + k % 2)
                    )
                    k += 1
    return cases


@pytest.fixture
def extra_header(monkeypatch):
    monkeypatch.setattr(cuda_emulation, "HEADER", cuda_emulation.HEADER + EXTRA)


@pytest.mark.parametrize(
    "make_cases", [reduce_sum_all_cases, reduce_sum_cases, relu_cases], ids=lambda f: f.__name__
)
def test_kernels_on_the_cpu(make_cases, extra_header, tmp_path) -> None:
    cases = make_cases()
    failures = run_cases(cases, tmp_path, np.random.default_rng(7))
    assert not failures, "\n".join(failures[:10])


# --- the numpy models are the kernels' exact arithmetic ----------------------------------------


def _run_emulated(cases, problems, workdir):
    """Build one program for ``cases`` and return every case's arrays after its steps."""
    import subprocess

    include = cuda_include_dir()
    (workdir / "emu.cpp").write_text(cuda_emulation.emulation_source(cases, problems))
    returncode, err = cuda_emulation.HostBuild(workdir, "emu.cpp", "emu", include).wait(900)
    assert returncode == 0, err[:3000]
    results = []
    for i, problem in enumerate(problems):
        data = workdir / f"exact{i}"
        data.mkdir()
        for k, a in enumerate(problem.args):
            if isinstance(a, np.ndarray):
                a.tofile(data / f"a{k}.bin")
        subprocess.run([str(workdir / "emu"), str(i), str(data)], check=True, timeout=600)
        results.append(
            [
                np.fromfile(data / f"a{k}.bin", dtype=a.dtype).reshape(a.shape)
                if isinstance(a, np.ndarray)
                else a
                for k, a in enumerate(problem.args)
            ]
        )
    return results


def test_summation_models_match_the_kernels_bit_for_bit(extra_header, tmp_path) -> None:
    """The emulated kernels (the templates' own float32 arithmetic, no FMA to contract) equal
    ``summation_model`` / ``row_sum_model`` exactly: the GPU tests' exact comparisons rest on it."""
    from kato.kernels.reduce_sum import row_sum_model
    from kato.kernels.reduce_sum_all import summation_model

    rsa, rs = get_operator("reduce_sum_all"), get_operator("reduce_sum")
    rng = np.random.default_rng(11)
    cases = [
        Case(
            rsa,
            {"BLOCK_SIZE": 128, "VEC": 4, "UNROLL": 2, "BLOCKS_PER_SM": 1, "FINISH": 0},
            (20011,),
            "float32",
            grid_cap=3,
        ),
        Case(
            rsa,
            {"BLOCK_SIZE": 256, "VEC": 8, "UNROLL": 4, "BLOCKS_PER_SM": 1, "FINISH": 2},
            (70001,),
            "bfloat16",
            grid_cap=2,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 0, "VEC": 2, "UNROLL": 8, "SPLIT": 0},
            (3, 5002),
            "float16",
            grid_cap=2,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 8, "VEC": 4, "UNROLL": 2, "SPLIT": 0},
            (37, 1000),
            "float32",
            grid_cap=1,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 256, "ROW_THREADS": 32, "VEC": 1, "UNROLL": 4, "SPLIT": 0},
            (9, 3001),
            "bfloat16",
            grid_cap=1,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 8, "VEC": 8, "UNROLL": 2, "SPLIT": 0},
            (11, 1003),
            "float16",
            grid_cap=2,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 256, "ROW_THREADS": 0, "VEC": 4, "UNROLL": 4, "SPLIT": 0},
            (3, 5001),
            "float32",
            grid_cap=2,
        ),
        # Fewer threads per row than a vector's elements: the edges taken in turns.
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 1, "VEC": 4, "UNROLL": 8, "SPLIT": 0},
            (41, 7),
            "float32",
            grid_cap=1,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 2, "VEC": 8, "UNROLL": 2, "SPLIT": 0},
            (23, 37),
            "bfloat16",
            grid_cap=1,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 256, "ROW_THREADS": 4, "VEC": 8, "UNROLL": 4, "SPLIT": 0},
            (13, 29),
            "float16",
            grid_cap=2,
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 0, "VEC": 4, "UNROLL": 2, "SPLIT": 1},
            (3, 70001),
            "float32",
            grid_cap=7,  # 2 pieces a row (the kernel's parts = grid // rows)
        ),
        Case(
            rs,
            {"BLOCK_SIZE": 128, "ROW_THREADS": 0, "VEC": 2, "UNROLL": 2, "SPLIT": 1},
            (2, 17001),
            "float16",  # the spec's grid: 66 pieces a row
        ),
    ]
    problems = [c.spec.make_problem(c.shape, c.dtype, rng) for c in cases]
    results = _run_emulated(cases, problems, tmp_path)
    for case, problem, got in zip(cases, problems, results, strict=True):
        x = problem.args[0]
        if case.spec is rsa:
            grid = min(rsa.grid(case.config, case.shape), case.grid_cap)
            assert got[1][0] == summation_model(x, case.config, grid), case
        else:
            rows = case.shape[0]
            grid = rs.launch(case.config, case.shape, case.dtype).grid[0]
            parts = max(1, min(grid, case.grid_cap or grid) // rows) if case.config["SPLIT"] else 1
            expected = row_sum_model(x, case.config, parts=parts)
            np.testing.assert_array_equal(got[1], expected, err_msg=str(case))
