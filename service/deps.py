"""FastAPI dependencies, as ``Annotated`` aliases for route signatures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.settings import Settings


def get_session(request: Request) -> Iterator[Session]:
    """One database session per request, from ``app.state.session_factory``."""
    with request.app.state.session_factory() as session:
        yield session


def get_settings(request: Request) -> Settings:
    """The settings the app was created with (``app.state.settings``)."""
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
