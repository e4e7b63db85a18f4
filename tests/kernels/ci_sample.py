"""CI's share of the emulation tests' (dtype x parameters) sweeps, and their full run.

A fused operator's emulation test that reruns its plain kernel's (dtype x parameters) sweep with
an epilogue builds and runs one template instance per case, most of them repeating what the
plain kernel's own test shows: the code paths are the parameters' values, and the epilogue is
the same code in every dtype. CI therefore runs :func:`rotated`: each combination of the
parameters once, its dtype rotating with their values, so that every dtype still meets every
value of each parameter; ``-m slow`` (:data:`EVERY_DTYPE`) runs the whole product.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from cuda_emulation import Case

#: Parametrises a test with ``every_dtype``: False in CI (its :func:`rotated` sample), True under
#: ``-m slow`` (the whole product).
EVERY_DTYPE = pytest.mark.parametrize(
    "every_dtype", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sample", "full"]
)


def rotated(cases: Sequence[Case], keys: Sequence[str], turn: int = 0) -> list[Case]:
    """The cases whose dtype is the ``(sum of the indices of their keys' values in
    spec.params + turn) % len(spec.dtypes)``-th of the spec's dtypes: from a sweep holding every
    (dtype, *keys), each combination of ``keys`` once and every (dtype, value of a key) pair.
    ``turn`` shifts which dtype a combination gets (to keep some other feature, such as every
    shape, in the sample). Raises ``ValueError`` on a case whose key value is not in the spec's
    space."""
    kept = []
    for c in cases:
        spec = c.spec
        index = sum(spec.params[k].index(c.config[k]) for k in keys) + turn
        if index % len(spec.dtypes) == spec.dtypes.index(c.dtype):
            kept.append(c)
    return kept


def assert_rotated(cases: Sequence[Case], keys: Sequence[str]) -> None:
    """Every dtype of the cases' spec meets every value of each key that the cases reach."""
    dtypes = cases[0].spec.dtypes
    for key in keys:
        pairs = {(c.dtype, c.config[key]) for c in cases}
        assert pairs == {(d, v) for d in dtypes for _, v in pairs}, key
