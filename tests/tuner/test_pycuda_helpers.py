"""The pycuda backend's pure helpers (no GPU): the verification poison and the shared-memory
opt-in rule. The GPU side is tests/gpu/test_backend_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels.limits import SHARED_WITHOUT_OPT_IN, needs_shared_opt_in
from kato.tuner.backends.pycuda import poison_word


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_outputs_are_poisoned_with_nan(dtype) -> None:
    word = poison_word(np.dtype(dtype), np.zeros(4))
    bits = np.array([word], dtype=f"u{np.dtype(dtype).itemsize}").view(dtype)
    assert np.isnan(bits).all()


def test_an_int_poison_is_a_value_the_reference_does_not_hold() -> None:
    assert poison_word(np.dtype(np.int32), np.array([1, 2, 3])) == 0xFFFFFFFF
    # -1 is a real key of a signed sort: all bits set would pass where it sits.
    assert poison_word(np.dtype(np.int32), np.array([-1, 2])) == 0x7FFFFFFF
    assert poison_word(np.dtype(np.int32), np.array([-1, 2**31 - 1])) == 0x80000000
    many = np.array([-1, 2**31 - 1, -(2**31), 0x5A5A5A5A, 0, 1], dtype=np.int64).astype(np.int32)
    assert poison_word(np.dtype(np.int32), many) == 2
    assert poison_word(np.dtype(np.uint8), np.arange(255)) == 0xFF
    assert poison_word(np.dtype(np.uint8), np.r_[np.arange(250), 255]) == 250


def test_the_opt_in_is_judged_on_static_plus_dynamic_shared_memory() -> None:
    assert not needs_shared_opt_in(0, SHARED_WITHOUT_OPT_IN)
    assert needs_shared_opt_in(512, SHARED_WITHOUT_OPT_IN)  # softmax 12288 float32 CACHE=1
    assert needs_shared_opt_in(0, SHARED_WITHOUT_OPT_IN + 1)
    assert not needs_shared_opt_in(SHARED_WITHOUT_OPT_IN, 0)  # static alone: nothing to opt in
