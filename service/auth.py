"""API tokens on requests: who may write (submit, batch, cancel, import) and, optionally, read.

A request presents ``Authorization: Bearer <secret>`` (secrets come from ``kato token create``).

- Write routes depend on :data:`WriterDep`. With ``auth_required`` (the default) a request
  without a token gets 401, an unknown token 401, a revoked token 403. With ``auth_required``
  off, requests without a token are let through as anonymous (``Caller.token is None``); a
  token that is presented is still checked, so its jobs are recorded and its quota applies.
- Cancelling: a token cancels the jobs it submitted and jobs submitted without a token; an
  admin token (``kato token create NAME --admin``) cancels any job, so that the jobs of a
  revoked token can still be stopped (:meth:`Caller.may_cancel`).
- Read routes are open unless ``auth_reads`` is set; then ``create_app`` mounts them with
  :func:`require_reader`, which applies the same rules as for writes.

Every 401 carries ``WWW-Authenticate: Bearer`` (RFC 6750).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kato.db import tokens
from kato.db.models import ApiToken
from kato.service.deps import SessionDep, transaction_ended
from kato.service.schemas import error_responses
from sqlalchemy.orm import Session

#: The OpenAPI security scheme (Swagger UI's "Authorize" button). It never raises by itself:
#: the dependencies below answer with Kato's own messages.
bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiToken",
    description="an API token from `kato token create NAME`, as `Authorization: Bearer <secret>`",
)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]

HOW_TO = "create a token with `kato token create NAME` and send 'Authorization: Bearer <secret>'"


@dataclass(frozen=True)
class Caller:
    """Who is calling: a live token, or anonymous (``token is None``: auth is off for this)."""

    token: ApiToken | None

    @property
    def token_id(self) -> str | None:
        return self.token.id if self.token is not None else None

    @property
    def admin(self) -> bool:
        return self.token is not None and self.token.admin

    def may_cancel(self, job_token_id: str | None) -> bool:
        """Whether this caller may cancel a job submitted with ``job_token_id`` (``None``:
        without a token). Anonymous callers (auth off) may cancel any job, as anyone who
        reaches the port may write."""
        return self.token is None or self.admin or job_token_id in (None, self.token.id)


def _unauthorized(message: str, error: str | None = None) -> HTTPException:
    challenge = "Bearer" if error is None else f'Bearer error="{error}"'
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": challenge}
    )


def _secret(request: Request, credentials: HTTPAuthorizationCredentials | None) -> str | None:
    """The presented secret; 401 for an Authorization header that is not a Bearer token."""
    if credentials is not None:
        return credentials.credentials.strip()
    if request.headers.get("authorization"):
        raise _unauthorized(
            "the Authorization header must be 'Bearer <secret>'", error="invalid_request"
        )
    return None


def authenticate(session: Session, secret: str | None, *, required: bool, what: str) -> Caller:
    """The caller for a presented secret (``None``: none presented).

    Raises: 401 (none presented while ``required``, or an unknown secret), 403 (revoked).
    """
    if secret is None:
        if required:
            raise _unauthorized(f"{what} needs an API token: {HOW_TO}")
        return Caller(None)
    verified = tokens.verify_token(session, secret)
    if verified.revoked:
        token = verified.token
        assert token is not None and token.revoked_at is not None
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"API token {token.id} ({token.name!r}) was revoked on "
            f"{token.revoked_at:%Y-%m-%d %H:%M} UTC; create a new one",
        )
    if not verified.ok:
        raise _unauthorized(f"invalid API token: {HOW_TO}", error="invalid_token")
    return Caller(verified.token)


def require_writer(request: Request, session: SessionDep, credentials: BearerDep) -> Caller:
    """Dependency of the write routes (see the module docstring). Ends the session's
    transaction before it returns, so the request holds no connection while it waits for a
    thread to run its route (:func:`service.deps.transaction_ended`)."""
    required = request.app.state.settings.auth_required
    with transaction_ended(session):
        return authenticate(
            session, _secret(request, credentials), required=required, what="this route"
        )


def require_reader(request: Request, credentials: BearerDep) -> Caller:
    """Dependency of the read routes when ``auth_reads`` is set: a live token is required."""
    secret = _secret(request, credentials)
    if secret is None:
        raise _unauthorized(f"this service requires an API token for reads too: {HOW_TO}")
    with request.app.state.session_factory() as session:
        return authenticate(session, secret, required=True, what="reading")


WriterDep = Annotated[Caller, Depends(require_writer)]

#: The 401/403 responses of a route behind a token, for the routes' ``responses=``.
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = error_responses(
    e401="no API token, or an unknown one (`WWW-Authenticate: Bearer`)",
    e403="the API token was revoked, or may not do this",
)
