"""The row sort's radix path on a real GPU (``sort`` with ALGO=radix, rows longer than MAX_ROW):
every valid radix config of ``sort`` verified exactly through the backend at an awkward
long-row shape (7 rows of a prime length, partial last tiles), the default config on awkward
and real shapes (one row; 3 rows just over a tile; top-p sampling's 64 x 128256; few rows of
2**20 + 1; many rows of 16384 and of 8193), every digit width with every ranking and histogram
method on them, tied rows, and NaNs/infinities/signed zeros bit for bit in the kernels' key
order. Each verification runs the whole call twice (the second call checks that a call leaves
nothing behind), with the tiles of all rows in one grid: the look-back runs concurrently, across
row boundaries.

    python3 -m pytest -q tests/gpu/test_sort_rows_radix_gpu.py
    python3 -m pytest -q tests/gpu/test_sort_rows_radix_gpu.py -k "default or awkward"  # quick
"""

from __future__ import annotations

import pytest
import test_sort_radix_gpu as sort_1d_radix_tests
from kato.kernels import get_operator
from kato.kernels.sort import radix
from sort_rows_problems import NanBits, TiedRows
from verify_harness import verify_configs, verify_variants

KEYS = ["float32", "int32"]
#: One row with a one-key last tile; 3 rows just over a tile of 8192; a prime length; top-p
#: sampling's logits; few long rows with a partial last tile; many rows of 2 tiles and of 1 tile
#: plus a key.
SHAPES = [
    (1, 8193),
    (3, 8193),
    (2, 10007),
    (64, 128256),
    (16, 2**20 + 1),
    (4096, 16384),
    (8192, 8193),
    (1, 2**24 + 1),
]


#: sort_1d's radix sample (one variant per digit width, tiles of 2048 to 12288 keys) as sort
#: configs, and the (RANK, HIST) pairs it runs with.
SAMPLE = [{k: v for k, v in c.items() if k != "FUSE"} for c in sort_1d_radix_tests.SAMPLE]
METHODS, METHOD_IDS = sort_1d_radix_tests.METHODS, sort_1d_radix_tests.METHOD_IDS


@pytest.fixture(scope="module")
def sort_spec():
    return get_operator("sort")


@pytest.mark.parametrize("hist", radix.HISTS)
@pytest.mark.parametrize("dtype", KEYS)
def test_every_radix_row_variant(sort_spec, dtype, hist):
    """Every valid radix config of sort of one HIST (95 per RANK, 285 per HIST) on 7 rows of
    100003 keys (9 to 49 tiles a row, each row's last one partial; odd rows misaligned for the
    vector histograms)."""
    where = lambda c: c["HIST"] == hist  # noqa: E731
    checked, failures = verify_variants(sort_spec, (7, 100003), dtype, seed=21, where=where)
    # 285 configs of this HIST, and the default config where its HIST is another
    default_hist = sort_spec.default_config((7, 100003), dtype)["HIST"]
    assert checked == 3 * 95 + (hist != default_hist) and not failures, failures[:5]


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows_default_config(sort_spec, shape, dtype):
    assert sort_spec.default_config(shape, dtype)["ALGO"] == "radix"
    checked, failures = verify_variants(sort_spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize(("rank", "hist"), METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "x".join(map(str, s)))
def test_awkward_rows(sort_spec, shape, dtype, rank, hist):
    """Every digit width (SAMPLE) with every ranking method and vector histogram."""
    sample = [{**c, "RANK": rank, "HIST": hist} for c in SAMPLE]
    errors = verify_configs(sort_spec, shape, dtype, sample, seed=shape[1] % 97)
    assert not errors, errors[:5]


@pytest.mark.parametrize(("rank", "hist"), METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("dtype", KEYS)
def test_tied_rows(dtype, rank, hist):
    sample = [{**c, "RANK": rank, "HIST": hist} for c in SAMPLE]
    errors = verify_configs(TiedRows(), (5, 2**18 + 3), dtype, sample)
    assert not errors, errors[:5]


def test_nan_and_signed_zero_bits():
    sample = [{**c, "RANK": rank, "HIST": hist} for c in SAMPLE[::2] for rank, hist in METHODS]
    errors = verify_configs(NanBits(), (9, 50021), "float32", sample)
    assert not errors, errors[:5]
