"""The sort kernels run on the CPU (tests/kernels/cuda_emulation.py): every code path on
awkward shapes, outputs compared exactly with the references as the GPU verifier does."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from cuda_emulation import Case, cuda_include_dir, run_cases
from kato.kernels import get_operator

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include_dir() is None,
    reason="needs g++ and the CUDA headers next to nvcc",
)

SORT = get_operator("sort")
SORT_1D = get_operator("sort_1d")


def emulated_cases() -> list[Case]:
    """Rows: every ITEMS x WARP_SHFL, one and several rows per block, row lengths 1 .. 2048 with
    tails, a capped grid (the row-group loop). 1-D: C = 256/512 with FUSE 1..3 and n from 1 to
    several global merges, n not a power of two."""
    cases = []
    row_shapes = [(3, 1), (5, 2), (4, 3), (3, 31), (5, 33), (3, 200), (2, 513), (2, 1000)]
    row_shapes += [(2, 2048)]
    for dtype in ("float32", "int32"):
        n = 0
        for items in (1, 2, 4, 8):
            for shfl in (0, 1):
                for shape in row_shapes[n % 3 :: 3] + [row_shapes[(n * 5) % len(row_shapes)]]:
                    block = 64 if items >= 8 else 128
                    config = {
                        "BLOCK": block,
                        "ITEMS": items,
                        "WARP_SHFL": shfl,
                        "SMEM_FUSE": 1 + (len(cases) % 2),
                        # Rows up to MAX_ROW are bitonic; the radix rows are
                        # test_sort_rows_radix_emulation.py's.
                        "ALGO": "bitonic",
                        "RADIX_BITS": SORT.params["RADIX_BITS"][0],
                        "RANK": SORT.params["RANK"][0],
                        "HIST": SORT.params["HIST"][0],
                    }
                    if SORT.check(config, shape, dtype) is None:
                        cases.append(Case(SORT, config, shape, dtype, 2 if n % 2 else None))
                n += 1
        if dtype == "float32":
            cases.append(Case(SORT, SORT.default_config((3, 2048), dtype), (3, 2048), dtype))
        for n_keys, fuse, shfl, items in (
            (1, 3, 1, 4),
            (7, 1, 0, 2),
            (256, 2, 1, 4),
            (513, 1, 1, 4),
            (1100, 3, 1, 2),
            (2500, 2, 1, 2),
            (3001, 2, 0, 4),
            (4500, 3, 1, 4),
        ):
            config = {
                "BLOCK": 128,
                "ITEMS": items,
                "WARP_SHFL": shfl,
                "FUSE": fuse,
                "SMEM_FUSE": 1 + (n_keys % 2),
                # The radix path is test_sort_radix_emulation.py's; RADIX_BITS, RANK and HIST
                # are then fixed.
                "ALGO": "bitonic",
                "RADIX_BITS": SORT_1D.params["RADIX_BITS"][0],
                "RANK": SORT_1D.params["RANK"][0],
                "HIST": SORT_1D.params["HIST"][0],
            }
            cases.append(
                Case(SORT_1D, config, (n_keys,), dtype, grid_cap=3 if n_keys % 2 else None)
            )
    return cases


def test_kernel_logic_on_the_cpu(tmp_path: Path) -> None:
    cases = emulated_cases()
    covered = {(c.spec.name, c.dtype, c.config["ITEMS"], c.config["WARP_SHFL"]) for c in cases}
    assert len([k for k in covered if k[0] == "sort"]) == 2 * 4 * 2
    fused = {(c.spec.name, c.config["SMEM_FUSE"]) for c in cases}
    assert len(fused) == 4
    for case in cases:
        assert case.spec.check(case.config, case.shape, case.dtype) is None, case
    failures = run_cases(cases, tmp_path, np.random.default_rng(11), binaries=2)
    assert not failures, "\n".join(failures)
