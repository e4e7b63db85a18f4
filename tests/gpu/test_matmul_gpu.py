"""Matmul on a real GPU: every dtype, awkward shapes, default config and every valid variant.

Shapes: single elements, primes, GEMV-like M=1 / N=1, K not a multiple of BK, a very tall
70000 x 64 x 64, and 4096^3 (the default's 128 x 128 tile path). The variant sweeps run every
valid config (<= ~100 per dtype) at a shape where the vector paths are valid but nothing is a
multiple of a tile (129 x 136 x 264), and at an all-odd shape where only the scalar fallback is.
"""

from __future__ import annotations

import pytest
from verify_harness import verify_variants

from kernels import get_operator

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
AWKWARD = [
    (1, 1, 1),
    (127, 131, 257),
    (1, 4096, 4096),
    (4096, 1, 4096),
    (300, 200, 1000),
    (70000, 64, 64),
    (129, 136, 264),
    (4096, 4096, 4096),
]


@pytest.fixture(scope="module")
def spec():
    return get_operator("matmul")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    """The backend's device-side verification (poisoned C, float64 reference, K-scaled
    tolerance) passes for the default config."""
    from tuner.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=0)
    try:
        config = spec.default_config(shape, dtype)
        assert backend.check(config) is None
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        assert backend.verify(calls) is None
    finally:
        backend.close()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(129, 136, 264), (67, 131, 97)], ids=lambda s: "x".join(map(str, s))
)
def test_every_valid_variant_verifies(spec, shape, dtype):
    checked, failures = verify_variants(spec, shape, dtype, seed=1)
    # every valid config: 86 / 60 / 60 at 129x136x264, the scalar fallbacks 6 / 15 / 15 at 67x131x97
    assert checked >= (48 if shape == (129, 136, 264) else 6)
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"
