"""A trial's cost bounded before launch: the per-trial limit scaled to the problem, and the
deadline a measurement fits its timing repeats into.

A fixed per-trial limit (``trial_timeout_seconds``, 60 s) suits kernels of micro- to
milliseconds, but a problem whose one launch takes seconds (a reduction over a few rows of a
billion elements) needs more than the limit just for the launches every trial makes. So:

- :func:`launch_lower_bound_s` predicts, before anything runs, a lower bound of one launch's
  time from the operator's ``bytes_moved`` and ``flops`` at the GPU catalog's peak bandwidth and
  an upper bound of its FLOP rate: no config of the problem can be faster;
- :func:`trial_timeout_s` scales the limit with it: the configured limit (the floor, which
  covers compiling and the usual launches) plus ``SLACK`` times the predicted cost of the
  launches every trial makes (:data:`MIN_LAUNCHES`), capped at :data:`CAP_FACTOR` times the
  floor;
- :class:`TrialDeadline` is the limit as the measuring code sees it: the backend (PyCUDA) skips
  warm-up launches and stops timing repeats when the next one would end past it, so a slow
  config is a time from fewer repeats rather than a timeout.

A config slower than the prediction by more than the limit allows still times out: the
prediction bounds what is certain, not what a bad config may cost. A task whose
:data:`MIN_LAUNCHES` predicted launches alone exceed the capped limit cannot be measured at all:
:func:`check_measurable` refuses it before anything runs, saying why, rather than let every
trial time out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kato.errors import KatoError

#: Launches every timed trial makes whatever its repeats: two verification runs, the launch
#: that sizes a timed batch, and one timed batch (one launch where a launch is longer than a
#: batch's target duration).
MIN_LAUNCHES = 4
#: The scaled limit allows this many times the predicted cost of :data:`MIN_LAUNCHES` launches
#: beyond the floor: the prediction is a lower bound, and real configs are slower.
SLACK = 4.0
#: The scaled limit is at most this many times the configured one.
CAP_FACTOR = 10.0
#: The measuring code plans to finish by this fraction of its limit: the rest is left for
#: sending the result back and for a last batch slower than the one before.
DEADLINE_FRACTION = 0.85

#: Dense FLOPs per SM per clock of the fastest type each compute capability's tensor cores run
#: (FP16 on Volta, Turing and Ampere, FP8 on Ada and Hopper): an upper bound of any kernel's rate,
#: so the time it gives is a lower bound. Keyed by the major version; later ones use the last.
_FLOPS_PER_SM_CLOCK = {7: 1024, 8: 2048, 9: 8192, 10: 16384}


def peak_flops(gpu: Any) -> float | None:
    """An upper bound of the FLOP/s any kernel reaches on ``gpu`` (a catalog entry), or None
    where its clock is not listed."""
    if gpu is None or not gpu.clock_mhz:
        return None
    major = gpu.compute_capability[0]
    per_clock = _FLOPS_PER_SM_CLOCK.get(major, _FLOPS_PER_SM_CLOCK[max(_FLOPS_PER_SM_CLOCK)])
    return float(gpu.sm_count * gpu.clock_mhz * 1e6 * per_clock)


def launch_lower_bound_s(spec: Any, shape: Sequence[int], dtype: str, gpu: Any) -> float:
    """Seconds one call of ``spec`` (all its steps) takes at least at ``shape``/``dtype`` on
    ``gpu`` (a :class:`kato.shared.gpus.GpuSpec`): its minimum bytes at peak bandwidth, or its
    FLOPs at the peak rate, whichever is longer. 0.0 where ``gpu`` is None or lists no figures."""
    if gpu is None:
        return 0.0
    bound = 0.0
    if gpu.memory_bandwidth_gbs:
        bound = spec.bytes_moved(shape, dtype) / (gpu.memory_bandwidth_gbs * 1e9)
    rate = peak_flops(gpu)
    if rate:
        bound = max(bound, spec.flops(shape, dtype) / rate)
    return bound


class UnmeasurableTask(KatoError, RuntimeError):
    """Even the launches every trial makes, at the predicted lower bound, do not fit the capped
    per-trial limit: no config of the task can be measured (the job fails with this message)."""


def check_measurable(floor_s: float, launch_s: float | None, what: str = "this task") -> None:
    """Raise :class:`UnmeasurableTask` where :data:`MIN_LAUNCHES` launches of at least
    ``launch_s`` seconds exceed :func:`trial_timeout_s` of ``floor_s`` (``what`` names the task in
    the message)."""
    if not launch_s or launch_s <= 0:
        return
    limit = trial_timeout_s(floor_s, launch_s)
    if MIN_LAUNCHES * launch_s > limit:
        raise UnmeasurableTask(
            f"one launch of {what} takes at least {launch_s:.3g} s (its bytes and FLOPs at the "
            f"GPU's peak), so a trial's {MIN_LAUNCHES} launches need {MIN_LAUNCHES * launch_s:.3g}"
            f" s, more than the per-trial limit's cap of {limit:.3g} s ({CAP_FACTOR:g} times the "
            f"configured {floor_s:g} s, KATO_TRIAL_TIMEOUT_SECONDS): tune a smaller shape, or "
            "raise the limit"
        )


def trial_timeout_s(floor_s: float, launch_s: float | None) -> float:
    """The limit of one trial (compile, verify, time) of a problem whose one launch takes at
    least ``launch_s`` seconds (None or 0: not predicted): ``floor_s`` plus :data:`SLACK` times
    :data:`MIN_LAUNCHES` launches, at most :data:`CAP_FACTOR` times ``floor_s``."""
    if not launch_s or launch_s <= 0:
        return floor_s
    return min(floor_s + SLACK * MIN_LAUNCHES * launch_s, CAP_FACTOR * floor_s)


class TrialDeadline:
    """When the measuring code of one trial must be done: :data:`DEADLINE_FRACTION` of
    ``limit_s`` after it is made (no deadline where ``limit_s`` is None)."""

    def __init__(self, limit_s: float | None):
        self.limit_s = limit_s
        self._end = None if limit_s is None else time.monotonic() + DEADLINE_FRACTION * limit_s

    def left_s(self) -> float:
        """Seconds until the deadline (``inf`` without one; negative once past)."""
        return float("inf") if self._end is None else self._end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether work of ``seconds`` started now ends by the deadline."""
        return seconds <= self.left_s()
