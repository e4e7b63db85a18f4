"""The queries the service, the worker and the CLI run. Each takes a :class:`Session`.

Functions that change state commit (their docstrings say so), so a caller can use one short
session per call. State changes that race with other processes (claiming, cancelling, counting
trials, keeping the best) are single conditional ``UPDATE`` statements, safe on SQLite (which
serialises writers) and PostgreSQL (row locks; claims use ``FOR UPDATE SKIP LOCKED``). After
such an update, a job already loaded in the session is refreshed from the database.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db.models import TERMINAL_STATUSES, BestConfig, Job, Trial, UTCDateTime, utcnow

#: Statuses of a trial that was never measured and does not count towards a job's budget.
UNCOUNTED_TRIAL_STATUSES = ("invalid",)

#: How many queued candidates a SQLite claim tries before looking again.
_CLAIM_CANDIDATES = 8


def shape_key(shape: Sequence[int]) -> str:
    """The canonical text of a shape: ``[4096, 4096]`` -> ``"4096x4096"``."""
    return "x".join(str(int(s)) for s in shape)


def _refresh_if_loaded(session: Session, job_id: str) -> None:
    """Reload a job the session holds, after a bulk ``UPDATE`` changed its row behind it."""
    job = session.identity_map.get(session.identity_key(Job, job_id))
    if job is not None:
        session.refresh(job)


# --- jobs ------------------------------------------------------------------------------------


def _new_job(
    *,
    operator: str,
    operator_version: str,
    shape: Sequence[int],
    dtype: str,
    gpu_model: str,
    budget_configs: int,
    budget_seconds: float | None = None,
    strategy: str = "forest",
    seed: int = 0,
    token_id: str | None = None,
) -> Job:
    return Job(
        operator=operator,
        operator_version=operator_version,
        shape=[int(s) for s in shape],
        shape_key=shape_key(shape),
        dtype=dtype,
        gpu_model=gpu_model,
        budget_configs=budget_configs,
        budget_seconds=budget_seconds,
        strategy=strategy,
        seed=seed,
        token_id=token_id,
        status="queued",
        trials_done=0,
        cancel_requested=False,
    )


def create_job(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    shape: Sequence[int],
    dtype: str,
    gpu_model: str,
    budget_configs: int,
    budget_seconds: float | None = None,
    strategy: str = "forest",
    seed: int = 0,
    token_id: str | None = None,
) -> Job:
    """Queue a tuning job (status ``queued``) and commit. Inputs must be validated already.

    ``token_id``: the API token that submitted it (``None``: the CLI, or auth turned off).
    """
    job = _new_job(
        operator=operator,
        operator_version=operator_version,
        shape=shape,
        dtype=dtype,
        gpu_model=gpu_model,
        budget_configs=budget_configs,
        budget_seconds=budget_seconds,
        strategy=strategy,
        seed=seed,
        token_id=token_id,
    )
    session.add(job)
    session.commit()
    return job


def create_jobs(session: Session, jobs: Sequence[Mapping[str, Any]]) -> list[Job]:
    """Queue several jobs in one transaction (all or none) and commit.

    Each item holds the keyword arguments of :func:`create_job`. Their ``created_at`` follow the
    order given, so workers claim them in that order.
    """
    rows = [_new_job(**fields) for fields in jobs]
    start = utcnow()
    for offset, job in enumerate(rows):
        job.created_at = start + timedelta(microseconds=offset)
    session.add_all(rows)
    session.commit()
    return rows


def get_job(session: Session, job_id: str) -> Job | None:
    """The job with this id, or ``None``."""
    return session.get(Job, job_id, populate_existing=True)


def list_jobs(session: Session, status: str | None = None, limit: int = 100) -> list[Job]:
    """Jobs, newest first, optionally only those with ``status``."""
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id).limit(limit)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    return list(session.scalars(stmt))


def request_cancel(session: Session, job_id: str) -> Job | None:
    """Cancel a job and commit; ``None`` if there is no such job.

    A queued job becomes ``cancelled`` at once. A running job gets ``cancel_requested``: its
    worker sees it when renewing the lease (:func:`renew_lease` returns ``False``), stops after
    the current trial and marks the job cancelled. Finished jobs are left as they are.
    """
    if session.get(Job, job_id) is None:
        return None
    now = utcnow()
    cancelled = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        .values(status="cancelled", cancel_requested=True, finished_at=now)
        .execution_options(synchronize_session=False)
    )
    if cancelled.rowcount == 0:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "running")
            .values(cancel_requested=True)
            .execution_options(synchronize_session=False)
        )
    session.commit()
    return get_job(session, job_id)


def _claimable(gpu_models: Sequence[str], now: Any) -> Any:
    """Queued, or running under a lease that has run out (its worker died)."""
    return and_(
        Job.gpu_model.in_(list(gpu_models)),
        or_(
            Job.status == "queued",
            and_(Job.status == "running", Job.lease_expires_at < now),
        ),
    )


def _cancel_abandoned(session: Session, now: Any) -> None:
    """Jobs whose worker died after a cancel was requested: cancelled, not claimed again."""
    session.execute(
        update(Job)
        .where(
            Job.status == "running",
            Job.cancel_requested.is_(True),
            Job.lease_expires_at < now,
        )
        .values(status="cancelled", finished_at=now, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    session.commit()


def claim_next_job(
    session: Session, *, gpu_models: Sequence[str], worker_id: str, lease_seconds: float
) -> Job | None:
    """Take the oldest claimable job for one of ``gpu_models`` and commit; ``None`` if none.

    Claimable: ``queued``, or ``running`` with an expired lease (a crashed worker; the job is
    resumed, its recorded trials kept). The job becomes ``running`` under ``worker_id`` with a
    lease of ``lease_seconds``; ``started_at`` is set on the first claim. Safe under concurrency:
    each job is claimed by exactly one caller (PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED``;
    elsewhere: a conditional ``UPDATE`` whose row count says who won).
    """
    if not gpu_models:
        return None
    now = utcnow()
    lease = now + timedelta(seconds=lease_seconds)
    _cancel_abandoned(session, now)

    if session.get_bind().dialect.name == "postgresql":
        job = session.scalars(
            select(Job)
            .where(_claimable(gpu_models, now))
            .order_by(Job.created_at, Job.id)
            .limit(1)
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        ).first()
        if job is None:
            session.rollback()
            return None
        job.status = "running"
        job.worker_id = worker_id
        job.lease_expires_at = lease
        job.started_at = job.started_at or now
        session.commit()
        return job

    while True:
        candidates = session.scalars(
            select(Job.id)
            .where(_claimable(gpu_models, now))
            .order_by(Job.created_at, Job.id)
            .limit(_CLAIM_CANDIDATES)
        ).all()
        if not candidates:
            session.rollback()
            return None
        for job_id in candidates:
            won = session.execute(
                update(Job)
                .where(Job.id == job_id, _claimable(gpu_models, now))
                .values(
                    status="running",
                    worker_id=worker_id,
                    lease_expires_at=lease,
                    started_at=func.coalesce(Job.started_at, literal(now, UTCDateTime())),
                )
                .execution_options(synchronize_session=False)
            )
            session.commit()
            if won.rowcount == 1:
                return get_job(session, job_id)
        # Every candidate went to another worker between our read and our write: look again.


def renew_lease(session: Session, job_id: str, worker_id: str, lease_seconds: float) -> bool:
    """Extend the lease of a job this worker runs, and commit.

    Returns ``False`` (and extends nothing) if the job is no longer running under ``worker_id``
    or a cancel was requested: the worker must stop.
    """
    renewed = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.worker_id == worker_id,
            Job.status == "running",
            Job.cancel_requested.is_(False),
        )
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    session.commit()
    _refresh_if_loaded(session, job_id)
    return renewed.rowcount == 1


def finish_job(
    session: Session, job_id: str, *, status: str, error: str | None = None
) -> Job | None:
    """Mark a job ``done``, ``failed`` or ``cancelled``, release its lease, and commit."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"finish_job needs one of {TERMINAL_STATUSES}, got {status!r}")
    job = session.get(Job, job_id)
    if job is None:
        return None
    job.status = status
    job.error = error
    job.finished_at = utcnow()
    job.lease_expires_at = None
    session.commit()
    return job


