"""Liveness and database reachability."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service.deps import SessionDep
from service.strict import StrictJSONRoute

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"], route_class=StrictJSONRoute)


@router.get("/v1/ping")
async def ping() -> dict[str, str]:
    """``{"status": "ok"}`` from the event loop: the process answers (no database, no thread).
    The load benchmark's ceiling."""
    return {"status": "ok"}


@router.get("/healthz")
def healthz(session: SessionDep) -> JSONResponse:
    """``{"status": "ok", "db": "ok"}``, or 503 with ``"db": "unreachable (ErrorClass)"``.

    Anyone may call it, so the driver's message (which can name the database host, port and
    user) goes to the log, not into the answer."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        cause = exc.orig if getattr(exc, "orig", None) else exc
        log.error("healthz: the database does not answer: %s", cause)
        return JSONResponse(
            {"status": "error", "db": f"unreachable ({type(cause).__name__})"}, status_code=503
        )
    return JSONResponse({"status": "ok", "db": "ok"})
