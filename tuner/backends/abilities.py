"""Optional abilities of a backend and of a backend factory, as protocols with their contracts.

A :class:`tuner.backends.base.Backend` needs only ``device``, ``space`` and ``evaluate``. What
else a backend can do is declared by implementing one of the protocols here; the worker and the
isolating owner ask :func:`abilities_of` (a backend) and :func:`factory_abilities_of` (a backend
factory), the one place that looks, and a backend without an ability works all the same: each
protocol says what happens then.

Which backends implement what:

=======================  ==============  ===============  ========
ability                  PyCudaBackend   IsolatedBackend  Replay
=======================  ==============  ===============  ========
:class:`Prepares`        yes             yes (its child)  no
:class:`Precompiles`     yes             yes              no
:class:`TakesHints`      yes             yes              no
:class:`ReportsCompiled` yes             yes              no
:class:`WaitsCompiled`   yes             yes              no
:class:`Interruptible`   no              yes              no
:class:`DrainsCompiles`  yes             yes              no
:class:`ReportsMemory`   yes             yes (its child)  no
:class:`ReleasesDevice`  no              yes              no
=======================  ==============  ===============  ========
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kato.tuner.backends.base import Backend, Config, DeviceInfo, DeviceMemory

if TYPE_CHECKING:
    from kato.db.models import Job
    from kato.db.queries import JobScope
    from kato.tuner import framework


@runtime_checkable
class Prepares(Protocol):
    """A backend whose set-up (inputs, references, device buffers) can run apart from its
    construction.

    Called once by the measuring child (:mod:`tuner.backends.isolated`) right after the
    backend is built and its device announced, while the parent starts compiling; before any
    :meth:`~tuner.backends.base.Backend.evaluate`. Must be idempotent (``evaluate`` may call it
    too). Raises for a problem of the backend itself (the job then fails). Absent: the backend
    sets itself up in its constructor or on its first evaluation.

    An :class:`~tuner.backends.isolated.IsolatedBackend`'s ``prepare`` has its child finish its
    set-up and waits for it: a worker holding several jobs on one GPU calls it in the job's
    GPU turn, right after reading the device's memory (:class:`ReportsMemory`), so that each
    job's buffers are on the device before the next job is admitted (:mod:`tuner.admission`).
    """

    def prepare(self) -> None: ...


# Compiling ahead: four abilities, each usable alone (a backend that only reports which configs
# are compiled still lets the search propose ahead). Each is called from the thread that runs
# the search (the one that calls ``evaluate``), never concurrently with the others; the compiles
# run on the backend's own threads or processes. None changes a result: a config ``evaluate``
# gets that was never compiled ahead is compiled then.


@runtime_checkable
class Precompiles(Protocol):
    """A backend that compiles a list of configs in the background. :meth:`precompile` queues
    ``configs`` (valid ones), in order, and returns at once; called once when a job starts, with
    every unmeasured config of a small space (:data:`tuner.job_runner.PRECOMPILE_MAX_CONFIGS`).
    Absent: nothing is compiled before the search asks for it."""

    def precompile(self, configs: Sequence[Config]) -> None: ...


@runtime_checkable
class TakesHints(Protocol):
    """A backend told which configs the search expects to ask for soon, likeliest first
    (``Search(on_upcoming=...)``); :meth:`hint` compiles them next, before the rest of its
    queue, and returns at once. It never changes what the search proposes. Absent: the
    strategy is not asked for hints (the forest then skips computing them)."""

    def hint(self, configs: Sequence[Config]) -> None: ...


@runtime_checkable
class ReportsCompiled(Protocol):
    """A backend that says whether measuring ``config`` now would not wait on the compiler
    (``Search(ready=...)``). :meth:`is_compiled` is cheap: polled for every config in flight
    before each measurement; True for a config that needs no compile. With it the search may
    propose ahead (up to the worker's ``lookahead``) while no config in flight is ready, and
    measures the first ready one. Absent: no proposal is made ahead (ask, measure, ask)."""

    def is_compiled(self, config: Config) -> bool: ...


@runtime_checkable
class WaitsCompiled(Protocol):
    """A backend that can block until one of ``configs`` is compiled (``Search(wait_ready=...)``;
    at once if none of them has started, or when the backend is interrupted); the search then
    measures that one. Absent: with none ready, the search measures the oldest in flight."""

    def wait_compiled(self, configs: Sequence[Config]) -> None: ...


@runtime_checkable
class Interruptible(Protocol):
    """A backend whose measurement can be stopped from another thread.

    :meth:`interrupt` is called from the worker's heartbeat thread while the search thread may
    be inside ``evaluate`` (or ``wait_compiled``), when the job is cancelled, its lease lost or
    the worker stops: so it must be thread-safe and return at once. After it, the running
    evaluation and every later one raise :class:`tuner.backends.isolated.TrialInterrupted`
    instead of returning a result. Absent: the search stops before its next measurement, once
    the running one ends.
    """

    def interrupt(self) -> None: ...


@runtime_checkable
class DrainsCompiles(Protocol):
    """A backend whose compiles ahead can be ended apart from :meth:`close`:
    :meth:`close_compiles` drops those queued and waits for those running (nvcc only, no GPU
    work). A worker sharing its GPU among jobs calls it before the GPU turn in which it closes
    the backend, so that no turn waits on nvcc; nothing is compiled ahead after it. Absent:
    ``close`` ends them, inside that turn."""

    def close_compiles(self) -> None: ...


@runtime_checkable
class ReportsMemory(Protocol):
    """A backend that reports its device's free and total memory now
    (:class:`~tuner.backends.base.DeviceMemory`, the driver's ``cuMemGetInfo``: what every
    process holds counts as used, this backend's own context and buffers included), or None
    where it cannot tell (a measuring child that died). A driver query, no GPU work: it takes
    no GPU turn. Called from the thread that evaluates, between evaluations. A worker holding
    several jobs on one GPU reads it before each job's device set-up to admit jobs by memory
    (:mod:`tuner.admission`). Absent: the device's memory is unknown and no job is held back
    for it (a replay has no device)."""

    def memory(self) -> DeviceMemory | None: ...


@runtime_checkable
class ReleasesDevice(Protocol):
    """A backend whose hold on the GPU (buffers, modules, CUDA context) can end apart from the
    rest of :meth:`close`: :meth:`release_device` ends it and returns once it has ended (an
    isolated backend's child has closed its backend and said so; the child's exit, most of a
    close's time, is left to ``close``). Safe to call twice; after it only ``close`` may be
    called. A worker sharing its GPU among jobs calls it in the GPU turn that ends a job and
    ``close`` after that turn, so that no other job waits on a process's exit. Absent:
    ``close`` runs inside that turn."""

    def release_device(self) -> None: ...


@dataclass(frozen=True)
class Abilities:
    """What one backend can do beyond the :class:`~tuner.backends.base.Backend` contract: the
    bound methods of its abilities, None where it has none, and whether it measures out of
    this process (:attr:`tuner.backends.base.Backend.measures_out_of_process`)."""

    prepare: Callable[[], None] | None = None
    precompile: Callable[[Sequence[Config]], None] | None = None
    hint: Callable[[Sequence[Config]], None] | None = None
    is_compiled: Callable[[Config], bool] | None = None
    wait_compiled: Callable[[Sequence[Config]], None] | None = None
    interrupt: Callable[[], None] | None = None
    close_compiles: Callable[[], None] | None = None
    memory: Callable[[], DeviceMemory | None] | None = None
    release_device: Callable[[], None] | None = None
    measures_out_of_process: bool = False


def abilities_of(backend: Any) -> Abilities:
    """The abilities ``backend`` declares by implementing the protocols above."""
    return Abilities(
        prepare=backend.prepare if isinstance(backend, Prepares) else None,
        precompile=backend.precompile if isinstance(backend, Precompiles) else None,
        hint=backend.hint if isinstance(backend, TakesHints) else None,
        is_compiled=backend.is_compiled if isinstance(backend, ReportsCompiled) else None,
        wait_compiled=backend.wait_compiled if isinstance(backend, WaitsCompiled) else None,
        interrupt=backend.interrupt if isinstance(backend, Interruptible) else None,
        close_compiles=backend.close_compiles if isinstance(backend, DrainsCompiles) else None,
        memory=backend.memory if isinstance(backend, ReportsMemory) else None,
        release_device=backend.release_device if isinstance(backend, ReleasesDevice) else None,
        measures_out_of_process=isinstance(backend, Backend) and backend.measures_out_of_process,
    )


# --- backend factories (:data:`tuner.factories.BackendFactory`: (job) -> Backend) ----------------


class Scoped(Protocol):
    """A factory that answers only some jobs. ``scope`` is read at every claim (an operator may
    be registered meanwhile), on the worker's thread; the worker claims only jobs in it.
    Absent: the worker claims every job of its GPU models."""

    @property
    def scope(self) -> JobScope: ...


@runtime_checkable
class CodeVersioned(Protocol):
    """A factory that says whether its backends run this process's kernel code:
    ``runs_current_code`` True (a GPU worker's) lets the owner of a job queued for an older
    operator version move the job to the current version before it measures; False (a replay
    of recorded times) leaves the job at its version. Absent: True."""

    runs_current_code: bool


@runtime_checkable
class MeasuresFramework(Protocol):
    """A factory that can time the framework's own op (PyTorch's) for a finished job, stored
    beside the winner (:mod:`tuner.framework`). Called once per job by its owner, after the
    job's backend is closed, on the worker's thread; returns a result saying whether it is
    ``ok`` (never raises for a failed baseline: an exception is logged and ignored), and stops
    when ``stop`` is set. It may take a ``turn`` keyword (a context manager factory: the GPU's
    turn, :mod:`tuner.gpu_gate`) to hold only around its GPU work; one that does not is
    called inside the turn. Absent: no baseline is stored (a replay worker)."""

    def measure_framework(
        self, job: Job, device: DeviceInfo, stop: framework.StopFlag
    ) -> framework.FrameworkResult: ...


@runtime_checkable
class EstimatesMemory(Protocol):
    """A factory that says how much device memory a job's backend will take: its device
    set-up's buffers (every copy it allocates) and, measuring in a child process, that child's
    CUDA context; an upper bound, from the job's operator, shape and dtype alone (no backend is
    built, nothing touches the GPU). Called on the worker's thread before it claims another job
    while holding some (:mod:`tuner.admission`). Absent: the worker estimates the job's buffers
    by its operator's :meth:`kernels.spec.OperatorSpec.buffer_bytes` (the figure the service
    checks a shape against the GPU's memory with)."""

    def device_bytes(self, job: Job) -> int: ...


@runtime_checkable
class KeepsSpares(Protocol):
    """A factory whose isolated backends can start their measuring children from a warm spare
    (:class:`tuner.backends.isolated.SpareChildren`, which the factory holds: one idle child
    for its backend kind, device and imports). A worker calls ``start_spares`` when its loop
    starts (:meth:`tuner.worker.Worker.run_forever`) and ``close_spares`` when it returns,
    after which no process of the pool is left; neither raises (a spare that cannot start
    means fresh children, as without one). Backends built while the spares are not started
    start fresh children. Absent: every child starts fresh."""

    def start_spares(self) -> None: ...

    def close_spares(self) -> None: ...


@dataclass(frozen=True)
class FactoryAbilities:
    """What a backend factory declares (see the protocols above)."""

    scoped: Scoped | None = None
    runs_current_code: bool = True
    measure_framework: Callable[..., Any] | None = None
    device_bytes: Callable[[Job], int] | None = None
    spares: KeepsSpares | None = None

    def scope(self) -> JobScope | None:
        """The factory's scope now (read anew: see :class:`Scoped`), or None: every job."""
        return self.scoped.scope if self.scoped is not None else None


def factory_abilities_of(factory: Any) -> FactoryAbilities:
    """The abilities a backend factory declares by implementing the protocols above."""
    return FactoryAbilities(
        # Looked up statically: ``isinstance(factory, Scoped)`` would evaluate the property (on
        # Python 3.11), importing a GPU worker's operator modules here rather than at a claim.
        scoped=factory if inspect.getattr_static(factory, "scope", None) is not None else None,
        runs_current_code=factory.runs_current_code if isinstance(factory, CodeVersioned) else True,
        measure_framework=factory.measure_framework
        if isinstance(factory, MeasuresFramework)
        else None,
        device_bytes=factory.device_bytes if isinstance(factory, EstimatesMemory) else None,
        spares=factory if isinstance(factory, KeepsSpares) else None,
    )
