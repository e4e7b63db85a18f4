"""Tuning jobs: submit (one or a batch), follow, list trials, cancel."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from kato.db import fleet, queries, tokens
from kato.db.models import Job
from kato.service.auth import AUTH_RESPONSES, Caller, WriterDep
from kato.service.deps import SessionDep, SettingsDep
from kato.service.schemas import (
    BatchProgress,
    JobBatchCreate,
    JobCreate,
    JobPublic,
    JobStatus,
    ListLimit,
    TrialPublic,
    error_responses,
)
from kato.service.settings import Settings
from kato.service.strict import StrictJSONRoute
from kato.service.validation import batch_fields, job_fields
from sqlalchemy.orm import Session

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=StrictJSONRoute)

NOT_FOUND = error_responses(e404="no such job")
SUBMIT_RESPONSES = {
    **AUTH_RESPONSES,
    **error_responses(
        e413="request body larger than the service's limit (KATO_MAX_BODY_BYTES)",
        e422="bad job: unknown operator, dtype or GPU, wrong rank, buffers larger than the "
        "GPU's memory, budget out of range, too many jobs in a batch, malformed JSON",
        e429="the token already has its most queued + running jobs (see Retry-After)",
    ),
}
#: Job ids are uuid4 hex; anything else is answered without a query (PostgreSQL rejects some
#: strings, such as ones holding NUL, outright).
_JOB_ID = re.compile(r"[0-9a-f]{1,32}")


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id[:64]!r} not found")


def _job_or_404(session: SessionDep, job_id: str) -> Job:
    job = queries.get_job(session, job_id) if _JOB_ID.fullmatch(job_id) else None
    if job is None:
        raise _not_found(job_id)
    return job


def _public(session: Session, jobs: list[Job], settings: Settings) -> list[JobPublic]:
    """Jobs as the API shows them; queued ones for a GPU model no live worker advertises say
    so in ``note`` (the live models are read once for all of them)."""
    live = fleet.live_gpu_models(session, settings.lease_seconds)
    return [JobPublic.from_job(job, note=fleet.note_for(job, live)) for job in jobs]


def _check_quota(session: Session, caller: Caller, adding: int, settings: Settings) -> None:
    """429 (with Retry-After) if ``adding`` jobs would take the caller's token past its quota
    of queued + running jobs. Anonymous callers (auth off) have no per-token quota. Leaves the
    transaction open (and the token's writers serialised) for the insert that follows."""
    if caller.token is None:
        return
    try:
        tokens.check_quota(session, caller.token, adding, settings.max_queued_jobs)
    except tokens.QuotaExceeded as exc:
        session.rollback()
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            str(exc),
            headers={"Retry-After": str(settings.queue_retry_after_seconds)},
        ) from None


@router.post("", status_code=status.HTTP_202_ACCEPTED, responses=SUBMIT_RESPONSES)
def submit_job(
    body: JobCreate, session: SessionDep, settings: SettingsDep, caller: WriterDep
) -> JobPublic:
    """Queue a tuning job; a worker with a GPU of that model picks it up. Needs an API token
    (unless the service runs with ``KATO_AUTH_REQUIRED=false``); the job records it."""
    fields = job_fields(body, settings)
    _check_quota(session, caller, 1, settings)
    job = queries.create_job(session, **fields, token_id=caller.token_id)
    return _public(session, [job], settings)[0]


@router.post("/batch", status_code=status.HTTP_202_ACCEPTED, responses=SUBMIT_RESPONSES)
def submit_jobs(
    body: JobBatchCreate, session: SessionDep, settings: SettingsDep, caller: WriterDep
) -> list[JobPublic]:
    """Queue several jobs (at most ``KATO_MAX_BATCH``); one invalid job rejects the whole batch
    (422 naming its index), and so does a batch that does not fit the token's quota (429)."""
    fields = batch_fields(body.jobs, settings, caller.token_id)
    _check_quota(session, caller, len(fields), settings)
    return _public(session, queries.create_jobs(session, fields), settings)


@router.get("/batch/{batch_id}", responses=error_responses(e404="no such batch"))
def get_batch(batch_id: str, session: SessionDep) -> BatchProgress:
    """A batch's progress (its id: any of its jobs' ``batch_id``): trials done of its total
    budget, jobs per status, best so far per key, GPU busy time, elapsed and estimated time
    left."""
    jobs = queries.batch_jobs(session, batch_id) if _JOB_ID.fullmatch(batch_id) else []
    if not jobs:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"batch {batch_id[:64]!r} not found")
    return BatchProgress.from_jobs(batch_id, jobs)


@router.get("", responses=error_responses(e422="bad status filter or limit"))
def list_jobs(
    session: SessionDep,
    settings: SettingsDep,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[ListLimit, Query()] = 100,
) -> list[JobPublic]:
    """Jobs, newest first, optionally only those in one status."""
    return _public(session, queries.list_jobs(session, status=status_filter, limit=limit), settings)


@router.get("/{job_id}", responses=NOT_FOUND)
def get_job(job_id: str, session: SessionDep, settings: SettingsDep) -> JobPublic:
    """A job: status, trials done, best time and config so far. A queued job for a GPU model
    that no live worker advertises says so in ``note``."""
    job = _job_or_404(session, job_id)
    return JobPublic.from_job(job, note=fleet.waiting_note(session, job, settings.lease_seconds))


@router.get("/{job_id}/trials", responses=NOT_FOUND)
def get_job_trials(job_id: str, session: SessionDep) -> list[TrialPublic]:
    """Every config the job measured, in order, failures included."""
    _job_or_404(session, job_id)
    return [TrialPublic.from_trial(t) for t in queries.job_trials(session, job_id)]


@router.delete("/{job_id}", responses={**NOT_FOUND, **AUTH_RESPONSES})
def cancel_job(job_id: str, session: SessionDep, caller: WriterDep) -> JobPublic:
    """Cancel: a queued job at once, a running one after its current trial. A token may cancel
    the jobs it submitted and jobs submitted without a token (403 for another token's job); an
    admin token may cancel any job."""
    job = _job_or_404(session, job_id)
    if not caller.may_cancel(job.token_id):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"job {job.id} was submitted with another API token; only that token or an admin "
            "token (`kato token create NAME --admin`) may cancel it",
        )
    cancelled = queries.request_cancel(session, job_id)
    if cancelled is None:
        raise _not_found(job_id)
    return JobPublic.from_job(cancelled)
