"""The worker: claims queued tuning jobs for the GPU model it owns and runs them.

A job's life on a worker: claim (with a lease) -> build a backend for (operator, shape, dtype) ->
run the search with the job's Optuna study stored in the same database -> record every trial as
it is measured -> write the winner to ``best_configs`` -> mark the job done. Between trials the
worker renews its lease and stops if the job was cancelled or the lease was lost.

A job interrupted half-way (worker killed, host gone) is claimed again once its lease expires;
the trials already recorded are loaded as known results and never measured again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from sqlalchemy.orm import Session, sessionmaker

from db import queries
from db.models import Job, Trial
from kernels import get_operator
from tuner.backends.base import Backend, TrialResult, TrialStatus
from tuner.search import Budget, Search

log = logging.getLogger(__name__)

#: Spaces up to this many valid configs are compiled ahead in full when a job starts.
PRECOMPILE_MAX_CONFIGS = 2000

#: Builds the backend that measures one job: (job) -> Backend.
BackendFactory = Callable[[Job], Backend]


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def trial_result_from_row(row: Trial) -> TrialResult:
    """Rebuild a measured result from its stored row (for resuming a job)."""
    return TrialResult(
        config=dict(row.config),
        status=TrialStatus(row.status),
        times_ms=list(row.times_ms or ([row.time_ms] if row.time_ms is not None else [])),
        compile_time_s=row.compile_time_s,
        registers=row.registers,
        shared_static_bytes=row.shared_static_bytes,
        shared_dynamic_bytes=row.shared_dynamic_bytes,
        local_bytes=row.local_bytes,
        blocks_per_sm=row.blocks_per_sm,
        occupancy=row.occupancy,
        error=row.error,
    )


def optuna_storage(db_url: str) -> optuna.storages.RDBStorage:
    """Optuna's study storage in the job database (its own tables beside Kato's)."""
    kwargs = {"connect_args": {"timeout": 30}} if db_url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(db_url, engine_kwargs=kwargs)


@dataclass
class JobOutcome:
    job_id: str
    status: str
    measured: int
    best_time_ms: float | None
    error: str | None = None


def _check_operator_version(job: Job) -> None:
    """Refuse to tune a job whose operator changed since it was submitted: its results would be
    stored under a version that no longer describes the kernel."""
    from kernels.spec import InvalidInput

    try:
        spec = get_operator(job.operator)
    except InvalidInput:
        return  # not a registered operator (e.g. a replayed Kernel Tuner space)
    if spec.version != job.operator_version:
        raise RuntimeError(
            f"operator {job.operator!r} changed since the job was submitted (version "
            f"{job.operator_version}, now {spec.version}); submit the job again"
        )


class JobRunner:
    """Runs one claimed job to its end. Never raises: failures end as a failed job."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        db_url: str,
        backend_factory: BackendFactory,
        *,
        worker_id: str,
        lease_seconds: float = 60.0,
        on_progress: Callable[[TrialResult, int, int], None] | None = None,
    ):
        self.sessions = sessions
        self.db_url = db_url
        self.backend_factory = backend_factory
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.on_progress = on_progress

    def run(self, job_id: str) -> JobOutcome:
        with self.sessions() as session:
            job = queries.get_job(session, job_id)
            if job is None:
                return JobOutcome(job_id, "missing", 0, None, "job not found")
            known = {
                t.config_key: trial_result_from_row(t) for t in queries.job_trials(session, job_id)
            }
            session.expunge(job)
        backend: Backend | None = None
        try:
            _check_operator_version(job)
            backend = self.backend_factory(job)
            outcome = self._search(job, backend, known)
        except Exception as exc:  # a broken backend or kernel fails the job, not the worker
            log.exception("job %s failed", job_id)
            with self.sessions() as session:
                queries.finish_job(
                    session, job_id, status="failed", error=f"{type(exc).__name__}: {exc}"
                )
            outcome = JobOutcome(job_id, "failed", len(known), None, str(exc))
        finally:
            if backend is not None:
                backend.close()
        return outcome

    def _search(self, job: Job, backend: Backend, known: dict[str, TrialResult]) -> JobOutcome:
        space = backend.space()
        lease_lost = threading.Event()

        def record(result: TrialResult, measured: int) -> None:
            with self.sessions() as session:
                queries.record_trial(
                    session,
                    job.id,
                    number=measured - 1,
                    config=result.config,
                    config_key=space.key(result.config),
                    result=result.to_dict(),
                )
                if not queries.renew_lease(session, job.id, self.worker_id, self.lease_seconds):
                    lease_lost.set()
            if self.on_progress is not None:
                self.on_progress(result, measured, job.budget_configs)

        precompile = getattr(backend, "precompile", None)
        if precompile is not None:
            # Compile ahead: small spaces entirely, in parallel, while the GPU measures.
            valid = space.valid_configs()
            if len(valid) <= PRECOMPILE_MAX_CONFIGS:
                precompile([c for c in valid if space.key(c) not in known])
        search = Search(
            space,
            backend.evaluate,
            strategy=job.strategy,
            seed=job.seed,
            storage=optuna_storage(self.db_url),
            study_name=f"kato-job-{job.id}",
            known=known,
            on_result=record,
            should_stop=lease_lost.is_set,
        )
        outcome = search.run(Budget(max_configs=job.budget_configs, max_seconds=job.budget_seconds))
        with self.sessions() as session:
            current = queries.get_job(session, job.id)
            cancelled = current is not None and (
                current.cancel_requested or current.status == "cancelled"
            )
            if outcome.stopped == "cancelled" and not cancelled:
                # The lease went to another worker: that worker owns the job now.
                return JobOutcome(job.id, "lost", outcome.measured, None, "lease lost")
            best = outcome.best
            if best is not None and not cancelled:
                device = backend.device()
                queries.upsert_best_config(
                    session,
                    operator=job.operator,
                    operator_version=job.operator_version,
                    shape=list(job.shape),
                    dtype=job.dtype,
                    gpu_model=device.model,
                    compute_capability="{}.{}".format(*device.compute_capability),
                    cuda_version=device.cuda_version,
                    config=best.config,
                    time_ms=best.time_ms,
                    job_id=job.id,
                )
            if cancelled:
                status, error = "cancelled", None
            elif best is None:
                status, error = "failed", "no config ran correctly (see the job's trials)"
            else:
                status, error = "done", None
            queries.finish_job(session, job.id, status=status, error=error)
        return JobOutcome(job.id, status, outcome.measured, best.time_ms if best else None, error)


