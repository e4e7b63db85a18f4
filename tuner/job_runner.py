"""One tuning job on one worker: :class:`JobRunner` runs a claimed job to its end.

A job's life: build a backend for (operator, shape, dtype) -> run the search with the job's
Optuna study stored in the same database -> record every trial as it is measured -> write the
winner to ``best_configs`` -> mark the job done. The loop that claims jobs and hands them to
runners is :class:`tuner.worker.Worker`.

While a job runs, a heartbeat thread renews the lease (every ``min(lease/3, 1 s)``, so a trial
longer than the lease keeps it) and refreshes the worker's ``kato_workers`` row. When the renewal
fails (a cancel was requested, or the lease went to another worker) it interrupts the backend:
an isolated measurement (:mod:`tuner.backends.isolated`) is killed at once, and the search stops
before its next trial. ``DELETE /v1/jobs/{id}`` therefore stops a running job within about a
second.

Everything a runner asks of the job database goes through its ledger (:mod:`db.ledger`:
heartbeats, reservations, results, the job's end; sessions and retries are the ledger's). Every
config is reserved before it is measured (:meth:`db.ledger.JobLedger.reserve`: a placeholder row
under the unique ``(job_id, config_key)`` constraint that also takes one unit of the budget), so
nothing is measured twice, also when several workers share one job: an idle worker joins a
running job with budget left as a *helper*; owner and helpers ask the same Optuna study
(``kato-job-<id>``), see each other's results and reservations before every proposal, and the
owner finishes the job once the budget is used and the helpers' last measurements are in.

A job interrupted half-way (worker killed, host gone) is claimed again once its lease expires;
the trials already recorded are loaded as known results and never measured again, and the
reservations of dead workers are released.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
from kato.db import retry
from kato.db.ledger import JobLedger, Ledger, Seen
from kato.db.models import Job, utcnow
from kato.kernels import get_operator
from kato.kernels.spec import InvalidInput
from kato.tuner import framework
from kato.tuner.admission import MemoryAdmission
from kato.tuner.backends.abilities import abilities_of, factory_abilities_of
from kato.tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus
from kato.tuner.backends.isolated import (
    DEFAULT_TRIAL_TIMEOUT_S,
    TrialInterrupted,
)
from kato.tuner.factories import BackendFactory
from kato.tuner.gpu_gate import GpuGate
from kato.tuner.proposers import proposer_class
from kato.tuner.search import Budget, Search, SearchResult, best_of
from kato.tuner.study import (
    FAILED_VALUE,
    StudyParams,
    describe_study,
    job_attrs,
    job_study_name,
    optuna_storage,
    record_study,
)
from kato.tuner.surrogate import import_models
from kato.tuner.warm_start import SourceReader, warm_start_configs

from kato import env
from kato.shared.kt_cache import config_key

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

# A worker's log is one channel (users configure "kato.tuner.worker"), whichever module
# writes the line.
log = logging.getLogger("kato.tuner.worker")

#: Spaces up to this many valid configs are compiled ahead in full when a job starts.
PRECOMPILE_MAX_CONFIGS = 2000

#: Configs a job's search may have asked for and not measured yet while the GPU would otherwise
#: wait on nvcc (``Search(ahead=...)``). On the H200 (softmax 32768x4096 float16, budget 100) the
#: GPU waited 4.9-5.5 s per job with 1 and 0.65-0.93 s with 4 (docs/results_h200.md). Each
#: proposal made ahead misses the results in flight: ``benchmarks/lookahead_sim.py`` (the
#: recorded spaces on a simulated clock, 40 seeds, budget 100) gives fraction of optimum / wall
#: seconds for 1 -> 4 of 0.896 / 66 -> 0.900 / 51 (convolution A100, 2.7 s compiles), 0.979 / 74
#: -> 0.965 / 61 (A4000), 0.977 / 18 -> 0.977 / 15 (gemm). 1 keeps the replayed search's quality
#: per measurement, at the cost of the GPU's idle time.
DEFAULT_LOOKAHEAD = 4

#: Times the framework's own op for a finished job on the device it ran on, stopping when the
#: event is set: (job, device, stop) -> FrameworkResult (:mod:`tuner.framework`).
FrameworkTimer = Callable[[Job, DeviceInfo, framework.StopFlag], framework.FrameworkResult]

T = TypeVar("T")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def first_configs(read_sources: SourceReader, job: Job, space: Any) -> list[dict[str, Any]]:
    """What a job measures first: the operator's default config for the job's shape (what a
    lookup serves before tuning, so every job records how far its winner beats it:
    docs/defaults.md), then the warm start's configs from what ``read_sources`` finds
    (:meth:`db.ledger.JobLedger.warm_start_sources`), each once."""
    first: list[dict[str, Any]] = []
    try:
        default = get_operator(job.operator).default_config(list(job.shape), job.dtype)
        if space.is_valid(default):  # a replay space may not hold it
            first.append(default)
    except Exception:  # an operator without a default for this shape still tunes
        log.warning("job %s: no default config to measure first", job.id, exc_info=True)
    seen = {space.key(c) for c in first}
    # The warm start's configs are valid already (it checks them with space.is_valid).
    first += [
        c for c in warm_start_configs(read_sources, job, space.is_valid) if space.key(c) not in seen
    ]
    return first


@dataclass
class JobOutcome:
    job_id: str
    status: str
    measured: int
    best_time_ms: float | None
    error: str | None = None


def _check_operator_version(job: Job, ledger: JobLedger) -> None:
    """Make sure ``job`` (a detached copy) is tuned for its operator's current code.

    A job submitted for an older version of its operator (before an upgrade of Kato) that has
    measured nothing is moved to the current version by its owner
    (:meth:`db.ledger.JobLedger.adopt_version`, and on the copy): its results then describe
    the kernel that runs. A worker of older code than the job's (a fleet half-way through an
    upgrade) must not move a newer job back to its own version.

    Raises:
        RuntimeError: the job is at another version and cannot be moved, saying why.
    """
    try:
        spec = get_operator(job.operator)
    except InvalidInput:
        return  # not a registered operator (e.g. a replayed Kernel Tuner space)
    if spec.version == job.operator_version:
        return
    old, new = job.operator_version, spec.version
    changed = f"operator {job.operator!r} is at version {new} here, the job at {old}"
    if ledger.helper:
        raise RuntimeError(f"{changed}: left to its owner")
    answer = ledger.adopt_version(old, new)
    if answer != "moved":
        raise RuntimeError(
            {
                "newer": f"{changed}, a newer version (submitted by newer Kato code): upgrade "
                "this worker, then submit the job again",
                "gone": f"{changed}, and the job is gone",
                "lost": f"{changed}, and the job went to another worker",
                "measured": f"{changed}, and the job has measured configs of the old version; "
                "submit the job again",
            }[answer]
        )
    log.info(
        "job %s: operator %s changed since it was submitted; tuning version %s (was %s)",
        job.id, job.operator, new, old,
    )  # fmt: skip
    job.operator_version = new


def _log_trial(ledger: JobLedger, job: Job, key: str, result: TrialResult, measured: int) -> None:
    """One INFO line for a trial this worker measured and stored: job, trial number, how many
    of the budget are measured, status, time (or the error's first line), the job's best so far
    (every worker's), config."""
    number, best = ledger.trial_number(key)
    if result.time_ms is not None:
        outcome = f"{result.time_ms:.4f} ms"
    else:
        outcome = ((result.error or "").strip().splitlines() or ["-"])[0][:120]
    log.info(
        "job %s trial %s (%d/%d): %s %s, best %s; config %s",
        job.id, "?" if number is None else number, measured, job.budget_configs,
        result.status.value, outcome, f"{best:.4f} ms" if best is not None else "-",
        json.dumps(result.config, sort_keys=True),
    )  # fmt: skip


class _SharedStudy:
    """The job's Optuna study as seen by one worker: each asked or added trial carries the
    worker's id (user attribute ``kato_worker``), and telling a trial another worker already
    failed is skipped instead of raising (a restarted owner fails the orphans of dead workers).

    Its storage calls are retried on a transient database fault (:func:`db.retry.call`), each
    safe to make again: a tell of a finished trial is skipped. An ask whose answer was lost
    leaves a RUNNING trial without an owner, failed as an orphan when the job's search next
    starts. Any other call that fails
    ends the search, which the runner starts again from the stored trials."""

    def __init__(
        self,
        study: optuna.Study,
        worker_id: str,
        *,
        policy: retry.RetryPolicy | None = None,
        stop: threading.Event | None = None,
    ):
        self._study, self._worker_id = study, worker_id
        self._policy, self._stop = policy, stop

    def _retried(self, what: str, step: Callable[[], T]) -> T:
        return retry.call(
            step, what=f"study {self._study.study_name}: {what}", logger=log,
            policy=self._policy, stop=self._stop,
        )  # fmt: skip

    def ask(self, *args: Any, **kwargs: Any) -> optuna.Trial:
        trial = self._retried("ask", lambda: self._study.ask(*args, **kwargs))
        self._retried("ask", lambda: trial.set_user_attr("kato_worker", self._worker_id))
        return trial

    def tell(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("skip_if_finished", True)
        return self._retried("tell", lambda: self._study.tell(*args, **kwargs))

    def enqueue_trial(self, *args: Any, **kwargs: Any) -> None:
        # A repeat (an enqueue whose answer was lost) is asked for once more and then
        # answered from the results or the configs in flight: it is never measured twice.
        self._retried("enqueue", lambda: self._study.enqueue_trial(*args, **kwargs))

    def get_trials(self, *args: Any, **kwargs: Any) -> list[optuna.trial.FrozenTrial]:
        return self._retried("read", lambda: self._study.get_trials(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


class SharedSearch(Search):
    """:class:`Search` on a study that several workers may use at once (for a strategy that asks
    Optuna; one that does not has no study to share): on start it fails only the RUNNING trials
    of workers that are not live (``is_live(worker_id)``), not those other workers are
    measuring now. A RUNNING trial with no worker yet is one another worker has just asked for
    (its owner is written right after the ask): it is failed only once it is older than
    ``orphan_grace_seconds``."""

    def __init__(
        self,
        *args: Any,
        worker_id: str,
        is_live: Callable[[str], bool],
        orphan_grace_seconds: float = 60.0,
        retry_policy: retry.RetryPolicy | None = None,
        shutdown: threading.Event | None = None,
        **kwargs: Any,
    ):
        self._starting = True
        super().__init__(*args, **kwargs)
        self._starting = False
        if self.study is None:
            return
        self.study = _SharedStudy(self.study, worker_id, policy=retry_policy, stop=shutdown)
        running = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        now = datetime.now()  # Optuna stamps trials with naive local time
        for t in running:
            owner = t.user_attrs.get("kato_worker")
            if owner is None:
                started = t.datetime_start
                age = (now - started).total_seconds() if started is not None else math.inf
                orphaned = age > orphan_grace_seconds
            else:
                # This worker's own: left by a search of this worker that ended (a database
                # fault ended it, or the process it had before a restart under the same id).
                orphaned = owner == worker_id or not is_live(owner)
            if orphaned:
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)

    def _fail_orphaned_trials(self) -> None:
        if not self._starting:  # pragma: no cover - the base class calls it from __init__ only
            super()._fail_orphaned_trials()


class _BudgetUsed(Exception):
    """Every unit of the job's budget is reserved (by this worker or others)."""


class SharedResults:
    """What one worker's search knows of the other workers on its job, and how a
    :meth:`db.ledger.JobLedger.sync` changes the search's results.

    ``final``: config keys whose recorded result the search holds (never read again);
    ``pending``: keys other workers were measuring at the last sync (a ``PENDING`` placeholder
    in the search's results, so the search neither proposes them nor overruns the budget)."""

    def __init__(self, known: Collection[str] = ()) -> None:
        self.final: set[str] = set(known)
        self.pending: set[str] = set()

    def apply(self, seen: Seen, results: dict[str, TrialResult], held: Collection[str]) -> None:
        """Bring ``seen`` into the search's ``results``: other workers' results, and their
        reservations as ``PENDING``. A key pending before and neither pending nor recorded now
        was released (its worker died): it leaves ``results``, measurable again, unless this
        worker ``held`` it since (reserved it: its result may be in the search while its row
        waits on the write-behind) or its result is known."""
        for key, stored in seen.results.items():
            results[key] = TrialResult.from_dict(stored)
            self.final.add(key)
        for key, config in seen.pending.items():
            if key not in results:
                results[key] = TrialResult(config=dict(config), status=TrialStatus.PENDING)
        for key in self.pending - set(seen.pending) - self.final - set(held):
            results.pop(key, None)
        self.pending = set(seen.pending)


@dataclass
class _JobState:
    """What the heartbeat thread and the search share while one job runs."""

    stop: threading.Event = field(default_factory=threading.Event)
    reason: str | None = None  # cancelled | lost | stopped (the worker is shutting down)
    shared: SharedResults = field(default_factory=SharedResults)
    last_sync: float = 0.0
    stored: int = 0  # results this worker stored (a search that stores one made progress)
    backend: Any = None  # interrupted by the heartbeat on a cancel or a lost lease


class _DatabaseUnavailable(Exception):
    """The database kept failing for longer than the retry policy allows: the job is left
    running under its lease, for a resume once the database answers."""


class JobRunner:
    """Runs one claimed job to its end, as its owner or as a helper. Never raises an
    ``Exception``: failures end as a failed job (owner) or a failed outcome (helper); an
    interrupt (``KeyboardInterrupt``, also wrapped in a library's error) is raised after the
    job's reservations and lease are given back.

    A database fault does not fail the job (:mod:`db.retry`): each step is retried with
    backoff; a search that a fault ends anyway starts again from the stored trials (as a
    resumed job does); after ``retry_policy.max_seconds`` of faults without a trial stored the
    run ends as ``interrupted`` and the job is left running under its lease for a resume.
    A fault at the run's start, before the job is read (its load, the release of dead workers'
    reservations), gives the job back instead (its lease ended: any worker's next claim takes
    it) and ends the run ``interrupted``. Only the job's own work (its backend, kernels,
    search) fails it.

    Args:
        lease_seconds: lease length; renewed every ``heartbeat_seconds`` (default
            ``min(lease/3, 1)``) by a background thread. Also how long a worker's heartbeat
            may be silent before it counts as dead (its reservations are released).
        on_heartbeat: called with ``(status, job_id)`` on every heartbeat (the worker refreshes
            its ``kato_workers`` row); exceptions are logged.
        sync_seconds: how often the search reads the other workers' results and reservations.
        lookahead: most configs the search asks for ahead while the GPU would wait on the
            compiler (``Search(ahead=...)``; 1: never). Only backends that compile ahead
            (:class:`tuner.backends.abilities.ReportsCompiled`) are asked ahead for.
        retry_policy: how database faults are retried (default
            :meth:`db.retry.RetryPolicy.from_env`).
        shutdown: set when the worker stops (a signal): the search stops before its next
            measurement, database steps are no longer retried, and the run ends ``stopped``
            with its reservations and lease given back.
        framework_timer: times PyTorch's own op for a job the owner is about to finish
            (:mod:`tuner.framework`), stored beside the winner; default: the backend
            factory's, if it has one (:class:`tuner.backends.abilities.MeasuresFramework`:
            a GPU worker's does, a replay worker's not). ``KATO_FRAMEWORK_BASELINE=false``
            turns it off. A baseline that fails is logged, never stored, and the job is done
            all the same; one whose outputs disagree with the references is stored, with a
            warning (PyTorch's op is what would run instead, accurate or not). Its result's
            ``compiled`` (the op compiled by ``torch.compile``) is stored the same way, beside
            it (``KATO_FRAMEWORK_COMPILED=false``: not taken).
        gpu_gate: the GPU's gate (:mod:`tuner.gpu_gate`), shared by the runners of a worker
            that holds several jobs at once (each measurement, device set-up, close and
            baseline then takes turns, and a config's compile is awaited before its turn, so
            nvcc never holds the GPU); default: one of its own. It also counts the job's GPU
            busy time, stored with the job (``gpu_busy_s``, ``gpu_busy_fraction``).
        admission: the memory ledger of a worker holding several jobs at once
            (:mod:`tuner.admission`): the job's device set-up then runs in a GPU turn of its
            own before its search, right after its backend reads the device's free memory
            for it, and the job leaves it when its run ends.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        db_url: str,
        backend_factory: BackendFactory,
        *,
        worker_id: str,
        lease_seconds: float = 60.0,
        on_progress: Callable[[TrialResult, int, int], None] | None = None,
        on_heartbeat: Callable[[str, str | None], None] | None = None,
        heartbeat_seconds: float | None = None,
        sync_seconds: float = 0.5,
        lookahead: int = DEFAULT_LOOKAHEAD,
        retry_policy: retry.RetryPolicy | None = None,
        shutdown: threading.Event | None = None,
        framework_timer: FrameworkTimer | None = None,
        gpu_gate: GpuGate | None = None,
        admission: MemoryAdmission | None = None,
    ):
        self.db_url = db_url
        self.admission = admission
        #: The state of the job running now (:meth:`interrupt` reads it from another thread).
        self._state: _JobState | None = None
        #: Whether other runners share the GPU (then compiles are awaited outside its gate).
        self.shares_gpu = gpu_gate is not None
        self.gpu_gate = gpu_gate or GpuGate()
        self.backend_factory = backend_factory
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.on_progress = on_progress
        self.on_heartbeat = on_heartbeat
        self.heartbeat_seconds = heartbeat_seconds or max(0.05, min(lease_seconds / 3, 1.0))
        self.sync_seconds = sync_seconds
        self.lookahead = lookahead
        self.retry_policy = retry_policy or retry.RetryPolicy.from_env()
        self.shutdown = shutdown or threading.Event()
        #: What the backend factory declares beyond building backends (:mod:`.abilities`).
        self.factory_abilities = factory_abilities_of(backend_factory)
        self.framework_timer = framework_timer or self.factory_abilities.measure_framework
        #: Everything this worker asks of the job database (:mod:`db.ledger`).
        self.ledger = Ledger(
            sessions,
            worker_id,
            lease_seconds=lease_seconds,
            retry_policy=self.retry_policy,
            stop=self.shutdown,
        )
        #: The job database's Optuna storage, opened by the first job (:func:`optuna_storage`).
        self._storage: optuna.storages.RDBStorage | None = None
        import_models()  # now, not in the first job's search

    def run(
        self, job_id: str, *, helper: bool = False, ledger: JobLedger | None = None
    ) -> JobOutcome:
        """Run ``job_id``: as its owner (claimed: the lease is ours) or, with ``helper``, as an
        extra worker on a job another worker owns. ``ledger``: the job's ledger made at its
        claim (default: a new one), shared with a thread that may give the job back while this
        run goes on (:meth:`Worker._give_back_held`); once given back, the run reserves and
        renews nothing more (:meth:`db.ledger.JobLedger.give_back`)."""
        if ledger is None:
            ledger = self.ledger.job(job_id, helper=helper)
        if self.shutdown.is_set():  # stopped between the claim and the run
            ledger.give_back()
            return JobOutcome(job_id, "stopped", 0, None, "the worker stopped")
        try:
            job = ledger.load()
            if job is not None and not helper:  # resumed: dead workers' trials never finish
                ledger.release_stale()
        except BaseException as exc:
            ledger.give_back()  # not left to wait out its lease
            if not isinstance(exc, Exception) or retry.is_interrupt(exc):
                raise
            log.warning("job %s: given back: its start failed: %s", job_id, retry.describe(exc))
            return JobOutcome(job_id, "interrupted", 0, None, retry.describe(exc))
        if job is None:
            return JobOutcome(job_id, "missing", 0, None, "job not found")
        state = _JobState()
        self._state = state
        if self.shutdown.is_set():  # stopped before interrupt() could see this run's state
            self.interrupt()
        beat = threading.Thread(
            target=self._heartbeat, args=(ledger, state), name="kato-heartbeat", daemon=True
        )
        backend: Backend | None = None
        interrupted = False
        try:
            if self.factory_abilities.runs_current_code:
                _check_operator_version(job, ledger)
            backend = self.backend_factory(job)
            state.backend = backend
            beat.start()
            outcome = self._search(job, backend, state, ledger)
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception) or retry.is_interrupt(exc)
            if interrupted:
                raise  # given back below, once the heartbeat has stopped
            if self.shutdown.is_set():  # say, a retry given up because the worker stops
                interrupted = True
                outcome = JobOutcome(job_id, "stopped", 0, None, "the worker stopped")
            else:
                outcome = self._failed(ledger, exc)
        finally:
            state.stop.set()
            if beat.is_alive():
                beat.join(5)
            if backend is not None:
                self._close(backend, job_id)
            if interrupted or state.reason == "stopped":
                ledger.give_back()
            if not interrupted:  # an interrupt does not wait on one more write
                self._store_gpu_busy(ledger, job_id)
            else:
                self.gpu_gate.forget(job_id)
            self._state = None
        return outcome

    def interrupt(self) -> None:
        """Stop the job running now, from any thread (a worker stopping at once): its search
        stops before its next measurement, an interruptible backend's measurement ends now,
        and the run gives its reservations and lease back (``stopped``)."""
        state = self._state
        if state is None:
            return
        state.reason = state.reason or "stopped"
        state.stop.set()
        interrupt = abilities_of(state.backend).interrupt if state.backend is not None else None
        if interrupt is not None:
            interrupt()

    def _close(self, backend: Backend, job_id: str) -> None:
        """Close ``backend``, the part that ends its hold on the GPU in a GPU turn (a child's
        context ends on the GPU): its compiles ahead are ended before the turn and, where the
        backend releases the device apart (``ReleasesDevice``, :mod:`tuner.backends.abilities`),
        the rest of the close (a child's exit) after it, so that neither nvcc nor a process's
        teardown holds the GPU another job shares."""
        abilities = abilities_of(backend)
        try:
            if abilities.close_compiles is not None:
                abilities.close_compiles()
            with self._gpu(job_id, counted=False):
                try:
                    if abilities.release_device is not None:
                        abilities.release_device()
                    else:
                        backend.close()
                finally:
                    # In the same turn: a reading taken after the close, its memory free, must
                    # not add the job's need to it too (tuner.admission).
                    if self.admission is not None:
                        self.admission.closed(job_id)
        finally:
            if abilities.release_device is not None:
                backend.close()

    def _set_up(self, job_id: str, backend: Backend) -> None:
        """A worker holding several jobs (:mod:`tuner.admission`): in one GPU turn, read the
        device's free memory (every held job set up before this one has its buffers on the
        device by now: each did so in a turn of its own) and then set the job's device up,
        so the next admission sees its buffers too. Raises what the set-up raises."""
        assert self.admission is not None
        abilities = abilities_of(backend)
        with self._gpu(job_id):
            memory = abilities.memory() if abilities.memory is not None else None
            self.admission.set_up(
                job_id,
                memory.free_bytes if memory is not None else None,
                memory.total_bytes if memory is not None else None,
            )
            if abilities.prepare is not None:
                abilities.prepare()

    def _gpu(self, job_id: str, *, counted: bool = True) -> contextlib.AbstractContextManager:
        """The GPU's turn for ``job_id``'s work (:class:`tuner.gpu_gate.GpuGate`)."""
        return self.gpu_gate.hold(job_id, counted=counted)

    def _store_gpu_busy(self, ledger: JobLedger, job_id: str) -> None:
        """Add the seconds this run held the GPU to the job's record (its busy fraction follows
        once it has ended); a database fault loses the figure, never the job."""
        busy = self.gpu_gate.forget(job_id)
        if busy <= 0:
            return
        try:
            ledger.add_gpu_busy(busy)
        except Exception as exc:
            if not retry.is_transient(exc):
                raise
            log.warning("job %s: its GPU busy time was not stored: %s", job_id, exc)

    def _failed(self, ledger: JobLedger, exc: Exception) -> JobOutcome:
        """The run raised ``exc``: a database fault that outlasted the retries leaves the job
        for a resume (``interrupted``); anything else (a broken backend or kernel) fails the
        job, not the worker."""
        job_id = ledger.job_id
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, _DatabaseUnavailable) or retry.is_transient(exc):
            log.warning(
                "job %s: left for a resume: the database failed for too long (%s)",
                job_id, retry.describe(exc),
            )  # fmt: skip
            ledger.release_mine()
            return JobOutcome(job_id, "interrupted", 0, None, retry.describe(exc))
        log.exception("job %s failed", job_id)
        ledger.release_mine()
        if ledger.helper:
            return JobOutcome(job_id, "failed", 0, None, error)
        try:
            if not ledger.fail(error):
                # The lease went to another worker (say, a write failed in a network
                # partition longer than the lease): the job is that worker's now.
                return JobOutcome(job_id, "lost", 0, None, error)
        except Exception as db_error:
            if not retry.is_transient(db_error):
                raise
            log.warning("job %s: could not be marked failed: %s", job_id, retry.describe(db_error))
            return JobOutcome(job_id, "interrupted", 0, None, error)
        return JobOutcome(job_id, "failed", 0, None, str(exc))

    # --- heartbeat ------------------------------------------------------------------------

    def _heartbeat(self, ledger: JobLedger, state: _JobState) -> None:
        """Renew the lease (owner) or check the job is still on (helper) until the job ends;
        on a cancel, a lost lease or a shutdown, stop the search and interrupt the backend. A
        database fault is logged once (and its recovery), and tried again on the next beat."""
        faults = retry.FaultLog(log, f"job {ledger.job_id}: heartbeat")
        while not state.stop.wait(self.heartbeat_seconds):
            if self.shutdown.is_set():
                reason = "stopped"
            else:
                try:
                    reason = self._beat(ledger)
                except Exception as exc:  # database hiccup: try again on the next beat
                    faults.failed(exc)
                    continue
                faults.ok()
                if reason is None:
                    continue
            state.reason = reason
            state.stop.set()
            interrupt = abilities_of(state.backend).interrupt
            if interrupt is not None:
                interrupt()
            return

    def _beat(self, ledger: JobLedger) -> str | None:
        """One heartbeat: ``None`` while the job goes on, else why this worker must stop."""
        if self.on_heartbeat is not None:
            # Before the lease: a heartbeat never outlives the lease it came with, so
            # a worker whose lease expired is never taken for live.
            self.on_heartbeat("busy", ledger.job_id)
        return ledger.renew()

    # --- the search -----------------------------------------------------------------------

    def _sync(self, ledger: JobLedger, search: Search, state: _JobState) -> None:
        """Bring other workers' results and reservations into the search (they count towards
        the budget and are never proposed to this worker's backend)."""
        seen = ledger.sync(state.shared.final)
        state.shared.apply(seen, search.results, ledger.held())

    def _await_result(self, ledger: JobLedger, key: str, state: _JobState) -> TrialResult | None:
        """Wait for another worker's measurement of ``key``; ``None`` if it was released."""
        stored = ledger.await_result(key, state.stop)
        if stored is not None:
            state.shared.final.add(key)
            return TrialResult.from_dict(stored)
        if state.stop.is_set():
            raise TrialInterrupted("the job stopped")
        return None

    def _search(
        self, job: Job, backend: Backend, state: _JobState, ledger: JobLedger
    ) -> JobOutcome:
        outcome = self._search_until_settled(job, backend, state, ledger)
        helper = ledger.helper
        if state.reason == "stopped":
            return JobOutcome(job.id, "stopped", outcome.measured, None, "the worker stopped")
        if state.reason is not None or outcome.stopped == "cancelled":
            current = ledger.load()
            cancelled = current is not None and (
                current.cancel_requested or current.status == "cancelled"
            )
            if helper or not cancelled:
                # A helper leaves the job to its owner; an owner whose lease went to another
                # worker leaves it to that worker.
                status = "helped" if helper else "lost"
                return JobOutcome(job.id, status, outcome.measured, None, state.reason)
            self._write_study_view(job, backend, ledger)
            if not ledger.cancel():  # claimed by another worker since: the job is its
                return JobOutcome(job.id, "lost", outcome.measured, None, state.reason)
            return JobOutcome(job.id, "cancelled", outcome.measured, None, None)
        if helper:
            return JobOutcome(job.id, "helped", len(outcome.new), None, None)
        self._write_study_view(job, backend, ledger)
        return self._finish(job, backend, state, ledger)

    def _write_study_view(self, job: Job, backend: Backend, ledger: JobLedger) -> None:
        """Owner, the job ending (done or cancelled): a strategy that proposes without Optuna
        (:attr:`tuner.proposers.Proposer.uses_study` False) keeps no study while it runs, so
        the job's study for optuna-dashboard is written now from its stored trials, each
        tagged with the worker that measured it (:func:`tuner.study.record_study`: a config
        the study holds already, say from an older Kato that wrote it per trial, is skipped).
        Never fails the job: a failure is logged."""
        if self._storage is None or proposer_class(job.strategy).uses_study:
            return
        try:
            rows = ledger.measured_trials()
            trials = [
                (
                    row.config,
                    row.time_ms if row.time_ms is not None else FAILED_VALUE,
                    row.created_at,
                    {"kato_worker": row.reserved_by} if row.reserved_by else {},
                )
                for row in rows
            ]
            params = StudyParams(backend.space().params)
            # Retried on a transient fault like every other write: record_study skips the
            # configs the study holds, so a try whose commit landed adds nothing the next time.
            retry.call(
                lambda: record_study(
                    self._storage, job_study_name(job.id), job_attrs(job), params, trials
                ),
                what=f"job {job.id}: its Optuna study", logger=log, policy=self.retry_policy,
                stop=self.shutdown,
            )  # fmt: skip
        except Exception as exc:
            # The study is a view of the stored trials (rebuilt by kato import of an export).
            log.warning("job %s: its Optuna study was not written (%s)", job.id,
                        retry.describe(exc) if retry.is_transient(exc) else exc)  # fmt: skip

    def _search_until_settled(
        self, job: Job, backend: Backend, state: _JobState, ledger: JobLedger
    ) -> SearchResult:
        """The job's search, run until its budget is used and settled (owner), or it stops.

        A transient database fault that ends the search (one its retries did not absorb) does
        not end the run: this worker's unfilled reservations are released and, after a
        backoff, the search starts again from the stored trials and study, as a resumed job
        does. Faults for longer than the retry policy's ``max_seconds`` without a result stored
        raise :class:`_DatabaseUnavailable`."""
        space = backend.space()
        known = self._known(ledger, state)
        precompile = abilities_of(backend).precompile
        if precompile is not None:
            # Compile ahead: small spaces entirely, in parallel, while the GPU measures.
            valid = space.valid_configs()
            if len(valid) <= PRECOMPILE_MAX_CONFIGS:
                precompile([c for c in valid if space.key(c) not in known])
        if self.admission is not None and not state.stop.is_set():
            self._set_up(job.id, backend)
        if self._storage is None:
            # Once per runner: opening Optuna's storage checks its schema (alembic), about
            # 0.3 s that every job of a batch paid again.
            self._storage = retry.call(
                lambda: optuna_storage(self.db_url), what=f"job {job.id}: open the study storage",
                logger=log, policy=self.retry_policy, stop=self.shutdown,
            )  # fmt: skip
        storage = self._storage
        try:
            return self._search_resumed(job, backend, space, known, storage, state, ledger)
        finally:
            storage.engine.dispose()  # its connections, now: not when the collector runs

    def _search_resumed(
        self,
        job: Job,
        backend: Backend,
        space: Any,
        known: dict[str, TrialResult],
        storage: optuna.storages.BaseStorage,
        state: _JobState,
        ledger: JobLedger,
    ) -> SearchResult:
        """:meth:`_search_once` until it ends other than by a transient database fault; after
        one, from the stored results again (see :meth:`_search_until_settled`)."""
        backoff = self.retry_policy.backoff()
        failing_since: float | None = None
        while True:
            stored = state.stored
            try:
                return self._search_once(job, backend, space, known, storage, state, ledger)
            except Exception as exc:
                if not retry.is_transient(exc) or retry.is_interrupt(exc):
                    raise
                error = exc
            now = time.monotonic()
            if failing_since is None or state.stored > stored:
                failing_since = now  # the last search stored results: a new fault
                backoff.reset()
            if self.shutdown.is_set():
                raise error
            if now - failing_since >= self.retry_policy.max_seconds:
                raise _DatabaseUnavailable(retry.describe(error)) from error
            wait = backoff.next()
            log.warning(
                "job %s: a database fault ended the search (%s); starting it again from the "
                "stored trials in %.1f s",
                job.id, retry.describe(error), wait,
            )  # fmt: skip
            ledger.release_mine()
            if state.stop.wait(wait):
                return SearchResult(best_of(known), known, stopped="cancelled")
            try:
                known = self._known(ledger, state)
            except Exception as exc:
                if not retry.is_transient(exc) or retry.is_interrupt(exc):
                    raise
                continue  # still failing: counted from failing_since, tried again

    def _known(self, ledger: JobLedger, state: _JobState) -> dict[str, TrialResult]:
        """The job's stored results (key -> result; reservations left out); they become the
        search's known results and what ``state.shared`` holds final."""
        stored = ledger.stored_results()
        known = {key: TrialResult.from_dict(result) for key, result in stored.items()}
        state.shared = SharedResults(known)
        state.last_sync = 0.0
        return known

    def _search_once(
        self,
        job: Job,
        backend: Backend,
        space: Any,
        known: dict[str, TrialResult],
        storage: optuna.storages.BaseStorage,
        state: _JobState,
        ledger: JobLedger,
    ) -> SearchResult:
        """One search of the job from ``known`` (the stored results) to its settled end."""
        helper = ledger.helper

        search: Search | None = None

        def should_stop() -> bool:
            if state.stop.is_set() or self.shutdown.is_set():
                return True
            now = time.monotonic()
            if search is not None and now - state.last_sync >= self.sync_seconds:
                state.last_sync = now
                self._sync(ledger, search, state)
            return False

        # Helpers draw their own proposals (another seed), so that workers sharing a job rarely
        # propose the same config at once; a collision costs a wait, never a second measurement.
        seed = job.seed if not helper else job.seed + zlib.crc32(self.worker_id.encode()) % 9973
        live = self.ledger.live_workers()
        abilities = abilities_of(backend)
        search = SharedSearch(
            space,
            functools.partial(
                self._measure, ledger, backend, state, space, lambda: search.release_writes()
            ),
            strategy=job.strategy,
            seed=seed,
            storage=storage,
            study_name=job_study_name(job.id),
            known=known,
            seed_configs=first_configs(ledger.warm_start_sources, job, space),
            on_result=functools.partial(self._record, ledger, job, state, space),
            should_stop=should_stop,
            on_upcoming=abilities.hint,  # compile the likely next ones first
            ahead=self.lookahead,
            ready=abilities.is_compiled,
            wait_ready=abilities.wait_compiled,
            write_behind=abilities.measures_out_of_process,
            evaluate_releases=True,
            worker_id=self.worker_id,
            is_live=live.__contains__,
            orphan_grace_seconds=self.lease_seconds,
            retry_policy=self.retry_policy,
            shutdown=self.shutdown,
        )
        if search.study is not None:  # what optuna-dashboard shows of the job
            describe_study(search.study, job_attrs(job))
        while True:
            budget = Budget(max_configs=job.budget_configs, max_seconds=_seconds_left(job))
            try:
                outcome = search.run(budget)
            except (TrialInterrupted, _BudgetUsed) as exc:
                stopped = "budget" if isinstance(exc, _BudgetUsed) else "cancelled"
                outcome = SearchResult(best_of(search.results), search.results, stopped=stopped)
            if self.shutdown.is_set() and state.reason is None:
                state.reason = "stopped"
            if helper or state.reason is not None or outcome.stopped == "cancelled":
                return outcome
            # The owner settles every reservation first, whatever stopped the search.
            if not self._budget_given_back(ledger, search, state) or outcome.stopped != "budget":
                return outcome

    def _measure(
        self,
        ledger: JobLedger,
        backend: Backend,
        state: _JobState,
        space: Any,
        release_writes: Callable[[], None],
        config: dict[str, Any],
    ) -> TrialResult:
        """The search's ``evaluate``: reserve ``config``, then start the earlier results' writes
        (``release_writes``: after the reservation, which they would otherwise hold up on a
        database of one writer, SQLite's) and measure it; a config another worker holds is
        awaited, the writes started first, and answered from its result (measured again only
        if that worker's reservation is released)."""
        key = space.key(config)
        while True:
            reservation = ledger.reserve(config, key)
            if reservation == "reserved":
                break
            if reservation == "budget":
                raise _BudgetUsed
            if reservation == "stopped":
                raise TrialInterrupted("the job is no longer running")
            # Taken: another worker's. Our last result's records go first: that worker may be
            # waiting for one of them (crossed configs) while we wait for its result.
            release_writes()
            result = self._await_result(ledger, key, state)
            if result is not None:
                return result
        try:
            release_writes()
            if self.shares_gpu:
                self._await_compile(backend, config, state)
            with self._gpu(ledger.job_id):
                return backend.evaluate(config)
        except BaseException:
            ledger.release(key)
            raise

    @staticmethod
    def _await_compile(backend: Backend, config: dict[str, Any], state: _JobState) -> None:
        """Wait for ``config``'s compile before taking the GPU's turn, so that another job
        measures while nvcc runs: it is moved to the front of the compile queue and awaited.
        A backend that does not compile ahead compiles inside ``evaluate``.

        Raises:
            TrialInterrupted: the job stopped (``state.stop``) while it waited.
        """
        abilities = abilities_of(backend)
        if abilities.is_compiled is None or abilities.hint is None:
            return
        while not state.stop.is_set() and not abilities.is_compiled(config):
            abilities.hint([config])
            if abilities.wait_compiled is not None:
                abilities.wait_compiled([config])  # at once if not started yet: poll again
            if not abilities.is_compiled(config):
                state.stop.wait(0.005)
        if state.stop.is_set():  # a job stopped while it waited measures nothing more
            raise TrialInterrupted("the job stopped")

    def _record(
        self,
        ledger: JobLedger,
        job: Job,
        state: _JobState,
        space: Any,
        result: TrialResult,
        measured: int,
    ) -> None:
        """The search's ``on_result``: store a result this worker holds the reservation of.

        On the search's write-behind thread where the backend measures out of process: only
        set operations (atomic under the GIL) on the state the main thread reads."""
        key = space.key(result.config)
        # Final before the ledger stops holding the key: a sync skips a key in either.
        state.shared.final.add(key)
        if ledger.holds(key):
            stored = ledger.record(key, result.to_dict())
            if stored:
                state.stored += 1
                self._log_trial(ledger, job, key, result, measured)
            else:
                log.warning(
                    "job %s: reservation of %s was released and taken since; not stored",
                    job.id,
                    key,
                )
        if self.on_progress is not None:
            self.on_progress(result, measured, job.budget_configs)

    def _log_trial(
        self, ledger: JobLedger, job: Job, key: str, result: TrialResult, measured: int
    ) -> None:
        """The INFO line of a trial stored (:func:`_log_trial`); skipped on a database fault
        (a log line is not worth a retry)."""
        if not log.isEnabledFor(logging.INFO):
            return
        try:
            _log_trial(ledger, job, key, result, measured)
        except Exception as exc:
            if not retry.is_transient(exc):
                raise
            log.info("job %s: trial of %s stored", job.id, json.dumps(result.config))

    def _budget_given_back(self, ledger: JobLedger, search: Search, state: _JobState) -> bool:
        """Owner, search stopped: wait for the other workers' last measurements, releasing the
        reservations of dead workers. True when a release gave budget back (a worker died
        mid-trial): the search goes on, so the job ends with its whole budget measured."""
        deadline = time.monotonic() + self.lease_seconds + _helper_grace()
        while not state.stop.is_set() and time.monotonic() < deadline:
            if ledger.settle():
                break
            state.stop.wait(0.1)
        current = ledger.load()
        if current is None or current.status != "running" or current.cancel_requested:
            return False
        if current.trials_done >= current.budget_configs:
            return False
        self._sync(ledger, search, state)  # forget the released keys: measurable again
        return len(search.results) < current.budget_configs

    def _finish(
        self, job: Job, backend: Backend, state: _JobState, ledger: JobLedger
    ) -> JobOutcome:
        """Owner, every reservation settled (:meth:`_budget_given_back`): store the job's best
        (over every worker's trials) and mark the job done (:meth:`JobLedger.finish`: one
        retried step; a try whose commit landed answers what it stored)."""
        device = backend.device()
        baseline = self._framework_baseline(job, backend, device, state, ledger)
        compiled = _compiled_baseline(job, baseline) if baseline is not None else None
        ending = ledger.finish(
            gpu_model=device.model,
            compute_capability="{}.{}".format(*device.compute_capability),
            cuda_version=device.cuda_version,
            default_key=_default_key(job),
            framework_ms=baseline.time_ms if baseline is not None else None,
            framework=framework.stored_label(baseline) if baseline is not None else None,
            compiled_ms=compiled.time_ms if compiled is not None else None,
            compiled=framework.stored_label(compiled) if compiled is not None else None,
        )
        return JobOutcome(job.id, ending.status, ending.measured, ending.best_time_ms, ending.error)

    def _framework_baseline(
        self, job: Job, backend: Backend, device: DeviceInfo, state: _JobState, ledger: JobLedger
    ) -> framework.FrameworkResult | None:
        """PyTorch's op timed for ``job`` (:attr:`framework_timer`), or None: no timer, turned
        off, the job has no winner to store it beside, or the baseline was not timed (logged
        with its reason; a timed ``mismatch`` is stored, with a warning). The job's backend is
        closed first, so the baseline has the GPU (and its memory) to itself; every
        measurement of the job has been settled by now."""
        if self.framework_timer is None or state.stop.is_set():
            return None
        try:
            if not framework.enabled():
                return None
        except ValueError as exc:
            log.warning("job %s: no framework baseline: %s", job.id, exc)
            return None
        current = ledger.load()
        if current is None or current.best_time_ms is None:
            return None
        self._close(backend, job.id)  # safe to call twice: run() closes it again
        t0 = time.monotonic()
        stop = _Either(state.stop, self.shutdown)
        try:
            if "turn" in inspect.signature(self.framework_timer).parameters:
                # PyTorch's op has the GPU to itself, torch's import left outside the turn.
                turn = functools.partial(self._gpu, job.id, counted=False)
                result = self.framework_timer(current, device, stop, turn=turn)
            else:
                with self._gpu(job.id, counted=False):
                    result = self.framework_timer(current, device, stop)
        except Exception:
            log.warning("job %s: the framework baseline failed", job.id, exc_info=True)
            return None
        took = time.monotonic() - t0
        if not _storable(job, result, "framework baseline", f"{result.status}, {took:.1f} s"):
            return None
        time_ms = result.time_ms or 0.0
        log.info(
            "job %s: %s %s: %.4f ms, Kato's winner %.4f ms (%.2fx; %.1f s)",
            job.id, result.framework, result.op, time_ms, current.best_time_ms,
            time_ms / current.best_time_ms, took,
        )  # fmt: skip
        return result


def _storable(job: Job, result: framework.FrameworkResult, what: str, how: str) -> bool:
    """Whether a baseline ``result`` is stored: a timed one is (a ``mismatch`` with a warning
    naming the op whose outputs missed Kato's tolerance); one not timed is logged with its
    reason (``how``: its status, and the time it took where known) and not stored."""
    if not result.timed:
        log.warning("job %s: no %s stored (%s): %s", job.id, what, how, result.detail)
        return False
    if not result.ok:
        log.warning(
            "job %s: %s stored, but %s's outputs are outside Kato's tolerance (%s): %s",
            job.id, what, result.framework, result.status, result.detail,
        )  # fmt: skip
    return True


def _compiled_baseline(
    job: Job, baseline: framework.FrameworkResult
) -> framework.FrameworkResult | None:
    """The compiled baseline to store beside the eager one (:mod:`tuner.framework`), or None:
    not attempted (turned off), or not timed (logged with its reason, as the eager one is; the
    job is done all the same); a timed ``mismatch`` is stored, with a warning."""
    result = baseline.compiled
    if result is None or not _storable(job, result, "compiled framework baseline", result.status):
        return None
    log.info(
        "job %s: %s %s: %.4f ms (eager %.4f ms)",
        job.id, result.framework, result.op, result.time_ms or 0.0, baseline.time_ms or 0.0,
    )  # fmt: skip
    return result


class _Either:
    """Set when either event is: the job's stop (a cancel, a lost lease) or the worker's."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)


def _default_key(job: Job) -> str | None:
    """The config key of ``job``'s operator's default config at its shape (every job measures
    it first: :func:`first_configs`; its time is stored beside the winner), or None."""
    try:
        spec = get_operator(job.operator)
        default = spec.default_config(list(job.shape), job.dtype)
        return config_key(list(spec.params), default)
    except Exception:  # an operator gone, or without a default here: nothing to report
        return None


def _seconds_left(job: Job) -> float | None:
    """What is left of the job's ``budget_seconds``, counted from its first start
    (``started_at``): a helper that joins late, a resumed job and the owner's run after a
    helper's budget unit came back all share the job's one clock, instead of each starting
    a full budget of its own (the job then ran past it, waiting on the helpers). At least a
    millisecond: the search then stops at its first check, with ``stopped == "time"``."""
    if job.budget_seconds is None:
        return None
    started = job.started_at or utcnow()
    elapsed = (utcnow() - started).total_seconds()
    return max(job.budget_seconds - elapsed, 1e-3)


def _helper_grace() -> float:
    """How long an owner waits beyond a lease for helpers' last measurements."""
    return float(env.get("KATO_HELPER_GRACE_SECONDS") or DEFAULT_TRIAL_TIMEOUT_S)
