"""The fused batchnorm + relu operators (``batchnorm_relu``, ``batchnorm_add_relu`` and their
backwards) on a real GPU: every valid config verified (batched compiles; every output against
its float64 reference, the steps run as one call, twice) for every dtype at an odd H*W; a
sample at an H*W every VEC divides; the default config on awkward and ResNet-size shapes; the
single-pass counters still right after many timed calls; and the chains forward -> backward
(the forward kernel's saved statistics and output feeding the backward kernel) against torch's
float64 relu(batch_norm(x) [+ r]) and its autograd.

    python3 -m pytest -q tests/gpu/test_batchnorm_relu_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.batchnorm_backward import DW_SUM_ERROR, DX_ERROR, DX_RTOL
from rowwise_harness import run_arrays, verify_all

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
NAMES = [
    "batchnorm_relu",
    "batchnorm_add_relu",
    "batchnorm_relu_backward",
    "batchnorm_add_relu_backward",
]
AWKWARD = [
    (64, 64, 112, 112),  # ResNet-18's stem at batch 64
    (64, 64, 56, 56),
    (64, 128, 28, 28),
    (64, 256, 14, 14),
    (64, 512, 7, 7),
    (1, 1, 1, 2),
    (1000, 3, 1, 1),
    (2, 5, 1, 1000003),
    (7, 1, 33, 31),
    (3, 1031, 3, 3),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_valid_config_verifies(name, dtype):
    checked, sources, failures = verify_all(get_operator(name), (3, 5, 7, 9), dtype)
    assert checked >= 896 and sources >= 24, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_sampled_configs_verify_where_every_vec_divides(name, dtype):
    spec = get_operator(name)
    checked, _, failures = verify_all(spec, (4, 7, 4, 6), dtype, max_configs=300, seed=3)
    assert checked >= 300 and not failures, failures[:5]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(name, shape, dtype):
    checked, _, failures = verify_all(get_operator(name), shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("name", NAMES)
def test_right_after_many_calls(name):
    """Verify, time (hundreds of calls over rotating buffers), verify again: the single-pass
    counters are back at zero after every call."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = get_operator(name)
    shape, dtype = (64, 128, 28, 28), "bfloat16"
    config = {
        "BLOCK_SIZE": 256,
        "VEC": 4,
        "UNROLL": 2,
        "STRATEGY": 1,
        "SPLIT": 16,
        "MIN_BLOCKS": 0,
        "APPLY": 1,
        "APPLY_BLOCK": 256,
        "APPLY_VEC": 4,
    }
    assert spec.check(config, shape, dtype) is None
    backend = PyCudaBackend(spec, shape, dtype, repeats=3, warmup=2, seed=6)
    try:
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        assert backend.verify(calls) is None
        assert all(t > 0 for t in backend.time(calls))
        assert backend.verify(calls) is None
    finally:
        backend.close()


def _x(shape, dtype, rng):
    """x without the problems' large offsets (U(-5, 5) + U(0.25, 4) N(0, 1) per channel)."""
    c = shape[1]
    x = rng.uniform(-5, 5, (1, c, 1, 1)) + rng.uniform(0.25, 4, (1, c, 1, 1)) * (
        rng.standard_normal(shape)
    )
    return x.astype(np.float32).astype(DTYPES[dtype][0])


SHAPES = [(8, 24, 9, 9), (5, 3, 31, 1), (16, 8, 28, 28)]


