"""Liveness and database reachability."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service.deps import SessionDep

router = APIRouter(tags=["health"])


@router.get("/v1/ping")
async def ping() -> dict[str, str]:
    """``{"status": "ok"}`` from the event loop: the process answers (no database, no thread).
    The load benchmark's ceiling."""
    return {"status": "ok"}


@router.get("/healthz")
def healthz(session: SessionDep) -> JSONResponse:
    """``{"status": "ok", "db": "ok"}``, or 503 with the database error."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        detail = str(exc.orig if getattr(exc, "orig", None) else exc).splitlines()[0]
        return JSONResponse({"status": "error", "db": detail}, status_code=503)
    return JSONResponse({"status": "ok", "db": "ok"})
