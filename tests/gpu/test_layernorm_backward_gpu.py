"""layernorm_backward on a real GPU: every valid config verified (batched compiles; dx, dweight
and dbias against their float64 references, the two stages run as one call, twice) for every
dtype at an odd, prime width and at a width where every row has the same head (dweight and dbias
in registers); the default config on awkward shapes; the grid stride with few partial rows; row
arrays that start off a vector boundary; and the backward fed by the layernorm forward kernel's
own saved mean and rstd (the contract between the two)."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator, limits
from kato.kernels.layernorm_backward import layernorm_backward_reference
from rowwise_harness import run_arrays, run_offset, verify_all

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
AWKWARD = [
    (1, 1),
    (1000, 1),
    (1, 4097),
    (3000, 3001),
    (17, 333),
    (262144, 128),
    (8192, 768),
    (16384, 1024),
    (7, 1000003),
    (64, 32768),
    (5, 50257),
]


@pytest.fixture(scope="module")
def spec():
    return get_operator("layernorm_backward")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(37, 1031), (45, 264)], ids=lambda s: "x".join(map(str, s)))
def test_every_valid_config_verifies(spec, dtype, shape):
    """1031 columns: heads differ per row (DW_ACC 1 and 2 only); 264 = 8 * 33: every row has
    the same head, DW_ACC=0 keeps dweight and dbias (and the weight) in registers."""
    checked, sources, failures = verify_all(spec, shape, dtype)
    assert checked > 1000 and sources > 100, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_stride_with_few_partials(spec, dtype, monkeypatch):
    """132 SMs counted as 1: stage 1 has at most SPLIT (<= 8) blocks for 2000 rows, so each
    block sums hundreds of rows into its partial row."""
    monkeypatch.setattr(limits, "NUM_SMS", 1)
    checked, _, failures = verify_all(spec, (2000, 96), dtype, max_configs=96, seed=4)
    assert checked >= 96 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_row_arrays_off_a_vector_boundary(spec, dtype, offset):
    """x, dy and dx start ``offset`` elements past an aligned address, weight, mean, rstd and
    the partials do not: every row has the same non-zero head (DW_ACC=0's fixed columns
    shifted)."""
    shape = (64, 4096)
    default = spec.default_config(shape, dtype)
    for config in (
        default,
        {**default, "DW_ACC": 1},
        {**default, "CACHE": 0, "DW_ACC": 2, "ROW_THREADS": 0},
    ):
        assert spec.check(config, shape, dtype) is None, config
        assert run_offset(spec, config, shape, dtype, (0, 4, 5), offset) == []


def _run(spec, shape, dtype, args):
    return run_arrays(spec, spec.default_config(shape, dtype), shape, dtype, args)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(300, 768), (33, 1031)], ids=lambda s: "x".join(map(str, s)))
def test_backward_of_the_forward_kernels_statistics(spec, dtype, shape):
    """The layernorm forward kernel's own mean and rstd (float32, in the order and with the
    biased variance it saves them; tests/gpu/test_layernorm_gpu.py holds them to the float64
    statistics) fed to the backward: dx, dweight and dbias within the problem's tolerances of
    the float64 reference from those statistics, and the statistics within 1e-5 of x's."""
    import kato.kernels.layernorm_backward as lb

    forward = get_operator("layernorm")
    rng = np.random.default_rng(7)
    fwd = _run(forward, shape, dtype, forward.make_problem(shape, dtype, rng).args)
    x, weight, _, _, mean, rstd = fwd[:6]
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=1), rtol=1e-5, atol=1e-5)
    problem = spec.make_problem(shape, dtype, rng)
    dy = problem.args[4]
    args = [x, weight, mean, rstd, dy, *problem.args[5:]]
    out = _run(spec, shape, dtype, args)
    refs = layernorm_backward_reference(x, weight, mean, rstd, dy)
    tolerances = [
        spec.tolerance(dtype),
        (lb.DW_SUM_ERROR * refs[3].max(), lb.DW_RTOL[dtype]),
        (lb.DW_SUM_ERROR * refs[4].max(), lb.DW_RTOL[dtype]),
    ]
    for got, ref, (atol, rtol) in zip(out[5:8], refs[:3], tolerances, strict=True):
        assert got.dtype == DTYPES[dtype][0]
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol)
