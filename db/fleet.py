"""Queries for a fleet of workers: presence (heartbeats, GPU models) and finding a running job
to help with.

Presence: every worker upserts its ``kato_workers`` row when it starts and on every heartbeat. A
worker is *live* while its heartbeat is younger than ``stale_seconds`` and its status is not
``stopped``.

Sharing one job: a worker with nothing to claim may join a running job as a helper
(:func:`join_running_job`). How workers on one job reserve, record and release its trials is
:mod:`db.ledger`'s, the one API a worker uses for a job.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from kato.db.models import Job, Worker, utcnow
from kato.db.queries import JobScope, in_scope
from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

# --- presence --------------------------------------------------------------------------------


def heartbeat_worker(
    session: Session,
    *,
    worker_id: str,
    hostname: str,
    pid: int,
    gpu_models: Sequence[str],
    devices: Sequence[Mapping[str, Any]] = (),
    backend: str,
    status: str,
    current_job_id: str | None,
) -> None:
    """Insert or update this worker's row (status, current job, ``heartbeat_at`` = now); commit."""
    now = utcnow()
    values = {
        "hostname": hostname,
        "pid": pid,
        "gpu_models": list(gpu_models),
        "devices": [dict(d) for d in devices],
        "backend": backend,
        "status": status,
        "current_job_id": current_job_id,
        "heartbeat_at": now,
    }
    updated = session.execute(
        update(Worker)
        .where(Worker.id == worker_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if updated.rowcount == 0:
        session.add(Worker(id=worker_id, started_at=now, **values))
        try:
            session.commit()
            return
        except IntegrityError:  # inserted meanwhile (a second thread of the same worker)
            session.rollback()
            session.execute(update(Worker).where(Worker.id == worker_id).values(**values))
    session.commit()


def list_workers(session: Session, limit: int = 1000) -> list[Worker]:
    """Worker rows, most recent heartbeat first."""
    stmt = select(Worker).order_by(Worker.heartbeat_at.desc(), Worker.id).limit(limit)
    return list(session.scalars(stmt))


def is_live(worker: Worker, stale_seconds: float) -> bool:
    """Heartbeat younger than ``stale_seconds`` and not stopped."""
    fresh = worker.heartbeat_at >= utcnow() - timedelta(seconds=stale_seconds)
    return worker.status != "stopped" and fresh


def live_worker_ids(session: Session, stale_seconds: float) -> set[str]:
    since = utcnow() - timedelta(seconds=stale_seconds)
    return set(
        session.scalars(
            select(Worker.id).where(Worker.status != "stopped", Worker.heartbeat_at >= since)
        )
    )


def live_gpu_models(session: Session, stale_seconds: float) -> set[str]:
    """GPU models that at least one live worker advertises."""
    since = utcnow() - timedelta(seconds=stale_seconds)
    rows = session.scalars(
        select(Worker.gpu_models).where(Worker.status != "stopped", Worker.heartbeat_at >= since)
    )
    return {model for models in rows for model in models or []}


def waiting_note(session: Session, job: Job, stale_seconds: float) -> str | None:
    """Why a queued job waits, when no live worker advertises its GPU model (else ``None``)."""
    if job.status != "queued":
        return None
    return note_for(job, live_gpu_models(session, stale_seconds))


def note_for(job: Job, live_models: Collection[str]) -> str | None:
    """:func:`waiting_note` with the live GPU models already known (one query for many jobs)."""
    if job.status != "queued" or job.gpu_model in live_models:
        return None
    return (
        f"no live worker advertises GPU model {job.gpu_model}; the job stays queued until one "
        "joins (GET /v1/workers lists the workers)"
    )


# --- sharing a job ---------------------------------------------------------------------------


def join_running_job(
    session: Session,
    *,
    gpu_models: Sequence[str],
    worker_id: str,
    max_workers_per_job: int,
    min_configs_per_worker: int,
    stale_seconds: float,
    scope: JobScope | None = None,
) -> str | None:
    """A running job this worker may help with, or ``None``.

    Eligible: running under a live lease for one of ``gpu_models`` and in ``scope`` (what this
    worker's backends can answer, :class:`db.queries.JobScope`), no cancel requested, fewer
    than ``max_workers_per_job`` live workers on it (owner included, counted from the workers'
    ``current_job_id``), and at least ``min_configs_per_worker`` unreserved configs of budget
    per worker once this one joins. Oldest job first. Nothing is written: the caller announces
    itself with its next heartbeat (``current_job_id``); a race may let one extra worker join.
    """
    if max_workers_per_job < 2 or not gpu_models:
        return None
    now = utcnow()
    since = now - timedelta(seconds=stale_seconds)
    helpers = (
        select(Worker.current_job_id, func.count().label("n"))
        .where(
            Worker.status != "stopped",
            Worker.heartbeat_at >= since,
            Worker.current_job_id.is_not(None),
            Worker.id != worker_id,
        )
        .group_by(Worker.current_job_id)
        .subquery()
    )
    on_job = func.coalesce(helpers.c.n, 0)
    rows = session.execute(
        select(Job.id, Job.budget_configs - Job.trials_done, on_job)
        .outerjoin(helpers, helpers.c.current_job_id == Job.id)
        .where(
            Job.status == "running",
            Job.gpu_model.in_(list(gpu_models)),
            in_scope(scope),
            Job.lease_expires_at >= now,
            Job.cancel_requested.is_(False),
            or_(Job.worker_id.is_(None), Job.worker_id != worker_id),
        )
        .order_by(Job.created_at, Job.id)
        .limit(50)
    ).all()
    session.rollback()
    for job_id, remaining, n in rows:
        workers = max(int(n), 1) + 1  # the owner counts even before its first heartbeat
        if workers <= max_workers_per_job and remaining >= workers * min_configs_per_worker:
            return job_id
    return None
