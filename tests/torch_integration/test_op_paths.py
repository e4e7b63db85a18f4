"""KatoOp's two paths (kato_torch/_op.py): where a call must reach the registered custom op."""

from __future__ import annotations

import warnings

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
