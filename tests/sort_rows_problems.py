"""Problems of the row sort's radix path (``sort`` with ALGO=radix) shared by its CPU emulation
tests (tests/kernels/test_sort_rows_radix_emulation.py) and its GPU tests
(tests/gpu/test_sort_rows_radix_gpu.py): tied rows, and NaN/inf/signed-zero keys compared as
bits."""

from __future__ import annotations

import numpy as np
from kato.kernels.sort import SortSpec, radix
from kato.kernels.spec import Problem


class TiedRows(SortSpec):
    """Rows of tied keys (int: all INT_MIN; float: -0.0 and +0.0 interleaved)."""

    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        if dtype == "float32":
            x = np.zeros(shape, np.float32)
            x[:, ::3] = -0.0
        else:
            x = np.full(shape, -(2**31), np.int32)
        problem.args[0] = x
        problem.references = [np.sort(x.astype(np.float64), axis=-1)]
        return problem


class NanBits(SortSpec):
    """float32 rows with NaNs of both signs (and payloads), +-inf, -0.0/+0.0, denormals among
    the stress keys, compared as bits: the output array is an int32 view, the reference the
    rows' bits in the kernels' key order (:func:`kernels.sort.radix.ordered_keys`: positive NaNs
    after +inf, negative ones before -inf, -0.0 before +0.0). NaN would fail the float
    comparison whatever its place."""

    SPECIALS = np.array(
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0x00000000]
        + [0x7F800000, 0xFF800000, 0x00000001, 0x80000001],
        np.uint32,
    ).view(np.float32)

    def make_problem(self, shape, dtype, rng) -> Problem:
        assert dtype == "float32"
        problem = super().make_problem(shape, dtype, rng)
        x = problem.args[0]
        picks = rng.random(x.shape) < 0.2
        x[picks] = self.SPECIALS[rng.integers(0, self.SPECIALS.size, int(picks.sum()))]
        problem.args[1] = problem.args[1].view(np.int32)
        order = np.argsort(radix.ordered_keys(x), axis=-1, kind="stable")
        bits = np.take_along_axis(x, order, axis=-1).view(np.int32)
        problem.references = [bits.astype(np.int64)]
        return problem
