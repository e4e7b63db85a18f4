"""reduce_sum_all on a real GPU: every dtype, awkward sizes, a sample of every valid variant per
case through the backend's verification, accuracy on 2**26 elements against a serial float32
sum, the deterministic finishes bit for bit against the numpy model, repeated launches."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.reduce_sum_all import sum_tolerance, summation_model
from step_runner import StepRunner
from verify_harness import verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
SIZES = [1, 2, 7, 33, 4097, 1000003, 2**24 + 5]


@pytest.fixture(scope="module")
def spec():
    return get_operator("reduce_sum_all")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_default_config_verifies(spec, n, dtype):
    checked, failures = verify_variants(spec, (n,), dtype, max_configs=1)
    assert not failures, failures[:3]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", [31, 65537, 3000017])
def test_valid_variants_verify(spec, n, dtype):
    """A seeded sample of 64 valid configs (every FINISH, vector width, block size...)."""
    checked, failures = verify_variants(spec, (n,), dtype, max_configs=64, seed=n)
    assert checked >= 64
    assert not failures, failures[:5]


def _args(spec, x):
    return [
        x,
        np.full(1, np.nan, dtype=np.float32),
        np.full(spec.MAX_GRID, np.nan, dtype=np.float32),
        np.zeros(2, dtype=np.uint32),
        np.int64(x.size),
    ]


CONFIGS = [
    {"BLOCK_SIZE": 256, "VEC": 4, "UNROLL": 4, "BLOCKS_PER_SM": 4, "FINISH": 0},
    {"BLOCK_SIZE": 1024, "VEC": 2, "UNROLL": 8, "BLOCKS_PER_SM": 1, "FINISH": 2},
    {"BLOCK_SIZE": 128, "VEC": 4, "UNROLL": 2, "BLOCKS_PER_SM": 32, "FINISH": 1},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"finish{c['FINISH']}")
def test_accuracy_on_2_pow_26_positive_values(spec, config):
    """U(0.5, 1.5): the kernel's error vs float64 is far below a serial float32 sum's; FINISH 0
    and 2 equal the numpy model of the kernel's tree bit for bit (FINISH 1's atomics are in
    arbitrary order)."""
    n = 2**26
    x = np.random.default_rng(26).uniform(0.5, 1.5, size=n).astype(np.float32)
    exact = x.astype(np.float64).sum()
    naive = abs(float(np.cumsum(x, dtype=np.float32)[-1]) - exact)
    out = StepRunner(spec, config, (n,), "float32").run(_args(spec, x))[1][0]
    error = abs(float(out) - exact)
    assert error < naive / 1000, (error, naive)
    assert error <= sum_tolerance(exact)
    if config["FINISH"] != 1:
        assert out == summation_model(x, config, spec.grid(config, (n,)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_inputs_match_the_model_exactly(spec, dtype):
    n = 3000017
    x = np.random.default_rng(5).uniform(0.5, 1.5, size=n).astype(DTYPES[dtype][0])
    config = spec.default_config((n,), dtype)
    out = StepRunner(spec, config, (n,), dtype).run(_args(spec, x))[1][0]
    assert out == summation_model(x, config, spec.grid(config, (n,)))


@pytest.mark.parametrize("finish", [0, 1, 2])
def test_repeated_launches_stay_correct(spec, finish):
    """The last-block ticket resets itself, the atomic output is re-zeroed by its init step."""
    n = 1000003
    x = np.random.default_rng(9).uniform(0.5, 1.5, size=n).astype(np.float32)
    config = {**spec.default_config((n,), "float32"), "FINISH": finish}
    out, _, counter = StepRunner(spec, config, (n,), "float32").run(_args(spec, x), repeat=5)[1:4]
    exact = x.astype(np.float64).sum()
    assert abs(float(out[0]) - exact) <= sum_tolerance(exact)
    if finish == 2:
        assert counter[0] == 0
