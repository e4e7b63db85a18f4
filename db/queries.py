"""The queries the service, the worker and the CLI run. Each takes a :class:`Session`.

Functions that change state commit (their docstrings say so), so a caller can use one short
session per call. State changes that race with other processes (claiming, cancelling, counting
trials, keeping the best) are single conditional ``UPDATE`` statements, safe on SQLite (which
serialises writers) and PostgreSQL (row locks; claims use ``FOR UPDATE SKIP LOCKED``). After
such an update, a job already loaded in the session is refreshed from the database.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import sub
from types import MappingProxyType
from typing import Any, TypeVar

from sqlalchemy import and_, exists, false, func, literal, or_, select, true, tuple_, update
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
    stays queued."""

    operators: frozenset[str] | None = None
    problems: frozenset[Problem] | None = None
    job_ids: frozenset[str] | None = None


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
    session: Session,
    *,
    gpu_models: Sequence[str],
    worker_id: str,
    lease_seconds: float,
    scope: JobScope | None = None,
    resume_own: bool = False,
) -> Job | None:
    """Take the oldest claimable job for one of ``gpu_models`` and commit; ``None`` if none.

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
        job = session.scalars(
            select(Job)
            .where(_claimable(gpu_models, now, scope))
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
            .where(_claimable(gpu_models, now, scope))
            .order_by(Job.created_at, Job.id)
            .limit(_CLAIM_CANDIDATES)
        ).all()
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
) -> BestConfig:
    """Store a winner for its result key and commit; an existing row is replaced only by a
    strictly faster ``time_ms``. Returns the row now stored for the key (the faster of the two).

    ``default_ms`` (the operator's default config on this shape) and ``framework_ms`` /
    ``framework`` (PyTorch's op on the same inputs) describe the key, not the config: given,
    they are stored on the row whichever config it keeps (the newest measurement wins, and
    ``updated_at`` moves so that the API's lookup cache sees the change); not given (None),
    the row keeps what it holds. ``framework_ms`` and ``framework`` go together.
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
        figures.update(framework_ms=framework_ms, framework=framework)
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


# --- lookups -------------------------------------------------------------------------------
#
# A lookup is split into loading and selecting: :func:`load_config_group` reads the rows of one
# (operator, version, dtype, GPU model) group once, as immutable values, and
# :func:`pick_best_config` selects from them without the database. ``POST /v1/configs/batch``
# loads each group once for up to 1000 lookups; :func:`lookup_best_config` (one lookup) keeps
# its indexed exact-shape query and reads only (id, shape, time) of the group for the nearest
# shape (cheaper for one lookup than whole rows), ordered by the same :func:`_nearest_first`.

_P = TypeVar("_P")

#: A lookup serves a winner tuned for another shape only where, on its own shape, it beat the
#: operator's default config by more than this factor (``default_ms > NEAREST_MIN_GAIN *
#: time_ms``); else the default is served. Replayed over the H200's recorded spaces
#: (``benchmarks/untuned_defaults.py``, docs/defaults.md) the unguarded nearest answer came to
#: mean 0.952, worst 0.551 of each space's optimum, the default to 0.979 / 0.876, this guard to
#: 0.980 / 0.876: where the default was about as good as the tuned optimum next door, a
#: neighbour's winner is a worse bet here than the default.
NEAREST_MIN_GAIN = 1.05


def beats_default(row: Any, min_gain: float | None = NEAREST_MIN_GAIN) -> bool:
    """Whether a stored winner may be served for another shape: it beat the default config on
    its own shape by more than ``min_gain`` (None or 0: no guard, any winner). A row whose
    default time is unknown (stored before migration 0006, or its job did not measure the
    default) is not known to beat it, and the recorded spaces say an unchecked neighbour is
    worse than the default on average: it is not served."""
    if not min_gain:
        return True
    return row.default_ms is not None and row.default_ms > min_gain * row.time_ms


#: What identifies a group of rows a lookup selects from: (operator, version, dtype, GPU model).
GroupKey = tuple[str, str, str, str]


@dataclass(frozen=True, slots=True)
class StoredConfig:
    """One row of ``kato_best_configs`` as a plain immutable value (no session attached).

    The attributes are :class:`db.models.BestConfig`'s columns under the same names, so code
    that only reads a row (``ConfigPublic.from_row``) takes either. ``shape`` is a tuple and
    ``config`` a read-only mapping: one value is shared by every lookup of a batch, so a caller
    must not be able to change what the next lookup sees (:func:`pick_best_config` hands
    ``accept`` a fresh ``dict`` copy).
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


#: A nearest-shape candidate: (shape, log2 of each dimension, time_ms, id, payload).
_Candidate = tuple[tuple[int, ...], tuple[float, ...], float, int, _P]


def _candidate(
    shape: Sequence[int], time_ms: float, row_id: int, payload: _P
) -> _Candidate[_P] | None:
    """A row as a nearest-shape candidate; ``None`` for a shape with a dimension below 1 (it has
    no log2 and never serves another shape)."""
    if not all(int(s) >= 1 for s in shape):
        return None
    return tuple(shape), tuple(math.log2(s) for s in shape), time_ms, row_id, payload


def _nearest_first(
    candidates: Iterable[_Candidate[_P]], shape: Sequence[int], max_distance: float | None
) -> list[_P]:
    """The payloads of ``candidates`` (all of ``shape``'s rank: the caller filters, once per
    group where it can), nearest first: least sum over dimensions of ``|log2 a - log2 b|``,
    then least ``time_ms``, then lowest id. Candidates of exactly ``shape`` are left out (they
    are the exact match's), and so are those farther than ``max_distance`` (inclusive bound;
    ``None``: no bound). The one nearest-shape ordering of every lookup."""
    shape = tuple(int(s) for s in shape)
    wanted = tuple(math.log2(s) for s in shape)
    ranked = []
    payloads = []
    for row_shape, logs, time_ms, row_id, payload in candidates:
        if row_shape == shape:
            continue
        # The terms |log2 a - log2 b| in dimension order, summed by the builtin: the distance
        # (ties included) is bit for bit the per-dimension sum lookups always used (sum() of
        # floats is compensated from Python 3.12, so a hand-written a + b could round a tie
        # differently). map() keeps the loop in C: this runs per stored row per lookup.
        distance = sum(map(abs, map(sub, logs, wanted)))
        if max_distance is None or distance <= max_distance:
            ranked.append((distance, time_ms, row_id, len(payloads)))
            payloads.append(payload)
    # Ids are unique, so the index after them never decides and payloads are never compared.
    ranked.sort()
    return [payloads[r[3]] for r in ranked]


class ConfigGroup:
    """The stored rows of one :data:`GroupKey`, indexed for :func:`pick_best_config`.

    Immutable after construction and free of database state, so one group can serve any number
    of lookups (from any thread). Built by :func:`load_config_group`, or from rows directly.
    """

    __slots__ = ("rows", "_exact", "_by_rank", "_config_class")

    def __init__(self, rows: Sequence[StoredConfig]) -> None:
        self.rows: tuple[StoredConfig, ...] = tuple(rows)
        exact: dict[str, list[StoredConfig]] = {}
        by_rank: dict[int, list[_Candidate[StoredConfig]]] = {}
        # Rows with equal configs share a class: winners of different shapes are often the
        # same config, and a lookup need not check one config twice (pick_best_config).
        classes: dict[str, int] = {}
        self._config_class: dict[int, int] = {}
        for row in self.rows:
            text = json.dumps(dict(row.config), sort_keys=True, default=repr)
            self._config_class[row.id] = classes.setdefault(text, len(classes))
            exact.setdefault(row.shape_key, []).append(row)
            candidate = _candidate(row.shape, row.time_ms, row.id, row)
            if candidate is not None:  # log2 once per row, not once per lookup
                by_rank.setdefault(len(row.shape), []).append(candidate)
        # The order of lookup_best_config's exact query: newest update first, then highest id.
        # UTCDateTime returns every timestamp timezone-aware in UTC and the database compares
        # the same instants, so Python's order is the database's.
        self._exact: dict[str, tuple[StoredConfig, ...]] = {
            key: tuple(sorted(same, key=lambda r: (r.updated_at, r.id), reverse=True))
            for key, same in exact.items()
        }
        self._by_rank: dict[int, tuple[_Candidate[StoredConfig], ...]] = {
            rank: tuple(candidates) for rank, candidates in by_rank.items()
        }

    def config_class(self, row: StoredConfig) -> int:
        """A number for ``row``'s config, equal for two rows of this group exactly when their
        configs are equal (as JSON: ``1``, ``1.0`` and ``true`` differ)."""
        return self._config_class[row.id]

    def exact(self, shape: Sequence[int]) -> tuple[StoredConfig, ...]:
        """The rows tuned for exactly ``shape``, newest ``updated_at`` first, then highest id."""
        return self._exact.get(shape_key(shape), ())

    def nearest(
        self, shape: Sequence[int], max_distance: float | None = None
    ) -> list[StoredConfig]:
        """The rows of ``shape``'s rank tuned for another shape, nearest first (the order of
        :func:`lookup_best_config`: least log2 distance, then least ``time_ms``, then lowest
        id), none farther than ``max_distance`` (inclusive; ``None``: no bound)."""
        return _nearest_first(self._by_rank.get(len(shape), ()), shape, max_distance)


def _group_filter(operator: str, operator_version: str, dtype: str, gpu_model: str) -> Any:
    return and_(
        BestConfig.operator == operator,
        BestConfig.operator_version == operator_version,
        BestConfig.dtype == dtype,
        BestConfig.gpu_model == gpu_model,
    )


def load_config_group(
    session: Session, *, operator: str, operator_version: str, dtype: str, gpu_model: str
) -> ConfigGroup:
    """Every stored row of one group, read in one query, as a :class:`ConfigGroup`.

    The group is a snapshot: rows stored after this call are not in it. Reads only.
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
    )
    result = session.execute(
        select(*columns)
        .where(_group_filter(operator, operator_version, dtype, gpu_model))
        .order_by(BestConfig.id)
    )
    return ConfigGroup(
        [
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
            )
            for row in result
        ]
    )


