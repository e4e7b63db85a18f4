"""add_layernorm on a real GPU: every valid config verified (batched compiles; s, y, mean and
rstd against their float64 references) for every dtype at an odd, prime width; the default
config on awkward shapes; a sampled set at widths where every row has the same head (weight and
bias in registers); the grid stride; row arrays that start off a vector boundary; and
layernorm_backward fed by add_layernorm's own s, mean and rstd (the contract between the two)."""

from __future__ import annotations

import kato.kernels.layernorm_backward as lb
import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator, limits
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
    return get_operator("add_layernorm")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_valid_config_verifies(spec, dtype):
    checked, sources, failures = verify_all(spec, (37, 1031), dtype)
    assert checked > 500 and sources > 100, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(spec, shape, dtype):
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    "shape", [(64, 130), (9, 4104), (301, 128)], ids=lambda s: "x".join(map(str, s))
)
def test_sampled_configs_verify(spec, shape, dtype):
    """128 columns and 4104 (= 8 * 513): widths where every row has the same head, so CACHE=2
    keeps weight and bias in registers (WB_REGS)."""
    checked, _, failures = verify_all(spec, shape, dtype, max_configs=96, seed=3)
    assert checked >= 96 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_stride_over_rows(spec, dtype, monkeypatch):
    monkeypatch.setattr(limits, "MAX_GRID_X", 7)
    checked, _, failures = verify_all(spec, (2000, 96), dtype, max_configs=64, seed=4)
    assert checked >= 64 and not failures, failures[:5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_row_arrays_off_a_vector_boundary(spec, dtype, offset):
    """x, the residual, s and y start ``offset`` elements past an aligned address, weight and
    bias do not: every row has a head, and their vectors are misaligned against the row's
    (element loads), with and without WB_REGS; CACHE=0 reads s back from the shifted rows."""
    shape = (64, 4096)
    default = spec.default_config(shape, dtype)
    for config in (default, {**default, "CACHE": 0}, {**default, "CACHE": 1}):
        assert spec.check(config, shape, dtype) is None
        assert run_offset(spec, config, shape, dtype, (0, 1, 4, 5), offset) == []


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(300, 768), (33, 1031)], ids=lambda s: "x".join(map(str, s)))
def test_layernorm_backward_of_the_saved_sum(spec, dtype, shape):
    """add_layernorm's s (element type), mean and rstd (float32) fed to layernorm_backward as
    its x, mean and rstd: dx, dweight and dbias within layernorm_backward's tolerances of the
    float64 reference from them, and the saved statistics within 1e-5 of s's own."""
    backward = get_operator("layernorm_backward")
    rng = np.random.default_rng(9)
    fwd = run_arrays(spec, spec.default_config(shape, dtype), shape, dtype,
                     spec.make_problem(shape, dtype, rng).args)  # fmt: skip
    weight, s, mean, rstd = fwd[2], fwd[4], fwd[6], fwd[7]
    s64 = s.astype(np.float64)
    np.testing.assert_allclose(mean, s64.mean(axis=1), rtol=1e-5, atol=1e-5)
    var = ((s64 - s64.mean(axis=1, keepdims=True)) ** 2).mean(axis=1)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(var + lb.EPS), rtol=1e-5)
    problem = backward.make_problem(shape, dtype, rng)
    dy = problem.args[4]
    args = [s, weight, mean, rstd, dy, *problem.args[5:]]
    out = run_arrays(backward, backward.default_config(shape, dtype), shape, dtype, args)
    ref_dx, ref_dw, ref_db, dw_abs, db_abs = lb.layernorm_backward_reference(
        s, weight, mean, rstd, dy
    )
    # Rows 2, 6, ... of s cancel to a hundredth of x: rstd and |dx| there are ~100x the
    # backward problem's own, so dx's atol covers a few float32 ulp of the largest |dx|.
    atol, rtol = backward.tolerance(dtype)
    tolerances = [
        (max(atol, 2.0**-20 * float(np.abs(ref_dx).max())), rtol),
        (lb.DW_SUM_ERROR * dw_abs.max(), lb.DW_RTOL[dtype]),
        (lb.DW_SUM_ERROR * db_abs.max(), lb.DW_RTOL[dtype]),
    ]
    refs = (ref_dx, ref_dw, ref_db)
    for got, ref, (atol, rtol) in zip(out[5:8], refs, tolerances, strict=True):
        assert got.dtype == DTYPES[dtype][0]
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol)
