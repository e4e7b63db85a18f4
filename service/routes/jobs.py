"""Tuning jobs: submit (one or a batch), follow, list trials, cancel."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from db import queries
from db.models import Job
from kernels import InvalidInput
from service.deps import SessionDep, SettingsDep
from service.schemas import JobBatchCreate, JobCreate, JobPublic, JobStatus, TrialPublic
from service.validation import job_fields

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

NOT_FOUND = {404: {"description": "no such job"}}
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


@router.post("", status_code=status.HTTP_202_ACCEPTED)
def submit_job(body: JobCreate, session: SessionDep, settings: SettingsDep) -> JobPublic:
    """Queue a tuning job; a worker with a GPU of that model picks it up."""
    job = queries.create_job(session, **job_fields(body, settings))
    return JobPublic.from_job(job)


@router.post("/batch", status_code=status.HTTP_202_ACCEPTED)
def submit_jobs(
    body: JobBatchCreate, session: SessionDep, settings: SettingsDep
) -> list[JobPublic]:
    """Queue several jobs; one invalid job rejects the whole batch (422 naming its index)."""
    if len(body.jobs) > settings.max_batch:
        raise InvalidInput(f"a batch holds at most {settings.max_batch} jobs, got {len(body.jobs)}")
    fields = []
    for index, job in enumerate(body.jobs):
        try:
            fields.append(job_fields(job, settings))
        except InvalidInput as exc:
            raise InvalidInput(f"jobs[{index}]: {exc}") from None
    return [JobPublic.from_job(job) for job in queries.create_jobs(session, fields)]


@router.get("")
def list_jobs(
    session: SessionDep,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[JobPublic]:
    """Jobs, newest first, optionally only those in one status."""
    jobs = queries.list_jobs(session, status=status_filter, limit=limit)
    return [JobPublic.from_job(job) for job in jobs]


@router.get("/{job_id}", responses=NOT_FOUND)
def get_job(job_id: str, session: SessionDep) -> JobPublic:
    """A job: status, trials done, best time and config so far."""
    return JobPublic.from_job(_job_or_404(session, job_id))


@router.get("/{job_id}/trials", responses=NOT_FOUND)
def get_job_trials(job_id: str, session: SessionDep) -> list[TrialPublic]:
    """Every config the job measured, in order, failures included."""
    _job_or_404(session, job_id)
    return [TrialPublic.from_trial(t) for t in queries.job_trials(session, job_id)]


@router.delete("/{job_id}", responses=NOT_FOUND)
def cancel_job(job_id: str, session: SessionDep) -> JobPublic:
    """Cancel: a queued job at once, a running one after its current trial."""
    job = queries.request_cancel(session, job_id) if _JOB_ID.fullmatch(job_id) else None
    if job is None:
        raise _not_found(job_id)
    return JobPublic.from_job(job)