def pick_best_config(
    group: ConfigGroup,
    shape: Sequence[int],
    *,
    accept: Callable[[dict[str, Any]], bool] | None = None,
    max_distance: float | None = None,
    nearest: bool = True,
    min_gain: float | None = NEAREST_MIN_GAIN,
) -> tuple[StoredConfig | None, str]:
    """:func:`lookup_best_config`'s selection over a loaded group; no database, no side
    effects besides calling ``accept``.

    Returns ``(row, "exact")`` for the first row of exactly ``shape`` that ``accept`` passes
    (newest ``updated_at`` first, then highest id); else ``(row, "nearest")`` for the first
    accepted row of :meth:`ConfigGroup.nearest` (least log2 distance, then least ``time_ms``,
    then lowest id; at most ``max_distance`` away, inclusive) where it :func:`beats_default`
    by ``min_gain`` (the first accepted row decides: one that does not leaves the default);
    else ``(None, "default")``. ``nearest=False`` stops after the exact shape (what
    ``match=exact`` serves), which saves the nearest search whose answer would be thrown away.

    ``accept`` must depend on the config alone (a spec check for this shape and dtype does):
    it gets a copy of each candidate's config, in the order above, until one passes, and is
    called once per distinct config (a later row with a config already rejected is skipped
    unchecked), so a lookup costs at most one check per distinct config of the group.
    """
    verdicts: dict[int, bool] = {}

    def first_accepted(rows: Iterable[StoredConfig]) -> StoredConfig | None:
        for row in rows:
            if accept is None:
                return row
            config_class = group.config_class(row)
            verdict = verdicts.get(config_class)
            if verdict is None:
                verdict = verdicts[config_class] = bool(accept(dict(row.config)))
            if verdict:
                return row
        return None

    row = first_accepted(group.exact(shape))
    if row is not None:
        return row, "exact"
    if nearest:
        row = first_accepted(group.nearest(shape, max_distance))
        if row is not None and beats_default(row, min_gain):
            return row, "nearest"
    return None, "default"


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
    min_gain: float | None = NEAREST_MIN_GAIN,
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
    The nearest accepted row is served only where it :func:`beats_default` by ``min_gain``
    (else the default: ``(None, "default")``).
    :func:`pick_best_config` selects the same way from a group loaded once
    (:func:`load_config_group`), for many lookups; both order nearest shapes by one function.
    """
    shape = [int(s) for s in shape]
    group = _group_filter(operator, operator_version, dtype, gpu_model)
    # ``accept`` (a spec check) costs far more than a row: it runs on the candidates in order
    # until one passes, not on every stored shape (a batch of 1000 lookups over 300 stored
    # shapes took 10 s when it ran on all of them).
    # The exact shape first, by the index: a hit stops here without reading the group.
    exact = session.scalars(
        select(BestConfig)
        .where(group, BestConfig.shape_key == shape_key(shape))
        .order_by(BestConfig.updated_at.desc(), BestConfig.id.desc())
    )
    for row in exact:  # newest first
        if accept is None or accept(row.config):
            return row, "exact"
    # The nearest shape: only (id, shape, time) of the group's rows, ordered as
    # pick_best_config orders them, then the candidates loaded one by one until one passes.
    candidates = []
    for row_id, row_shape, time_ms in session.execute(
        select(BestConfig.id, BestConfig.shape, BestConfig.time_ms).where(group)
    ):
        if len(row_shape) == len(shape):
            candidate = _candidate(row_shape, time_ms, row_id, row_id)
            if candidate is not None:
                candidates.append(candidate)
    for row_id in _nearest_first(candidates, shape, max_distance):
        row = session.get(BestConfig, row_id)
        if row is not None and (accept is None or accept(row.config)):
            if beats_default(row, min_gain):
                return row, "nearest"
            break  # the nearest valid neighbour decides, as pick_best_config's
    return None, "default"
