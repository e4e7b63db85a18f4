"""float32 matmul's split-K clusters (``SPLIT_K`` on the CUDA-core path, sm_90): where the space
keeps them, what they launch and render. Their results are checked on the GPU
(tests/gpu/test_matmul_gpu.py) and their compiles by tests/kernels/test_matmul_compile.py."""

from __future__ import annotations

import math

import pytest
from kato.kernels import get_operator
from kato.kernels.matmul import (
    SPLIT_K_MAX_TILES,
    registers_needed,
    shared_bytes,
)
from test_matmul_spec import fp32_cfg

SPEC = get_operator("matmul")
TN = get_operator("matmul_tn")


def cfg(**kw):
    """A 64 x 128 float32 tile (8 x 8 per thread, 128 threads) that splits at small shapes."""
    return fp32_cfg(**{"BM": 64, "BN": 128, "BK": 16, "WM": 32, "WN": 64, **kw})


def test_split_configs_are_valid_only_where_tiles_are_few():
    # 1000 x 1001: 16 x 8 tiles of 64 x 128, under two waves; 4096^2: 2048 tiles, over.
    assert SPEC.check(cfg(SPLIT_K=2), (1000, 1001, 999), "float32") is None
    assert SPEC.check(cfg(SPLIT_K=4), (1000, 1001, 999), "float32") is None
    reason = SPEC.check(cfg(SPLIT_K=2), (4096, 4096, 4096), "float32")
    assert reason is not None and "two waves" in reason and "2048 tiles" in reason
    # the boundary: SPLIT_K_MAX_TILES tiles of 64 x 128 are refused, one fewer kept
    rows = SPLIT_K_MAX_TILES // 2 * 64
    assert SPEC.check(cfg(SPLIT_K=2), (rows, 256, 512), "float32") is not None
    assert SPEC.check(cfg(SPLIT_K=2), (rows - 64, 256, 512), "float32") is None


def test_every_cta_of_a_cluster_gets_a_k_tile():
    # K = 48 is 3 k tiles of 16: SPLIT_K 3 takes one each, 4 would leave a CTA without one
    assert SPEC.check(cfg(SPLIT_K=3), (100, 100, 48), "float32") is None
    reason = SPEC.check(cfg(SPLIT_K=4), (100, 100, 48), "float32")
    assert reason == "SPLIT_K=4 with 3 k tiles: a CTA would get none"


def test_split_k_is_float32_only_on_the_mma_path():
    tc = {**cfg(BK=32, WM=32, WN=32, TM=4, TN=4, VEC=8, PAD=0, STAGES=3), "SPLIT_K": 2}
    reason = SPEC.check(tc, (1000, 1000, 1000), "float16")
    assert reason == "SPLIT_K is a wgmma tunable, pinned to 1 under ENGINE=mma"


def test_split_k_needs_clusters():
    config = cfg(SPLIT_K=2)
    assert SPEC.check_arch(config, "sm_90") is None
    assert SPEC.check_arch(config, "sm_100") is None
    assert "clusters" in SPEC.check_arch(config, "sm_80")
    assert SPEC.check_arch(cfg(), "sm_80") is None


@pytest.mark.parametrize("split", [1, 2, 3, 4])
def test_launch_is_one_cluster_of_split_ctas_per_tile(split):
    shape = (1000, 1001, 999)
    one = SPEC.launch(cfg(), shape, "float32")
    launch = SPEC.launch(cfg(SPLIT_K=split), shape, "float32")
    assert launch.grid == (one.grid[0] * split, one.grid[1], 1)
    assert launch.block == one.block
    tiles = math.ceil(1000 / 64) * math.ceil(1001 / 128)
    # every tile's cluster is in the grid (grid.x counts the 8-row groups' tiles)
    assert launch.grid[0] * launch.grid[1] >= tiles * split


def test_partial_sums_fit_the_shared_memory():
    stage = shared_bytes(cfg(), "float32")
    assert stage == 2 * (16 * (64 + 4) + 16 * 128) * 4
    assert shared_bytes(cfg(SPLIT_K=2), "float32") == max(stage, 64 * 128 * 4)
    assert SPEC.launch(cfg(SPLIT_K=2), (1000, 1001, 999), "float32").shared_bytes == 64 * 128 * 4
    # the reduction's registers count against the launch bounds
    assert registers_needed(cfg(SPLIT_K=2), "float32") > registers_needed(cfg(), "float32")


def _rendered_defines(source: str) -> list[str]:
    """The ``#define`` lines the spec puts before the template."""
    lines = []
    for line in source.splitlines():
        if not line.startswith("#define"):
            break
        lines.append(line)
    return lines


def test_split_1_renders_no_macro_and_split_2_its_own():
    shape = (1000, 1001, 999)
    plain = _rendered_defines(SPEC.render(cfg(), shape, "float32"))
    assert plain[0] == "#define BM 64" and not [d for d in plain if "SPLIT_K" in d]
    split = _rendered_defines(SPEC.render(cfg(SPLIT_K=2), shape, "float32"))
    assert [d for d in split if "SPLIT_K" in d] == ["#define SPLIT_K 2"]


def test_the_space_gains_split_configs_for_small_problems_in_every_layout():
    for spec in (SPEC, TN, get_operator("matmul_nt")):
        small = [
            c
            for c in spec.candidates((768, 768, 8192), "float32")
            if spec.check(c, (768, 768, 8192), "float32") is None
        ]
        assert {c["SPLIT_K"] for c in small} == {1, 2, 3, 4}, spec.name
        big = [
            c
            for c in spec.candidates((4096, 4096, 4096), "float32")
            if spec.check(c, (4096, 4096, 4096), "float32") is None
        ]
        assert {c["SPLIT_K"] for c in big} == {1}, spec.name
