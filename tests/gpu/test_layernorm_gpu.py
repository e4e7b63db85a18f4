"""LayerNorm on a real GPU: every dtype on awkward shapes (default config), a seeded sample of
valid variants per case verified through the backend (y, mean and rstd, each against its float64
reference with its own tolerance), and the row loop's grid stride with a capped grid."""

from __future__ import annotations

import pytest
from kato.kernels import get_operator, limits
from verify_harness import verify_config, verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
#: One element, one column (variance 0: rstd = 1/sqrt(eps), y = bias), a single long odd row,
#: primes, the issue's short-row case (128 columns, several rows per warp) with a big grid,
#: 1024 columns, rows longer than any register cache, 32768-wide rows.
AWKWARD = [
    (1, 1),
    (1000, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (262144, 128),
    (16384, 1024),
    (7, 1000003),
    (64, 32768),
]
#: Sampled variants: rows split at VEC 4 and 8 (130), everything up to VEC 8, a register-cache
#: edge (4104 = 8 * 513 columns), short rows; odd and prime rows split at every VEC > 1 (issue
#: 31): a vocabulary of 50257, 127, 3.
VARIANT_SHAPES = [(64, 130), (37, 1000), (9, 4104), (301, 128), (9, 50257), (33, 127), (40, 3)]


@pytest.fixture(scope="module")
def spec():
    return get_operator("layernorm")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    default = spec.default_config(shape, dtype)
    checked, failures = verify_variants(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, (default, failures)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", VARIANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sampled_variants_verify(spec, shape, dtype):
    """A seeded sample of 64 valid configs per case (the space has hundreds per shape; every
    (ROW_THREADS, CACHE) pair that is valid appears in a sample of this size)."""
    checked, failures = verify_variants(spec, shape, dtype, max_configs=64, seed=3)
    assert checked >= 64
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_stride_over_rows(spec, dtype, monkeypatch):
    """A grid of 7 blocks for 2000 rows: every row group loops (weight/bias registers reused)."""
    monkeypatch.setattr(limits, "MAX_GRID_X", 7)
    checked, failures = verify_variants(spec, (2000, 96), dtype, max_configs=48, seed=4)
    assert checked >= 48 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("vec", [1, 4])
def test_long_rows_verify(spec, dtype, vec):
    """The longest per-thread streams: 8 threads per row of 2^20 columns (131072 or 32768
    elements each). Merging every vector straight into a thread's running partial drifted rstd
    by 1e-5 relative there (bfloat16 VEC 1 failed its tolerance in the CPU emulation,
    tests/kernels/test_layernorm_emulation.py); the kernel now merges per unrolled step."""
    shape = (64, 2**20)
    config = {
        "BLOCK_SIZE": 128,
        "VEC": vec,
        "ROW_THREADS": 8,
        "CACHE": 0,
        "MIN_BLOCKS": 0,
        "GROUP_ROWS": 1,
    }
    assert verify_config(spec, shape, dtype, config) is None


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("row_threads", [32, 0])  # a warp per row, the whole block
def test_rows_past_2_to_the_24_columns_verify(spec, dtype, row_threads):
    """Welford counts are floats, exact up to 2^24 elements per partial: a row of 2^24 + 4104
    columns makes the last merges' counts inexact (rounded to even), which moves each merge
    weight by at most 2^-24 relative: the result must still pass the float64 reference."""
    shape = (2, 2**24 + 4104)
    config = {
        "BLOCK_SIZE": 1024,
        "VEC": 4,
        "ROW_THREADS": row_threads,
        "CACHE": 0,
        "MIN_BLOCKS": 0,
        "GROUP_ROWS": 1,
    }
    assert spec.check(config, shape, dtype) is None
    assert verify_config(spec, shape, dtype, config) is None
    default = spec.default_config(shape, dtype)
    assert verify_config(spec, shape, dtype, default) is None, default


#: Few long rows (issue 31): a block per row keeps 8 (16) of the GPU's SMs busy.
FEW_LONG_ROWS = [((8, 4194304), "float32"), ((16, 1048573), "bfloat16")]
#: How much faster the best split variant must be than the best block-per-row one.
SPLIT_MARGIN = 2.0


def _row_configs(spec, shape, dtype, group_rows):
    """The widest vector's block-per-row variants (CACHE 0, 1, 2 on 512 and 1024 threads, with
    and without MIN_BLOCKS=2; GROUP_ROWS 1) or split ones (GROUP_ROWS 0: 128 to 1024 threads, 1
    or 2 blocks per SM) that check() admits."""
    vec = 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    found = []
    for block in (128, 256, 512, 1024):
        for cache in (0, 1, 2) if group_rows else (0,):
            for min_blocks in (0, 2):
                config = {"BLOCK_SIZE": block, "VEC": vec, "ROW_THREADS": 0, "CACHE": cache}
                config.update(MIN_BLOCKS=min_blocks, GROUP_ROWS=group_rows)
                if spec.check(config, shape, dtype) is None:
                    found.append(config)
    return found


@pytest.mark.parametrize(("shape", "dtype"), FEW_LONG_ROWS, ids=lambda s: str(s))
def test_split_rows_verify_and_beat_a_block_per_row(spec, shape, dtype):
    """Through the backend (y, mean and rstd verified against the float64 reference, then
    timed): every split variant tried is correct, the best is SPLIT_MARGIN times faster than
    the best block per row, and the default config is a split one within 25% of that best."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(spec, shape, dtype, repeats=10, seed=31)
    try:
        times = {}
        for group_rows in (1, 0):
            configs = _row_configs(spec, shape, dtype, group_rows)
            assert len(configs) >= 3, (group_rows, configs)
            results = [backend.evaluate(c) for c in configs]
            bad = [(r.config, r.status, r.error) for r in results if not r.ok]
            assert not bad, bad[:3]
            times[group_rows] = min(r.time_ms for r in results)
        assert times[0] * SPLIT_MARGIN < times[1], times
        default = spec.default_config(shape, dtype)
        assert default["GROUP_ROWS"] == 0
        result = backend.evaluate(default)
        assert result.ok, result.error
        assert result.time_ms < 1.25 * times[0], (result.time_ms, times)
    finally:
        backend.close()
