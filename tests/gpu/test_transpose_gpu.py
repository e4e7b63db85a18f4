"""Transpose on a real GPU: every dtype on awkward shapes (default config), every valid variant
verified exactly through the backend, every vector width on shapes it does not divide (rows
split at vector boundaries, issue 31), and the tile loop's grid stride with a capped grid."""

from __future__ import annotations

import kato.kernels.transpose as transpose_module
import pytest
from kato.kernels import DTYPES, get_operator
from verify_harness import verify_variants

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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grid_stride_over_tiles(spec, dtype, monkeypatch):
    """A grid of 7 blocks for hundreds of tiles: every block loops over its tiles."""
    monkeypatch.setattr(transpose_module, "MAX_GRID", 7)
    checked, failures = verify_variants(spec, (300, 456), dtype, max_configs=24, seed=2)
    assert checked >= 24 and not failures, failures[:5]
