"""Liveness and database health: reachable, and whether it takes writes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from kato.db.health import read_only
from kato.service.deps import SessionDep
from kato.service.faults import READ_ONLY, database_fault
from kato.service.schemas import HealthPublic
from kato.service.strict import StrictJSONRoute
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

router = APIRouter(tags=["health"], route_class=StrictJSONRoute)

READ_ONLY_DETAIL = f"{READ_ONLY}: reads are answered, writes get 503"


@router.get("/v1/ping", openapi_extra={"x-database": False})
async def ping() -> dict[str, str]:
    """``{"status": "ok"}`` from the event loop: the process answers (no database, no thread).
    The load benchmark's ceiling."""
    return {"status": "ok"}


@router.get(
    "/healthz",
    response_model=HealthPublic,
    response_model_exclude_none=True,
    responses={503: {"model": HealthPublic, "description": "the database does not answer"}},
)
def healthz(request: Request, session: SessionDep) -> JSONResponse:
    """``{"status": "ok", "db": "ok"}``; ``"degraded"`` with ``"db": "read-only"`` while the
    database takes no writes (200: reads, lookups included, are still answered); 503 with
    ``"db": "unreachable (ErrorClass)"`` (or the fault's name) and ``Retry-After`` when it
    does not answer.

    Anyone may call it, so the driver's message (which can name the database host, port and
    user) goes to the log, once per fault (``app.state.db_faults``), not into the answer."""
    faults = request.app.state.db_faults
    try:
        session.execute(text("SELECT 1"))
        is_read_only = read_only(session)  # a probe that writes nothing (db.health)
    except SQLAlchemyError as exc:
        faults.failed(exc)
        fault = database_fault(exc)
        cause = exc.orig if getattr(exc, "orig", None) else exc
        name = "unreachable" if fault is None else fault.kind.replace("_", "-")
        return JSONResponse(
            {"status": "error", "db": f"{name} ({type(cause).__name__})"},
            status_code=503,
            headers={"Retry-After": str(5 if fault is None else fault.retry_after)},
        )
    faults.ok()
    if is_read_only:
        return JSONResponse({"status": "degraded", "db": "read-only", "detail": READ_ONLY_DETAIL})
    return JSONResponse({"status": "ok", "db": "ok"})
