"""The queries the service, the worker and the CLI run. Each takes a :class:`Session`.

Functions that change state commit (their docstrings say so), so a caller can use one short
session per call. State changes that race with other processes (claiming, cancelling, counting
trials, keeping the best) are single conditional ``UPDATE`` statements, safe on SQLite (which
serialises writers) and PostgreSQL (row locks; claims use ``FOR UPDATE SKIP LOCKED``). After
such an update, a job already loaded in the session is refreshed from the database.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from kato.db.models import (
    RESERVED,
    BestConfig,
    Job,
    Trial,
    UTCDateTime,
    new_job_id,
    result_values,
    utcnow,
)
from sqlalchemy import (
    and_,
    delete,
    exists,
    false,
    func,
    literal,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from kato.shared.status import TERMINAL_STATUSES

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
    batch_id: str | None = None,
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
        batch_id=batch_id,
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
    order given, so workers claim them in that order. They share one new ``batch_id``
    (:func:`batch_jobs`).
    """
    batch_id = new_job_id()
    rows = [_new_job(**fields, batch_id=batch_id) for fields in jobs]
    start = utcnow()
    for offset, job in enumerate(rows):
        job.created_at = start + timedelta(microseconds=offset)
    session.add_all(rows)
    session.commit()
    return rows


def batch_jobs(session: Session, batch_id: str) -> list[Job]:
    """The jobs of one batch, in the order they were submitted (empty: no such batch)."""
    stmt = select(Job).where(Job.batch_id == batch_id).order_by(Job.created_at, Job.id)
    return list(session.scalars(stmt))


