"""Softmax backward over the last dimension of (rows, cols) matrices: the spec of
``softmax_backward.cu``.

``dx = y * (dy - sum(dy * y))`` per row, from the forward's output y and the gradient dy (what
``torch._softmax_backward_data(dy, y, -1, dtype)`` computes), one reduction per row, float32
accumulation for every element type.

Kernel arguments (:attr:`Problem.args` order): ``y, dy, dx, rows, cols`` (int32 sizes).

Parameter space (Kernel Tuner key order; the model is :mod:`kernels.rowwise`'s):

- ``BLOCK_SIZE``: threads per block.
- ``VEC``: elements per vector access, at most 16 bytes, for any ``cols`` (scalar head and tail
  around the aligned vectors of each row).
- ``ROW_THREADS``: 8, 16 or 32 lanes of a warp per row (several rows per warp), or 0 = a block.
- ``CACHE``: 0 = the dx pass re-reads y and dy (L2); 1 = both rows' vectors in dynamic shared
  memory (``rows_per_block * 2 * (cols // VEC) * VEC * itemsize`` bytes); 2 = in registers.
- ``MIN_BLOCKS``: the min-blocks clause of ``__launch_bounds__`` (rendered as the register cap
  it implies: equivalent configs share a compile).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import rowwise
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Problem

#: Registers a CACHE=2 kernel needs besides its two row caches (one per element,
#: :func:`kernels.rowwise.vector_registers`; fit to ptxas reports on sm_90,
#: tests/kernels/test_softmax_backward_compile.py: with 32, float16 rows of 12 vectors of 4
#: per lane spilled under a 128-register cap).
REGISTER_OVERHEAD = 40
#: atol of dx as a fraction of max over rows of (max y) * sum |y * dy| (see :meth:`tolerance`).
DOT_ERROR = 2.0**-16


class SoftmaxBackwardSpec(rowwise.RowwiseSpec):
    """Row-wise softmax gradient from y and dy, one pass over each row."""

    name = "softmax_backward"
    description = (
        "softmax backward over the last dimension of (rows, cols) matrices: "
        "dx = y * (dy - sum(dy * y)) from y and dy, float32 accumulation"
    )
    params = dict(rowwise.COMMON_PARAMS)
    template = Path(__file__).with_name("softmax_backward.cu")
    kernel_name = "softmax_backward_kernel"
    cached_arrays = 2
    register_overhead = REGISTER_OVERHEAD
    #: float32: dx = y * (dy - dot) rounds a few times (rtol 1e-5, 20 ulp); float16 / bfloat16:
    #: the output rounding alone is half an ulp, 2**-11 resp. 2**-9 relative: 4x that. atol
    #: here is the floor of what the output type cannot hold: float16 rounds results below its
    #: smallest normal to subnormals 2**-24 apart; the problem's atol adds the dot's rounding.
    TOLERANCES = {
        "float32": (2.0**-125, 1e-5),
        "float16": (2.0**-24, 2e-3),
        "bfloat16": (2.0**-125, 8e-3),
    }

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """The widest vector; short rows in registers shared by few lanes, a warp or a block per
        row in registers, then shared memory, then streaming (:meth:`RowwiseSpec.base_default`).
        """
        return self.base_default(shape, dtype, {})

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """y = softmax(N(0, 1) logits) per row, as stored in ``dtype``; dy = N(0, 1) + a per-row
        offset (rows 0, 4, ... get +-4: a large dot that must be subtracted, others U(-1, 1));
        dx pre-filled with NaN. Reference: float64 from y and dy as stored.

        The logits' spread of 1 keeps every y of a row within e^+-5 of 1 / cols, so a relative
        check sees every element (y of 1e-30 next to y of 1 would let zeros through).
        """
        rows, cols = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        offsets = rng.uniform(-1.0, 1.0, size=(rows, 1)).astype(np.float32)
        offsets[0::4] = 4.0
        offsets[2::4] = -4.0
        y = np.empty((rows, cols), dtype=np_dtype)
        dy = np.empty((rows, cols), dtype=np_dtype)
        dx = np.empty((rows, cols), dtype=np_dtype)
        reference = np.empty((rows, cols), dtype=np.float64)
        scale = np.empty(rows, dtype=np.float64)  # per row: max y * sum |y * dy|

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            n = chunk.stop - chunk.start
            logits = gen.standard_normal((n, cols), dtype=np.float32)
            logits -= logits.max(axis=1, keepdims=True)
            np.exp(logits, out=logits)
            logits /= logits.sum(axis=1, keepdims=True)
            y[chunk] = logits
            g = gen.standard_normal((n, cols), dtype=np.float32)
            g += offsets[chunk]
            dy[chunk] = g
            dx[chunk] = np.nan
            y64 = y[chunk].astype(np.float64)
            dy64 = dy[chunk].astype(np.float64)
            reference[chunk], scale[chunk] = softmax_backward_reference(y64, dy64)

        fill_rows(rng, rows, cols, fill)
        atol, rtol = self.tolerance(dtype)
        return Problem(
            args=[y, dy, dx, np.int32(rows), np.int32(cols)],
            outputs=[2],
            references=[reference],
            tolerances=[(max(atol, DOT_ERROR * float(scale.max())), rtol)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of dx against the float64 reference, before the problem's own atol.

        dx = y * (dy - dot) cancels where dy is close to the row's dot, and there the error is
        the float32 dot's: |err| <= y * |dot error|, with the dot's error a small multiple of
        2**-24 * sum |y * dy| (sequential sums per thread of at most a few thousand terms, then
        a tree). Each problem therefore sets atol = 2**-16 * max_r(max y_r * sum |y_r dy_r|),
        above that bound for every row and, since y stays within e^+-5 of 1/cols
        (:meth:`make_problem`), still far below the typical |dx| of every row (~1e-3 of it at
        50257 columns): a kernel that leaves an element out fails.
        """
        return super().tolerance(dtype)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """y and dy read once, dx written once: ``3 * rows * cols * itemsize``."""
        rows, cols = shape
        return 3 * rows * cols * DTYPES[dtype][2]


def softmax_backward_reference(y: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``y * (dy - sum(y * dy))`` over the last axis, and per row ``max y * sum |y dy|``
    (the scale of the dot's rounding error)."""
    y64 = y.astype(np.float64)
    prod = y64 * dy.astype(np.float64)
    dot = prod.sum(axis=-1, keepdims=True)
    scale = y64.max(axis=-1) * np.abs(prod).sum(axis=-1)
    out = dy.astype(np.float64) - dot
    out *= y64
    return out, scale


SOFTMAX_BACKWARD = register(SoftmaxBackwardSpec())

__all__ = ["SOFTMAX_BACKWARD", "SoftmaxBackwardSpec", "softmax_backward_reference"]
