"""Queries for a fleet of workers: presence (heartbeats, GPU models) and jobs shared by several
workers (trial reservations).

Presence: every worker upserts its ``kato_workers`` row when it starts and on every heartbeat. A
worker is *live* while its heartbeat is younger than ``stale_seconds`` and its status is not
``stopped``.

Sharing one job: a worker measures a config only after reserving it. A reservation is a
placeholder row in ``kato_trials`` (status ``running``, ``error`` naming the worker) inserted in
the same transaction that takes one unit of the job's budget (``trials_done + 1`` under the
condition ``trials_done < budget_configs``). The unique ``(job_id, config_key)`` constraint makes
the reservation exclusive: two workers never measure the same config, and the budget of distinct
configs is never overrun. Completing fills the placeholder in (no second count); releasing (the
measurement was interrupted, or its worker died) deletes it and gives the unit back.

Trial numbers: a reservation takes the lowest number none of the job's rows holds, so a
released reservation's number goes to the next one; a job's numbers are 0, 1, 2, ... without
gaps, and the unique ``(job_id, number)`` constraint refuses a repeat. A number, once given, is
never changed (it orders the trials, not the time they were measured: ``created_at`` does).

Lock order: every transaction that writes both takes the job's row first, then trial rows. A
reservation must (its count decides whether it may insert); completing and releasing lock the
job row before touching their trial. In the other order PostgreSQL deadlocked: one worker
completing a trial waited for the job row that another held while inserting that same config,
which waited for the first worker's trial update.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import delete, exists, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from db.models import Job, Trial, Worker, utcnow
from db.queries import JobScope, in_scope

#: Status of a placeholder row: the config is being measured by the worker its ``error`` names.
RESERVED = "running"
_RESERVED_BY = "being measured by worker "

Reservation = Literal["reserved", "taken", "budget", "stopped"]

#: Tries to give a reservation a number that a writer outside the job's lock did not take.
_NUMBER_ATTEMPTS = 5


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


def reserve_trial(
    session: Session,
    job_id: str,
    *,
    config: Mapping[str, Any],
    config_key: str,
    worker_id: str,
) -> Reservation:
    """Reserve ``config`` of a running job for ``worker_id`` to measure; commit.

    Returns ``reserved`` (measure it, then :func:`complete_trial` or :func:`release_trial`;
    also when ``worker_id`` holds the reservation already, so that a call whose commit landed
    may be made again), ``taken`` (recorded already, or being measured by another worker: read
    it with :func:`find_trial`), ``budget`` (the job's budget of distinct configs is used up) or
    ``stopped`` (the job is no longer running, or a cancel was requested).

    The placeholder gets the job's :func:`lowest_free_number`, under the job's row lock: the
    numbers of a job's rows stay 0, 1, 2, ... without repeats (the database's unique
    ``(job_id, number)`` refuses one) and without gaps (a released reservation's number goes to
    the next reservation).
    """
    for _ in range(_NUMBER_ATTEMPTS):
        counted = session.execute(
            update(Job)
            .where(
                Job.id == job_id,
                Job.status == "running",
                Job.cancel_requested.is_(False),
                Job.trials_done < Job.budget_configs,
            )
            .values(trials_done=Job.trials_done + 1)
            .execution_options(synchronize_session=False)
        )
        if counted.rowcount == 0:
            session.rollback()
            if (row := find_trial(session, job_id, config_key)) is not None:
                return "reserved" if reserved_by(row) == worker_id else "taken"
            job = session.get(Job, job_id, populate_existing=True)
            session.rollback()
            if job is None or job.status != "running" or job.cancel_requested:
                return "stopped"
            return "budget"
        session.add(
            Trial(
                job_id=job_id,
                number=lowest_free_number(session, job_id),
                config=dict(config),
                config_key=config_key,
                status=RESERVED,
                times_ms=[],
                error=_RESERVED_BY + worker_id,
            )
        )
        try:
            session.commit()
        except IntegrityError:  # the count is rolled back with the row
            session.rollback()
            if (row := find_trial(session, job_id, config_key)) is not None:
                # Ours already: a retry of a reservation whose commit landed but whose answer
                # was lost (the connection dropped). Else recorded or reserved by another worker.
                return "reserved" if reserved_by(row) == worker_id else "taken"
            # Not the config but its number: a writer outside the job's row lock
            # (queries.record_trial) stored that number meanwhile. Take the next free one.
            continue
        return "reserved"
    raise RuntimeError(f"job {job_id}: no free trial number after {_NUMBER_ATTEMPTS} attempts")


def lowest_free_number(session: Session, job_id: str) -> int:
    """The lowest trial number that none of the job's rows (recorded or reserved) holds: one
    past the highest while the numbers are dense, else the first gap a released reservation
    left. Call it under the job's row lock, so that two writers never pick the same number."""
    count, highest = session.execute(
        select(func.count(Trial.number), func.coalesce(func.max(Trial.number), -1)).where(
            Trial.job_id == job_id
        )
    ).one()
    if count == highest + 1:
        return int(count)  # dense: the common case, answered from the (job_id, number) index
    taken = aliased(Trial)
    held = select(Trial.number).where(Trial.job_id == job_id)
    if session.scalar(held.where(Trial.number == 0)) is None:
        return 0
    return int(
        session.scalar(
            select(func.min(Trial.number + 1)).where(
                Trial.job_id == job_id,
                ~exists().where(taken.job_id == job_id, taken.number == Trial.number + 1),
            )
        )
    )


def reserved_by(trial: Trial) -> str | None:
    """The worker measuring a placeholder trial (``None`` for a recorded one)."""
    if trial.status != RESERVED or not (trial.error or "").startswith(_RESERVED_BY):
        return None
    return (trial.error or "")[len(_RESERVED_BY) :]


