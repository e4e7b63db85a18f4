"""BatchNorm training backward of an NCHW tensor: the spec of ``batchnorm_backward.cu``.

From the forward's input x, the mean and invstd it saved (float32, what :mod:`kernels.batchnorm`
writes), the weight and the gradient dy of ``y = xhat * weight + bias``, ``xhat = (x - mean) *
invstd``, per channel c over its ``n = N*H*W`` elements::

    dbias_c = sum dy,   dweight_c = sum dy * xhat                                  (float32)
    dx = weight_c * invstd_c * (dy - dbias_c / n - xhat * dweight_c / n)     (element type)

as torch's autograd of ``batch_norm(training=True)`` (``native_batch_norm_backward``) computes
them. Two plain float32 sums per channel (dy and dy * (x - mean)) over SPLIT blocks per channel,
merged in a fixed order (a finalize kernel or the channel's last block: no float atomics, the
same bits on every run), then the elementwise dx pass. float32 arithmetic for every element type.

Kernel arguments (:attr:`Problem.args` order, the same for every kernel)::

    x, dy, mean, invstd, weight,            inputs (x, dy: N*C*H*W elements of the element type)
    dx, dweight, dbias,                     outputs
    workspace, counters,                    scratch
    N, C, HW                                int32

- ``mean``, ``invstd``, ``weight``, ``dweight``, ``dbias``: float32, C elements each.
- ``workspace``: float32, ``C * 2 * MAX_SPLIT`` (:func:`workspace_floats`): one (sum dy,
  sum dy (x - mean)) pair per block; any contents at the start.
- ``counters``: uint32, ``C + 1``; zero before the first call (the single-pass kernel leaves
  them zero after every call; the two-kernel one writes SPLIT into ``counters[C]``).

The parameter space, constraints and steps are :mod:`kernels.batchnorm.channelwise`'s (the
reduction streams x and dy, the elementwise pass x and dy in and dx out).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import parallel
from kato.kernels.batchnorm.channelwise import ChannelwiseSpec
from kato.kernels.batchnorm_stats import MAX_SPLIT, BatchNormStatsSpec
from kato.kernels.parallel import fill_rows, run_chunks
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Problem

#: The forward's eps (torch's default): the problems' saved invstd.
EPS = 1e-5
#: Registers the reduction kernels need besides a step's vectors (the compile tests check that
#: no variant check() accepts spills).
REGISTER_OVERHEAD = 32
#: The same for the dx pass (pointers, the channel's range and indices, the coefficients).
APPLY_OVERHEAD = 24
#: atol of dweight (dbias) as a fraction of max over channels of sum |dy xhat| (|dy|): see
#: :meth:`BatchNormBackwardSpec.tolerance`.
DW_SUM_ERROR = 2.0**-18
#: atol of dx as a fraction of max over channels of |weight invstd|: see
#: :meth:`BatchNormBackwardSpec.tolerance`.
DX_ERROR = 2.0**-15
#: rtol of dx per dtype: float32 roundings (1e-5); float16 / bfloat16 the output rounding, 4x
#: half an ulp.
DX_RTOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}
#: rtol of dweight and dbias (float32 for every element type).
DW_RTOL = 1e-5
#: The problems' x: batchnorm_stats' generator (offset channels included).
_STATS = BatchNormStatsSpec()


def workspace_floats(c: int) -> int:
    """Floats of the workspace: MAX_SPLIT partial pairs per channel."""
    return c * 2 * MAX_SPLIT


class BatchNormBackwardSpec(ChannelwiseSpec):
    """Training-mode BatchNorm backward of an NCHW tensor: dweight and dbias by deterministic
    per-channel reductions, then dx."""

    name = "batchnorm_backward"
    description = (
        "batchnorm training backward of an NCHW tensor from x, the forward's saved mean and "
        "invstd, weight and dy: dweight, dbias (deterministic per-channel float32 sums over "
        "blocks), then dx"
    )
    template = Path(__file__).with_name("batchnorm_backward.cu")
    prefix = "batchnorm_bwd"
    kernel_name = "batchnorm_bwd_partial"
    kernel_names = (
        "batchnorm_bwd_partial",
        "batchnorm_bwd_finalize",
        "batchnorm_bwd_fused",
        "batchnorm_bwd_apply",
    )
    arrays = 2
    register_overhead = REGISTER_OVERHEAD
    apply_overhead = APPLY_OVERHEAD

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """batchnorm_stats' default reduction geometry (measured on the H200: blocks of 512
        threads, fewer for small channels, SPLIT doubled while channels x SPLIT x BLOCK_SIZE
        stay within ~132 x 1024 threads, the widest VEC dividing H*W, single pass): this
        reduction streams the same channels, two arrays instead of one, with cheaper
        arithmetic; UNROLL 2 where 4 vectors of both arrays do not fit the registers. The dx
        pass as :meth:`ChannelwiseSpec.with_apply`: in the channel's own block where SPLIT=1,
        else a separate pass."""
        self.validate(shape, dtype)
        stats = _STATS.default_config(shape, dtype)
        if self.check({**stats, "APPLY": 0, "APPLY_BLOCK": 512, "APPLY_VEC": 1}, shape, dtype):
            stats = {**stats, "UNROLL": 2}
        return self.with_apply(stats, shape, dtype)

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x from batchnorm_stats' generator (channels 0, 4, ... at a large offset with a small
        spread, the others U(-5, 5) + U(0.1, 4) N(0, 1)); mean and invstd from x (float64,
        biased variance, eps 1e-5, stored as float32, as the forward saves them); weight
        +-U(0.5, 1.5); dy = N(0, 1), plus +-xhat on channels 1, 5, ... (a gradient correlated
        with y: the xhat dweight / n term is as large as dy there) and +-1 on channels 2, 6,
        ... (dbias / n as large as dy). dx, dweight, dbias NaN; workspace NaN, counters zero.
        References: float64 from the inputs as stored (x, dy in the element type, mean and
        invstd in float32)."""
        n, c, h, w = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        stats = _STATS.make_problem(shape, dtype, rng)
        x = stats.args[0]
        mean = stats.references[0].astype(np.float32)
        invstd = stats.references[2].astype(np.float32)
        sign = np.where(rng.random(c) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=c)).astype(np.float32)
        signs = np.where(rng.random(c) < 0.5, -1.0, 1.0).astype(np.float32)
        pattern = np.arange(c) % 4
        correlated = np.where(pattern == 1, signs, 0.0).astype(np.float32)[None, :, None, None]
        shifted = np.where(pattern == 2, signs, 0.0).astype(np.float32)[None, :, None, None]
        mean4 = mean[None, :, None, None]
        invstd4 = invstd[None, :, None, None]
        dy = np.empty(x.shape, dtype=np_dtype)

        def fill(chunk: slice, gen: np.random.Generator) -> None:  # images of dy
            g = gen.standard_normal((chunk.stop - chunk.start, c, h, w), dtype=np.float32)
            xhat = (x[chunk].astype(np.float32) - mean4) * invstd4
            g += correlated * xhat
            g += shifted
            dy[chunk] = g

        fill_rows(rng, n, c * h * w, fill)
        dx_ref, dw_ref, db_ref, dw_abs, db_abs = batchnorm_backward_reference(
            x, dy, mean, invstd, weight
        )
        scale = float(np.max(np.abs(weight.astype(np.float64) * invstd)))
        return Problem(
            args=[
                x,
                dy,
                mean,
                invstd,
                weight,
                np.full(x.shape, np.nan, dtype=np_dtype),
                np.full(c, np.nan, dtype=np.float32),
                np.full(c, np.nan, dtype=np.float32),
                np.full(workspace_floats(c), np.nan, dtype=np.float32),
                np.zeros(c + 1, dtype=np.uint32),
                np.int32(n),
                np.int32(c),
                np.int32(h * w),
            ],
            outputs=[5, 6, 7],
            references=[dx_ref, dw_ref, db_ref],
            tolerances=[
                (DX_ERROR * scale, DX_RTOL[dtype]),
                (max(DW_SUM_ERROR * float(dw_abs.max()), 1e-30), DW_RTOL),
                (max(DW_SUM_ERROR * float(db_abs.max()), 1e-30), DW_RTOL),
            ],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of dx for a problem whose channels have ``|weight invstd| <= 1``;
        each problem's own (:attr:`Problem.tolerances`) scales it:

        - dx: atol = 2**-15 * max over channels of ``|weight invstd|``, rtol :data:`DX_RTOL`.
          dx is ``weight invstd`` times ``dy - dbias / n - xhat dweight / n``, whose terms are
          O(1) to O(6) (|xhat| up to ~6) and carry the float32 sums' relative error (up to a
          few 1e-6 over the longest per-thread streams, a few thousand vectors) besides a few
          roundings: a small fraction of 2**-15 of the scale. A term left out is off by the
          scale itself on the problems' correlated and shifted channels.
        - dweight, dbias (float32 for every element type): rtol 1e-5, atol = 2**-18 * max over
          channels of ``sum |dy xhat|`` (resp. ``sum |dy|``): float32 sums run sequentially
          over a thread's vectors (at most n / (SPLIT * BLOCK_SIZE)) and then through fixed
          trees, so their error is a small multiple of 2**-24 times the sum of magnitudes; one
          element's term left out or counted twice still fails (a term is ~1 against 2**-18 n).
        """
        if dtype not in self.dtypes:
            raise InvalidInput(f"batchnorm_backward does not support dtype {dtype!r}")
        return (DX_ERROR, DX_RTOL[dtype])

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x and dy read, dx written once (the two-pass kernels read x and dy twice, the second
        time from L2 where they fit); mean, invstd and weight read, dweight and dbias written
        (float32, C each)."""
        n, c, h, w = shape
        return 3 * n * c * h * w * DTYPES[dtype][2] + 5 * 4 * c

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """What :meth:`bytes_moved` counts, plus the workspace and the counters."""
        c = shape[1]
        return self.bytes_moved(shape, dtype) + 4 * workspace_floats(c) + 4 * (c + 1)


