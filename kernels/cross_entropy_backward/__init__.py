"""Cross-entropy backward over the last dimension of (rows, cols) logits: the spec of
``cross_entropy_backward.cu``.

``dlogits = (softmax(x) - onehot(label)) * dloss`` per row, computed as ``exp(x - lse)`` from
the forward's saved float32 ``lse`` (``cross_entropy``'s second output), the int64 labels and a
float32 gradient per row (``reduction='none'``'s incoming gradient; for torch's mean reduction
the caller passes ``1 / count`` on every counted row). Rows whose label is the ignore index get
zeros; a label outside ``[0, cols)`` that is not the ignore index gives a NaN row (as the
forward's NaN loss). float32 arithmetic for every element type; one pass, no reduction.

In place: ``dlogits`` may be the logits buffer itself (pass the same pointer twice): every
element is read once and then written by the same thread, the kernel's pointers are not
``__restrict__``, so the result is the same as with separate buffers (tested on the CPU
emulation and on the GPU). A buffer that overlaps the logits partly is not supported.

Kernel arguments (:attr:`Problem.args` order): ``logits, labels, lse, dloss, dlogits, rows,
cols, ignore_index`` (labels int64, lse and dloss float32 per row, rows/cols int32,
ignore_index int64).

Parameter space (as the forward's, :mod:`kernels.cross_entropy.model`): ``BLOCK_SIZE``, ``VEC``,
``ROW_THREADS``, ``MIN_BLOCKS`` and ``SPLIT`` (chunks per row, each its own work item: with few
rows a row's columns spread over several blocks; nothing needs merging).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels.cross_entropy import model
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Problem

#: atol of dlogits as a fraction of max over rows of p_label * |dloss| (see :meth:`tolerance`).
LABEL_ERROR = 2.0**-17


class CrossEntropyBackwardSpec(model.CrossEntropyBase):
    """Row-wise cross-entropy gradient with respect to the logits, one pass, in place or not."""

    name = "cross_entropy_backward"
    description = (
        "cross-entropy backward over the last dimension of (rows, cols) logits: "
        "dlogits = (exp(x - lse) - onehot(label)) * dloss per row from the forward's lse, "
        "zeros for ignored rows; one pass, may write over the logits; float32 arithmetic"
    )
    template = Path(__file__).with_name("cross_entropy_backward.cu")
    kernel_name = "cross_entropy_bwd"
    #: float32: exp of a float32 difference and a product, a few roundings (rtol 1e-5, ~80 ulp);
    #: float16 / bfloat16: the output rounding alone is half an ulp, 2**-11 resp. 2**-9
    #: relative: 4x that. atol is the floor of what the output type cannot hold (float16 rounds
    #: below its smallest normal to subnormals 2**-24 apart); the problem's atol adds the label
    #: element's cancellation.
    TOLERANCES = {
        "float32": (2.0**-125, 1e-5),
        "float16": (2.0**-24, 2e-3),
        "bfloat16": (2.0**-125, 8e-3),
    }

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """The forward's logits and labels (every 8th row from row 3 ignored,
        :func:`kernels.cross_entropy.model.make_logits`), their lse in float64 stored as
        float32, dloss = +-U(0.5, 2) per row (ignored rows too: the kernel must not use it);
        dlogits pre-filled with NaN. Reference: float64 from the inputs as stored."""
        rows, cols = self.validate(shape, dtype)
        logits, labels = model.make_logits(rows, cols, dtype, rng)
        lse = model.logsumexp(logits).astype(np.float32)
        sign = np.where(rng.random(rows) < 0.5, -1.0, 1.0)
        dloss = (sign * rng.uniform(0.5, 2.0, size=rows)).astype(np.float32)
        dlogits = np.full((rows, cols), np.nan, dtype=DTYPES[dtype][0])
        reference = model.cross_entropy_backward_reference(logits, labels, lse, dloss)
        kept = labels != model.IGNORE_INDEX
        p_label = np.zeros(rows)
        idx = np.flatnonzero(kept)
        p_label[idx] = np.exp(logits[idx, labels[idx]].astype(np.float64) - lse[idx])
        scale = float((p_label * np.abs(dloss)).max())
        atol, rtol = self.tolerance(dtype)
        return Problem(
            args=[
                logits,
                labels,
                lse,
                dloss,
                dlogits,
                np.int32(rows),
                np.int32(cols),
                np.int64(model.IGNORE_INDEX),
            ],
            outputs=[4],
            references=[reference],
            tolerances=[(max(atol, LABEL_ERROR * scale), rtol)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of dlogits against the float64 reference, before the problem's own
        atol.

        Every element but the label's is p * dloss with p = exp(x - lse) good to a few float32
        ulps: a relative check. The label's is (p - 1) * dloss, which cancels where p is near 1:
        there the error is p's, ~1e-6 * p * |dloss|. Each problem therefore sets atol =
        2**-17 * max_r(p_label_r * |dloss_r|), above that bound and, with labels drawn
        uniformly (p_label ~ 1 / cols), far below every row's typical |dlogits|: an element
        left out or computed from the wrong lse fails.
        """
        return super().tolerance(dtype)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """Logits read and dlogits written once; labels, lse and dloss read once per row."""
        rows, cols = shape
        return 2 * rows * cols * DTYPES[dtype][2] + 16 * rows


CROSS_ENTROPY_BACKWARD = register(CrossEntropyBackwardSpec())

__all__ = ["CROSS_ENTROPY_BACKWARD", "LABEL_ERROR", "CrossEntropyBackwardSpec"]
