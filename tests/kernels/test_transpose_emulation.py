"""The transpose kernels run on the CPU (tests/kernels/cuda_emulation.py): every code path on
awkward shapes, outputs compared exactly with the references as the GPU verifier does."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import cuda_emulation
import numpy as np
import pytest
from cuda_emulation import Case, cuda_include_dir, run_cases
from kato.kernels import DTYPES, get_operator
from kato.kernels.transpose import aligned

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include_dir() is None,
    reason="needs g++ and the CUDA headers next to nvcc",
)

SPEC = get_operator("transpose")


def with_checked_stores(cases: list[Case]) -> list[Case]:
    """``cases``, each of HINTS 1 or 2 followed by its HINTS 0 twin. The emulation checks the
    address of every ``__stcs`` (alignment, and the arrays' bounds with ``Case.bounds``), but
    the plain stores of HINTS 1 and 2 are assignments here; the twin stores to the same
    addresses (test_transpose_compile: the accesses differ only in their qualifiers) through
    the checked ``__stcs``."""
    out = []
    for case in cases:
        out.append(case)
        if case.config["HINTS"]:
            config = {**case.config, "HINTS": 0}
            out.append(dataclasses.replace(case, config=config))
    return out


def emulated_cases() -> list[Case]:
    """Every dtype x tile x layout, the widest vectors the shape allows, tails on both sides,
    1 x N and N x 1, capped grids (the tile loop's grid stride), and each cache hint (with
    :func:`with_checked_stores`)."""
    cases = []
    shapes = {"float32": [(40, 72), (1, 36), (33, 1)], "float16": [(48, 24), (8, 120), (17, 3)]}
    shapes["bfloat16"] = [(24, 104), (1, 7), (70, 2)]
    configs = [
        (32, 4, 4, 1),
        (32, 8, 4, 2),
        (16, 2, 2, 0),
        (64, 4, 8, 2),
        (64, 2, 8, 1),
        (32, 1, 8, 2),
        (16, 1, 1, 1),
        (64, 8, 2, 0),
        (32, 2, 1, 1),
    ]
    for dtype, dtype_shapes in shapes.items():
        for n, (tile, vec, rpt, smem) in enumerate(configs):
            config = {"TILE": tile, "VEC": vec, "RPT": rpt, "SMEM": smem, "MIN_BLOCKS": 0}
            config["HINTS"], config["SKEW"] = n % 3, 0
            for shape in dtype_shapes:
                if SPEC.check(config, shape, dtype) is None:
                    cases.append(Case(SPEC, config, shape, dtype, grid_cap=3 if n % 2 else None))
                    break
        for shape in dtype_shapes:
            cases.append(Case(SPEC, SPEC.default_config(shape, dtype), shape, dtype))
    return with_checked_stores(cases)


def test_kernel_logic_on_the_cpu(tmp_path: Path) -> None:
    cases = emulated_cases()
    assert len({(c.dtype, c.config["SMEM"], c.config["TILE"]) for c in cases}) >= 18
    assert {c.config["HINTS"] for c in cases} == {0, 1, 2}
    failures = run_cases(cases, tmp_path, np.random.default_rng(7))
    assert not failures, "\n".join(failures)


#: Shapes no vector width divides: odd x odd, primes, 1 x n and n x 1, sizes just past a tile
#: of 16, 32 and 64, and one side aligned with the other not (each path's offsets on one side).
SPLIT_SHAPES = [
    (37, 53),
    (31, 67),
    (1, 37),
    (41, 1),
    (33, 65),
    (65, 17),
    (17, 19),
    (40, 37),
    (37, 40),
    (3, 5),
]

#: (TILE, VEC, RPT, SMEM) with VEC 2, 4 and 8 over every tile and layout.
SPLIT_CONFIGS = [
    (32, 4, 4, 1),
    (64, 2, 8, 2),
    (16, 2, 2, 0),
    (32, 8, 4, 2),
    (64, 4, 4, 1),
    (16, 4, 1, 2),
    (64, 8, 8, 0),
    (32, 2, 1, 1),
    (16, 8, 1, 1),
    (64, 4, 2, 0),
]


def split_cases() -> list[Case]:
    """Every dtype x split config on a shape no VEC divides (cycling through SPLIT_SHAPES),
    arrays shifted by 0 to 3 elements from a 16-byte boundary (the offsets come from the
    addresses), capped grids, global accesses checked against the arrays' bounds (the stores
    of HINTS 1 and 2 through their HINTS 0 twins: :func:`with_checked_stores`); then the
    default config of every split shape."""
    cases = []
    for d, dtype in enumerate(("float32", "float16", "bfloat16")):
        for n, (tile, vec, rpt, smem) in enumerate(SPLIT_CONFIGS):
            config = {"TILE": tile, "VEC": vec, "RPT": rpt, "SMEM": smem, "MIN_BLOCKS": 0}
            config["HINTS"], config["SKEW"] = (n + d) % 3, 0
            for m in range(len(SPLIT_SHAPES)):
                shape = SPLIT_SHAPES[(n + 3 * d + m) % len(SPLIT_SHAPES)]
                if SPEC.check(config, shape, dtype) is None and not aligned(config, shape):
                    offset, cap = (n + d) % 4, 2 if n % 3 == 0 else None
                    cases.append(Case(SPEC, config, shape, dtype, cap, offset, bounds=True))
                    break
        for shape in SPLIT_SHAPES[d::3]:
            config = SPEC.default_config(shape, dtype)
            cases.append(Case(SPEC, config, shape, dtype, offset=d, bounds=True))
    return with_checked_stores(cases)


def test_split_rows_on_the_cpu(tmp_path: Path) -> None:
    """Shapes whose rows are not whole vectors, at every vector width: exact transposes, no
    access outside x and y, none misaligned."""
    cases = split_cases()
    split = [c for c in cases if not aligned(c.config, c.shape)]
    for dtype in ("float32", "float16", "bfloat16"):
        widths = {c.config["VEC"] for c in split if c.dtype == dtype}
        assert widths == ({2, 4} if dtype == "float32" else {2, 4, 8}), (dtype, widths)
        shapes = {c.shape for c in split if c.dtype == dtype}
        assert len(shapes) >= 6, (dtype, shapes)
    assert {c.offset for c in split} == {0, 1, 2, 3}
    assert {c.config["HINTS"] for c in split} == {0, 1, 2}
    failures = run_cases(cases, tmp_path, np.random.default_rng(11))
    assert not failures, "\n".join(failures)


#: Shapes for SKEW=1 (output rows of ``rows`` elements start mid sector): odd and prime sides,
#: rows under a sector (3, 5, 7 and, for 2-byte elements, 9 and 15), 1 x N and N x 1, sizes
#: just past a tile of 16, 32 and 64 (several tile rows: the slices of interior tiles), and
#: even sizes no sector divides.
SKEW_SHAPES = [
    (37, 53),
    (3, 5),
    (1, 37),
    (41, 1),
    (65, 17),
    (129, 7),
    (7, 40),
    (33, 65),
    (15, 33),
    (17, 19),
    (100, 36),
    (9, 70),
]

#: (TILE, VEC, RPT, SMEM) with SKEW=1: every tile, layout and vector width (VEC=1 too).
SKEW_CONFIGS = [
    (32, 4, 4, 1),
    (64, 2, 8, 2),
    (16, 2, 2, 0),
    (32, 8, 4, 2),
    (64, 4, 4, 1),
    (16, 1, 2, 1),
    (64, 8, 8, 0),
    (32, 1, 8, 2),
    (16, 8, 1, 1),
    (64, 1, 4, 1),
    (16, 4, 1, 2),
]


def skew_cases() -> list[Case]:
    """Every dtype x SKEW config on shapes where it is valid (cycling through SKEW_SHAPES), the
    arrays shifted by 0 to 3 elements from a 16-byte boundary (the sector offsets come from
    y's address), capped grids, accesses checked against the arrays' bounds and alignment (the
    stores of HINTS 1 and 2 through their HINTS 0 twins)."""
    cases = []
    for d, dtype in enumerate(("float32", "float16", "bfloat16")):
        for n, (tile, vec, rpt, smem) in enumerate(SKEW_CONFIGS):
            config = {"TILE": tile, "VEC": vec, "RPT": rpt, "SMEM": smem, "MIN_BLOCKS": 0}
            config["HINTS"], config["SKEW"] = (n + d) % 3, 1
            taken = 0
            for m in range(len(SKEW_SHAPES)):
                shape = SKEW_SHAPES[(2 * n + 5 * d + m) % len(SKEW_SHAPES)]
                if SPEC.check(config, shape, dtype) is None:
                    offset, cap = (n + d + taken) % 4, 2 if (n + taken) % 3 == 0 else None
                    cases.append(Case(SPEC, config, shape, dtype, cap, offset, bounds=True))
                    taken += 1
                    if taken == 2:
                        break
    return with_checked_stores(cases)


def test_skewed_tiles_on_the_cpu(tmp_path: Path) -> None:
    """SKEW=1: exact transposes on awkward shapes at every vector width and dtype, no access
    outside x and y, none misaligned."""
    cases = skew_cases()
    for dtype in ("float32", "float16", "bfloat16"):
        mine = [c for c in cases if c.dtype == dtype]
        widths = {c.config["VEC"] for c in mine}
        assert widths == ({1, 2, 4} if dtype == "float32" else {1, 2, 4, 8}), (dtype, widths)
        shapes = {c.shape for c in mine}
        assert len(shapes) >= 8, (dtype, shapes)
        assert any(c.shape[0] < 32 // DTYPES[dtype][2] for c in mine), dtype  # rows < V
        # One tile row, two, and three or more (interior slices: neither row end).
        assert {0, 1, 2} <= {min(c.shape[0] // c.config["TILE"], 2) for c in mine}, dtype
    assert {c.shape for c in cases} >= {(1, 37), (41, 1), (3, 5), (129, 7)}
    assert {c.offset for c in cases} == {0, 1, 2, 3}
    assert {c.config["HINTS"] for c in cases} == {0, 1, 2}
    assert {c.config["TILE"] for c in cases} == {16, 32, 64}
    assert {c.config["SMEM"] for c in cases} == {0, 1, 2}
    assert any(c.grid_cap for c in cases)
    failures = run_cases(cases, tmp_path, np.random.default_rng(13))
    assert not failures, "\n".join(failures)


#: ``__stcs`` of the emulation, and the same store also logged (address, bytes, block) to the
#: file named by ``KATO_EMU_STORE_LOG``.
CHECKED_STORE = (
    "template <class V> inline void __stcs(V* p, V v) { *const_cast<V*>(emu_aligned(p)) = v; }"
)
LOGGED_STORE = r"""
const char* emu_store_path = std::getenv("KATO_EMU_STORE_LOG");
FILE* emu_store_log = emu_store_path ? std::fopen(emu_store_path, "w") : nullptr;
template <class V> inline void __stcs(V* p, V v) {
  *const_cast<V*>(emu_aligned(p)) = v;
  if (emu_store_log) {
    std::fprintf(emu_store_log, "%llu %u %u\n", (unsigned long long)(uintptr_t)p,
                 (unsigned)sizeof(V), blockIdx.x);
  }
}
"""


def logged_stores(cases: list[Case], workdir: Path) -> list[np.ndarray]:
    """Runs ``cases`` (HINTS 0: every store is an ``__stcs``) and returns, per case, its stores
    as rows (address, bytes, block), after checking its output."""
    assert cuda_emulation.HEADER.count(CHECKED_STORE) == 1
    header = cuda_emulation.HEADER.replace(CHECKED_STORE, LOGGED_STORE)
    rng = np.random.default_rng(17)
    problems = [c.spec.make_problem(c.shape, c.dtype, rng) for c in cases]
    source = cuda_emulation.emulation_source(cases, problems).replace(cuda_emulation.HEADER, header)
    (workdir / "logged.cpp").write_text(source)
    include = cuda_include_dir()
    returncode, err = cuda_emulation.HostBuild(workdir, "logged.cpp", "logged", include).wait()
    assert returncode == 0, err[:3000]
    logs = []
    for i, (case, problem) in enumerate(zip(cases, problems, strict=True)):
        data = workdir / f"logged{i}"
        data.mkdir()
        for k, a in enumerate(problem.args):
            if isinstance(a, np.ndarray):
                a.tofile(data / f"a{k}.bin")
        env = {**os.environ, "KATO_EMU_STORE_LOG": str(data / "stores.txt")}
        run = [str(workdir / "logged"), str(i), str(data)]
        subprocess.run(run, check=True, timeout=600, env=env)
        y = problem.args[1]
        got = np.fromfile(data / "a1.bin", dtype=y.dtype).reshape(y.shape)
        np.testing.assert_array_equal(got.astype(np.float64), problem.references[0], str(case))
        logs.append(np.loadtxt(data / "stores.txt", dtype=np.uint64, ndmin=2))
    return logs


def sector_faults(case: Case, stores: np.ndarray) -> tuple[list[int], list[int]]:
    """The 32-byte sectors of y that are written by two blocks (tiles), and those written in
    stores narrower than a vector, among the sectors holding no output row's first or last
    element (the sectors a row shares with its neighbours). Checks that every element of y is
    stored exactly once."""
    rows, cols = case.shape
    itemsize = DTYPES[case.dtype][2]
    base = int(stores[:, 0].min())  # y[0][0]: every element is stored
    count = np.zeros(rows * cols, np.int64)
    owner: dict[int, set[int]] = {}
    narrow: set[int] = set()
    for address, size, block in stores.tolist():
        first = (address - base) // itemsize
        count[first : first + size // itemsize] += 1
        for sector in range(address // 32, (address + size - 1) // 32 + 1):
            owner.setdefault(sector, set()).add(block)
            if size < case.config["VEC"] * itemsize:
                narrow.add(sector)
    assert (count == 1).all(), f"{case}: elements stored {set(count.tolist())} times"
    ends = np.concatenate([np.arange(cols) * rows, np.arange(cols) * rows + rows - 1])
    shared = {(base + int(e) * itemsize) // 32 for e in ends}
    two = sorted(s for s, blocks in owner.items() if len(blocks) > 1 and s not in shared)
    return two, sorted(narrow - shared)


#: Shapes of several tile rows and columns whose output rows start mid sector, and configs of
#: the widest and of narrower vectors (HINTS 0: every store through the logged __stcs).
OWNERSHIP = [
    ("float32", (133, 75), (32, 4, 4, 1)),
    ("float32", (150, 33), (64, 1, 4, 1)),
    ("float32", (77, 40), (16, 2, 2, 2)),
    ("float16", (131, 40), (32, 8, 4, 2)),
    ("bfloat16", (200, 9), (64, 2, 8, 0)),
    ("float16", (70, 21), (16, 4, 1, 1)),
]


def test_skewed_tiles_write_whole_sectors(tmp_path: Path) -> None:
    """The point of SKEW=1 (issue 31): inside an output row, every 32-byte sector is written by
    one block (tile) alone, in whole aligned vectors; only the sectors holding a row's first or
    last element are shared. SKEW=0 on the same shapes splits sectors at tile edges between
    two blocks (and, where output rows are not whole vectors, writes the vectors at tile edges
    element by element): the check finds them."""
    cases = []
    for n, (dtype, shape, (tile, vec, rpt, smem)) in enumerate(OWNERSHIP):
        for skew in (1, 0):
            config = {"TILE": tile, "VEC": vec, "RPT": rpt, "SMEM": smem, "MIN_BLOCKS": 0}
            config["HINTS"], config["SKEW"] = 0, skew
            assert SPEC.check(config, shape, dtype) is None, (config, shape, dtype)
            cases.append(Case(SPEC, config, shape, dtype, offset=n % 4))
    for case, stores in zip(cases, logged_stores(cases, tmp_path), strict=True):
        two, narrow = sector_faults(case, stores)
        if case.config["SKEW"]:
            assert not two and not narrow, (str(case), two[:5], narrow[:5])
        else:
            assert two, str(case)
            # Output rows that are not whole vectors: the split path's heads and tails.
            assert bool(narrow) == (case.shape[0] % case.config["VEC"] != 0), str(case)
