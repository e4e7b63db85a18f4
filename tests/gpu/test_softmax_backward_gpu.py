"""softmax_backward on a real GPU: every valid config verified (batched compiles) for every
dtype at an odd, prime width; the default config on awkward shapes (1 row, 1 column, primes,
rows longer than any register cache, a 50257-column vocabulary); a sampled set on other
widths; the grid stride; row arrays that start off a vector boundary."""

from __future__ import annotations

import pytest
from kato.kernels import get_operator, limits
from rowwise_harness import run_offset, verify_all

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
#: 1 element, 1 column, a long odd single row, primes, short rows (several per warp), a width
#: that is a multiple of every VEC, a 50257-column vocabulary, rows longer than any cache.
AWKWARD = [
    (1, 1),
    (1000, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (65536, 128),
    (16384, 1024),
    (33, 50257),
    (5, 1000003),
]


@pytest.fixture(scope="module")
def spec():
    return get_operator("softmax_backward")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_valid_config_verifies(spec, dtype):
    """1031 columns (prime): every row starts at another offset of a vector, so every VEC runs
    its scalar head and tail, and CACHE=1/2 hold rows of up to 1031 // VEC vectors."""
    checked, sources, failures = verify_all(spec, (37, 1031), dtype)
    assert checked > 150 and sources > 100, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(64, 130), (9, 4104), (301, 96)], ids=lambda s: "x".join(map(str, s))
)
def test_sampled_configs_verify(spec, shape, dtype):
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=96, seed=3)
    assert checked >= 96 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_stride_over_rows(spec, dtype, monkeypatch):
    """A grid of 7 blocks for 2000 rows: every row group loops."""
    monkeypatch.setattr(limits, "MAX_GRID_X", 7)
    checked, _, failures = verify_all(spec, (2000, 97), dtype, max_configs=64, seed=4)
    assert checked >= 64 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_row_arrays_off_a_vector_boundary(spec, dtype, offset):
    """y, dy and dx start ``offset`` elements past an aligned address (views into a larger
    buffer): 4096 columns, a multiple of every VEC, still get a head in every row."""
    for config in (
        spec.default_config((64, 4096), dtype),
        {**spec.default_config((64, 4096), dtype), "CACHE": 0},
    ):
        assert spec.check(config, (64, 4096), dtype) is None
        assert run_offset(spec, config, (64, 4096), dtype, (0, 1, 2), offset) == []
