"""Every valid sort and sort_1d variant compiles for sm_80 and sm_90 with the resources the specs
model; and the kernels, run on the CPU, sort awkward shapes exactly.

Sources do not depend on the shape: the valid configs of ``sort`` at one row of a single key
are every row-kernel variant there is (~100 per key type), those of ``sort_1d`` at any n every
1-D variant (FUSE only changes the launch sequence: ~44 sources per key type).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from compile_harness import Outcome, compile_variants, distinct_variants
from cuda_emulation import Case, cuda_include_dir, run_cases

from kernels import get_operator
from kernels.sort import register_cap
from tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SORT = get_operator("sort")
SORT_1D = get_operator("sort_1d")
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_80,sm_90").split(","))
BLOCK_KERNELS = ("sort_rows_kernel", "sort_1d_block", "sort_1d_merge")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    # One row of one key admits every row-kernel config (the sources ignore the shape).
    variants = distinct_variants(SORT, [((1, 1), d) for d in SORT.dtypes])
    variants += distinct_variants(SORT_1D, [((2**24,), d) for d in SORT_1D.dtypes])
    start = time.perf_counter()
    found = compile_variants(variants, ARCHS, tmp_path_factory.mktemp("cubins"), batch=24)
    print(
        f"\n{len(variants)} sort variants x {len(ARCHS)} archs in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return found


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    assert len(outcomes) == 2 * (80 + 48) * len(ARCHS)
    failed = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error]
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:5])


def test_resources_match_the_model(outcomes: list[Outcome]) -> None:
    """Block kernels: registers within the launch bounds and no spills (check() rejects ITEMS
    that would not fit), no static shared memory (the buffer is dynamic); global passes: no
    spills within their 256-thread bounds."""
    bad = []
    for o in outcomes:
        if o.error:
            continue
        config = o.variant.config
        for name, res in o.resources.items():
            cap = register_cap(config) if name in BLOCK_KERNELS else 255
            if not 1 <= res.registers <= cap:
                bad.append(f"{o.arch} {o.variant} {name}: {res.registers} regs > {cap}")
            if res.spill_bytes or res.local_bytes:
                bad.append(f"{o.arch} {o.variant} {name}: {res.spill_bytes} B spilled")
            if res.shared_static_bytes:
                bad.append(f"{o.arch} {o.variant} {name}: {res.shared_static_bytes} B static")
    assert not bad, "\n".join(bad[:10])


# --- the kernels on the CPU ---------------------------------------------------------------------


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
            }
            cases.append(
                Case(SORT_1D, config, (n_keys,), dtype, grid_cap=3 if n_keys % 2 else None)
            )
    return cases


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_kernel_logic_on_the_cpu(tmp_path: Path) -> None:
    if cuda_include_dir() is None:
        pytest.skip("CUDA headers not found next to nvcc")
    cases = emulated_cases()
    covered = {(c.spec.name, c.dtype, c.config["ITEMS"], c.config["WARP_SHFL"]) for c in cases}
    assert len([k for k in covered if k[0] == "sort"]) == 2 * 4 * 2
    fused = {(c.spec.name, c.config["SMEM_FUSE"]) for c in cases}
    assert len(fused) == 4
    for case in cases:
        assert case.spec.check(case.config, case.shape, case.dtype) is None, case
    failures = run_cases(cases, tmp_path, np.random.default_rng(11), binaries=2)
    assert not failures, "\n".join(failures)
