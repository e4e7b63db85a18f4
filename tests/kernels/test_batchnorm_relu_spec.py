"""The fused batchnorm + relu specs (``batchnorm_relu``, ``batchnorm_add_relu`` and their
backwards): what they share with batchnorm / batchnorm_backward (space, checks, defaults,
steps), the epilogue macro they render, argument lists, and their float64 references against
torch's own float64 ``relu(batch_norm(x) [+ r])`` and its autograd."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import InvalidInput, get_operator, list_operators
from kato.kernels.batchnorm_relu_backward import MASK_MARGIN

BN = get_operator("batchnorm")
BNB = get_operator("batchnorm_backward")
RELU = get_operator("batchnorm_relu")
ADD_RELU = get_operator("batchnorm_add_relu")
RELU_BWD = get_operator("batchnorm_relu_backward")
ADD_RELU_BWD = get_operator("batchnorm_add_relu_backward")
SPECS = [RELU, ADD_RELU, RELU_BWD, ADD_RELU_BWD]
AWKWARD = [(1, 1, 1, 2), (2, 3, 5, 7), (1, 1, 1, 1000003), (1000, 3, 1, 1), (16, 2048, 7, 7),
           (64, 64, 112, 112), (64, 512, 7, 7)]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_registered_sharing_the_templates_and_space(spec) -> None:
    base = BN if spec in (RELU, ADD_RELU) else BNB
    assert spec in list_operators()
    assert spec.template == base.template and spec.kernel_names == base.kernel_names
    assert spec.params == base.params
    shape, dtype = (8, 16, 14, 14), "bfloat16"
    config = base.default_config(shape, dtype)
    assert spec.check(config, shape, dtype) is None
    assert spec.steps(config, shape, dtype) == base.steps(config, shape, dtype)
    # The same text with the operator's epilogue macro in front: nothing else differs.
    mine, theirs = spec.render(config, shape, dtype), base.render(config, shape, dtype)
    assert "BN_RELU" not in theirs.split("\n//", 1)[0]  # the defines before the template
    assert mine.replace(f"#define BN_RELU {spec.relu_mode}\n", "") == theirs
    assert spec.relu_mode == (1 if spec in (RELU, RELU_BWD) else 2)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_default_configs_are_valid(spec, dtype) -> None:
    for shape in AWKWARD:
        assert spec.check(spec.default_config(shape, dtype), shape, dtype) is None, shape


def test_validate_refuses_one_value_per_channel() -> None:
    for spec in SPECS[:2]:
        with pytest.raises(InvalidInput, match="more than one value per channel"):
            spec.validate((1, 4, 1, 1), "float32")


def test_argument_lists_and_outputs() -> None:
    shape, rng = (2, 5, 3, 7), np.random.default_rng(0)
    p = ADD_RELU.make_problem(shape, "float16", rng)
    assert [a.shape for a in p.args[:2]] == [shape, shape] and p.args[1].dtype == np.float16
    assert p.outputs == [6, 7, 8, 9, 10] and len(p.args) == 18
    assert np.isnan(p.args[6]).all()
    p = RELU_BWD.make_problem(shape, "float32", rng)
    assert p.outputs == [6, 7, 8] and p.args[5].shape == (5,) and len(p.args) == 14
    p = ADD_RELU_BWD.make_problem(shape, "bfloat16", rng)
    assert p.outputs == [6, 7, 8, 9] and len(p.args) == 15
    assert p.args[2].shape == shape and p.args[9].shape == shape
    assert p.tolerances[3] == (0.0, 0.0)  # dresidual is dy's values or 0: exact


def test_forward_references_are_torch_in_float64() -> None:
    torch = pytest.importorskip("torch")
    for spec in (RELU, ADD_RELU):
        problem = spec.make_problem((4, 6, 3, 5), "bfloat16", np.random.default_rng(2))
        args = problem.args
        x, r = args[0], (args[1] if spec is ADD_RELU else None)
        w, b, rm_in, rv_in = args[2:6] if spec is ADD_RELU else args[1:5]
        rm = torch.tensor(rm_in, dtype=torch.float64)
        rv = torch.tensor(rv_in, dtype=torch.float64)
        y = torch.nn.functional.batch_norm(
            torch.tensor(x.astype(np.float64)), rm, rv, torch.tensor(w, dtype=torch.float64),
            torch.tensor(b, dtype=torch.float64), training=True, momentum=0.1, eps=1e-5,
        )  # fmt: skip
        if r is not None:
            y = y + torch.tensor(r.astype(np.float64))
        y = torch.relu(y).numpy()
        assert 0.3 < (y == 0).mean() < 0.8  # both sides of the ReLU
        np.testing.assert_allclose(problem.references[0], y, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(problem.references[3], rm.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(problem.references[4], rv.numpy(), rtol=1e-12, atol=1e-12)


def _torch_grads(torch, x, w, b, dy, residual=None, y_mask=None):
    """float64 autograd of relu(batch_norm(x) [+ r]) (y_mask: relu's mask given instead)."""
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    rt = torch.zeros(x.shape, dtype=torch.float64, requires_grad=True)
    z = torch.nn.functional.batch_norm(xt, None, None, wt, bt, training=True, eps=1e-5) + rt
    out = torch.relu(z) if y_mask is None else z * torch.tensor(y_mask)
    grads = torch.autograd.grad(out, (xt, wt, bt, rt), torch.tensor(dy.astype(np.float64)))
    return [g.numpy() for g in grads]


def test_relu_backward_references_are_torch_autograd_in_float64() -> None:
    """dx, dweight, dbias against torch's float64 autograd of relu(batch_norm(x)) (statistics
    recomputed from x: they agree to the float32 rounding of the saved ones); and the mask
    matters: the plain batchnorm backward of the same dy is far off."""
    torch = pytest.importorskip("torch")
    problem = RELU_BWD.make_problem((5, 6, 3, 7), "float16", np.random.default_rng(3))
    x, dy, mean, invstd, w, b = problem.args[:6]
    gx, gw, gb, _ = _torch_grads(torch, x, w, b, dy)
    dx_ref, dw_ref, db_ref = problem.references
    np.testing.assert_allclose(db_ref, gb, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw_ref, gw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx_ref, gx, rtol=1e-5, atol=1e-5)
    plain = BNB.make_problem((5, 6, 3, 7), "float16", np.random.default_rng(3))
    assert not np.allclose(plain.references[0], dx_ref, atol=0.1)
    # dy is 0 wherever bn(x) is within MASK_MARGIN of 0, and only there beyond chance.
    y = (x.astype(np.float64) - mean[None, :, None, None]) * (invstd * w)[None, :, None, None]
    y += b[None, :, None, None]
    assert (dy[np.abs(y) < MASK_MARGIN] == 0).all()


def test_add_relu_backward_references_are_torch_autograd_in_float64() -> None:
    """dx, dweight, dbias, dresidual against torch's float64 autograd with relu's mask taken
    from the problem's y (as threshold_backward does)."""
    torch = pytest.importorskip("torch")
    problem = ADD_RELU_BWD.make_problem((5, 6, 3, 7), "bfloat16", np.random.default_rng(4))
    x, dy, y, mean, invstd, w = problem.args[:6]
    mask = (y.astype(np.float64) > 0).astype(np.float64)
    assert 0.3 < mask.mean() < 0.9
    gx, gw, gb, gr = _torch_grads(torch, x, w, np.zeros(6, np.float32), dy, y_mask=mask)
    dx_ref, dw_ref, db_ref, dres_ref = problem.references
    np.testing.assert_array_equal(dres_ref, gr)
    np.testing.assert_allclose(db_ref, gb, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw_ref, gw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx_ref, gx, rtol=1e-5, atol=1e-5)


def test_bytes_moved() -> None:
    shape, e = (32, 256, 56, 56), 32 * 256 * 56 * 56
    assert RELU.bytes_moved(shape, "float16") == BN.bytes_moved(shape, "float16")
    assert ADD_RELU.bytes_moved(shape, "float16") == BN.bytes_moved(shape, "float16") + 2 * e
    assert RELU_BWD.bytes_moved(shape, "bfloat16") == BNB.bytes_moved(shape, "bfloat16") + 4 * 256
    assert ADD_RELU_BWD.bytes_moved(shape, "float32") == BNB.bytes_moved(shape, "float32") + 8 * e
