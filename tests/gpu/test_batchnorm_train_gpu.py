"""batchnorm (training forward) and batchnorm_backward on a real GPU: every valid config verified
(batched compiles; every output against its float64 reference, the steps run as one call,
twice) for every dtype at an odd H*W and at H*W = 2 (one element short of an empty vector); a
sample at an H*W every VEC divides; the default config on awkward and ResNet-size shapes; the
single-pass counters still right after many timed calls; the running statistics updated in
place (input and output the same buffer); the backward's sums bitwise the same on every run;
and the chain forward -> backward against torch's batch_norm and its autograd in float64."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.batchnorm import EPS, MOMENTUM
from kato.kernels.batchnorm_backward import (
    DW_SUM_ERROR,
    DX_ERROR,
    DX_RTOL,
    batchnorm_backward_reference,
)
from rowwise_harness import run_arrays, verify_all
from step_runner import upload
from verify_harness import verify_config

DTYPE_NAMES = ["float32", "float16", "bfloat16"]
NAMES = ["batchnorm", "batchnorm_backward"]
AWKWARD = [
    (256, 64, 56, 56),
    (256, 256, 14, 14),
    (128, 512, 7, 7),
    (16, 64, 112, 112),
    (1, 1, 1, 2),  # the fewest elements a training channel may have
    (1000, 3, 1, 1),  # H*W = 1
    (2, 5, 1, 1000003),  # one huge prime plane per (n, c)
    (7, 1, 33, 31),  # one channel
    (1, 7, 13, 1),  # N = 1, a prime plane
    (3, 1031, 3, 3),
]


def _spec(name):
    return get_operator(name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (2, 3, 1, 2)], ids=lambda s: "x".join(map(str, s)))
def test_every_valid_config_verifies(name, dtype, shape):
    spec = _spec(name)
    checked, sources, failures = verify_all(spec, shape, dtype)
    assert checked >= 896 and sources >= 24, (checked, sources)
    assert not failures, failures[:5]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_sampled_configs_verify_where_every_vec_divides(name, dtype):
    checked, _, failures = verify_all(_spec(name), (4, 7, 4, 6), dtype, max_configs=600, seed=3)
    assert checked >= 600 and not failures, failures[:5]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_verifies(name, shape, dtype):
    checked, _, failures = verify_all(_spec(name), shape, dtype, max_configs=0)
    assert checked == 1 and not failures, failures


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_longest_thread_streams_verify(name, dtype):
    """128 threads, SPLIT 1 on a (256, 64, 56, 56) channel: each thread streams 6272 elements
    (the float32 sums' longest sequential runs of the benchmark shapes), and the normalise / dx
    pass runs in the same block."""
    config = {
        "BLOCK_SIZE": 128,
        "VEC": 1,
        "UNROLL": 2,
        "STRATEGY": 1,
        "SPLIT": 1,
        "MIN_BLOCKS": 0,
        "APPLY": 1,
        "APPLY_BLOCK": 256,
        "APPLY_VEC": 1,
    }
    assert verify_config(_spec(name), (256, 64, 56, 56), dtype, config) is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("strategy", [0, 1])
def test_right_after_many_calls(name, strategy):
    """Verify, time (hundreds of calls over rotating buffers), verify again: the single-pass
    counters are back at zero after every call and the two-kernel SPLIT header stays right; then
    another SPLIT on the same buffers."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = _spec(name)
    shape, dtype = (64, 512, 28, 28), "float16"
    config = {
        "BLOCK_SIZE": 256,
        "VEC": 8,
        "UNROLL": 2,
        "STRATEGY": strategy,
        "SPLIT": 16,
        "MIN_BLOCKS": 0,
        "APPLY": 0,
        "APPLY_BLOCK": 512,
        "APPLY_VEC": 4,
    }
    backend = PyCudaBackend(spec, shape, dtype, repeats=3, warmup=2, seed=6)
    try:
        calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
        assert backend.verify(calls) is None
        assert all(t > 0 for t in backend.time(calls))
        assert backend.verify(calls) is None
        other = {**config, "SPLIT": 4, "APPLY": strategy, "APPLY_BLOCK": 256}
        assert spec.check(other, shape, dtype) is None
        calls = backend.load(backend.compile(other), spec.steps(other, shape, dtype))
        assert backend.verify(calls) is None
    finally:
        backend.close()


def _run_aliased(spec, config, shape, dtype, args, alias):
    """Run ``config``'s steps once with argument ``b`` passed as the same device buffer as
    argument ``a`` for every ``(a, b)`` in ``alias``; returns every array copied back."""
    import pycuda.autoprimaryctx  # noqa: F401 - a context for this process
    import pycuda.driver as cuda
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.nvcc import compile_kernel

    source = spec.render(config, shape, dtype)
    module = cuda.module_from_buffer(
        compile_kernel(source, spec.kernel_name, arch=describe_device(0).arch).cubin
    )
    device = upload(cuda, args)
    for a, b in alias:
        device[b] = device[a]
    for step in spec.steps(config, shape, dtype):
        fn = module.get_function(step.kernel)
        fn(*device, block=step.launch.block, grid=step.launch.grid)
    cuda.Context.synchronize()
    out = []
    for a, d in zip(args, device, strict=True):
        host = np.empty_like(a) if isinstance(a, np.ndarray) else a
        if isinstance(a, np.ndarray):
            cuda.memcpy_dtoh(host, d)
        out.append(host)
    return out


@pytest.mark.parametrize("split", [1, 8])
@pytest.mark.parametrize("strategy", [0, 1])
def test_running_statistics_update_in_place(split, strategy):
    """running_mean_in and running_mean one buffer (and the variances): what kato_torch passes
    for a module's buffers. The updated statistics match the reference made from the inputs."""
    spec = _spec("batchnorm")
    shape, dtype = (6, 9, 5, 5), "float32"
    config = {**spec.default_config(shape, dtype), "STRATEGY": strategy, "SPLIT": split}
    config["APPLY"] = 0
    assert spec.check(config, shape, dtype) is None
    problem = spec.make_problem(shape, dtype, np.random.default_rng(4))
    out = _run_aliased(spec, config, shape, dtype, problem.args, [(3, 8), (4, 9)])
    atol, rtol = problem.tolerances[3]
    np.testing.assert_allclose(out[3], problem.references[3], rtol=rtol, atol=atol)
    np.testing.assert_allclose(out[4], problem.references[4], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_backward_is_deterministic(dtype):
    """Single pass with 64 blocks per channel (which block merges varies from run to run): five
    runs give bitwise the same dweight, dbias and dx."""
    spec = _spec("batchnorm_backward")
    shape = (32, 16, 28, 28)
    config = {**spec.default_config(shape, dtype), "STRATEGY": 1, "SPLIT": 64, "APPLY": 0}
    assert spec.check(config, shape, dtype) is None
    problem = spec.make_problem(shape, dtype, np.random.default_rng(5))
    runs = [run_arrays(spec, config, shape, dtype, problem.args) for _ in range(5)]
    for run in runs[1:]:
        for k in (5, 6, 7):
            assert run[k].tobytes() == runs[0][k].tobytes(), k


def _chain(dtype, shape, x=None):
    """The forward kernel (default config) on its problem, x replaced by ``x`` if given, then
    the backward kernel (default config) fed the forward's x, saved mean and invstd and weight
    and a problem's dy. Returns (forward outputs, forward references, forward tolerances, dy,
    backward outputs)."""
    from kato.kernels.batchnorm import batchnorm_reference

    fwd, bwd = _spec("batchnorm"), _spec("batchnorm_backward")
    rng = np.random.default_rng(8)
    problem = fwd.make_problem(shape, dtype, rng)
    args = list(problem.args)
    refs = problem.references
    if x is not None:
        args[0] = x
        refs = batchnorm_reference(x, *args[1:5], EPS, MOMENTUM)
    out = run_arrays(fwd, fwd.default_config(shape, dtype), shape, dtype, args)
    x, weight, mean, invstd = out[0], out[1], out[6], out[7]
    bproblem = bwd.make_problem(shape, dtype, rng)
    dy = bproblem.args[1]
    bargs = [x, dy, mean, invstd, weight, *bproblem.args[5:]]
    got = run_arrays(bwd, bwd.default_config(shape, dtype), shape, dtype, bargs)
    return out, refs, problem.tolerances, dy, got


SHAPES = [(8, 24, 9, 9), (5, 3, 31, 1), (64, 8, 28, 28)]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_of_the_forward_kernels_statistics(dtype, shape):
    """The forward kernel's saved mean and invstd (float32) fed to the backward kernel, on the
    forward's problem (channels at a large offset included): every forward output within its
    tolerance, and dx, dweight, dbias within the problem tolerances of the float64 reference
    from those saved statistics (the contract between the two operators)."""
    out, refs, tolerances, dy, got = _chain(dtype, shape)
    for k, ref, (atol, rtol) in zip(range(5, 10), refs, tolerances, strict=True):
        np.testing.assert_allclose(out[k].astype(np.float64), ref, rtol=rtol, atol=atol)
    x, weight, mean, invstd = out[0], out[1], out[6], out[7]
    dx, dweight, dbias = got[5], got[6], got[7]
    assert dx.dtype == DTYPES[dtype][0] and dweight.dtype == dbias.dtype == np.float32
    ref = batchnorm_backward_reference(x, dy, mean, invstd, weight)
    k = float(np.max(np.abs(weight.astype(np.float64) * invstd)))
    np.testing.assert_allclose(
        dx.astype(np.float64), ref[0], rtol=DX_RTOL[dtype], atol=DX_ERROR * k
    )
    np.testing.assert_allclose(dweight, ref[1], rtol=1e-5, atol=DW_SUM_ERROR * ref[3].max())
    np.testing.assert_allclose(dbias, ref[2], rtol=1e-5, atol=DW_SUM_ERROR * ref[4].max())


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_against_torch_float64(dtype, shape):
    """The chain against torch's batch_norm and its autograd in float64 (exact statistics, no
    saved float32 ones): y and the running statistics, then dx, dweight and dbias of the same
    dy. x without the problems' large offsets (U(-5, 5) + U(0.25, 4) N(0, 1) per channel): a
    float32 mean of 1e4 + N(0, 1) is off by up to 5e-4 of the spread, which moves dweight by
    that times sum dy whoever computes it, torch's float32 kernels included."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    n, c, h, w = shape
    x = rng.uniform(-5, 5, (1, c, 1, 1)) + rng.uniform(0.25, 4, (1, c, 1, 1)) * rng.standard_normal(
        shape
    )
    x = x.astype(np.float32).astype(DTYPES[dtype][0])
    out, _, _, dy, got = _chain(dtype, shape, x)
    _, weight, bias, rm_in, rv_in, y, _, _, rm, rv = out[:10]
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    wt = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    rmt = torch.tensor(rm_in, dtype=torch.float64)
    rvt = torch.tensor(rv_in, dtype=torch.float64)
    yt = torch.nn.functional.batch_norm(xt, rmt, rvt, wt, bt, True, MOMENTUM, EPS)
    y_atol, y_rtol = _spec("batchnorm").tolerance(dtype)
    np.testing.assert_allclose(y.astype(np.float64), yt.detach().numpy(), rtol=y_rtol, atol=y_atol)
    np.testing.assert_allclose(rm, rmt.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rv, rvt.numpy(), rtol=1e-5, atol=1e-5)

    dyt = torch.tensor(dy.astype(np.float64))
    gx, gw, gb = (g.numpy() for g in torch.autograd.grad(yt, (xt, wt, bt), dyt))
    dx, dweight, dbias = got[5].astype(np.float64), got[6], got[7]
    dy64 = dy.astype(np.float64)
    xhat = (
        xt.detach().numpy() - xt.detach().numpy().mean(axis=(0, 2, 3), keepdims=True)
    ) / np.sqrt(xt.detach().numpy().var(axis=(0, 2, 3), keepdims=True) + EPS)
    dw_scale = np.abs(dy64 * xhat).sum(axis=(0, 2, 3)).max()
    np.testing.assert_allclose(
        dbias, gb, rtol=1e-5, atol=DW_SUM_ERROR * np.abs(dy64).sum(axis=(0, 2, 3)).max()
    )
    np.testing.assert_allclose(dweight, gw, rtol=1e-5, atol=DW_SUM_ERROR * dw_scale)
    k = float(np.max(np.abs(weight * out[7])))
    np.testing.assert_allclose(dx, gx, rtol=DX_RTOL[dtype], atol=DX_ERROR * k)