# --- trials ----------------------------------------------------------------------------------


def record_trial(
    session: Session,
    job_id: str,
    *,
    number: int,
    config: Mapping[str, Any],
    config_key: str,
    result: Mapping[str, Any],
) -> Trial:
    """Store one evaluated config of a job and commit; idempotent on ``(job_id, config_key)``.

    ``result`` is :meth:`tuner.backends.base.TrialResult.to_dict`. If the config was recorded
    before (a resumed job), the stored trial is returned unchanged. Otherwise the job's
    ``trials_done`` grows by one (except for ``invalid`` trials, which are never measured) and,
    for an ``ok`` trial faster than the job's best so far, ``best_time_ms``/``best_config`` are
    replaced.
    """
    existing = _find_trial(session, job_id, config_key)
    if existing is not None:
        return existing
    trial = Trial(
        job_id=job_id,
        number=number,
        config=dict(config),
        config_key=config_key,
        status=str(result["status"]),
        time_ms=result.get("time_ms"),
        times_ms=list(result.get("times_ms") or []),
        compile_time_s=result.get("compile_time_s"),
        registers=result.get("registers"),
        shared_static_bytes=result.get("shared_static_bytes"),
        shared_dynamic_bytes=result.get("shared_dynamic_bytes"),
        local_bytes=result.get("local_bytes"),
        blocks_per_sm=result.get("blocks_per_sm"),
        occupancy=result.get("occupancy"),
        error=result.get("error"),
    )
    session.add(trial)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()  # recorded meanwhile by another session (same key)
        existing = _find_trial(session, job_id, config_key)
        if existing is None:
            raise
        return existing

    if trial.status not in UNCOUNTED_TRIAL_STATUSES:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(trials_done=Job.trials_done + 1)
            .execution_options(synchronize_session=False)
        )
    if trial.status == "ok" and trial.time_ms is not None:
        session.execute(
            update(Job)
            .where(
                Job.id == job_id,
                or_(Job.best_time_ms.is_(None), Job.best_time_ms > trial.time_ms),
            )
            .values(best_time_ms=trial.time_ms, best_config=dict(config))
            .execution_options(synchronize_session=False)
        )
    session.commit()
    _refresh_if_loaded(session, job_id)
    return trial


