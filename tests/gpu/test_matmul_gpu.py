"""matmul, matmul_nt and matmul_tn on a real GPU: every dtype, awkward shapes, default config
and every valid variant.

Shapes: single elements, primes, GEMV-like M=1 / N=1, K not a multiple of BK, a very tall
70000 x 64 x 64, 4096^3 (the default's wide-tile path), and rows whose pitch is not a multiple
of the vector width (which loads those rows' vectors element by element). The variant sweeps
run every valid config of each layout in each alignment class: matmul at 129 x 136 x 264 (every
matrix aligned, nothing a multiple of a tile) and 67 x 131 x 97 (all odd); every layout at
127 x 129 x 131, 1 x 1 x 1 and 33 x 8191 x 17 (no row aligned: VEC 4 and 8 stay valid), and at
136 x 136 x 264 (aligned); and a sample of the two mixed classes (one operand aligned).
"""

from __future__ import annotations

import pytest
from verify_harness import verify_variants

from kernels import get_operator

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
OPERATORS = ["matmul", "matmul_nt", "matmul_tn"]
AWKWARD = [
    (1, 1, 1),
    (127, 131, 257),
    (1, 4096, 4096),
    (4096, 1, 4096),
    (300, 200, 1000),
    (70000, 64, 64),
    (129, 136, 264),
    (4096, 4096, 4096),
    (33, 8191, 17),
    (4095, 4097, 4093),
    (1025, 768, 3071),
]
_IDS = {"ids": lambda s: "x".join(map(str, s))}


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_default_config_verifies(operator, shape, dtype):
    """The backend's device-side verification (poisoned C, float64 reference, K-scaled
    tolerance) passes for the default config."""
    from tuner.backends.pycuda import PyCudaBackend

    spec = get_operator(operator)
    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=0)
    try:
        config = spec.default_config(shape, dtype)
        assert backend.check(config) is None
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        assert backend.verify(calls) is None
    finally:
        backend.close()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(129, 136, 264), (67, 131, 97)], **_IDS)
def test_every_valid_matmul_variant_verifies(shape, dtype):
    checked, failures = verify_variants(get_operator("matmul"), shape, dtype, seed=1)
    # every valid config: 86 / 60 / 60 at 129x136x264; 78 / 18 / 18 at 67x131x97 (VEC 4 / 8
    # load the unaligned rows element by element)
    assert checked >= 18
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(127, 129, 131), (1, 1, 1), (33, 8191, 17)], **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_every_valid_variant_verifies_where_no_row_is_aligned(operator, shape, dtype):
    spec = get_operator(operator)
    checked, failures = verify_variants(spec, shape, dtype, seed=2)
    assert {c["VEC"] for c in spec_space(spec, shape, dtype)} == (
        {1, 4} if dtype == "float32" else {1, 8}
    )
    assert checked >= 18  # 78 / 78 / 38 float32 (matmul, _nt, _tn), 18 on tensor cores
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("operator", ["matmul_nt", "matmul_tn"])
def test_every_valid_layout_variant_verifies_aligned(operator, dtype):
    checked, failures = verify_variants(get_operator(operator), (136, 136, 264), dtype, seed=3)
    assert checked >= 40  # 86 / 60 / 60 (matmul_nt), 40 / 60 / 60 (matmul_tn)
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(136, 129, 264), (129, 136, 263)], **_IDS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_mixed_alignment_variants_verify(operator, shape, dtype):
    """Some of A, B and C aligned, the others not (pitches K or M, K or N, N): 24 configs."""
    spec = get_operator(operator)
    checked, failures = verify_variants(spec, shape, dtype, max_configs=24, seed=4)
    assert checked >= 24
    assert not failures, f"{len(failures)} of {checked} failed: {failures[:5]}"


def spec_space(spec, shape, dtype):
    from tuner.space import SearchSpace

    return SearchSpace(spec.params, lambda c: spec.check(c, shape, dtype)).valid_configs()