def add_gpu_busy(session: Session, job_id: str, seconds: float) -> None:
    """Add ``seconds`` of GPU busy time to a job and, once it has ended, set its busy fraction
    (busy time over ``started_at`` to ``finished_at``); commits."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(gpu_busy_s=func.coalesce(Job.gpu_busy_s, 0.0) + seconds)
        .execution_options(synchronize_session=False)
    )
    job = get_job(session, job_id)
    if job is not None and job.started_at is not None and job.finished_at is not None:
        wall = (job.finished_at - job.started_at).total_seconds()
        job.gpu_busy_fraction = (job.gpu_busy_s or 0.0) / wall if wall > 0 else None
    session.commit()


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


@dataclass(frozen=True)
class Problem:
    """One problem a worker can answer: jobs of this operator, shape, dtype and GPU model, and
    of this operator version unless it is ``None`` (any version)."""

    operator: str
    shape_key: str
    dtype: str
    gpu_model: str
    operator_version: str | None = None


@dataclass(frozen=True)
class JobScope:
    """Which jobs a worker's backends can run, for claiming: jobs of ``operators`` (``None``:
    any), and, unless ``problems`` is ``None``, only those one of ``problems`` matches (an
    empty set: none); unless ``job_ids`` is ``None``, only those jobs (``kato tune`` runs the
    one job it created, never an older queued one). A job outside every live worker's scope
    stays queued.

    A worker that holds several jobs at once (:class:`tuner.worker.Worker`'s ``jobs_at_once``)
    leaves out the jobs it holds (``exclude_job_ids``: also from resuming its own) and every
    job of a group it holds (``exclude_groups``: (operator, dtype, GPU model), the jobs whose
    warm start reads each other's results), so a group's jobs still run one after the other in
    queue order and each starts from what it would alone."""

    operators: frozenset[str] | None = None
    problems: frozenset[Problem] | None = None
    job_ids: frozenset[str] | None = None
    exclude_job_ids: frozenset[str] = frozenset()
    exclude_groups: frozenset[tuple[str, str, str]] = frozenset()


def in_scope(scope: JobScope | None) -> Any:
    """The SQL condition: the job is in ``scope`` (``None``: every job)."""
    if scope is None:
        return true()
    clauses = []
    if scope.operators is not None:
        clauses.append(Job.operator.in_(sorted(scope.operators)))
    if scope.problems is not None:
        # Row-value IN lists, not one OR per problem: SQLite limits an expression's depth to
        # 1000, and a directory of recordings may hold more.
        pinned = sorted(
            (p.operator, p.operator_version, p.shape_key, p.dtype, p.gpu_model)
            for p in scope.problems
            if p.operator_version is not None
        )
        unpinned = sorted(
            (p.operator, p.shape_key, p.dtype, p.gpu_model)
            for p in scope.problems
            if p.operator_version is None
        )
        matches = []
        if pinned:
            columns = (Job.operator, Job.operator_version, Job.shape_key, Job.dtype, Job.gpu_model)
            matches.append(tuple_(*columns).in_(pinned))
        if unpinned:
            columns = (Job.operator, Job.shape_key, Job.dtype, Job.gpu_model)
            matches.append(tuple_(*columns).in_(unpinned))
        clauses.append(or_(*matches) if matches else false())
    if scope.job_ids is not None:
        clauses.append(Job.id.in_(sorted(scope.job_ids)) if scope.job_ids else false())
    if scope.exclude_job_ids:
        clauses.append(Job.id.not_in(sorted(scope.exclude_job_ids)))
    if scope.exclude_groups:
        groups = tuple_(Job.operator, Job.dtype, Job.gpu_model)
        clauses.append(groups.not_in(sorted(scope.exclude_groups)))
    return and_(true(), *clauses)


def _claimable(gpu_models: Sequence[str], now: Any, scope: JobScope | None = None) -> Any:
    """Queued, or running under a lease that has run out (its worker died); in ``scope``."""
    return and_(
        Job.gpu_model.in_(list(gpu_models)),
        or_(
            Job.status == "queued",
            and_(Job.status == "running", Job.lease_expires_at < now),
        ),
        in_scope(scope),
    )


def _cancel_abandoned(session: Session, now: Any) -> None:
    """Jobs whose worker died after a cancel was requested: cancelled, not claimed again, and
    the reservations left in them deleted with their budget (no one will measure them, and a
    cancelled job holds none). A worker that was only slow to renew finds its reservation gone
    and stores nothing (:mod:`db.ledger`), as after a release."""
    abandoned = (
        Job.status == "running",
        Job.cancel_requested.is_(True),
        Job.lease_expires_at < now,
    )
    for job_id in session.scalars(select(Job.id).where(*abandoned)).all():
        cancelled = session.execute(
            update(Job)
            .where(Job.id == job_id, *abandoned)  # still so: no claim or end landed since
            .values(status="cancelled", finished_at=now, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )
        if cancelled.rowcount != 1:
            continue
        delete_reservations(session, job_id)
    session.commit()


def delete_reservations(session: Session, job_id: str, *where: Any) -> int:
    """Delete the job's reservations (placeholder trials) matching ``where`` (all where
    nothing is given) and give their units of budget back; how many. Not committed."""
    gone = session.execute(
        delete(Trial).where(Trial.job_id == job_id, Trial.status == RESERVED, *where)
    ).rowcount
    if gone:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(trials_done=Job.trials_done - gone)
            .execution_options(synchronize_session=False)
        )
    return gone


def claim_next_job(
    session: Session,
    *,
    gpu_models: Sequence[str],
    worker_id: str,
    lease_seconds: float,
    scope: JobScope | None = None,
    resume_own: bool = False,
) -> Job | None:
    """Take the next claimable job for one of ``gpu_models`` and commit; ``None`` if none.

    Which job: batches (``batch_id``) and jobs submitted alone in queue order (``created_at``,
    then id): the oldest batch with a claimable job goes first, and a newer one never jumps
    it, so a big batch cannot starve older work. Within that batch, the job whose group
    (operator, dtype, GPU model) has the most of the batch's jobs still to run (queued, itself
    included), ties in queue order: the longest remaining chain first, the critical-path rule,
    so that a worker holding several jobs (whose group's jobs it runs one after the other,
    :class:`JobScope`) starts the long chains early and keeps every slot busy to the batch's
    end instead of running the last groups' chains alone. A group's own jobs still go in
    queue order (they tie). The rule stays within a batch: the batch is what was submitted to
    be done together, and across batches queue order is the promise.

    ``scope``: only jobs the worker can answer (:class:`JobScope`); the others stay queued for
    workers that can.

    ``resume_own`` (a worker that runs one job at a time): a job already running under
    ``worker_id`` comes first, its lease renewed. It is one this worker claimed and is not
    running: a claim whose commit landed while its answer was lost with the connection, or a
    job it left during a database outage. A retried claim thus takes it again instead of a
    second job, and it is resumed without waiting for its lease to run out.

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
    if resume_own and (own := _renew_own(session, gpu_models, worker_id, lease, scope)):
        return own

    if session.get_bind().dialect.name == "postgresql":
        claimable = _claimable(gpu_models, now, scope)
        job = None
        ranked = _claim_ranking(session, claimable)
        # The ranked batch's jobs may all be locked by concurrent claims: then, as before,
        # the first unlocked one in queue order.
        for stmt in (ranked, select(Job).where(claimable).order_by(Job.created_at, Job.id)):
            if stmt is None:
                break
            job = session.scalars(
                stmt.limit(1)
                .with_for_update(skip_locked=True, of=Job)
                .execution_options(populate_existing=True)
            ).first()
            if job is not None:
                break
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
        ranked = _claim_ranking(session, _claimable(gpu_models, now, scope))
        candidates = (
            []
            if ranked is None
            else session.scalars(ranked.with_only_columns(Job.id).limit(_CLAIM_CANDIDATES)).all()
        )
        if not candidates:
            session.rollback()
            return None
        for job_id in candidates:
            won = session.execute(
                update(Job)
                .where(Job.id == job_id, _claimable(gpu_models, now, scope))
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


def next_claimable_job(
    session: Session, *, gpu_models: Sequence[str], scope: JobScope | None = None
) -> Job | None:
    """The job :func:`claim_next_job` would take now (its own running jobs aside), read
    without claiming it: a worker decides whether it can hold the job before it takes it
    (:mod:`tuner.admission`). Another worker may claim it meanwhile."""
    if not gpu_models:
        return None
    ranked = _claim_ranking(session, _claimable(gpu_models, utcnow(), scope))
    return None if ranked is None else session.scalars(ranked.limit(1)).first()


def _claim_ranking(session: Session, claimable: Any) -> Any:
    """The jobs meeting ``claimable`` in the order a claim takes them (see
    :func:`claim_next_job`), as a ``SELECT`` of :class:`Job` without a limit; ``None`` when
    none is claimable. Reads the head of the queue first, so that the ranking covers one batch
    (at most ``KATO_MAX_BATCH`` jobs), not the whole queue."""
    head = session.execute(
        select(Job.id, Job.batch_id).where(claimable).order_by(Job.created_at, Job.id).limit(1)
    ).first()
    if head is None:
        return None
    if head.batch_id is None:
        return select(Job).where(Job.id == head.id, claimable)
    peer = aliased(Job)
    # The job's group's jobs in its batch still to run, itself included (it may be a
    # resumed one, running under an expired lease).
    chain = (
        select(func.count(peer.id))
        .where(
            peer.batch_id == Job.batch_id,
            peer.operator == Job.operator,
            peer.dtype == Job.dtype,
            peer.gpu_model == Job.gpu_model,
            or_(peer.status == "queued", peer.id == Job.id),
        )
        .correlate(Job)
        .scalar_subquery()
    )
    return (
        select(Job)
        .where(claimable, Job.batch_id == head.batch_id)
        .order_by(chain.desc(), Job.created_at, Job.id)
    )


def _renew_own(
    session: Session,
    gpu_models: Sequence[str],
    worker_id: str,
    lease: datetime,
    scope: JobScope | None,
) -> Job | None:
    """The oldest job running under ``worker_id`` (no cancel requested), its lease renewed to
    ``lease``; commit. ``None`` if there is none."""
    job_id = session.scalar(
        select(Job.id)
        .where(
            Job.status == "running",
            Job.worker_id == worker_id,
            Job.cancel_requested.is_(False),
            Job.gpu_model.in_(list(gpu_models)),
            in_scope(scope),
        )
        .order_by(Job.created_at, Job.id)
        .limit(1)
    )
    if job_id is None:
        return None
    renewed = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "running", Job.worker_id == worker_id)
        .values(lease_expires_at=lease)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return get_job(session, job_id) if renewed.rowcount == 1 else None


