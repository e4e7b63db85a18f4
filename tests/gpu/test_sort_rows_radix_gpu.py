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

import numpy as np
import pytest
from kato.kernels import get_operator
from kato.kernels.sort import SortSpec, radix
from kato.kernels.spec import Problem
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


def _radix_config(**overrides) -> dict:
    config = {
        "BLOCK": 512,
        "ITEMS": 16,
        "WARP_SHFL": 0,
        "SMEM_FUSE": 1,
        "ALGO": "radix",
        "RADIX_BITS": 8,
        "RANK": radix.RANKS[0],
        "HIST": radix.HISTS[0],
    }
    return {**config, **overrides}


#: One variant per digit width, tiles of 2048 to 12288 keys (as test_sort_radix_gpu.py).
SAMPLE = [
    _radix_config(BLOCK=256, ITEMS=8, RADIX_BITS=4),
    _radix_config(BLOCK=128, ITEMS=24, RADIX_BITS=5),
    _radix_config(BLOCK=512, ITEMS=12, RADIX_BITS=6),
    _radix_config(BLOCK=1024, ITEMS=12, RADIX_BITS=7),
    _radix_config(BLOCK=512, ITEMS=24, RADIX_BITS=8),
]
METHODS = [(rank, radix.HISTS[0]) for rank in radix.RANKS]
METHODS += [("atomic", hist) for hist in radix.HISTS[1:]]
METHOD_IDS = [f"{rank}-{hist}" for rank, hist in METHODS]


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
    # 285 configs of this HIST, and the default config (HIST=scalar) where it is another
    assert checked == 3 * 95 + (hist != radix.HISTS[0]) and not failures, failures[:5]


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


class TiedRows(SortSpec):
    """Rows of tied keys (int: all INT_MIN; float: -0.0 and +0.0 interleaved)."""

    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        if dtype == "float32":
            x = np.zeros(shape, np.float32)
            x[:, ::3] = -0.0
        else:
            x = np.full(shape, -(2**31), np.int32)
        problem.args[0] = x
        problem.references = [np.sort(x.astype(np.float64), axis=-1)]
        return problem


class NanBits(SortSpec):
    """float32 rows with NaNs of both signs, +-inf, signed zeros and denormals among the stress
    keys, compared as bits (an int32 view of y) with the kernels' documented key order
    (:func:`kernels.sort.radix.ordered_keys`; positive NaNs last, negative ones first)."""

    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        x = problem.args[0]
        specials = np.array(
            [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000, 0, 0x7F800000]
            + [0xFF800000, 1, 0x80000001],
            np.uint32,
        ).view(np.float32)
        picks = rng.random(x.shape) < 0.2
        x[picks] = specials[rng.integers(0, specials.size, int(picks.sum()))]
        problem.args[1] = problem.args[1].view(np.int32)
        order = np.argsort(radix.ordered_keys(x), axis=-1, kind="stable")
        problem.references = [np.take_along_axis(x, order, -1).view(np.int32).astype(np.int64)]
        return problem


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
