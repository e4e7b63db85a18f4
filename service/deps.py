"""FastAPI dependencies, as ``Annotated`` aliases for route signatures; and how a request's
database session is held.

A request holds a pooled connection only while one of its threads runs. FastAPI runs each
sync dependency, the sync route and then (for a route with a response model) the response's
validation in separate hops through AnyIO's thread pool (``api_threads`` tokens), and a
request waits for a token between hops. A request that waited holding a connection could
deadlock the API: with every thread waiting for a connection held by requests waiting for a
thread (issue 29). So:

- :func:`get_session` is async: creating a ``Session`` opens no connection (that happens at
  its first query, in a thread) and closing it runs on the event loop, not in a pool thread;
- a sync dependency that uses the session ends its transaction before it returns
  (:func:`transaction_ended`), which hands the connection back to the pool in its thread;
- a sync route closes its sessions before it returns, in its own thread
  (:func:`closing_sessions`, applied to every route by ``service.strict.StrictJSONRoute``).

Then at most one connection per running thread is checked out, and a pool of ``api_threads``
connections plus headroom (``Settings.api_db_connections``) never makes a thread wait.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from kato.service.settings import Settings
from sqlalchemy.orm import Session

F = TypeVar("F", bound=Callable[..., Any])


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One database session per request, from ``app.state.session_factory``.

    Async on purpose (see the module docstring): the session's connection is checked out by
    the first query of a sync dependency or route, which hands it back before returning; the
    close here is then a no-op (or, after an error, a rollback) on the event loop.
    """
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.close()


@contextlib.contextmanager
def transaction_ended(session: Session) -> Iterator[Session]:
    """End ``session``'s transaction when the block exits: commit when it returned, close
    (roll back, release) when it raised. Either way the connection goes back to the pool in
    the calling thread; loaded objects stay readable after a commit (``expire_on_commit``
    off). For sync dependencies that take :data:`SessionDep`."""
    try:
        yield session
        session.commit()
    except BaseException:
        session.close()
        raise


def closing_sessions(endpoint: F) -> F:
    """``endpoint``, closing every ``Session`` it was given before it returns or raises, in the
    thread it ran in, when it is a plain function (FastAPI runs those in the thread pool).

    Contract of a route: it commits what it writes and returns values, not ORM objects with
    attributes still to load (they are detached by then). Coroutine and generator endpoints
    are returned unchanged.
    """
    if not inspect.isfunction(endpoint) or (
        inspect.iscoroutinefunction(endpoint)
        or inspect.isgeneratorfunction(endpoint)
        or inspect.isasyncgenfunction(endpoint)
    ):
        return endpoint

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return run  # type: ignore[return-value]


async def get_settings(request: Request) -> Settings:
    """The settings the app was created with (``app.state.settings``). Async: reading an
    attribute needs no trip through the thread pool."""
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
