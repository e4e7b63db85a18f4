"""Tuning workers built from :class:`~service.settings.Settings`: the one place where a worker's
knobs (lease, sharing, look-ahead, isolation, per-trial limit, database retries) meet the
settings, for ``kato serve``'s workers, ``kato worker``, ``kato tune`` and
``kato.tune_kernel``.

A caller's explicit option wins over the setting it stands for (``None``: the setting).
Everything here imports the tuner when called, not when imported: the CLI starts fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kato.service.settings import Settings

if TYPE_CHECKING:  # the tuner is imported by the functions, when a worker is built
    from kato.tuner.factories import BackendFactory
    from kato.tuner.job_runner import JobRunner
    from kato.tuner.worker import Worker
    from sqlalchemy.orm import Session, sessionmaker


def measuring(
    settings: Settings, isolate: bool | None = None, trial_timeout: float | None = None
) -> tuple[bool, float]:
    """Whether to measure in a child process and the per-trial limit (the floor of the limit
    scaled to a task's cost, :mod:`tuner.trial_cost`): the options where given, else
    ``KATO_ISOLATE`` and ``KATO_TRIAL_TIMEOUT_SECONDS``."""
    isolated = settings.isolate if isolate is None else isolate
    return isolated, trial_timeout or settings.trial_timeout_seconds


def gpu_backends(
    settings: Settings,
    device: int,
    *,
    isolate: bool | None = None,
    trial_timeout: float | None = None,
    jobs_at_once: int | None = None,
) -> BackendFactory:
    """The PyCUDA backend factory of CUDA device ``device``, measuring as :func:`measuring`
    says; for a worker holding several jobs at once (``jobs_at_once``, default
    ``KATO_JOBS_PER_WORKER``) a job's device set-up waits for its GPU turn."""
    from kato.tuner.factories import pycuda_backend_factory

    isolated, timeout = measuring(settings, isolate, trial_timeout)
    shared = (jobs_at_once or settings.jobs_per_worker) > 1
    return pycuda_backend_factory(
        device, isolate=isolated, trial_timeout_s=timeout, defer_prepare=shared
    )


def build_worker(
    settings: Settings,
    sessions: sessionmaker[Session],
    gpu_models: Sequence[str],
    backends: BackendFactory,
    *,
    devices: list[dict[str, Any]],
    backend_name: str = "pycuda",
    worker_id: str | None = None,
    lease_seconds: float | None = None,
    poll_seconds: float = 1.0,
    max_workers_per_job: int | None = None,
    jobs_at_once: int | None = None,
) -> Worker:
    """A worker claiming jobs of ``gpu_models`` and measuring through ``backends``.

    Raises:
        ValueError: ``KATO_DB_RETRY_SECONDS`` is not a number of seconds >= 0.
    """
    from kato.db.retry import RetryPolicy
    from kato.tuner.worker import Worker

    return Worker(
        sessions,
        settings.db_url,
        list(gpu_models),
        backends,
        worker_id=worker_id,
        retry_policy=RetryPolicy.from_env(),
        lease_seconds=lease_seconds or settings.lease_seconds,
        poll_seconds=poll_seconds,
        backend_name=backend_name,
        devices=devices,
        max_workers_per_job=max_workers_per_job or settings.max_workers_per_job,
        lookahead=settings.lookahead,
        jobs_at_once=jobs_at_once or settings.jobs_per_worker,
    )


def build_runner(
    settings: Settings,
    sessions: sessionmaker[Session],
    backends: BackendFactory,
    *,
    worker_id: str,
    on_progress: Callable[..., None] | None = None,
) -> JobRunner:
    """A runner of one job at a time under ``worker_id`` (``kato tune``: the job it queued).

    Raises:
        ValueError: ``KATO_DB_RETRY_SECONDS`` is not a number of seconds >= 0.
    """
    from kato.db.retry import RetryPolicy
    from kato.tuner.job_runner import JobRunner

    return JobRunner(
        sessions,
        settings.db_url,
        backends,
        worker_id=worker_id,
        lease_seconds=settings.lease_seconds,
        on_progress=on_progress,
        lookahead=settings.lookahead,
        retry_policy=RetryPolicy.from_env(),
    )


def queue_and_claim(
    sessions: sessionmaker[Session], fields: dict[str, Any], worker_id: str, lease_seconds: float
) -> str | None:
    """Queue the job of ``fields`` (``db.queries.create_job``'s arguments, validated by the
    caller: :func:`service.validation.job_fields`) and claim it at once for ``worker_id``, to
    run in this process now (``kato tune``, ``kato.tune_kernel``); its id, or None where
    another worker took it first. Only this job is claimed, never an older one of the queue.
    """
    from kato.db import queries

    with sessions() as session:
        job = queries.create_job(session, **fields)
        claimed = queries.claim_next_job(
            session,
            gpu_models=[fields["gpu_model"]],
            worker_id=worker_id,
            lease_seconds=lease_seconds,
            scope=queries.JobScope(job_ids=frozenset({job.id})),
        )
        job_id = job.id
    return job_id if claimed is not None and claimed.id == job_id else None
