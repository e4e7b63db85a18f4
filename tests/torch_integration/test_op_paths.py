"""KatoOp's two paths (kato_torch/_op.py): where a call must reach the registered custom op."""

from __future__ import annotations

import warnings

import pytest
import torch

from kato_torch._op import KatoOp, eager


@KatoOp.define("_test_opaque_double")
def _opaque_double(x: torch.Tensor) -> torch.Tensor:
    """2x, written where no trace sees it (as a ctypes kernel launch is)."""
    y = torch.empty_like(x)
    y.numpy()[...] = 2 * x.detach().numpy()
    return y


@_opaque_double.register_fake
def _(x):
    return torch.empty_like(x)


def test_plain_calls_are_eager_and_a_jit_trace_records_the_custom_op():
    x = torch.arange(4.0)
    assert eager() and torch.equal(_opaque_double(x), 2 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings on numpy
        traced = torch.jit.trace(lambda t: _opaque_double(t), (x,))
    assert "kato::_test_opaque_double" in str(traced.graph)
    other = torch.tensor([1.0, -3.0, 5.0])
    assert torch.equal(traced(other), 2 * other)  # a trace of its internals would not be


@KatoOp.define("_test_opaque_square")
def _opaque_square(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    y.numpy()[...] = x.detach().numpy() ** 2
    return y


@_opaque_square.register_fake
def _(x):
    return torch.empty_like(x)


def _square_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _square_grad(ctx, dy):
    (x,) = ctx.saved_tensors
    return _opaque_double(x) * dy  # a KatoOp with no autograd formula of its own


_opaque_square.register_autograd(_square_grad, setup_context=_square_setup)


def test_eager_gradients_and_a_double_backward_raise_as_the_custom_op_does():
    """The direct path's autograd.Function gives the formula's gradient; a second derivative
    through an op with no formula raises, as the registered custom op does, instead of
    silently dropping the term."""
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    (g,) = torch.autograd.grad(_opaque_square(x).sum(), x)
    assert torch.equal(g, 2 * x.detach())
    (g,) = torch.autograd.grad(_opaque_square(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        torch.autograd.grad(g.sum(), x)


class _Recording(torch.Tensor):
    """A tensor subclass that records the functions called on it."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(getattr(func, "__name__", func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_goes_through_the_registered_op():
    x = torch.arange(3.0).as_subclass(_Recording)
    _Recording.seen.clear()
    y = _opaque_double(x)
    assert any("_test_opaque_double" in name for name in _Recording.seen), _Recording.seen
    assert torch.equal(y.as_subclass(torch.Tensor), torch.tensor([0.0, 2.0, 4.0]))


@KatoOp.define("_test_scale_and_stat")
def _scale_and_stat(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(3x, -x, max|x|): two differentiable outputs and a statistic, as a norm returns."""
    return 3 * x, -x, x.abs().max()


@_scale_and_stat.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(())


_received: list[tuple] = []


def _scale_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[2])


def _scale_grad(ctx, dy, dz, dstat):
    _received.append((dy, dz, dstat))
    return 3 * dy - dz


_scale_and_stat.register_autograd(_scale_grad, setup_context=_scale_setup)


def test_a_statistic_output_gets_no_zero_gradient_and_an_unused_output_gets_zeros():
    """The eager backward receives None for an output marked non-differentiable (no zero
    tensor allocated and filled every step) and zeros for a differentiable output the loss did
    not use, so the formula sees what the registered custom op's would."""
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    _received.clear()
    y, _, stat = _scale_and_stat(x)
    (g,) = torch.autograd.grad((y * torch.tensor([1.0, 2.0, 3.0])).sum(), x)
    assert torch.equal(g, torch.tensor([3.0, 6.0, 9.0]))
    ((dy, dz, dstat),) = _received
    assert dstat is None
    assert torch.equal(dz, torch.zeros(3)) and torch.equal(dy, torch.tensor([1.0, 2.0, 3.0]))
    assert not stat.requires_grad