def batchnorm_backward_reference(
    x: np.ndarray, dy: np.ndarray, mean: np.ndarray, invstd: np.ndarray, weight: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Float64 ``(dx, dweight, dbias, sum |dy xhat|, sum |dy|)`` of training-mode BatchNorm from
    the saved mean and invstd given (the forward's, as stored), a few channels at a time on
    several threads (:func:`kernels.parallel.run_chunks`)."""
    n, c, h, w = x.shape
    count = n * h * w
    dx = np.empty(x.shape)
    sums = np.empty((4, c))
    step = max(1, parallel.CHUNK_ELEMENTS // max(count, 1))

    def channels(i: int) -> None:  # channels [c0, c0 + step), on one of the threads
        part = slice(i * step, (i + 1) * step)
        mu = mean[part].astype(np.float64)[None, :, None, None]
        r = invstd[part].astype(np.float64)[None, :, None, None]
        k = weight[part].astype(np.float64)[None, :, None, None] * r
        xhat = (x[:, part].astype(np.float64) - mu) * r
        g = dy[:, part].astype(np.float64)
        terms = g * xhat
        dweight = terms.sum(axis=(0, 2, 3))
        dbias = g.sum(axis=(0, 2, 3))
        sums[:, part] = (
            dweight,
            dbias,
            np.abs(terms).sum(axis=(0, 2, 3)),
            np.abs(g).sum(axis=(0, 2, 3)),
        )
        xhat *= dweight[None, :, None, None] / count
        g -= dbias[None, :, None, None] / count
        g -= xhat
        g *= k
        dx[:, part] = g

    run_chunks(channels, -(-c // step), chunk_bytes=4 * 8 * step * count)
    return dx, sums[0], sums[1], sums[2], sums[3]


BATCHNORM_BACKWARD = register(BatchNormBackwardSpec())

__all__ = [
    "BATCHNORM_BACKWARD",
    "DW_SUM_ERROR",
    "DX_ERROR",
    "EPS",
    "BatchNormBackwardSpec",
    "batchnorm_backward_reference",
    "workspace_floats",
]
