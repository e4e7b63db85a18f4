"""The layernorm_relu and layernorm_relu_backward specs: layernorm's and layernorm_backward's
spaces, checks, defaults and launches with the epilogue macro on; their problems' references
against an independent float64 computation (torch's autograd of relu(layer_norm(x)) where torch
is installed); the band of dy kept away from the mask's edge; bytes moved."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.layernorm import layernorm_reference
from kato.kernels.layernorm_relu_backward import MASK_MARGIN, pre_activation

LN, FORWARD = get_operator("layernorm"), get_operator("layernorm_relu")
LNB, BACKWARD = get_operator("layernorm_backward"), get_operator("layernorm_relu_backward")
SHAPES = [(1, 1), (7, 31), (33, 1000), (3, 4097), (64, 1031)]


def sample_configs(spec, n=300, seed=0):
    configs = [
        dict(zip(spec.params, c, strict=True)) for c in itertools.product(*spec.params.values())
    ]
    return random.Random(seed).sample(configs, min(n, len(configs)))


@pytest.mark.parametrize(("base", "fused"), [(LN, FORWARD), (LNB, BACKWARD)], ids=["fwd", "bwd"])
def test_same_space_checks_defaults_and_launches_as_the_plain_operator(base, fused):
    """The plain operator's space, defaults, launches and checks (the backward's CACHE=2
    register check one row-sized register set tighter), its defines plus EPILOGUE_RELU=1."""
    assert fused.params == base.params and fused.dtypes == base.dtypes
    assert fused.template == base.template and fused.kernel_names == base.kernel_names
    assert fused.version != base.version
    for shape, dtype in itertools.product(SHAPES + [(8, 2**20 + 1)], fused.dtypes):
        assert fused.default_config(shape, dtype) == base.default_config(shape, dtype)
        for config in sample_configs(fused, n=60, seed=shape[1]):
            reason = fused.check(config, shape, dtype)
            if reason != base.check(config, shape, dtype):
                # The backward's bias loads: register caches at the plain kernel's edge spill.
                assert fused is BACKWARD and config["CACHE"] == 2, (config, reason)
                assert "spill" in reason and "spill" in (
                    base.check(config, shape, dtype) or "spill"
                )
            if reason is None:
                assert fused.steps(config, shape, dtype) == base.steps(config, shape, dtype)
                plain = base.defines(config, shape, dtype)
                assert "EPILOGUE_RELU" not in plain
                assert fused.defines(config, shape, dtype) == {**plain, "EPILOGUE_RELU": 1}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_reference_is_the_clipped_layernorm(shape, dtype):
    problem = FORWARD.make_problem(shape, dtype, np.random.default_rng(1))
    x, weight, bias = problem.args[:3]
    y, mean, rstd = layernorm_reference(x, weight, bias, 1e-5)
    np.testing.assert_array_equal(problem.references[0], np.maximum(y, 0.0))
    np.testing.assert_array_equal(problem.references[1], mean)
    np.testing.assert_array_equal(problem.references[2], rstd)
    assert problem.outputs == [3, 4, 5]
    if shape[1] >= 31:  # both sides of the ReLU in the problem
        clipped = float((problem.references[0] == 0).mean())
        assert 0.3 < clipped < 0.7, clipped


def test_backward_problem_layout_and_bytes():
    shape, dtype = (33, 1000), "bfloat16"
    problem = BACKWARD.make_problem(shape, dtype, np.random.default_rng(2))
    x, weight, bias, mean, rstd, dy, dx, dweight, dbias, partials, nparts, rows, cols = problem.args
    assert problem.outputs == [6, 7, 8]
    assert x.shape == dy.shape == dx.shape == shape and bias.shape == weight.shape == (1000,)
    assert bias.dtype == weight.dtype == DTYPES[dtype][0]
    assert mean.dtype == rstd.dtype == np.float32 and (rows, cols) == shape
    assert np.isnan(dx.astype(np.float32)).all() and np.isnan(partials).all()
    itemsize = 2
    assert BACKWARD.bytes_moved(shape, dtype) == LNB.bytes_moved(shape, dtype) + 1000 * itemsize


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_references_are_autograds_of_relu_layer_norm(shape, dtype):
    """dx, dweight and dbias against torch's float64 autograd of relu(layer_norm) computed from
    the problem's saved mean and rstd (native_layer_norm_backward after threshold_backward on
    the float64 output): equal to rounding."""
    torch = pytest.importorskip("torch")
    problem = BACKWARD.make_problem(shape, dtype, np.random.default_rng(3))
    x, weight, bias, mean, rstd, dy = (
        torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in problem.args[:6]
    )
    y = torch.relu((x - mean[:, None]) * rstd[:, None] * weight + bias)
    g = torch.ops.aten.threshold_backward(dy, y, 0)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        g, x, [shape[1]], mean[:, None], rstd[:, None], weight, bias, [True, True, True]
    )
    for got, want in zip(problem.references, (dx, dw, db), strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dy_is_zero_only_in_the_band_around_the_mask_edge(dtype):
    """Within the band around zero (pre_activation's edge: MASK_MARGIN relative, and the
    float32 rounding of the mean) dy is 0; the band is a small fraction of the elements, and
    outside it dy is left as drawn (never zero)."""
    shape = (256, 1024)
    problem = BACKWARD.make_problem(shape, dtype, np.random.default_rng(4))
    x, weight, bias, mean, rstd, dy = problem.args[:6]
    pre, edge = pre_activation(x, weight, bias, mean, rstd)
    band = np.abs(pre) <= edge
    assert (dy[band] == 0).all()
    assert 0 < band.mean() < 2e-3, band.mean()
    assert (dy[~band] != 0).mean() > 0.999
    # The band is at least MASK_MARGIN of the pre-activation's terms wide.
    w = np.abs(weight.astype(np.float64))
    xw = np.abs(x.astype(np.float64) - mean[:, None]) * rstd[:, None] * w
    assert (edge >= MASK_MARGIN * (xw + np.abs(bias.astype(np.float64)))).all()


def test_a_broken_mask_misses_the_backward_tolerances():
    """The problem's tolerances tell a kernel that forgot the mask (layernorm_backward's
    reference on the unmasked dy) from a correct one."""
    from kato.kernels.layernorm_backward import layernorm_backward_reference

    problem = BACKWARD.make_problem((64, 1031), "float32", np.random.default_rng(5))
    x, weight, _, mean, rstd, dy = problem.args[:6]
    unmasked = layernorm_backward_reference(x, weight, mean, rstd, dy)[:3]
    for got, ref, (atol, rtol) in zip(
        unmasked, problem.references, problem.tolerances, strict=True
    ):
        assert not (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()


def test_the_backward_rejects_only_register_caches_at_the_plain_edge():
    """Every config the fused backward rejects and the plain one admits keeps its rows in
    registers (CACHE=2); the rest of the space is the plain one's, and so is every default."""
    for shape, dtype in itertools.product([(4096, 2048), (64, 4096), (45, 264)], BACKWARD.dtypes):
        plain = fused = 0
        for combo in itertools.product(*BACKWARD.params.values()):
            config = dict(zip(BACKWARD.params, combo, strict=True))
            ok_plain = LNB.check(config, shape, dtype) is None
            ok_fused = BACKWARD.check(config, shape, dtype) is None
            assert ok_fused <= ok_plain and (ok_fused == ok_plain or config["CACHE"] == 2)
            plain, fused = plain + ok_plain, fused + ok_fused
        assert 0.95 * plain <= fused < plain, (shape, dtype, plain, fused)
        assert BACKWARD.default_config(shape, dtype) == LNB.default_config(shape, dtype)
