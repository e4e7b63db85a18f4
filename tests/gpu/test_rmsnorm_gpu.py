"""rmsnorm on a real GPU: every valid config verified (batched compiles, y and rstd against
their float64 references) for every dtype at an odd, prime width; the default config on
awkward shapes; a sampled set on other widths; the grid stride (weight registers reused over
rows); row arrays that start off a vector boundary (the weight does not)."""

from __future__ import annotations

import pytest
from kato.kernels import get_operator, limits
from rowwise_harness import run_offset, verify_all

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
AWKWARD = [
    (1, 1),
    (1000, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (262144, 128),
    (8192, 768),
    (16384, 1024),
    (7, 1000003),
    (64, 32768),
]


@pytest.fixture(scope="module")
def spec():
    return get_operator("rmsnorm")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_valid_config_verifies(spec, dtype):
    checked, sources, failures = verify_all(spec, (37, 1031), dtype)
    assert checked > 500 and sources > 100, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(64, 130), (9, 4104), (301, 128)], ids=lambda s: "x".join(map(str, s))
)
def test_sampled_configs_verify(spec, shape, dtype):
    """128 columns and 4104 (= 8 * 513): widths where every row has the same head, so CACHE=2
    keeps the weight in registers (WB_REGS)."""
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=96, seed=3)
    assert checked >= 96 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_stride_over_rows(spec, dtype, monkeypatch):
    monkeypatch.setattr(limits, "MAX_GRID_X", 7)
    checked, _, failures = verify_all(spec, (2000, 96), dtype, max_configs=64, seed=4)
    assert checked >= 64 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_row_arrays_off_a_vector_boundary(spec, dtype, offset):
    """x and y start ``offset`` elements past an aligned address, the weight does not: every
    row has a head, and the weight's vectors are misaligned against the row's (element loads),
    with and without WB_REGS."""
    shape = (64, 4096)
    default = spec.default_config(shape, dtype)
    for config in (default, {**default, "CACHE": 0}):
        assert spec.check(config, shape, dtype) is None
        assert run_offset(spec, config, shape, dtype, (0, 2), offset) == []
