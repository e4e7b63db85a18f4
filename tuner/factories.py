"""Backend factories: what a worker builds the backend of each job it claims with.

A factory is a :data:`BackendFactory` (``factory(job) -> Backend``) that also says which jobs it
can answer (``scope``, a :class:`db.queries.JobScope`: the worker claims only those) and
whether its backends run this code's kernels (``runs_current_code``: only then is a job queued
at an older operator version moved to the current one; a recording answers the version it
measured). Optional abilities (memory estimates, the framework's baseline) are the protocols of
:mod:`tuner.backends.abilities`.

- :class:`PyCudaBackends`: the GPU, in process or in an isolated child per job;
- :class:`ReplayBackends`: recorded spaces (Kernel Tuner cache files) answering the jobs of
  their own problems, for tests, CI and benchmarks without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kato.db import queries
from kato.db.models import Job
from kato.kernels import get_operator, list_operators
from kato.kernels.spec import InvalidInput
from kato.tuner import framework
from kato.tuner.backends.base import Backend, DeviceInfo
from kato.tuner.backends.isolated import (
    DEFAULT_TRIAL_TIMEOUT_S,
    BackendSpec,
    SpareChildren,
    measuring_backend,
)
from kato.tuner.backends.pycuda import setup_bytes
from kato.tuner.backends.replay import RecordedProblem, recorded_problem

from kato.shared.gpus import find_gpu, normalize_gpu_name
from kato.shared.kt_cache import load_cache

#: Builds the backend that measures one job: (job) -> Backend.
BackendFactory = Callable[[Job], Backend]

#: Device memory a measuring child's CUDA context takes, counted in a job's need when a worker
#: holds several (:mod:`tuner.admission`): a Hopper context with the CUDA 12/13 runtime takes
#: a few hundred MB; an estimate, to be read on the H200 (busy-fraction session).
CHILD_CONTEXT_BYTES = 512 << 20


class _KeepsSpares:
    """:class:`tuner.backends.abilities.KeepsSpares` for a factory whose ``spares`` is its
    :class:`SpareChildren` (None: not isolated, or spares turned off)."""

    spares: SpareChildren | None = None

    def start_spares(self) -> None:
        if self.spares is not None:
            self.spares.start()

    def close_spares(self) -> None:
        if self.spares is not None:
            self.spares.close()


class PyCudaBackends(_KeepsSpares):
    """Backends on CUDA device ``device_index`` for the job's operator, shape and dtype; with
    ``isolate``, measured in a child process (:class:`IsolatedBackend`) that a faulting kernel
    cannot take down with the worker. Answers every operator registered in this process (and by
    ``imports``, which the child imports too) on the worker's GPU models. With
    ``defer_prepare`` (a worker holding several jobs on the GPU) a child makes its inputs at
    once and its device buffers only in its job's first GPU turn. Isolated, it keeps a warm
    spare child for the device while a worker runs (:class:`SpareChildren`,
    :class:`tuner.backends.abilities.KeepsSpares`) unless ``spares`` is False."""

    runs_current_code = True

    def __init__(
        self,
        device_index: int = 0,
        *,
        isolate: bool = False,
        trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
        imports: Sequence[str] = (),
        defer_prepare: bool = False,
        spares: bool = True,
    ):
        self.device_index, self.isolate = device_index, isolate
        self.trial_timeout_s, self.imports = trial_timeout_s, tuple(imports)
        self.defer_prepare = defer_prepare
        #: The warm spare children of this factory's backends (isolated only).
        self.spares = (
            SpareChildren("pycuda", device_index=device_index, imports=self.imports)
            if isolate and spares
            else None
        )

    @property
    def scope(self) -> queries.JobScope:
        """Every registered operator, read at each claim (a module may register one later)."""
        import importlib

        for module in self.imports:
            importlib.import_module(module)
        return queries.JobScope(operators=frozenset(spec.name for spec in list_operators()))

    def measure_framework(
        self,
        job: Job,
        device: DeviceInfo,
        stop: framework.StopFlag,
        turn: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> framework.FrameworkResult:
        """PyTorch's op for ``job`` on this factory's device, in a child process of its own
        (:func:`tuner.framework.measure_in_child`), stopped when ``stop`` is set; its GPU work
        in ``turn`` (torch's import before it)."""
        return framework.measure_in_child(
            job.operator,
            tuple(job.shape),
            job.dtype,
            device_index=self.device_index,
            gpu_model=device.model,
            imports=self.imports,
            stop=stop,
            turn=turn,
        )

    def device_bytes(self, job: Job) -> int:
        """The device memory ``job``'s backend takes at most
        (:class:`tuner.backends.abilities.EstimatesMemory`): its set-up's buffers
        (:func:`tuner.backends.pycuda.setup_bytes`) and, isolated, its child's CUDA context."""
        spec = get_operator(job.operator)
        buffers = setup_bytes(spec, tuple(job.shape), job.dtype, find_gpu(job.gpu_model))
        return buffers + (CHILD_CONTEXT_BYTES if self.isolate else 0)

    def __call__(self, job: Job) -> Backend:
        spec = BackendSpec(
            kind="pycuda",  # in process, set up at the first measurement while configs compile
            operator=job.operator,
            shape=tuple(job.shape),
            dtype=job.dtype,
            device_index=self.device_index,
            imports=self.imports,
        )
        return measuring_backend(
            spec, isolate=self.isolate, trial_timeout_s=self.trial_timeout_s,
            defer_prepare=self.defer_prepare, spares=self.spares,
        )  # fmt: skip


def pycuda_backend_factory(
    device_index: int = 0,
    *,
    isolate: bool = False,
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    imports: Sequence[str] = (),
    defer_prepare: bool = False,
    spares: bool = True,
) -> PyCudaBackends:
    """:class:`PyCudaBackends` (a :data:`BackendFactory` with its scope)."""
    return PyCudaBackends(
        device_index, isolate=isolate, trial_timeout_s=trial_timeout_s, imports=imports,
        defer_prepare=defer_prepare, spares=spares,
    )  # fmt: skip


@dataclass(frozen=True)
class Recording:
    """A recorded space and the problem it was measured for (:func:`recorded_problem`)."""

    path: Path
    problem: RecordedProblem

    @property
    def key(self) -> tuple[str, str | None, str, str, str]:
        p = self.problem
        return (p.operator, p.operator_version, p.shape_key, p.dtype, p.gpu_model)


def recording_files(path: Path) -> list[Path]:
    """``path`` itself, or the ``*.json`` and ``*.json.gz`` files in the directory ``path`` and
    below it (hidden files and folders skipped), sorted by path."""
    if path.is_file():
        return [path]
    names = (".json", ".json.gz")
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.name.endswith(names)
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def find_recordings(path: Path) -> list[Recording]:
    """The recordings at ``path`` (:func:`recording_files`), each with its problem.

    Raises:
        ValueError: a file is not a recording or does not say what it is for, or there is none.
        OSError: a file cannot be read.
    """
    files = recording_files(path)
    if not files:
        raise ValueError(f"{path}: no recordings (*.json, *.json.gz) in this directory")
    return [Recording(f, recorded_problem(load_cache(f), f)) for f in files]


class ReplayBackends(_KeepsSpares):
    """Replay backends answering from ``recordings``, each only the job of its own problem:
    operator, shape, dtype and GPU model equal, and the operator version where the recording
    names one. A recording of an older operator version answers only jobs still at that version
    (such a job is never moved to the current version: its times are of the old kernel). With
    ``isolate``, through a child process like a GPU worker's (with a warm spare child while a
    worker runs, unless ``spares`` is False: :class:`SpareChildren`); each evaluation takes
    ``delay_s`` seconds (a stand-in for measuring).

    ``gpu_models``: keep only the recordings of these models (default: all).

    Raises:
        ValueError: a recording of an operator not registered here, two recordings for one
            problem, or none left for ``gpu_models``.
    """

    runs_current_code = False

    def __init__(
        self,
        recordings: Sequence[Recording],
        *,
        gpu_models: Sequence[str] | None = None,
        isolate: bool = False,
        trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
        delay_s: float = 0.0,
        spares: bool = True,
    ):
        self.isolate, self.trial_timeout_s, self.delay_s = isolate, trial_timeout_s, delay_s
        #: The warm spare children of this factory's backends (isolated only).
        self.spares = SpareChildren("replay") if isolate and spares else None
        kept = list(recordings)
        if gpu_models:
            wanted = {normalize_gpu_name(m) for m in gpu_models}
            kept = [r for r in kept if r.problem.gpu_model in wanted]
            if not kept:
                have = sorted({r.problem.gpu_model for r in recordings}) or ["none"]
                raise ValueError(
                    f"no recording is for GPU model {', '.join(sorted(wanted))} (the "
                    f"recordings are for {', '.join(have)}): a recording answers only jobs "
                    "for the GPU it was measured on"
                )
        self.recordings: dict[tuple[str, str | None, str, str, str], Recording] = {}
        for rec in kept:
            try:  # recorded_problem checked the file's space; a Recording made by hand too
                get_operator(rec.problem.operator)
            except InvalidInput as exc:
                raise ValueError(f"{rec.path}: a recording for {rec.problem}: {exc}") from None
            other = self.recordings.setdefault(rec.key, rec)
            if other is not rec:
                raise ValueError(
                    f"{other.path} and {rec.path} are both recordings of {rec.problem}: "
                    "keep one of them"
                )

    @property
    def gpu_models(self) -> list[str]:
        return sorted({r.problem.gpu_model for r in self.recordings.values()})

    @property
    def scope(self) -> queries.JobScope:
        problems = frozenset(
            queries.Problem(
                operator=r.problem.operator,
                shape_key=r.problem.shape_key,
                dtype=r.problem.dtype,
                gpu_model=r.problem.gpu_model,
                operator_version=r.problem.operator_version,
            )
            for r in self.recordings.values()
        )
        return queries.JobScope(problems=problems)

    def recording_for(self, job: Job) -> Recording | None:
        """The recording of ``job``'s problem at its version, else one that names no version."""
        problem = (job.shape_key, job.dtype, job.gpu_model)
        return self.recordings.get(
            (job.operator, job.operator_version, *problem)
        ) or self.recordings.get((job.operator, None, *problem))

    def __call__(self, job: Job) -> Backend:
        rec = self.recording_for(job)
        if rec is None:
            raise LookupError(
                f"no recording answers this job ({job.operator} version {job.operator_version} "
                f"{job.shape_key} {job.dtype} on {job.gpu_model}); this worker's are for: "
                + "; ".join(str(r.problem) for r in self.recordings.values())
            )
        options = (("delay_s", self.delay_s), ("gpu_model", rec.problem.gpu_model))
        spec = BackendSpec(kind="replay", replay_file=str(rec.path), options=options)
        return measuring_backend(
            spec, isolate=self.isolate, trial_timeout_s=self.trial_timeout_s, spares=self.spares
        )


def replay_backend_factory(
    path: Path,
    *,
    gpu_models: Sequence[str] | None = None,
    isolate: bool = False,
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    delay_s: float = 0.0,
) -> ReplayBackends:
    """:class:`ReplayBackends` for the recordings at ``path`` (a file, or a directory of them:
    :func:`find_recordings`, whatever their names)."""
    return ReplayBackends(
        find_recordings(Path(path)),
        gpu_models=gpu_models,
        isolate=isolate,
        trial_timeout_s=trial_timeout_s,
        delay_s=delay_s,
    )
