"""Workers: the processes that claim and run tuning jobs, as their heartbeats describe them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from kato.db import fleet
from kato.service.deps import SessionDep, SettingsDep
from kato.service.schemas import ListLimit, QueryFlag, WorkerPublic
from kato.service.strict import StrictJSONRoute

router = APIRouter(prefix="/v1/workers", tags=["workers"], route_class=StrictJSONRoute)


@router.get("")
def list_workers(
    session: SessionDep,
    settings: SettingsDep,
    live: Annotated[
        QueryFlag | None, Query(description="only live (true) or only dead (false)")
    ] = None,
    limit: Annotated[ListLimit, Query()] = 200,
) -> list[WorkerPublic]:
    """Workers, most recent heartbeat first: GPU models, backend, status, current job. A worker
    is live while its heartbeat is younger than the lease (``KATO_LEASE_SECONDS``)."""
    out = []
    for worker in fleet.list_workers(session, limit=limit):
        is_live = fleet.is_live(worker, settings.lease_seconds)
        if live is None or live == is_live:
            out.append(WorkerPublic.from_worker(worker, is_live))
    return out
