"""Cross-entropy forward over the last dimension of (rows, cols) logits: the spec of
``cross_entropy.cu``.

Fused log-softmax + negative log-likelihood with int64 class labels, as
``torch.nn.functional.cross_entropy(logits, labels, reduction='none', ignore_index=-100)``:
per row ``loss = logsumexp(x) - x[label]`` (float32; 0 where the label is the ignore index) and
the row's ``lse = logsumexp(x)`` (float32, what ``cross_entropy_backward`` reads). A label
outside ``[0, cols)`` that is not the ignore index gives a NaN loss for its row and is never
used as an index (torch raises a device assert there instead). Labels are int64 only (int32
would double the compiles for one load a row; :mod:`kernels.cross_entropy.model` says more).
float32 accumulation for every element type; one pass over each row (online max and rescaled,
compensated sum).

Kernel arguments (:attr:`Problem.args` order): ``logits, labels, loss, lse, partials, rows,
cols, ignore_index`` (labels int64; partials float32 scratch of ``2 * MAX_SPLIT * rows``
elements, used by SPLIT > 1; rows/cols int32, ignore_index int64).

Parameter space (Kernel Tuner key order; the model is :mod:`kernels.cross_entropy.model`'s):

- ``BLOCK_SIZE``, ``VEC``, ``ROW_THREADS``, ``MIN_BLOCKS``: as the row-wise operators'
  (:mod:`kernels.rowwise`): threads per block, elements per vector for any cols, 8/16/32 lanes
  of a warp or a block per row (or chunk), the min-blocks clause of ``__launch_bounds__``.
- ``SPLIT``: chunks per row (1, 2, ... 64). 1: the main kernel writes loss and lse. More: each
  chunk's (max, sum) goes to ``partials`` and ``cross_entropy_combine`` merges them per row (a
  thread per row), so a few vocabulary-sized rows still occupy every SM.

No row cache: the row is read once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.cross_entropy import model
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, Launch, Problem, Step

#: lse's atol: 2e-6 for the float32 log and rounding, plus 2**-25 * sqrt(cols) for the float32
#: sums (per thread, sequential, then a tree): a simulation of the worst config (8 threads per
#: row, one element per load) in float32 stayed under 2**-27 * sqrt(cols) over 20 rows of 1031,
#: 50257 and 256000 N(0, 1) logits.
LSE_BASE_ATOL = 2e-6
LSE_SUM_ERROR = 2.0**-25
#: rtol of lse and loss: one to two float32 ulps (lse is ~ |offset| + log(cols)).
RTOL = 2.0**-23


def lse_atol(cols: int) -> float:
    """The lse output's atol for rows of ``cols`` columns (see :data:`LSE_BASE_ATOL`)."""
    return LSE_BASE_ATOL + LSE_SUM_ERROR * math.sqrt(cols)


class CrossEntropySpec(model.CrossEntropyBase):
    """Row-wise cross-entropy forward; outputs loss and lse per row (float32)."""

    name = "cross_entropy"
    description = (
        "cross-entropy forward over the last dimension of (rows, cols) logits with int64 labels "
        "and an ignore index (-100): loss = logsumexp(x) - x[label] per row and the row's "
        "logsumexp (both float32); float32 accumulation, one pass; rows split over blocks"
    )
    template = Path(__file__).with_name("cross_entropy.cu")
    kernel_name = "cross_entropy_fwd"
    kernel_names = ("cross_entropy_fwd", "cross_entropy_combine")
    #: Both outputs are float32 whatever the logits' type; the problem's own atol adds the
    #: sums' rounding (:func:`lse_atol`) and, for loss, lse's magnitude.
    TOLERANCES = {dtype: (LSE_BASE_ATOL, RTOL) for dtype in ("float32", "float16", "bfloat16")}

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """The main kernel; with SPLIT > 1 then the combine: ``ceil(rows / 256)`` blocks of 256."""
        main = Step(self.kernel_name, self.launch(config, shape, dtype))
        if config["SPLIT"] == 1:
            return [main]
        grid = min(math.ceil(shape[0] / 256), limits.MAX_GRID_X)
        return [main, Step("cross_entropy_combine", Launch(grid=(grid, 1, 1), block=(256, 1, 1)))]

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Logits N(0, 1) + a per-row offset (+-100 on alternate even rows), labels uniform
        with every 8th row (from row 3) ignored (:func:`kernels.cross_entropy.model.make_logits`);
        loss, lse and the partials pre-filled with NaN. References: float64 from the logits as
        stored."""
        rows, cols = self.validate(shape, dtype)
        logits, labels = model.make_logits(rows, cols, dtype, rng)
        ref_loss, ref_lse = model.cross_entropy_reference(logits, labels)
        loss = np.full(rows, np.nan, dtype=np.float32)
        lse = np.full(rows, np.nan, dtype=np.float32)
        partials = np.full(2 * model.MAX_SPLIT * rows, np.nan, dtype=np.float32)
        lse_tol = lse_atol(cols)
        loss_tol = lse_tol + RTOL * float(np.abs(ref_lse).max())
        return Problem(
            args=[
                logits,
                labels,
                loss,
                lse,
                partials,
                np.int32(rows),
                np.int32(cols),
                np.int64(model.IGNORE_INDEX),
            ],
            outputs=[2, 3],
            references=[ref_loss, ref_lse],
            tolerances=[(loss_tol, RTOL), (lse_tol, RTOL)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of loss and lse before the problem's own atol: 2e-6 and 2**-23 (one
        to two float32 ulps). Each problem sets lse's atol to :func:`lse_atol` (the float32
        sums' rounding grows like sqrt(cols)) and loss's to that plus 2**-23 of the largest
        |lse| (loss = lse - x[label] inherits lse's absolute error)."""
        return super().tolerance(dtype)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """Logits read once, labels read, loss and lse written: ``rows * (cols * itemsize +
        16)`` (the label's logit, a cache hit, and the partials, ``8 * SPLIT`` bytes a row
        through L2, are not counted)."""
        rows, cols = shape
        return rows * cols * DTYPES[dtype][2] + 16 * rows

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """What :meth:`bytes_moved` counts, plus the partials buffer."""
        rows, _ = shape
        return self.bytes_moved(shape, dtype) + 8 * model.MAX_SPLIT * rows


CROSS_ENTROPY = register(CrossEntropySpec())

__all__ = ["CROSS_ENTROPY", "CrossEntropySpec", "lse_atol"]
