"""``kato_torch.layer_norm_relu`` and its custom operators on the CPU (the path a tensor Kato's
kernels cannot run on takes): schemas, fake and autograd registrations (opcheck), values and
gradients identical to ``torch.relu(F.layer_norm(...))``, what it leaves to PyTorch, shape
capture and a compiled graph. Kato's kernels: tests/gpu/test_layer_norm_relu_torch_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import kato_torch

SHAPES = [(1, 1), (3, 7), (33, 130), (2, 5, 9)]


def _inputs(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cols = shape[-1]
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3 + 20
    w = torch.randn(cols, generator=gen, dtype=torch.float64)
    b = torch.randn(cols, generator=gen, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (x, w, b)]


def _reference(x, w, b, eps=1e-5):
    return torch.relu(torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps))


def _outputs_and_grads(fn, inputs, seed=1):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    return y, torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize("shape", SHAPES)
def test_values_and_gradients_are_torchs_exactly(shape):
    """Public function and custom op: y, dx, dweight and dbias bit for bit those of autograd
    through F.layer_norm and torch.relu (the fallback runs the same ATen ops), with both
    clipped and passed elements in every row of more than one column."""
    x, w, b = _inputs(shape)
    want, want_grads = _outputs_and_grads(_reference, [x, w, b])
    if shape[-1] > 1:
        assert (want == 0).any() and (want > 0).any()
    for fn in (
        lambda x, w, b: kato_torch.layer_norm_relu(x, (x.shape[-1],), w, b),
        lambda x, w, b: torch.ops.kato.layer_norm_relu(x.contiguous(), w, b, 1e-5)[0],
    ):
        got, got_grads = _outputs_and_grads(fn, [x, w, b])
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        for g, r in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, r, atol=0, rtol=0)


def test_a_wrong_mask_would_show():
    """The comparison above can fail: the gradient of layer_norm without the ReLU differs."""
    x, w, b = _inputs((33, 130))
    _, relu_grads = _outputs_and_grads(_reference, [x, w, b])
    _, plain_grads = _outputs_and_grads(
        lambda x, w, b: torch.nn.functional.layer_norm(x, (130,), w, b), [x, w, b]
    )
    for g, r in zip(relu_grads, plain_grads, strict=True):
        assert not torch.allclose(g, r, atol=1e-3, rtol=1e-3)


def test_the_custom_ops_pass_opcheck_and_return_float32_statistics():
    x, w, b = (t.detach().requires_grad_() for t in _inputs((5, 12)))
    opcheck(torch.ops.kato.layer_norm_relu.default, (x, w, b, 1e-5))
    y, mean, rstd = torch.ops.kato.layer_norm_relu(x, w, b, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (5,)
    x64 = x.detach().double()
    torch.testing.assert_close(mean.double(), x64.mean(-1), atol=1e-5, rtol=1e-5)
    dy = torch.randn(5, 12)
    args = (x.detach(), w.detach(), b.detach(), mean, rstd, y.detach(), dy)
    opcheck(torch.ops.kato.layer_norm_relu_backward.default, args)
    dx, dw, db = torch.ops.kato.layer_norm_relu_backward(*args)
    g = torch.where(y.detach() > 0, dy, 0.0)
    want = torch.autograd.grad(torch.nn.functional.layer_norm(x, (12,), w, b), (x, w, b), g)
    for got, ref in zip((dx, dw, db), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_what_kato_does_not_cover_goes_to_pytorch():
    """No bias, no weight, a normalized shape over two dims, float64: torch's own result."""
    x = torch.randn(2, 3, 4)
    w = torch.randn(4)
    torch.testing.assert_close(
        kato_torch.layer_norm_relu(x, (4,), w),
        torch.relu(torch.nn.functional.layer_norm(x, (4,), w)),
    )
    torch.testing.assert_close(
        kato_torch.layer_norm_relu(x, (3, 4)), torch.relu(torch.nn.functional.layer_norm(x, (3, 4)))
    )
    x64, w64, b64 = _inputs((3, 6), torch.float64)
    torch.testing.assert_close(
        kato_torch.layer_norm_relu(x64, (6,), w64, b64), _reference(x64, w64, b64), atol=0, rtol=0
    )


def test_record_lists_the_fused_forward_and_backward_keys():
    x, w, b = _inputs((6, 16))
    with kato_torch.record() as rec:
        kato_torch.layer_norm_relu(x, (16,), w, b).sum().backward()
    keys = {(k.operator, k.shape, k.dtype) for k in rec.keys}
    assert keys == {
        ("layernorm_relu", (6, 16), "float32"),
        ("layernorm_relu_backward", (6, 16), "float32"),
    }


def test_compiled_graph_keeps_the_fused_op():
    """torch.compile(fullgraph=True, aot_eager) traces the op and its backward op."""
    x, w, b = _inputs((6, 16))

    def step(x, w, b):
        return torch.ops.kato.layer_norm_relu(x, w, b, 1e-5)[0].square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, w, b)
    grads = torch.autograd.grad(got, (x, w, b))
    want = _reference(x, w, b).square().sum()
    want_grads = torch.autograd.grad(want, (x, w, b))
    torch.testing.assert_close(got, want)
    for g, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, r)
