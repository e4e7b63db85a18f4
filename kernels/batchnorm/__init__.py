"""BatchNorm training forward of an NCHW tensor: the spec of ``batchnorm.cu``.

Per channel c over its ``n = N*H*W`` elements, as ``torch.nn.functional.batch_norm(x,
running_mean, running_var, weight, bias, training=True, momentum, eps)``::

    mean_c, var_c = the channel's mean and biased variance,  invstd_c = 1 / sqrt(var_c + eps)
    y = (x - mean_c) * invstd_c * weight_c + bias_c                          (element type)
    running_mean_c <- (1 - momentum) running_mean_c + momentum mean_c
    running_var_c  <- (1 - momentum) running_var_c + momentum var_c n / (n - 1)   (unbiased)

and ``mean`` and ``invstd`` saved (float32) for :mod:`kernels.batchnorm_backward`. The statistics
are :mod:`kernels.batchnorm_stats`' (its Welford partials, Chan merges and strategies; its
device code is copied into ``batchnorm.cu`` verbatim, since a rendered source is one template
and batchnorm_stats' own must stay byte-identical for its recorded results: a spec test checks
the copy). y is written as ``(x - pivot) * scale + shift`` about the channel's first element, so
channels with a large mean keep float32 accuracy. Per-channel parameters and statistics are
float32 for every element type (as cuDNN's batchnorm takes them for float16 data). float32
arithmetic throughout.

Kernel arguments (:attr:`Problem.args` order, the same for every kernel)::

    x, weight, bias, running_mean_in, running_var_in,          inputs (x: N*C*H*W elements)
    y, mean, invstd, running_mean, running_var,                outputs
    workspace, counters,                                       scratch
    N, C, HW, eps, momentum                                    int32 x 3, float32 x 2

- ``weight``, ``bias``, ``running_mean_in``, ``running_var_in``, ``mean``, ``invstd``,
  ``running_mean``, ``running_var``: float32, C elements each. ``running_mean`` may be the same
  buffer as ``running_mean_in`` and ``running_var`` as ``running_var_in`` (an in-place update,
  as torch's; each element is read, then written, by one thread). The problems here pass
  separate buffers, so that a verification's repeated call sees the same inputs.
- ``workspace``: float32, ``C * (2 + 3 * MAX_SPLIT)`` (:func:`workspace_floats`): each
  channel's (scale, shift), then one (count, mean, M2) partial per block; any contents at the
  start.
- ``counters``: uint32, ``C + 1``; zero before the first call (the single-pass kernel leaves
  them zero after every call; the two-kernel one writes SPLIT into ``counters[C]``).
- ``momentum``: torch's default is 0.1 (:data:`MOMENTUM`), ``eps`` 1e-5 (:data:`EPS`).

The parameter space, constraints and steps are :mod:`kernels.batchnorm.channelwise`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import parallel
from kato.kernels.batchnorm.channelwise import ChannelwiseSpec
from kato.kernels.batchnorm_stats import MAX_SPLIT, BatchNormStatsSpec, batchnorm_stats_reference
from kato.kernels.parallel import run_chunks
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Problem

EPS = 1e-5
#: torch's default momentum of the running statistics.
MOMENTUM = 0.1
#: Registers the statistics kernels need besides a step's vectors (batchnorm_stats' own figure;
#: the compile tests check that no variant check() accepts spills).
REGISTER_OVERHEAD = 32
#: The same for the normalise pass (pointers, the channel's range and indices, the coefficients).
APPLY_OVERHEAD = 24
#: The statistics' problems: batchnorm_stats' generator (offset channels included).
_STATS = BatchNormStatsSpec()


def workspace_floats(c: int) -> int:
    """Floats of the workspace: (scale, shift) per channel, then MAX_SPLIT partials of 3."""
    return c * (2 + 3 * MAX_SPLIT)


class BatchNormSpec(ChannelwiseSpec):
    """Training-mode BatchNorm forward of an NCHW tensor: statistics, normalise, scale and
    shift, running-statistics update."""

    name = "batchnorm"
    description = (
        "batchnorm training forward of an NCHW tensor: per-channel statistics (Welford "
        "partials merged across blocks), y = xhat * weight + bias, saved mean and invstd, "
        "running statistics updated with momentum (unbiased variance)"
    )
    template = Path(__file__).with_name("batchnorm.cu")
    prefix = "batchnorm_fwd"
    kernel_name = "batchnorm_fwd_partial"
    kernel_names = (
        "batchnorm_fwd_partial",
        "batchnorm_fwd_finalize",
        "batchnorm_fwd_fused",
        "batchnorm_fwd_apply",
    )
    arrays = 1
    register_overhead = REGISTER_OVERHEAD
    apply_overhead = APPLY_OVERHEAD
    #: y against the float64 reference: |xhat w| <= ~9 (|xhat| <= 6, |w| <= 1.5). float32: the
    #: statistics' relative error (~1e-6, batchnorm_stats' tolerance 1e-5) times that plus a
    #: few roundings: atol 2e-5, rtol 1e-5. float16 / bfloat16: the output rounding, half an ulp
    #: (2**-11 resp. 2**-9 relative): rtol 4x that, atol as float32.
    Y_TOLERANCES = {
        "float32": (2e-5, 1e-5),
        "float16": (2e-5, 2e-3),
        "bfloat16": (2e-5, 8e-3),
    }

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """:meth:`ChannelwiseSpec.validate`, plus: more than one value per channel (the
        unbiased running variance divides by ``n - 1``; torch refuses ``n = 1`` in training
        too)."""
        shape = super().validate(shape, dtype)
        n, _, h, w = shape
        if n * h * w < 2:
            raise InvalidInput(
                "batchnorm in training needs more than one value per channel (N*H*W >= 2), "
                f"got N={n}, H*W={h * w}"
            )
        return shape

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """batchnorm_stats' default statistics (blocks of 512 threads, fewer for small
        channels; SPLIT doubled while channels x SPLIT x BLOCK_SIZE stay within ~132 x 1024
        threads; the widest VEC dividing H*W; single pass; measured on the H200's recorded
        spaces), with the normalise pass of :meth:`ChannelwiseSpec.with_apply`: in the
        channel's own block where SPLIT=1, else a separate pass. Both passes are memory-bound
        streams of the same shape, so what suits the statistics suits the normalise pass."""
        self.validate(shape, dtype)
        return self.with_apply(_STATS.default_config(shape, dtype), shape, dtype)

    # --- problems and references --------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x from batchnorm_stats' generator (channels 0, 4, ... at a large offset with a small
        spread: 1e4 + N(0, 1) in float32, 1e3 + 8 N(0, 1) otherwise; the others U(-5, 5) +
        U(0.1, 4) N(0, 1)); weight +-U(0.5, 1.5), bias U(-1, 1), running mean U(-1, 1) and
        variance U(0.5, 2) (float32); outputs NaN, workspace NaN, counters zero. References:
        float64 from x as stored."""
        n, c, h, w = self.validate(shape, dtype)
        stats = _STATS.make_problem(shape, dtype, rng)
        x = stats.args[0]
        sign = np.where(rng.random(c) < 0.5, -1.0, 1.0)
        weight = (sign * rng.uniform(0.5, 1.5, size=c)).astype(np.float32)
        bias = rng.uniform(-1.0, 1.0, size=c).astype(np.float32)
        running_mean = rng.uniform(-1.0, 1.0, size=c).astype(np.float32)
        running_var = rng.uniform(0.5, 2.0, size=c).astype(np.float32)
        refs = batchnorm_reference(
            x, weight, bias, running_mean, running_var, EPS, MOMENTUM, stats=stats.references
        )
        y = np.full(x.shape, np.nan, dtype=x.dtype)
        outputs = [np.full(c, np.nan, dtype=np.float32) for _ in range(4)]
        stats_tolerance = _STATS.tolerance(dtype)
        return Problem(
            args=[
                x,
                weight,
                bias,
                running_mean,
                running_var,
                y,
                *outputs,
                np.full(workspace_floats(c), np.nan, dtype=np.float32),
                np.zeros(c + 1, dtype=np.uint32),
                np.int32(n),
                np.int32(c),
                np.int32(h * w),
                np.float32(EPS),
                np.float32(MOMENTUM),
            ],
            outputs=[5, 6, 7, 8, 9],
            references=list(refs),
            tolerances=[self.Y_TOLERANCES[dtype], *[stats_tolerance] * 4],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` of y (:attr:`Y_TOLERANCES`). mean, invstd and the running
        statistics are float32 and batchnorm_stats' (1e-5, 1e-5) each: the running statistics
        are convex combinations of inputs and statistics held to that."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"batchnorm does not support dtype {dtype!r}")
        return self.Y_TOLERANCES[dtype]

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """x read and y written once (the two-pass kernels read x twice, the second time from L2
        where it fits); weight, bias and the running statistics read, mean, invstd and the
        running statistics written (float32, C each)."""
        n, c, h, w = shape
        return 2 * n * c * h * w * DTYPES[dtype][2] + 8 * 4 * c

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """x, y, the eight float32 channel arrays, the workspace and the counters."""
        c = shape[1]
        return self.bytes_moved(shape, dtype) + 4 * workspace_floats(c) + 4 * (c + 1)


def batchnorm_reference(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    eps: float,
    momentum: float,
    stats: Sequence[np.ndarray] | None = None,
) -> tuple[np.ndarray, ...]:
    """Float64 ``(y, mean, invstd, running_mean, running_var)`` of training-mode BatchNorm on an
    NCHW array (torch's formulas; the running variance updated with the unbiased variance),
    y a few channels at a time on several threads (:func:`kernels.parallel.run_chunks`).
    ``stats``: x's float64 (mean, biased var, invstd) where already computed
    (:func:`kernels.batchnorm_stats.batchnorm_stats_reference`)."""
    n, c, h, w = x.shape
    mean, var, invstd = stats if stats is not None else batchnorm_stats_reference(x, eps)
    count = n * h * w
    new_mean = (1 - momentum) * running_mean.astype(np.float64) + momentum * mean
    new_var = (1 - momentum) * running_var.astype(np.float64) + momentum * var * (
        count / (count - 1)
    )
    scale = invstd * weight.astype(np.float64)
    shift = bias.astype(np.float64) - mean * scale
    y = np.empty(x.shape)
    step = max(1, parallel.CHUNK_ELEMENTS // max(count, 1))

    def channels(i: int) -> None:  # channels [c0, c0 + step), on one of the threads
        c0 = i * step
        part = slice(c0, c0 + step)
        chunk = x[:, part].astype(np.float64)
        chunk *= scale[None, part, None, None]
        chunk += shift[None, part, None, None]
        y[:, part] = chunk

    run_chunks(channels, -(-c // step), chunk_bytes=8 * step * count)
    return y, mean, invstd, new_mean, new_var


BATCHNORM = register(BatchNormSpec())

__all__ = [
    "BATCHNORM",
    "EPS",
    "MOMENTUM",
    "BatchNormSpec",
    "batchnorm_reference",
    "workspace_floats",
]
