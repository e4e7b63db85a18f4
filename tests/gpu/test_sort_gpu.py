"""sort (rows) and sort_1d on a real GPU: both key types on awkward shapes with duplicates,
+-inf, -0.0/0.0, INT_MIN/INT_MAX (default configs), every valid variant verified exactly
through the backend, and the grid-stride loops with capped grids."""

from __future__ import annotations

import kato.kernels.sort as sort_module
import pytest
from kato.kernels import get_operator
from verify_harness import verify_variants

KEYS = ["float32", "int32"]
ROWS = [
    (1, 1),
    (3, 7),
    (1000, 1),
    (65536, 33),
    (4096, 4096),
    (5, 4097),
    (3, 6000),
    (7, 8192),
    (1, 2),
    (100003, 3),
]
LENGTHS = [1, 2, 1000, 8191, 8192, 8193, 1000003, 2**24, 2**24 + 1]


@pytest.fixture(scope="module")
def sort_spec():
    return get_operator("sort")


@pytest.fixture(scope="module")
def sort_1d_spec():
    return get_operator("sort_1d")


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", ROWS, ids=lambda s: "x".join(map(str, s)))
def test_rows_default_config(sort_spec, shape, dtype):
    checked, failures = verify_variants(sort_spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", [(64, 1000), (3, 4096), (1000, 3), (9, 8192)], ids=str)
def test_rows_every_valid_variant(sort_spec, shape, dtype):
    checked, failures = verify_variants(sort_spec, shape, dtype, seed=1)
    assert checked >= 2 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("n", LENGTHS, ids=str)
def test_1d_default_config(sort_1d_spec, n, dtype):
    checked, failures = verify_variants(sort_1d_spec, (n,), dtype, max_configs=0)
    assert checked == 1 and not failures, failures


class BitonicOnly(sort_module.Sort1dSpec):
    """sort_1d without its radix configs (tests/gpu/test_sort_radix_gpu.py verifies those)."""

    def check(self, config, shape, dtype):
        if config.get("ALGO") != "bitonic":
            return "radix: tested in test_sort_radix_gpu.py"
        return super().check(config, shape, dtype)


@pytest.mark.parametrize("dtype", KEYS)
def test_1d_every_valid_variant(dtype):
    """Every bitonic block size x keys per thread x shuffles x FUSE x launch bounds (~140
    configs) on 300007 keys: several global merges and a partial last block."""
    checked, failures = verify_variants(BitonicOnly(), (300007,), dtype, seed=3)
    assert checked >= 100 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", KEYS)
def test_grid_stride_loops(sort_spec, dtype, monkeypatch):
    """Grids of 3 blocks: the row-group loop, the block-sort/merge chunk loops and the global
    passes' group loop all take several iterations."""
    monkeypatch.setattr(sort_module, "MAX_GRID", 3)
    checked, failures = verify_variants(sort_spec, (777, 100), dtype, max_configs=16, seed=4)
    assert not failures, failures[:5]
    checked, failures = verify_variants(BitonicOnly(), (100001,), dtype, max_configs=16, seed=5)
    assert not failures, failures[:5]