def complete_trial(
    session: Session, job_id: str, *, config_key: str, worker_id: str, result: Mapping[str, Any]
) -> bool:
    """Fill in this worker's reservation with its measured ``result``
    (:meth:`TrialResult.to_dict`) and keep the job's best; commit.

    A reservation released meanwhile (this worker looked dead to another, its heartbeat late
    during a long measurement) is taken again first, so that the measurement is stored rather
    than made twice: ``False`` only if that fails too (another worker has reserved or recorded
    the config since, the budget is used up or the job stopped), and nothing is stored then.

    Safe to call again after a failure: a completion whose commit landed (its answer lost with
    the connection) is found stored and answers ``True``, with nothing written twice."""
    if _fill_reservation(session, job_id, config_key, worker_id, result):
        return True
    if _holds(find_trial(session, job_id, config_key), result):
        session.rollback()
        return True
    again = reserve_trial(
        session, job_id, config=result["config"], config_key=config_key, worker_id=worker_id
    )
    return again == "reserved" and _fill_reservation(session, job_id, config_key, worker_id, result)


def _holds(row: Trial | None, result: Mapping[str, Any]) -> bool:
    """Whether a recorded (not reserved) ``row`` holds ``result``: same status, times, error."""
    return (
        row is not None
        and row.status != RESERVED
        and row.status == str(result["status"])
        and list(row.times_ms or []) == list(result.get("times_ms") or [])
        and row.time_ms == result.get("time_ms")
        and (row.error or None) == (result.get("error") or None)
    )


def _fill_reservation(
    session: Session, job_id: str, config_key: str, worker_id: str, result: Mapping[str, Any]
) -> bool:
    """Fill in this worker's reservation of ``config_key`` (``False``: there is none); commit."""
    time_ms = result.get("time_ms")
    _lock_job(session, job_id)
    filled = session.execute(
        update(Trial)
        .where(
            Trial.job_id == job_id,
            Trial.config_key == config_key,
            Trial.status == RESERVED,
            Trial.error == _RESERVED_BY + worker_id,
        )
        .values(
            status=str(result["status"]),
            time_ms=time_ms,
            times_ms=list(result.get("times_ms") or []),
            compile_time_s=result.get("compile_time_s"),
            registers=result.get("registers"),
            shared_static_bytes=result.get("shared_static_bytes"),
            shared_dynamic_bytes=result.get("shared_dynamic_bytes"),
            local_bytes=result.get("local_bytes"),
            blocks_per_sm=result.get("blocks_per_sm"),
            occupancy=result.get("occupancy"),
            error=result.get("error"),
            created_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    if filled.rowcount == 1 and result["status"] == "ok" and time_ms is not None:
        session.execute(
            update(Job)
            .where(Job.id == job_id, or_(Job.best_time_ms.is_(None), Job.best_time_ms > time_ms))
            .values(best_time_ms=time_ms, best_config=dict(result["config"]))
            .execution_options(synchronize_session=False)
        )
    session.commit()
    return filled.rowcount == 1


def release_trial(session: Session, job_id: str, *, config_key: str, worker_id: str) -> bool:
    """Delete this worker's reservation of ``config_key`` and give its budget unit back;
    commit. ``False`` if there was none."""
    return _release(session, job_id, [(config_key, _RESERVED_BY + worker_id)]) == 1


def _lock_job(session: Session, job_id: str) -> None:
    """Take the job's row lock (PostgreSQL; SQLite's one writer needs none) before a trial's:
    the lock order of the module docstring."""
    session.execute(select(Job.id).where(Job.id == job_id).with_for_update())


def _release(session: Session, job_id: str, keys: Sequence[tuple[str, str]]) -> int:
    _lock_job(session, job_id)
    released = 0
    for config_key, marker in keys:
        gone = session.execute(
            delete(Trial).where(
                Trial.job_id == job_id,
                Trial.config_key == config_key,
                Trial.status == RESERVED,
                Trial.error == marker,
            )
        )
        if gone.rowcount == 1:
            released += 1
    if released:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(trials_done=Job.trials_done - released)
            .execution_options(synchronize_session=False)
        )
    session.commit()
    return released


def release_stale_reservations(
    session: Session, job_id: str, *, stale_seconds: float, keep: str | None = None
) -> int:
    """Release the reservations of workers that are not live (killed mid-trial); commit.
    ``keep``: a worker id whose reservations stay regardless. Returns how many were released."""
    live = live_worker_ids(session, stale_seconds)
    if keep is not None:
        live.add(keep)
    stale = [
        (t.config_key, t.error or "")
        for t in reservations(session, job_id)
        if reserved_by(t) not in live
    ]
    return _release(session, job_id, stale) if stale else 0


def reservations(session: Session, job_id: str) -> list[Trial]:
    """The job's placeholder rows (configs being measured now)."""
    return list(
        session.scalars(select(Trial).where(Trial.job_id == job_id, Trial.status == RESERVED))
    )


def find_trial(session: Session, job_id: str, config_key: str) -> Trial | None:
    return session.scalars(
        select(Trial)
        .where(Trial.job_id == job_id, Trial.config_key == config_key)
        .execution_options(populate_existing=True)
    ).first()


def trials_since(session: Session, job_id: str, known: set[str]) -> list[Trial]:
    """The job's rows (recorded and reserved) whose config key is not in ``known``."""
    rows = session.scalars(
        select(Trial).where(Trial.job_id == job_id).execution_options(populate_existing=True)
    )
    return [t for t in rows if t.config_key not in known]
