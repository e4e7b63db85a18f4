"""The radix sort on a real GPU (sort_1d with ALGO=radix, sort_1d_pairs): every valid variant
verified exactly through the backend on fresh random keys (duplicates, +-inf, -0.0/0.0,
INT_MIN/INT_MAX), awkward lengths, all-equal keys and a -0.0/+0.0 mix, and the pairs' values
in exact stable order; every ranking method (RANK) and every histogram method (HIST: the vector
ones read lengths that are no multiple of 4, and 2^24 + 1 keys loop several times per thread)
on every length and on the tied keys. Each
verification runs the whole call twice (the second call checks that a call leaves nothing
behind), on many tiles at once: the look-back runs concurrently.

    python3 -m pytest -q tests/gpu/test_sort_radix_gpu.py
    python3 -m pytest -q tests/gpu/test_sort_radix_gpu.py -k "vec4"   # the new HIST values only
"""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import get_operator
from kato.kernels.sort import Sort1dPairsSpec, Sort1dSpec, radix
from kato.kernels.spec import Problem
from verify_harness import verify_configs, verify_variants

KEYS = ["float32", "int32"]
#: 1 key, a warp, around a tile, around powers of two, a partial last tile of many.
LENGTHS = [1, 31, 2047, 2049, 2**16 - 1, 2**20 + 1, 3 * 2**20 + 7, 2**24 + 1]


class RadixOnly(Sort1dSpec):
    """sort_1d with the bitonic configs left out of the space (test_sort_gpu.py covers them)."""

    def check(self, config, shape, dtype):
        if config.get("ALGO") != "radix":
            return "bitonic: not part of this test"
        return super().check(config, shape, dtype)


def _tied_keys(n: int, dtype: str) -> np.ndarray:
    if dtype == "float32":
        keys = np.zeros(n, np.float32)
        keys[::3] = -0.0
        return keys
    return np.full(n, -(2**31), np.int32)


class TiedSort1d(RadixOnly):
    """All keys tied (int: all INT_MIN; float: -0.0 and +0.0 interleaved)."""

    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        problem.args[0] = _tied_keys(shape[0], dtype)
        problem.references = [np.sort(problem.args[0].astype(np.float64))]
        return problem


class TiedPairs(Sort1dPairsSpec):
    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        x = problem.args[0] = _tied_keys(shape[0], dtype)
        problem.references = [np.sort(x.astype(np.float64)), radix.stable_order(x)]
        return problem


def _radix_config(**overrides) -> dict:
    config = {
        "BLOCK": 512,
        "ITEMS": 16,
        "WARP_SHFL": 0,
        "SMEM_FUSE": 1,
        "FUSE": 1,
        "ALGO": "radix",
        "RADIX_BITS": 8,
        "RANK": radix.RANKS[0],
        "HIST": radix.HISTS[0],
    }
    return {**config, **overrides}


#: One variant per digit width (4..8 passes, odd and even counts), tiles of 2048 to 12288 keys;
#: the tests run them with every RANK and HIST (:data:`METHODS`, :func:`_ranked`).
SAMPLE = [
    _radix_config(BLOCK=256, ITEMS=8, RADIX_BITS=4),
    _radix_config(BLOCK=128, ITEMS=24, RADIX_BITS=5),
    _radix_config(BLOCK=512, ITEMS=12, RADIX_BITS=6),
    _radix_config(BLOCK=1024, ITEMS=12, RADIX_BITS=7),
    _radix_config(BLOCK=512, ITEMS=24, RADIX_BITS=8),
]


#: (RANK, HIST) pairs the sample runs with: every ranking method with the scalar histogram, and
#: every vector histogram with the fastest ranking on the H100 (atomic). The two kernels are
#: independent: the histogram kernel's source does not depend on RANK.
METHODS = [(rank, radix.HISTS[0]) for rank in radix.RANKS]
METHODS += [("atomic", hist) for hist in radix.HISTS[1:]]
METHOD_IDS = [f"{rank}-{hist}" for rank, hist in METHODS]


@pytest.mark.parametrize("hist", radix.HISTS)
@pytest.mark.parametrize("dtype", KEYS)
def test_every_radix_variant(dtype, hist):
    """Every valid radix config of sort_1d of one HIST (~95 per RANK, 285 per HIST) on
    3 * 2^20 + 7 keys: hundreds of tiles, a partial last one."""
    spec, where = RadixOnly(), lambda c: c["HIST"] == hist
    checked, failures = verify_variants(spec, (3 * 2**20 + 7,), dtype, seed=11, where=where)
    assert checked >= 60 and not failures, failures[:5]


@pytest.mark.parametrize("hist", radix.HISTS)
@pytest.mark.parametrize("dtype", KEYS)
def test_every_pairs_variant(dtype, hist):
    spec, where = get_operator("sort_1d_pairs"), lambda c: c["HIST"] == hist
    checked, failures = verify_variants(spec, (3 * 2**20 + 7,), dtype, seed=12, where=where)
    assert checked >= 50 and not failures, failures[:5]


def _ranked(configs: list[dict], rank: str, hist: str = radix.HISTS[0]) -> list[dict]:
    return [{**c, "RANK": rank, "HIST": hist} for c in configs]


def _pairs_configs(configs: list[dict]) -> list[dict]:
    """The SAMPLE configs' pairs counterparts that fit (a value per item needs registers)."""
    pairs = get_operator("sort_1d_pairs")
    found = [{k: c[k] for k in Sort1dPairsSpec.params} for c in configs]
    return [c for c in found if pairs.check(c, (2**20,), "int32") is None]


@pytest.mark.parametrize(("rank", "hist"), METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("n", LENGTHS, ids=str)
def test_awkward_lengths(n, dtype, rank, hist):
    """Every digit width (SAMPLE) for keys, three of them for pairs."""
    sample = _ranked(SAMPLE, rank, hist)
    errors = verify_configs(get_operator("sort_1d"), (n,), dtype, sample, seed=n % 97)
    pairs = get_operator("sort_1d_pairs")
    errors += verify_configs(pairs, (n,), dtype, _pairs_configs(sample[::2]), seed=n % 89)
    assert not errors, errors[:5]


@pytest.mark.parametrize(("rank", "hist"), METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("dtype", KEYS)
def test_tied_keys_keep_their_order(dtype, rank, hist):
    n = 2**20 + 3
    sample = _ranked(SAMPLE, rank, hist)
    errors = verify_configs(TiedSort1d(), (n,), dtype, sample)
    errors += verify_configs(TiedPairs(), (n,), dtype, _pairs_configs(sample))
    assert not errors, errors[:5]