def release_lease(session: Session, job_id: str, worker_id: str) -> bool:
    """End ``worker_id``'s lease of a running job now and commit: the job stays ``running``
    with its trials, and the next claim (any worker's) resumes it at once instead of after the
    lease. For a worker that stops mid-job. ``False`` if the job is not running under it."""
    released = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
        .values(lease_expires_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.commit()
    _refresh_if_loaded(session, job_id)
    return released.rowcount == 1


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


def first_seen(session: Session, operator: str, operator_version: str) -> datetime | None:
    """When the first job of this operator version was submitted (``None``: never): how a
    worker tells an older version of an operator from a newer one (versions are hashes)."""
    return session.scalar(
        select(func.min(Job.created_at)).where(
            Job.operator == operator, Job.operator_version == operator_version
        )
    )


def adopt_operator_version(
    session: Session, job_id: str, *, worker_id: str, old_version: str, new_version: str
) -> bool:
    """Move a job that ``worker_id`` owns (``running`` under its lease) and that has measured
    nothing (no trial rows, reservations included) from ``old_version`` of its operator to
    ``new_version``, and commit. Returns whether it moved; otherwise nothing is written.

    A job queued before an upgrade that changed its operator asked for a config of (operator,
    shape, dtype, GPU), not of one version of the code: with nothing of the old kernel stored
    under it, it is tuned for the kernel that runs now. Only its owner moves it, right after
    claiming it: a helper never does (the owner's copy would keep the old version). Whether
    ``new_version`` is the newer one is the caller's to judge (:func:`first_seen`).
    """
    adopted = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.operator_version == old_version,
            Job.status == "running",
            Job.worker_id == worker_id,
            ~exists().where(Trial.job_id == job_id),
        )
        .values(operator_version=new_version)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    _refresh_if_loaded(session, job_id)
    return adopted.rowcount == 1


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
        **result_values(result),
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


