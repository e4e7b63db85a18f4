"""layernorm_relu and layernorm_relu_backward on a real GPU, as layernorm's and
layernorm_backward's GPU tests hold those: through the backend (every output against its float64
reference), the default config on awkward shapes, seeded samples of variants (the forward's
split rows and GROUP_ROWS=0 pieces included), every valid backward config at a width whose heads
move and one where they do not, row arrays off a vector boundary, and the backward fed by the
forward kernel's own mean and rstd, its mask agreeing with the forward's y."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.layernorm_backward import DW_RTOL, DW_SUM_ERROR
from kato.kernels.layernorm_relu_backward import layernorm_relu_backward_reference, pre_activation
from rowwise_harness import run_arrays, run_offset, verify_all
from verify_harness import verify_variants

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
AWKWARD = [
    (1, 1),
    (1000, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (262144, 128),
    (4096, 2048),
    (16384, 1024),
    (7, 1000003),
    (64, 32768),
]
VARIANT_SHAPES = [(64, 130), (37, 1000), (9, 4104), (301, 128), (33, 127), (40, 3)]


@pytest.fixture(scope="module")
def forward():
    return get_operator("layernorm_relu")


@pytest.fixture(scope="module")
def backward():
    return get_operator("layernorm_relu_backward")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_forward_default_config_verifies(forward, shape, dtype):
    checked, failures = verify_variants(forward, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", VARIANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_sampled_variants_verify(forward, shape, dtype):
    checked, failures = verify_variants(forward, shape, dtype, max_configs=64, seed=3)
    assert checked >= 64
    assert not failures, failures[:5]


@pytest.mark.parametrize(
    ("shape", "dtype"), [((8, 2**20 + 1), "bfloat16"), ((3, 2**20), "float32")]
)
def test_forward_rows_in_pieces_verify(forward, shape, dtype):
    """GROUP_ROWS=0 (two launches, a block per piece; split rows' head and tail in the first
    piece): every sampled variant clips y."""
    checked, failures = verify_variants(
        forward, shape, dtype, max_configs=12, seed=5, where=lambda c: c["GROUP_ROWS"] == 0
    )
    assert checked >= 12 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(37, 1031), (45, 264)], ids=lambda s: "x".join(map(str, s)))
def test_backward_every_valid_config_verifies(backward, dtype, shape):
    """1031 columns: heads differ per row; 264 = 8 * 33: DW_ACC=0 keeps the column sums (and
    the weight) in registers."""
    checked, sources, failures = verify_all(backward, shape, dtype)
    assert checked > 1000 and sources > 100, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_backward_default_config_verifies(backward, shape, dtype):
    checked, _, failures = verify_all(backward, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_backward_row_arrays_off_a_vector_boundary(backward, dtype, offset):
    """x, dy and dx (args 0, 5, 6) start ``offset`` elements past an aligned address; weight,
    bias, mean, rstd and the partials do not."""
    shape = (64, 4096)
    default = backward.default_config(shape, dtype)
    for config in (
        default,
        {**default, "DW_ACC": 1},
        {**default, "CACHE": 0, "DW_ACC": 2, "ROW_THREADS": 0},
    ):
        assert backward.check(config, shape, dtype) is None, config
        assert run_offset(backward, config, shape, dtype, (0, 5, 6), offset) == []


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(300, 768), (33, 1031), (4096, 2048)], ids=str)
def test_backward_of_the_forward_kernels_output(forward, backward, dtype, shape):
    """The forward kernel's mean and rstd fed to the backward kernel (the pair kato_torch runs):
    dx, dweight and dbias within tolerance of the float64 reference from those statistics
    (dy zeroed in pre_activation's band around zero), and the forward's y positive exactly
    where the mask recomputed from the saved statistics passes dy outside that band (which
    covers the float32 rounding of the saved mean the forward normalised without)."""
    rng = np.random.default_rng(7)
    fwd_problem = forward.make_problem(shape, dtype, rng)
    fwd = run_arrays(forward, forward.default_config(shape, dtype), shape, dtype, fwd_problem.args)
    x, weight, bias, y, mean, rstd = fwd[:6]
    problem = backward.make_problem(shape, dtype, rng)
    dy = problem.args[5].copy()
    pre, edge = pre_activation(x, weight, bias, mean, rstd)
    outside = np.abs(pre) > edge
    dy[~outside] = 0
    assert outside.mean() > 0.99
    assert ((y.astype(np.float64) > 0) == (pre > 0))[outside].all()
    args = [x, weight, bias, mean, rstd, dy, *problem.args[6:]]
    out = run_arrays(backward, backward.default_config(shape, dtype), shape, dtype, args)
    refs = layernorm_relu_backward_reference(x, weight, bias, mean, rstd, dy)
    tolerances = [
        backward.tolerance(dtype),
        (DW_SUM_ERROR * refs[3].max(), DW_RTOL[dtype]),
        (DW_SUM_ERROR * refs[4].max(), DW_RTOL[dtype]),
    ]
    for got, ref, (atol, rtol) in zip(out[6:9], refs[:3], tolerances, strict=True):
        assert got.dtype == DTYPES[dtype][0]
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol)
