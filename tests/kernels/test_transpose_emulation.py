"""The transpose kernels run on the CPU (tests/kernels/cuda_emulation.py): every code path on
awkward shapes, outputs compared exactly with the references as the GPU verifier does."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from cuda_emulation import Case, cuda_include_dir, run_cases
from kato.kernels import get_operator
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
