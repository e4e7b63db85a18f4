"""reduce_sum (over the last dim) on a real GPU: every dtype, awkward shapes, every valid variant
(or a seeded sample of 64) through the backend's verification; every SPLIT and every VEC at odd
row lengths and few long rows; accuracy on 2**26 elements against a serial float32 sum and bit
for bit against the numpy model of the kernel's tree (split rows and scalar heads and tails
included); split rows launched again and again (the row tickets reset)."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.reduce_sum import row_sum_model
from step_runner import StepRunner
from verify_harness import verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
AWKWARD = [
    (1, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (5, 1000003),
    (262147, 128),
    (1, 32768),
    (1, 2**26 + 3),
    (3, 1000003),
    (100000, 7),
    (4, 16777216),
]
#: Few long rows (every SPLIT value valid at most of them) with odd lengths.
SPLIT_SHAPES = [(1, 2**22 + 3), (3, 1000003), (7, 50257), (130, 40009)]


def cfg(block, row_threads, vec, unroll, split):
    return {
        "BLOCK_SIZE": block,
        "ROW_THREADS": row_threads,
        "VEC": vec,
        "UNROLL": unroll,
        "SPLIT": split,
    }


@pytest.fixture(scope="module")
def spec():
    return get_operator("reduce_sum")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    _, failures = verify_variants(spec, shape, dtype, max_configs=1)
    assert not failures, failures[:3]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(3000, 3001), (257, 4096), (64, 136), (70001, 8)], ids=lambda s: "x".join(map(str, s))
)
def test_valid_variants_verify(spec, shape, dtype):
    checked, failures = verify_variants(spec, shape, dtype, max_configs=64, seed=shape[1])
    assert checked >= 36
    assert not failures, failures[:5]


def test_accuracy_on_2_pow_26_positive_values(spec):
    """4 rows of 2**24 U(0.5, 1.5), a block per row: error far below a serial float32 sum's,
    and every row equal to the numpy model of the kernel's tree bit for bit."""
    config = cfg(1024, 0, 4, 8, 0)
    x = np.random.default_rng(26).uniform(0.5, 1.5, size=(4, 2**24)).astype(np.float32)
    exact = x.astype(np.float64).sum(axis=1)
    naive = np.abs(np.cumsum(x, axis=1, dtype=np.float32)[:, -1] - exact)
    args = [x, np.full(4, np.nan, dtype=np.float32), np.int32(4), np.int32(2**24)]
    out = StepRunner(spec, config, x.shape, "float32").run(args)[1]
    error = np.abs(out.astype(np.float64) - exact)
    # A float32 result of ~1.7e7 is itself only good to half an ulp (1.0): ask for a few ulps,
    # and for an error far below the serial float32 sum's (which is off by ~1e2 to ~1e3).
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (error <= 4 * ulp).all(), (error, ulp)
    assert (error < naive / 10).all(), (error, naive)
    np.testing.assert_array_equal(out, row_sum_model(x, config))


@pytest.mark.parametrize(
    ("shape", "config"),
    [
        ((4096, 16384), cfg(256, 32, 4, 8, 0)),
        ((65536, 1024), cfg(128, 8, 4, 8, 0)),
    ],
    ids=["warp", "8-lane groups"],
)
def test_row_groups_match_the_model_exactly(spec, shape, config):
    """2**26 elements in rows shared by a warp or by 8 lanes: bit for bit the numpy model."""
    x = np.random.default_rng(7).uniform(0.5, 1.5, size=shape).astype(np.float32)
    args = [x, np.full(shape[0], np.nan, dtype=np.float32), np.int32(shape[0]), np.int32(shape[1])]
    out = StepRunner(spec, config, shape, "float32").run(args)[1]
    np.testing.assert_array_equal(out, row_sum_model(x, config))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_inputs_match_the_model_exactly(spec, dtype):
    shape = (300, 1000)
    problem = spec.make_problem(shape, dtype, np.random.default_rng(3))
    x = problem.args[0]
    for config in (
        spec.default_config(shape, dtype),
        cfg(128, 8, 8, 2, 0),
        cfg(512, 0, 2, 4, 0),
    ):
        out = StepRunner(spec, config, shape, dtype).run(problem.args)[1]
        np.testing.assert_array_equal(out, row_sum_model(x, config))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_split_variant_verifies(spec, shape, dtype):
    """Every valid config with a block per row or per piece (every SPLIT, VEC, BLOCK_SIZE and
    UNROLL) on odd lengths: the row's pieces, its head and its tail each counted once."""
    checked, failures = verify_variants(spec, shape, dtype, where=lambda c: c["ROW_THREADS"] == 0)
    assert checked >= 60, checked
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(5, 4097), (100000, 7), (257, 4099), (33, 50257)], ids=lambda s: "x".join(map(str, s))
)
def test_every_vector_width_verifies_on_odd_rows(spec, shape, dtype):
    """Every VEC with every row strategy (UNROLL 2 and 8) where cols is no multiple of it."""
    checked, failures = verify_variants(
        spec, shape, dtype, where=lambda c: c["UNROLL"] != 4 and c["SPLIT"] == 0
    )
    vecs = [v for v in spec.params["VEC"] if v * DTYPES[dtype][2] <= 16]
    # less BLOCK_SIZE 1024 x 128 bytes in flight (16-byte VEC, UNROLL 8) for each ROW_THREADS
    assert checked >= 4 * 3 * len(vecs) * 2 - 3, checked
    assert not failures, failures[:5]


@pytest.mark.parametrize(
    ("shape", "dtype", "config"),
    [
        ((1, 2**26 + 3), "float32", None),  # the default: SPLIT=4, 528 pieces
        (
            (4, 2**24 + 1),
            "bfloat16",
            cfg(256, 0, 8, 8, 8),
        ),
        (
            (3, 1000003),
            "float16",
            cfg(128, 0, 4, 2, 1),
        ),
        (
            (5, 1000003),
            "float32",
            cfg(512, 0, 4, 4, 0),
        ),
        (
            (1000, 4099),
            "float16",
            cfg(128, 8, 8, 4, 0),
        ),
    ],
    ids=["default-1x67108867", "split8-4x16777217", "split1-3x1000003", "block-odd", "rows-odd"],
)
def test_split_and_odd_rows_match_the_model_exactly_launch_after_launch(spec, shape, dtype, config):
    """Bit for bit the numpy model, after three launches on the same buffers (each row's last
    block resets its ticket, so every launch splits and finishes the same way)."""
    if config is None:
        config = spec.default_config(shape, dtype)
        assert config["SPLIT"] > 0
    assert spec.check(config, shape, dtype) is None, config
    problem = spec.make_problem(shape, dtype, np.random.default_rng(5))
    out = StepRunner(spec, config, shape, dtype).run(problem.args, repeat=3)[1]
    np.testing.assert_array_equal(out, row_sum_model(problem.args[0], config))
    ((atol, _),) = problem.tolerances
    assert (np.abs(out - problem.references[0]) <= atol).all()
