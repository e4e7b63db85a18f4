"""The backend contract: evaluate one config of one tuning task and report a :class:`TrialResult`.

A backend never raises for a bad config: a config that fails to compile, launch or verify is a
result with a failure status and its error text, so the search records it and goes on. Backends
raise only for problems of the backend itself (no device, unreadable cache file).
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kato.tuner.space import SearchSpace

from kato.shared.status import TrialStatus

Config = dict[str, Any]


@dataclass
class TrialResult:
    """What one evaluation of one config produced. ``time_ms`` is the median of ``times_ms``."""

    config: Config
    status: TrialStatus
    times_ms: list[float] = field(default_factory=list)
    compile_time_s: float | None = None
    registers: int | None = None
    shared_static_bytes: int | None = None
    shared_dynamic_bytes: int | None = None
    local_bytes: int | None = None
    blocks_per_sm: int | None = None
    occupancy: float | None = None  # active warps per SM / max warps per SM
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    @property
    def time_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.ok and self.times_ms else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        d["time_ms"] = self.time_ms
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialResult:
        """The result :meth:`to_dict` gave (or a stored trial's, :meth:`db.models.Trial.result`);
        ``time_ms`` is recomputed from ``times_ms``, other keys are ignored."""
        return cls(
            config=dict(data["config"]),
            status=TrialStatus(data["status"]),
            times_ms=list(data.get("times_ms") or []),
            **{name: data.get(name) for name in _FIGURES},
        )


#: The fields of a :class:`TrialResult` besides its config, status and times.
_FIGURES = tuple(
    f.name for f in fields(TrialResult) if f.name not in ("config", "status", "times_ms")
)


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU a backend measures on. ``model`` is the catalog's canonical name ("H200")."""

    name: str
    model: str
    compute_capability: tuple[int, int]
    cuda_version: str
    sm_count: int | None = None
    memory_bytes: int | None = None

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as its driver reports it at one moment (``cuMemGetInfo``), in bytes:
    ``free`` excludes what every process holds on it (this one's context and buffers too)."""

    free_bytes: int
    total_bytes: int


class Backend(ABC):
    """Evaluates configs of one tuning task on one device (real or recorded).

    Thread-safety: a backend instance is used by one thread at a time.
    """

    name: str
    #: Whether this process's other threads cannot disturb a measurement: True for a backend
    #: that times in a child process, or does not time at all (replay). False for one that
    #: times in this process, where a busy thread's share of the GIL would pause the launch
    #: loop between two CUDA events (the search then writes its records inline).
    measures_out_of_process: bool = False
    #: The time one :meth:`evaluate` may take (compile, verify, time), set by the backend's
    #: owner (:func:`tuner.backends.isolated.measuring_backend`, or the measuring child before
    #: each config); None: no limit. A backend that can fit its work into it does (the PyCUDA
    #: backend times fewer repeats, :class:`tuner.trial_cost.TrialDeadline`); others ignore it.
    trial_limit_s: float | None = None

    @abstractmethod
    def device(self) -> DeviceInfo:
        """The device this backend measures on (for a replay file, the recorded one)."""

    @abstractmethod
    def space(self) -> SearchSpace:
        """The search space of the task: parameters, and which combinations are valid."""

    @abstractmethod
    def evaluate(self, config: Config) -> TrialResult:
        """Measure ``config`` (compile, verify, time) and return the result; never raises for a
        faulty config. ``config`` must be valid according to :meth:`space`."""

    def launch_lower_bound_s(self) -> float | None:
        """Seconds one launch of the task takes at least, predicted before any runs
        (:func:`tuner.trial_cost.launch_lower_bound_s`), or None where it cannot be predicted:
        the per-trial limit scales with it (:func:`tuner.trial_cost.trial_timeout_s`)."""
        return None

    def healthy(self) -> bool:
        """Whether the backend can still measure after the last result.

        False after a fault that poisoned the device state (a CUDA context with a sticky error:
        illegal or misaligned address, trap): every later launch would fail too, so an isolating
        owner (:class:`tuner.backends.isolated.IsolatedBackend`) replaces the process.
        """
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device resources. Safe to call twice."""