class Worker:
    """Claims jobs for ``gpu_models`` and runs them one at a time until stopped."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        db_url: str,
        gpu_models: list[str],
        backend_factory: BackendFactory,
        *,
        worker_id: str | None = None,
        lease_seconds: float = 60.0,
        poll_seconds: float = 1.0,
    ):
        self.sessions = sessions
        self.gpu_models = gpu_models
        self.worker_id = worker_id or default_worker_id()
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.runner = JobRunner(
            sessions, db_url, backend_factory, worker_id=self.worker_id, lease_seconds=lease_seconds
        )
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run_once(self) -> JobOutcome | None:
        """Claim and run one job; None when nothing is queued for our GPU models."""
        with self.sessions() as session:
            job = queries.claim_next_job(
                session,
                gpu_models=self.gpu_models,
                worker_id=self.worker_id,
                lease_seconds=self.lease_seconds,
            )
            job_id = job.id if job is not None else None
        if job_id is None:
            return None
        log.info("worker %s runs job %s", self.worker_id, job_id)
        return self.runner.run(job_id)

    def run_forever(self, *, max_jobs: int | None = None) -> int:
        """Run jobs until :meth:`stop` (or ``max_jobs`` done); returns the number run."""
        done = 0
        while not self._stop.is_set() and (max_jobs is None or done < max_jobs):
            try:
                outcome = self.run_once()
            except Exception:  # database hiccup: log, back off, go on
                log.exception("worker %s: claim failed", self.worker_id)
                outcome = None
            if outcome is None:
                self._stop.wait(self.poll_seconds)
            else:
                done += 1
        return done


def pycuda_backend_factory(device_index: int = 0) -> BackendFactory:
    """Backends on CUDA device ``device_index`` for the job's operator, shape and dtype."""

    def make(job: Job) -> Backend:
        from tuner.backends.pycuda import PyCudaBackend

        return PyCudaBackend(
            get_operator(job.operator), job.shape, job.dtype, device_index=device_index
        )

    return make
