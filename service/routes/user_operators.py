"""Registering user operators at runtime: ``POST /v1/operators`` and the stored versions.

``GET /v1/operators`` and ``GET /v1/operators/{name}`` (``service/routes/operators.py``) list
them with the built-in ones: :func:`install` makes the database's stored operators part of the
API process's registry (``db.operators.use_database``).

A body is a declarative definition only (the spec and the text of its CUDA files): it is
validated (every expression parsed against a whitelist, never evaluated as Python) and stored;
CUDA is compiled and run only by workers, in their measuring child.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Response, status
from kato.db import operators as stored
from kato.service.auth import AUTH_RESPONSES, WriterDep
from kato.service.deps import SessionDep
from kato.service.schemas import StrictBody, error_responses
from kato.service.strict import StrictJSONRoute
from pydantic import BaseModel

router = APIRouter(prefix="/v1/operators", tags=["operators"], route_class=StrictJSONRoute)

SCOPE_HINT = "create a token that may with `kato token create NAME --operators`"


class OperatorCreate(StrictBody):
    """A user operator: its spec (the fields of ``kato.toml``, see docs/user_kernels.md) and
    the text of the files it names (the template, the reference kernel)."""

    spec: dict[str, Any]
    files: dict[str, str]


class OperatorAdded(BaseModel):
    name: str
    version: str
    created: bool  # false: this version was stored already
    versions: int  # versions of this name stored
    #: The fields outside the version (``description``, ``backward``) this request replaced in
    #: the stored version: they decide nothing of its variants, so its results stay served.
    updated: list[str] = []


class OperatorVersion(BaseModel):
    name: str
    version: str
    created_at: datetime
    current: bool


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {
            "model": OperatorAdded,
            "description": "this version is stored already (its description and [backward] "
            "section, which the version leaves out, replaced where they differ: `updated`)",
        },
        **AUTH_RESPONSES,
        **error_responses(
            e422="the spec is invalid (an unknown name in an expression, a function call or "
            "attribute in one, a file missing, a name taken by a built-in operator, ...)"
        ),
    },
)
def add_operator(
    body: OperatorCreate, session: SessionDep, caller: WriterDep, response: Response
) -> OperatorAdded:
    """Store a user operator as the newest version of its name (201; 200 when this version
    is stored already, its description and ``[backward]`` section replaced where they differ,
    named in ``updated``). Needs a token with the operators scope (or an admin one)."""
    token = caller.token
    if token is not None and not (token.admin or token.operators):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"API token {token.id} ({token.name!r}) may not register operators: {SCOPE_HINT}",
        )
    definition = stored.parse_definition(body.model_dump(), "operator")
    added = stored.add_operator(session, definition, token_id=caller.token_id)
    if stored.installed() is not None:
        stored.installed().refresh()  # this process serves it at once
    if not added.created:
        response.status_code = status.HTTP_200_OK
    return OperatorAdded(**added.__dict__)


@router.get("/{name}/versions", responses=error_responses(e404="no stored operator of that name"))
def operator_versions(name: str, session: SessionDep) -> list[OperatorVersion]:
    """Every stored version of a user operator, oldest first (the last is the current one)."""
    rows = stored.versions(session, name[:64])
    if not rows:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no stored operator {name[:64]!r}")
    return [
        OperatorVersion(
            name=r.name, version=r.version, created_at=r.created_at, current=r is rows[-1]
        )
        for r in rows
    ]


def install(app: FastAPI) -> None:
    """Serve the database's stored operators in this process (``app.state.session_factory``)."""
    stored.use_database(app.state.session_factory)