@pytest.mark.parametrize("residual", [False, True], ids=["relu", "add_relu"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_against_torch_float64(residual, dtype, shape):
    """The forward kernel (default config) on x [and a residual], its y, saved mean and
    invstd (and its y, for the add variant's mask) fed to the backward kernel with a random dy:
    y and the running statistics against torch's float64 relu(batch_norm(x) [+ r]), dx,
    dweight, dbias [, dresidual] against its autograd. dy is 0 where relu's input is within
    1e-3 or twice y's atol of 0 (relu's gradient there depends on roundings: bn(x)'s before
    the add, in float16 / bfloat16)."""
    torch = pytest.importorskip("torch")
    fwd = get_operator("batchnorm_add_relu" if residual else "batchnorm_relu")
    bwd = get_operator(f"{fwd.name}_backward")
    rng = np.random.default_rng(9)
    n, c, h, w = shape
    problem = fwd.make_problem(shape, dtype, rng)
    args = list(problem.args)
    x = args[0] = _x(shape, dtype, rng)
    k = 2 if residual else 1  # weight's position
    out = run_arrays(fwd, fwd.default_config(shape, dtype), shape, dtype, args)
    weight, bias, rm_in, rv_in = out[k : k + 4]
    y, mean, invstd, rm, rv = out[k + 4 : k + 9]

    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    wt = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    rt = torch.tensor(args[1].astype(np.float64) if residual else np.zeros(shape),
                      requires_grad=True)  # fmt: skip
    rmt, rvt = torch.tensor(rm_in, dtype=torch.float64), torch.tensor(rv_in, dtype=torch.float64)
    zt = torch.nn.functional.batch_norm(xt, rmt, rvt, wt, bt, True, 0.1, 1e-5) + rt
    yt = torch.relu(zt)
    # The problem's y tolerance, for this x: the add variant's atol carries bn(x)'s rounding
    # before the add (half an ulp of the largest |bn(x)|).
    atol, rtol = fwd.Y_TOLERANCES[dtype]
    if residual:
        bn = (zt - rt).detach().numpy()
        atol += fwd.UNIT_ROUNDOFF[dtype] * float(np.abs(bn).max())
    np.testing.assert_allclose(y.astype(np.float64), yt.detach().numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(rm, rmt.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rv, rvt.numpy(), rtol=1e-5, atol=1e-5)

    dy = rng.standard_normal(shape)
    dy[np.abs(zt.detach().numpy()) < max(1e-3, 2 * atol)] = 0.0
    dy = dy.astype(np.float32).astype(DTYPES[dtype][0])
    bproblem = bwd.make_problem(shape, dtype, rng)
    if residual:  # x, dy, y, mean, invstd, weight, dx, dweight, dbias, dresidual, ...
        bargs = [x, dy, y, mean, invstd, weight, *bproblem.args[6:]]
    else:  # x, dy, mean, invstd, weight, bias, dx, dweight, dbias, ...
        bargs = [x, dy, mean, invstd, weight, bias, *bproblem.args[6:]]
    got = run_arrays(bwd, bwd.default_config(shape, dtype), shape, dtype, bargs)
    dx, dweight, dbias = got[6].astype(np.float64), got[7], got[8]
    dyt = torch.tensor(dy.astype(np.float64))
    gx, gw, gb, gr = (g.numpy() for g in torch.autograd.grad(yt, (xt, wt, bt, rt), dyt))
    g = np.where(zt.detach().numpy() > 0, dy.astype(np.float64), 0.0)
    xhat = (x.astype(np.float64) - x.astype(np.float64).mean(axis=(0, 2, 3), keepdims=True)) / (
        np.sqrt(x.astype(np.float64).var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    )
    np.testing.assert_allclose(
        dbias, gb, rtol=1e-5, atol=DW_SUM_ERROR * np.abs(g).sum(axis=(0, 2, 3)).max()
    )
    np.testing.assert_allclose(
        dweight, gw, rtol=1e-5, atol=DW_SUM_ERROR * np.abs(g * xhat).sum(axis=(0, 2, 3)).max()
    )
    scale = float(np.max(np.abs(weight * invstd)))
    np.testing.assert_allclose(dx, gx, rtol=DX_RTOL[dtype], atol=DX_ERROR * scale)
    if residual:
        np.testing.assert_array_equal(got[9].astype(np.float64), gr)