def trial_time(session: Session, job_id: str, config_key: str) -> float | None:
    """The measured time of one config of a job (its trial's median), or None where the job
    has no successful trial of it."""
    trial = _find_trial(session, job_id, config_key)
    if trial is None or trial.status != "ok":
        return None
    return trial.time_ms


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
    default_ms: float | None = None,
    framework_ms: float | None = None,
    framework: str | None = None,
    compiled_ms: float | None = None,
    compiled: str | None = None,
) -> BestConfig:
    """Store a winner for its result key and commit; an existing row is replaced only by a
    strictly faster ``time_ms``. Returns the row now stored for the key (the faster of the two).

    ``default_ms`` (the operator's default config on this shape) and ``framework_ms`` /
    ``framework`` (PyTorch's op on the same inputs) describe the key, not the config: given,
    they are stored on the row whichever config it keeps (the newest measurement wins, and
    ``updated_at`` moves so that the API's lookup cache sees the change); not given (None),
    the row keeps what it holds. ``framework_ms`` and ``framework`` go together, as do
    ``compiled_ms`` and ``compiled`` (the same op compiled by ``torch.compile``); a new
    ``framework_ms`` given without ``compiled_ms`` clears the stored compiled pair (the two
    baselines are one measurement's).
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
    now = utcnow()
    figures: dict[str, Any] = {}
    if default_ms is not None:
        figures["default_ms"] = default_ms
    if framework_ms is not None:
        # The two baselines are stored as a unit: a compiled figure is never older than the
        # eager one beside it (another torch, another run), so a fresh eager baseline without
        # a compiled one clears it (the policy then keeps its rule for rows without one).
        figures.update(framework_ms=framework_ms, framework=framework,
                       compiled_ms=compiled_ms, compiled=compiled if compiled_ms is not None
                       else None)  # fmt: skip
    elif compiled_ms is not None:
        figures.update(compiled_ms=compiled_ms, compiled=compiled)
    values = {
        "shape": [int(s) for s in shape],
        "config": dict(config),
        "time_ms": time_ms,
        "job_id": job_id,
        "updated_at": now,
        **figures,
    }
    for _attempt in range(3):
        replaced = session.execute(
            update(BestConfig)
            .where(key, BestConfig.time_ms > time_ms)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if figures and not replaced.rowcount:  # a faster config kept: the key's figures move
            session.execute(
                update(BestConfig)
                .where(key)
                .values(**figures, updated_at=now)
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


def set_framework_baselines(
    session: Session,
    row_id: int,
    *,
    framework_ms: float,
    framework: str | None,
    compiled_ms: float | None = None,
    compiled: str | None = None,
) -> bool:
    """Store PyTorch's baselines on best-config row ``row_id`` and commit (``kato baseline``:
    winners stored without them). The row's config and time stay; the pairs go together as in
    :func:`upsert_best_config` (no ``compiled_ms`` clears the stored compiled pair: the two are
    one measurement's), and ``updated_at`` moves so that lookup caches see the change. False
    where the row is gone."""
    done = session.execute(
        update(BestConfig)
        .where(BestConfig.id == row_id)
        .values(
            framework_ms=framework_ms,
            framework=framework,
            compiled_ms=compiled_ms,
            compiled=compiled if compiled_ms is not None else None,
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return bool(done.rowcount)


# --- lookups -------------------------------------------------------------------------------
#
# The rows a lookup selects from, read by the queries below; the selection itself (exact ->
# nearest -> default, the nearest-shape order, the guard against the default config) is
# :mod:`service.lookup`'s, the one place that decides what is served.

#: What identifies a group of rows a lookup selects from: (operator, version, dtype, GPU model).
GroupKey = tuple[str, str, str, str]


@dataclass(frozen=True, slots=True)
class StoredConfig:
    """One row of ``kato_best_configs`` as a plain immutable value (no session attached).

    The attributes are :class:`db.models.BestConfig`'s columns under the same names, so code
    that only reads a row (``ConfigPublic.from_row``) takes either. ``shape`` is a tuple and
    ``config`` a read-only mapping: one value is shared by every lookup of a batch, so a caller
    must not be able to change what the next lookup sees (``service.lookup.pick_best_config``
    hands ``accept`` a fresh ``dict`` copy).
    """

    id: int
    operator: str
    operator_version: str
    shape: tuple[int, ...]
    shape_key: str
    dtype: str
    gpu_model: str
    compute_capability: str
    cuda_version: str
    config: Mapping[str, Any]
    time_ms: float
    job_id: str | None
    updated_at: datetime
    default_ms: float | None = None
    framework_ms: float | None = None
    framework: str | None = None
    compiled_ms: float | None = None
    compiled: str | None = None


def _group_filter(operator: str, operator_version: str, dtype: str, gpu_model: str) -> Any:
    return and_(
        BestConfig.operator == operator,
        BestConfig.operator_version == operator_version,
        BestConfig.dtype == dtype,
        BestConfig.gpu_model == gpu_model,
    )


def exact_best_configs(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    dtype: str,
    gpu_model: str,
    shape: Sequence[int],
) -> Iterator[BestConfig]:
    """The group's rows tuned for exactly ``shape`` (by the index), newest ``updated_at``
    first, then highest id; read lazily, so a caller that stops at the first pays for one."""
    return iter(
        session.scalars(
            select(BestConfig)
            .where(
                _group_filter(operator, operator_version, dtype, gpu_model),
                BestConfig.shape_key == shape_key(shape),
            )
            .order_by(BestConfig.updated_at.desc(), BestConfig.id.desc())
        )
    )


def group_shapes(
    session: Session, *, operator: str, operator_version: str, dtype: str, gpu_model: str
) -> list[tuple[int, list[int], float]]:
    """``(id, shape, time_ms)`` of every row of the group: what ordering nearest shapes
    needs, without the configs (cheaper for one lookup than whole rows)."""
    stmt = select(BestConfig.id, BestConfig.shape, BestConfig.time_ms).where(
        _group_filter(operator, operator_version, dtype, gpu_model)
    )
    return [(row_id, list(shape), time_ms) for row_id, shape, time_ms in session.execute(stmt)]


def best_config_row(session: Session, row_id: int) -> BestConfig | None:
    """The best-config row ``row_id`` (None: gone since it was listed)."""
    return session.get(BestConfig, row_id)


def newest_tuned_version(
    session: Session, *, operator: str, dtype: str, gpu_model: str
) -> str | None:
    """The operator version of the most recently updated best config of ``operator`` on
    ``gpu_model`` in ``dtype`` (then the highest id), any shape; None where none is stored."""
    return session.scalars(
        select(BestConfig.operator_version)
        .where(
            BestConfig.operator == operator,
            BestConfig.gpu_model == gpu_model,
            BestConfig.dtype == dtype,
        )
        .order_by(BestConfig.updated_at.desc(), BestConfig.id.desc())
        .limit(1)
    ).first()


def best_configs_version(
    session: Session,
) -> tuple[int, str | None, int | None, float | None]:
    """A cheap fingerprint of ``kato_best_configs``: (rows, newest ``updated_at``, largest id,
    sum of ``time_ms``).

    It changes whenever a winner is stored, so the lookup cache (:mod:`service.lookup_cache`)
    is dropped exactly when its answers may have changed: a new row changes the count, and a
    faster config replacing one (:func:`upsert_best_config` replaces only with a strictly
    faster time) lowers the sum. The newest ``updated_at`` alone would miss a replacement
    whenever another row is dated later (an imported file's dates, a worker host whose clock
    runs behind).
    """
    count, newest, largest, total = session.execute(
        select(
            func.count(),
            func.max(BestConfig.updated_at),
            func.max(BestConfig.id),
            func.sum(BestConfig.time_ms),
        )
    ).one()
    return (
        int(count),
        None if newest is None else str(newest),
        largest,
        None if total is None else float(total),
    )


def config_group_rows(
    session: Session, *, operator: str, operator_version: str, dtype: str, gpu_model: str
) -> list[StoredConfig]:
    """Every stored row of one group, read in one query, as immutable values, by id.

    A snapshot: rows stored after this call are not in it. Reads only.
    """
    columns = (
        BestConfig.id,
        BestConfig.operator,
        BestConfig.operator_version,
        BestConfig.shape,
        BestConfig.shape_key,
        BestConfig.dtype,
        BestConfig.gpu_model,
        BestConfig.compute_capability,
        BestConfig.cuda_version,
        BestConfig.config,
        BestConfig.time_ms,
        BestConfig.job_id,
        BestConfig.updated_at,
        BestConfig.default_ms,
        BestConfig.framework_ms,
        BestConfig.framework,
        BestConfig.compiled_ms,
        BestConfig.compiled,
    )
    result = session.execute(
        select(*columns)
        .where(_group_filter(operator, operator_version, dtype, gpu_model))
        .order_by(BestConfig.id)
    )
    return [
        StoredConfig(
            id=row.id,
            operator=row.operator,
            operator_version=row.operator_version,
            shape=tuple(row.shape),
            shape_key=row.shape_key,
            dtype=row.dtype,
            gpu_model=row.gpu_model,
            compute_capability=row.compute_capability,
            cuda_version=row.cuda_version,
            config=MappingProxyType(dict(row.config)),
            time_ms=row.time_ms,
            job_id=row.job_id,
            updated_at=row.updated_at,
            default_ms=row.default_ms,
            framework_ms=row.framework_ms,
            framework=row.framework,
            compiled_ms=row.compiled_ms,
            compiled=row.compiled,
        )
        for row in result
    ]


# --- warm start ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredSource:
    """What was measured for one (GPU model, shape) at one operator version (a warm-start
    source, :mod:`tuner.warm_start`): ``trials`` are (config, time_ms) pairs of OK results,
    stored winners and job trials, in no order and possibly repeating a config."""

    gpu_model: str
    shape: tuple[int, ...]
    operator_version: str
    #: Measured at another version than the job's (older kernel code).
    other_version: bool
    trials: list[tuple[dict[str, Any], float]]


#: A source's identity in the database: (GPU model, shape).
_SourceKey = tuple[str, tuple[int, ...]]


def warm_start_sources(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    dtype: str,
    shape: Sequence[int],
    gpu_model: str,
    exclude_job_id: str | None = None,
    per_source: int = 10,
) -> list[MeasuredSource]:
    """What the database knows for a job's warm start (reads only): per (GPU model, shape of
    the same rank) of the same operator and dtype, the OK trials of its jobs (the fastest
    ``per_source`` of each job) and its stored best configs.

    Each (GPU model, shape) is read at one version: ``operator_version`` where anything OK was
    measured there at that version, else the other version that measured there most recently
    (newest OK trial or best config; older kernel code, e.g. from before an upgrade), marked
    :attr:`MeasuredSource.other_version`. One version per source, so that a key re-tuned at the
    new version stops seeding its stale winner, and so that a stale time never competes with a
    current one. The job's own (GPU model, shape) is a source only at other versions (at its
    own, it is the job itself), and not at all once another job measured it at its own version;
    ``exclude_job_id``'s trials are never read.
    """
    shape = [int(s) for s in shape]
    own = (gpu_model, tuple(shape))

    def usable(model: str, src_shape: Sequence[int], version: str) -> _SourceKey | None:
        src = (model, tuple(int(s) for s in src_shape))
        if len(src[1]) != len(shape) or (src == own and version == operator_version):
            return None
        return src

    # When each (source, version) last measured something OK, to pick one version per source.
    # A job counts only with an OK trial: a job queued for the new version (``kato retune``)
    # or one whose every config failed must not hide the older version's results.
    last_ok = dict(
        session.execute(
            select(Trial.job_id, func.max(Trial.created_at))
            .join(Job, Job.id == Trial.job_id)
            .where(Job.operator == operator, Job.dtype == dtype, Trial.time_ms.is_not(None))
            .group_by(Trial.job_id)
        ).all()
    )
    jobs: dict[tuple[_SourceKey, str], list[str]] = {}
    seen: dict[_SourceKey, dict[str, Any]] = {}  # source -> version -> newest OK timestamp

    def saw(src: _SourceKey, version: str, when: Any) -> None:
        versions = seen.setdefault(src, {})
        if versions.get(version) is None or (when is not None and versions[version] < when):
            versions[version] = when

    # Whether the job's own key was measured at its own version (another job re-tuned it):
    # then its older versions are no source, as for every other (GPU, shape).
    own_current = False

    def is_own_current(model: str, src_shape: Sequence[int], version: str) -> bool:
        return (model, tuple(int(s) for s in src_shape)) == own and version == operator_version

    for job_id, model, src_shape, version in session.execute(
        select(Job.id, Job.gpu_model, Job.shape, Job.operator_version).where(
            Job.operator == operator, Job.dtype == dtype
        )
    ).all():
        if job_id != exclude_job_id and job_id in last_ok:
            own_current = own_current or is_own_current(model, src_shape, version)
        src = usable(model, src_shape, version)
        if src is None or job_id == exclude_job_id or job_id not in last_ok:
            continue
        jobs.setdefault((src, version), []).append(job_id)
        saw(src, version, last_ok[job_id])
    best: dict[tuple[_SourceKey, str], list[tuple[dict[str, Any], float]]] = {}
    for model, src_shape, version, config, t, updated in session.execute(
        select(
            BestConfig.gpu_model,
            BestConfig.shape,
            BestConfig.operator_version,
            BestConfig.config,
            BestConfig.time_ms,
            BestConfig.updated_at,
        ).where(BestConfig.operator == operator, BestConfig.dtype == dtype)
    ).all():
        if t is not None and math.isfinite(t):
            own_current = own_current or is_own_current(model, src_shape, version)
        src = usable(model, src_shape, version)
        if src is None or t is None or not math.isfinite(t):
            continue
        best.setdefault((src, version), []).append((config, t))
        saw(src, version, updated)

    sources = []
    for src, versions in seen.items():
        if src == own and own_current:
            continue  # re-tuned at this version: its stale winner is no guide any more
        if operator_version in versions:
            version = operator_version
        else:  # the newest other version; ties (no timestamps) by name, to be deterministic
            version = max(versions, key=lambda v: (versions[v] is not None, versions[v], v))
        measured = list(best.get((src, version), []))
        for job_id in jobs.get((src, version), []):
            measured += [
                (config, t)
                for config, t in session.execute(
                    select(Trial.config, Trial.time_ms)
                    .where(Trial.job_id == job_id, Trial.time_ms.is_not(None))
                    .order_by(Trial.time_ms)
                    .limit(per_source)
                ).all()
            ]
        model, src_shape = src
        sources.append(
            MeasuredSource(
                gpu_model=model,
                shape=src_shape,
                operator_version=version,
                other_version=version != operator_version,
                trials=measured,
            )
        )
    return sources
