"""reduce_sum (over the last dim) on a real GPU: every dtype, awkward shapes, every valid variant
(or a seeded sample of 64) through the backend's verification, accuracy on 2**26 elements against
a serial float32 sum and bit for bit against the numpy model of the kernel's tree."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import get_operator
from kato.kernels.reduce_sum import row_sum_model
from step_runner import StepRunner
from verify_harness import verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
AWKWARD = [(1, 1), (1, 4097), (3000, 3001), (17, 333), (5, 1000003), (262147, 128), (1, 32768)]


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
    config = {"BLOCK_SIZE": 1024, "ROW_THREADS": 0, "VEC": 4, "UNROLL": 8}
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
        ((4096, 16384), {"BLOCK_SIZE": 256, "ROW_THREADS": 32, "VEC": 4, "UNROLL": 8}),
        ((65536, 1024), {"BLOCK_SIZE": 128, "ROW_THREADS": 8, "VEC": 4, "UNROLL": 8}),
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
        {"BLOCK_SIZE": 128, "ROW_THREADS": 8, "VEC": 8, "UNROLL": 2},
        {"BLOCK_SIZE": 512, "ROW_THREADS": 0, "VEC": 2, "UNROLL": 4},
    ):
        out = StepRunner(spec, config, shape, dtype).run(problem.args)[1]
        np.testing.assert_array_equal(out, row_sum_model(x, config))
