"""An expression whose arithmetic leaves the real numbers is a clear ExpressionError (a 4xx at
the API), not a TypeError from a later comparison (a 500)."""

from __future__ import annotations

import pytest
from kato.kernels.user.expr import ExpressionError, parse


@pytest.mark.parametrize("text", ["(-8) ** 0.5 > 1", "max((-1) ** 0.5, 2)", "x ** 0.5 == 2"])
def test_a_complex_result_is_refused_with_a_reason(text):
    with pytest.raises(ExpressionError, match="not a real number|takes numbers"):
        parse(text, ["x"]).evaluate({"x": -4})


def test_real_powers_still_evaluate():
    assert parse("x ** 0.5 == 2", ["x"]).evaluate({"x": 4}) is True
    assert parse("(-8) ** 2", ["x"]).evaluate({"x": 0}) == 64