def _find_trial(session: Session, job_id: str, config_key: str) -> Trial | None:
    return session.scalars(
        select(Trial).where(Trial.job_id == job_id, Trial.config_key == config_key)
    ).first()


def job_trials(session: Session, job_id: str) -> list[Trial]:
    """The trials of a job in the order they were evaluated."""
    return list(
        session.scalars(
            select(Trial).where(Trial.job_id == job_id).order_by(Trial.number, Trial.id)
        )
    )


# --- best configs ----------------------------------------------------------------------------


def upsert_best_config(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    shape: Sequence[int],
    dtype: str,
    gpu_model: str,
    compute_capability: str,
    cuda_version: str,
    config: Mapping[str, Any],
    time_ms: float,
    job_id: str | None,
) -> BestConfig:
    """Store a winner for its result key and commit; an existing row is replaced only by a
    strictly faster ``time_ms``. Returns the row now stored for the key (the faster of the two).
    """
    key = and_(
        BestConfig.operator == operator,
        BestConfig.operator_version == operator_version,
        BestConfig.shape_key == shape_key(shape),
        BestConfig.dtype == dtype,
        BestConfig.gpu_model == gpu_model,
        BestConfig.compute_capability == compute_capability,
        BestConfig.cuda_version == cuda_version,
    )
    values = {
        "shape": [int(s) for s in shape],
        "config": dict(config),
        "time_ms": time_ms,
        "job_id": job_id,
        "updated_at": utcnow(),
    }
    for _attempt in range(3):
        session.execute(
            update(BestConfig)
            .where(key, BestConfig.time_ms > time_ms)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        row = session.scalars(select(BestConfig).where(key)).first()
        if row is not None:
            session.commit()
            session.refresh(row)
            return row
        session.add(
            BestConfig(
                operator=operator,
                operator_version=operator_version,
                shape_key=shape_key(shape),
                dtype=dtype,
                gpu_model=gpu_model,
                compute_capability=compute_capability,
                cuda_version=cuda_version,
                **values,
            )
        )
        try:
            session.commit()
        except IntegrityError:
            session.rollback()  # another writer inserted the key first: compare with theirs
            continue
        return session.scalars(select(BestConfig).where(key)).one()
    raise RuntimeError("upsert_best_config: the row kept changing under concurrent writers")


def _log2_distance(a: Sequence[int], b: Sequence[int]) -> float:
    return sum(abs(math.log2(x) - math.log2(y)) for x, y in zip(a, b, strict=True))


def lookup_best_config(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    shape: Sequence[int],
    dtype: str,
    gpu_model: str,
    accept: Callable[[dict[str, Any]], bool] | None = None,
    max_distance: float | None = None,
) -> tuple[BestConfig | None, str]:
    """The best stored config for a request, and where it comes from.

    Returns ``(row, "exact")`` for a row of the same shape (if rows differ only by compute
    capability or CUDA version, the most recently updated); else ``(row, "nearest")`` for the
    row of the same operator, version, dtype, GPU model and rank whose shape is closest (least
    sum over dimensions of ``|log2 a - log2 b|``; ties go to the fastest); else
    ``(None, "default")``. ``accept`` (optional) rejects configs that are not valid for the
    requested shape, e.g. ``lambda c: spec.check(c, shape, dtype) is None``. ``max_distance``
    (optional) is the farthest a nearest shape may be (the same log2 distance; 0 serves exact
    shapes only): a winner tuned for a very different shape can be slower than the default.
    """
    shape = [int(s) for s in shape]
    group = (
        BestConfig.operator == operator,
        BestConfig.operator_version == operator_version,
        BestConfig.dtype == dtype,
        BestConfig.gpu_model == gpu_model,
    )
    # ``accept`` (a spec check) costs far more than a row: it runs on the candidates in order
    # until one passes, not on every stored shape (a batch of 1000 lookups over 300 stored
    # shapes took 10 s when it ran on all of them).
    exact = session.scalars(
        select(BestConfig)
        .where(*group, BestConfig.shape_key == shape_key(shape))
        .order_by(BestConfig.updated_at.desc(), BestConfig.id.desc())
    )
    for row in exact:  # newest first
        if accept is None or accept(row.config):
            return row, "exact"
    candidates = []
    for row_id, row_shape, time_ms in session.execute(
        select(BestConfig.id, BestConfig.shape, BestConfig.time_ms).where(*group)
    ):
        if len(row_shape) != len(shape) or not all(int(s) >= 1 for s in row_shape):
            continue
        if row_shape == shape:
            continue  # the exact shape, rejected above
        distance = _log2_distance(row_shape, shape)
        if max_distance is None or distance <= max_distance:
            candidates.append((distance, time_ms, row_id))
    for _distance, _time_ms, row_id in sorted(candidates):
        row = session.get(BestConfig, row_id)
        if row is not None and (accept is None or accept(row.config)):
            return row, "nearest"
    return None, "default"
