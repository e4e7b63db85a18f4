"""The transpose kernels run on the CPU (tests/kernels/cuda_emulation.py): every code path on
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

SPEC = get_operator("transpose")


def emulated_cases() -> list[Case]:
    """Every dtype x tile x layout, the widest vectors the shape allows, tails on both sides,
    1 x N and N x 1, and capped grids (the tile loop's grid stride)."""
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
            for shape in dtype_shapes:
                if SPEC.check(config, shape, dtype) is None:
                    cases.append(Case(SPEC, config, shape, dtype, grid_cap=3 if n % 2 else None))
                    break
        for shape in dtype_shapes:
            cases.append(Case(SPEC, SPEC.default_config(shape, dtype), shape, dtype))
    return cases


def test_kernel_logic_on_the_cpu(tmp_path: Path) -> None:
    cases = emulated_cases()
    assert len({(c.dtype, c.config["SMEM"], c.config["TILE"]) for c in cases}) >= 18
    failures = run_cases(cases, tmp_path, np.random.default_rng(7))
    assert not failures, "\n".join(failures)
