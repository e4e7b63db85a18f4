"""Transpose on a real GPU: every dtype on awkward shapes (default config), every valid variant
verified exactly through the backend, every vector width on shapes it does not divide (rows
split at vector boundaries, issue 31), the plain cache hints (HINTS 1 and 2) on odd shapes, the
output-aligned tiles (SKEW=1) on odd shapes and the issue's, and the tile loop's grid stride
with a capped grid."""

from __future__ import annotations

import kato.kernels.transpose as transpose_module
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.transpose import skew_applies
from verify_harness import verify_config, verify_configs, verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
#: Single elements, 1 x N and N x 1, primes, sizes off every tile and vector width, very wide
#: and very tall (131072 tiles of 32 x 32, past grid.y's 65535 if it were used).
AWKWARD = [
    (1, 1),
    (1, 4097),
    (4097, 1),
    (3000, 3001),
    (17, 333),
    (1, 2**22),
    (2**22, 2),
    (65536, 130),
    (4096, 4104),
]


@pytest.fixture(scope="module")
def spec():
    return get_operator("transpose")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_exact(spec, shape, dtype):
    default = spec.default_config(shape, dtype)
    checked, failures = verify_variants(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, (default, failures)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(96, 200), (37, 53), (130, 72)], ids=lambda s: "x".join(map(str, s))
)
def test_every_valid_variant_verifies(spec, shape, dtype):
    """Every valid config (float16 and bfloat16 share compiled kernels)."""
    checked, failures = verify_variants(spec, shape, dtype, seed=1)
    assert checked >= 40
    assert not failures, failures[:5]


#: Shapes no vector width divides: odd x odd (the issue's 8191 x 8193 too), primes past a tile,
#: 1 x n, n x 1, and one side a multiple of 8 with the other not.
SPLIT = [(1000, 1003), (257, 4099), (1, 4097), (4097, 1), (4096, 1001), (1001, 4096), (8191, 8193)]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SPLIT, ids=lambda s: "x".join(map(str, s)))
def test_every_vector_width_on_split_shapes(spec, shape, dtype):
    """Every VEC of at most 16 bytes (ALIGNED=0 for each VEC > 1), a seeded sample of its
    configs and the default, verified exactly."""
    widths = [v for v in spec.params["VEC"] if v * DTYPES[dtype][2] <= 16]
    samples = 3 if shape == (8191, 8193) else 10
    for vec in widths:
        checked, failures = verify_variants(
            spec, shape, dtype, max_configs=samples, seed=vec, where=lambda c, v=vec: c["VEC"] == v
        )
        assert checked >= samples and not failures, (vec, failures[:5])


#: Odd sides, issue 31's 8191 x 8193 in small: every row starts at its own offset within a
#: 32-byte sector, so the sectors at tile edges are shared by neighbouring blocks; then one side
#: odd, the other a multiple of every vector width.
ODD = [(127, 129), (129, 127), (255, 4097), (1000, 1003), (4096, 1001)]


def _verify_every_width(spec, shape, dtype, seed, where):
    """Four seeded configs matching ``where`` at every vector width of at most 16 bytes,
    each verified exactly."""
    for vec in (v for v in spec.params["VEC"] if v * DTYPES[dtype][2] <= 16):
        checked, failures = verify_variants(
            spec,
            shape,
            dtype,
            max_configs=4,
            seed=seed + vec,
            where=lambda c, v=vec: c["VEC"] == v and where(c),
        )
        assert checked >= 4 and not failures, (vec, failures[:5])


@pytest.mark.parametrize("hints", [1, 2])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", ODD, ids=lambda s: "x".join(map(str, s)))
def test_plain_cache_hints_on_odd_shapes(spec, shape, dtype, hints):
    """HINTS 1 (plain stores) and 2 (plain loads and stores): a seeded sample of the configs
    of every vector width (split rows for VEC > 1), verified exactly."""
    _verify_every_width(spec, shape, dtype, 10 * hints, lambda c: c["HINTS"] == hints)


#: 8191 x 8193 float32: the tuned winner (data/h100, TILE=64 VEC=1 RPT=4 SMEM=2) and a split
#: 16-byte one.
ISSUE_CONFIGS = [
    {"TILE": 64, "VEC": 1, "RPT": 4, "SMEM": 2, "MIN_BLOCKS": 0, "SKEW": 0},
    {"TILE": 64, "VEC": 4, "RPT": 4, "SMEM": 1, "MIN_BLOCKS": 0, "SKEW": 0},
]


@pytest.mark.parametrize("hints", [1, 2])
def test_plain_cache_hints_on_the_issue_shape(spec, hints):
    for config in ISSUE_CONFIGS:
        config = {**config, "HINTS": hints}
        error = verify_config(spec, (8191, 8193), "float32", config)
        assert error is None, (config, error)


#: Output rows that start mid 32-byte sector (SKEW=1 valid): odd sides, 1 x n and n x 1, rows
#: under a sector, an even side no sector divides.
SKEWED = [(127, 129), (129, 127), (255, 4097), (1, 4097), (4097, 1), (3, 5), (1002, 1003)]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SKEWED, ids=lambda s: "x".join(map(str, s)))
def test_skewed_tiles_on_odd_shapes(spec, shape, dtype):
    """SKEW=1: a seeded sample of the configs of every vector width, verified exactly."""
    assert skew_applies(shape, dtype)
    _verify_every_width(spec, shape, dtype, 20, lambda c: c["SKEW"] == 1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_skewed_tiles_on_the_issue_shape(spec, dtype):
    """The SKEW=1 configs timed at 8191 x 8193 (TILE 64, every VEC, RPT 4 and 8, SMEM 1,
    MIN_BLOCKS 0 and 4, HINTS 2), on one problem."""
    configs = [
        {"TILE": 64, "VEC": vec, "RPT": rpt, "SMEM": 1, "MIN_BLOCKS": mb, "HINTS": 2, "SKEW": 1}
        for vec in (1, 2, 4, 8)
        for rpt in (4, 8)
        for mb in (0, 4)
    ]
    configs = [c for c in configs if spec.check(c, (8191, 8193), dtype) is None]
    assert len(configs) >= 6
    failures = verify_configs(spec, (8191, 8193), dtype, configs)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grid_stride_over_skewed_tiles(spec, dtype, monkeypatch):
    """SKEW=1's two loops over the tiles (interior ones, then the others) with 7 blocks."""
    monkeypatch.setattr(transpose_module, "MAX_GRID", 7)
    checked, failures = verify_variants(
        spec, (301, 456), dtype, max_configs=12, seed=3, where=lambda c: c["SKEW"] == 1
    )
    assert checked >= 12 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grid_stride_over_tiles(spec, dtype, monkeypatch):
    """A grid of 7 blocks for hundreds of tiles: every block loops over its tiles."""
    monkeypatch.setattr(transpose_module, "MAX_GRID", 7)
    checked, failures = verify_variants(spec, (300, 456), dtype, max_configs=24, seed=2)
    assert checked >= 24 and not failures, failures[:5]
