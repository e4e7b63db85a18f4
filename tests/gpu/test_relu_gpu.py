"""relu forward + backward on a real GPU: every dtype, awkward sizes (1, primes, not multiples of
32 or of the vector width), every valid variant (or a seeded sample of 64) through the backend's
verification (y and dx exact), and the bitmask itself compared exactly with pack_mask."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.relu import mask_words, pack_mask
from step_runner import StepRunner
from verify_harness import verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
SIZES = [1, 2, 31, 33, 65, 4099, 1000003, 2**24 + 7]


@pytest.fixture(scope="module")
def spec():
    return get_operator("relu")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_default_config_verifies(spec, n, dtype):
    _, failures = verify_variants(spec, (n,), dtype, max_configs=1)
    assert not failures, failures[:3]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", [97, 100003])
def test_valid_variants_verify(spec, n, dtype):
    checked, failures = verify_variants(spec, (n,), dtype, max_configs=64, seed=n)
    assert checked >= 64
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("n", [1, 33, 1000, 100003])
def test_mask_packing_is_exact(spec, n, dtype):
    """MASK=1: bit i of word w is element 32w + i, bits past n are 0, and the backward reads it
    back correctly; MASK=0 leaves the mask buffer untouched."""
    problem = spec.make_problem((n,), dtype, np.random.default_rng(n))
    x, dy = problem.args[0], problem.args[1]
    expected = pack_mask(x.astype(np.float64) > 0)
    vecs = [v for v in spec.params["VEC"] if v * DTYPES[dtype][2] <= 16]
    for vec in vecs:
        for block, unroll, bps in ((128, 1, 0), (256, 4, 2), (1024, 2, 16)):
            for mask in (0, 1):
                config = {
                    "MASK": mask,
                    "BLOCK_SIZE": block,
                    "VEC": vec,
                    "UNROLL": unroll,
                    "BLOCKS_PER_SM": bps,
                }
                assert spec.check(config, (n,), dtype) is None
                got = StepRunner(spec, config, (n,), dtype).run(problem.args)
                words = got[3]
                assert words.size == mask_words(n)
                if mask:
                    np.testing.assert_array_equal(words, expected, err_msg=str(config))
                else:
                    assert (words == 0xFFFFFFFF).all(), config
                np.testing.assert_array_equal(got[2].astype(np.float64), problem.references[0])
                np.testing.assert_array_equal(got[4].astype(np.float64), problem.references[1])
                assert np.array_equal(got[0], x) and np.array_equal(got[1], dy)  # inputs intact
