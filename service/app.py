"""The FastAPI application factory.

``create_app(settings)`` migrates the database (``db.session.init_db``) and keeps, on
``app.state``: ``settings``, ``engine`` and ``session_factory`` (a ``sessionmaker``); workers and
the CLI started beside the app reuse ``app.state.session_factory``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from fastapi import Depends, FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRouter
from fastapi_offline import FastAPIOffline
from kato.db import queries
from kato.db.retry import FaultLog
from kato.db.session import init_db, make_engine, session_factory
from kato.kernels import InvalidInput
from kato.service import __version__
from kato.service.auth import AUTH_RESPONSES, require_reader
from kato.service.faults import RequestFaults, database_error, server_error
from kato.service.limits import BodySizeLimit
from kato.service.lookup_cache import LookupCache, LookupFastPath
from kato.service.routes import configs, gpus, health, jobs, operators, user_operators, workers
from kato.service.schemas import ErrorPublic, UnavailablePublic
from kato.service.settings import Settings
from kato.service.strict import (
    HttpMethods,
    StrictJSONRoute,
    StrictURL,
    cap_errors,
    echo,
    escape_surrogates,
    literal_methods,
)
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match, Mount

log = logging.getLogger(__name__)

DESCRIPTION = """\
Kato tunes CUDA kernel configurations by measurement and serves the winners.

- **Look up** the config to use: `GET /v1/configs/{operator}?shape=4096x4096&dtype=float16&gpu=H200`
  (source `exact`, `nearest` or `default`; never touches a GPU).
- **Tune**: `POST /v1/jobs` queues a job; a worker with a GPU of that model runs the search and
  stores every trial and the winner.

Writes (submit, batch, cancel) need an API token (`kato token create NAME`), sent as
`Authorization: Bearer <secret>`; reads are open unless the service sets `KATO_AUTH_READS`.
"""


async def _invalid_input(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(
        {"detail": escape_surrogates(str(exc))}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT
    )


async def _request_validation(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422, bounded: the first few field errors (:func:`service.strict.cap_errors`),
    each echoing at most a short prefix of its input (:func:`service.strict.echo`)."""
    assert isinstance(exc, RequestValidationError)
    detail = [
        {
            k: [echo(part) for part in v] if k == "loc" else echo(v)
            for k, v in e.items()
            if k != "url"
        }
        for e in cap_errors(list(exc.errors()))
    ]
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


#: Methods a 405's ``Allow`` may list (RFC 9110's, and PATCH).
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str] | None:
    """Every method some route of ``app`` takes at this request's path, or ``None`` where a
    mount (the docs' static files) owns the path and answers for itself.

    Starlette's router answers a 405 with the methods of the first route whose path matched;
    a path served by several routes (``GET`` and ``POST /v1/jobs``) takes all of theirs.
    """
    literal = literal_methods(app, scope["path"])
    if literal is not None:  # a literal path's own routes only (service.strict.HttpMethods)
        return [m for m in _METHODS if m in literal]
    allowed = []
    for method in _METHODS:
        probe = {**scope, "method": method}
        for route in app.router.routes:
            match = route.matches(probe)[0]
            if match == Match.FULL and isinstance(route, Mount):
                return None
            if match == Match.FULL:
                allowed.append(method)
                break
    if "GET" in allowed and "HEAD" not in allowed:  # answered as GET (HttpMethods)
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    return allowed


async def _method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    allowed = allowed_methods(request.app, dict(request.scope))
    if allowed:
        headers["Allow"] = ", ".join(allowed)
    detail = f"{request.method} is not allowed here; this path takes {headers.get('Allow')}"
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)


async def _watch_best_configs(app: FastAPI) -> None:
    """Drop the lookup cache whenever a winner is stored (polls a fingerprint of the table)."""
    cache: LookupCache = app.state.lookup_cache
    interval = app.state.settings.lookup_cache_check_seconds

    def fingerprint() -> object:
        with app.state.session_factory() as session:
            return queries.best_configs_version(session)

    faults = app.state.db_faults
    while True:
        try:
            cache.set_version(await run_in_threadpool(fingerprint))
        except SQLAlchemyError as exc:
            cache.clear()  # cannot tell: serve from the database until it answers again
            faults.failed(exc)  # once per fault, not on every poll
        else:
            faults.ok()
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Set the API's thread limit; start the lookup cache's watcher (when the cache is on);
    stop it at shutdown."""
    # AnyIO's limiter is per event loop, so it is set here, in the loop that serves: its
    # tokens are the connections the pool holds for requests (service.deps).
    anyio.to_thread.current_default_thread_limiter().total_tokens = app.state.settings.api_threads
    task = None
    if app.state.lookup_cache.enabled:
        app.state.lookup_cache.set_version(None)
        task = asyncio.create_task(_watch_best_configs(app))
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _document_common_errors(app: FastAPI) -> None:
    """Every operation that takes a body can also answer 400 (a body FastAPI cannot decode) and
    413 (larger than ``max_body_bytes``, from :class:`BodySizeLimit`), every operation 422
    (a path or query string that is not UTF-8, from :class:`service.strict.StrictURL`) and 503
    (a database fault, :mod:`service.faults`; not where the operation's ``openapi_extra`` says
    ``"x-database": False``): declare them in the OpenAPI schema, for routes added later too."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.setdefault(
            "ErrorPublic", ErrorPublic.model_json_schema(ref_template=REF_TEMPLATE)
        )
        components.setdefault(
            "UnavailablePublic", UnavailablePublic.model_json_schema(ref_template=REF_TEMPLATE)
        )
        error = {"content": {"application/json": {"schema": {"$ref": ERROR_REF}}}}
        unavailable = {"content": {"application/json": {"schema": {"$ref": UNAVAILABLE_REF}}}}
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                if not isinstance(operation, dict):
                    continue
                if operation.pop("x-database", True):
                    operation.setdefault("responses", {}).setdefault(
                        "503",
                        {
                            "description": "the database cannot serve the request now "
                            "(unreachable, busy, read-only, ...; `fault` says which): "
                            "retry after `Retry-After` seconds",
                            "headers": {
                                "Retry-After": {
                                    "description": "seconds to wait before retrying",
                                    "schema": {"type": "integer"},
                                }
                            },
                            **unavailable,
                        },
                    )
                operation.setdefault("responses", {}).setdefault(
                    "422", {"description": "the path or a query parameter is not UTF-8", **error}
                )
                if "requestBody" in operation:
                    responses = operation.setdefault("responses", {})
                    responses.setdefault(
                        "400", {"description": "the body could not be decoded", **error}
                    )
                    responses.setdefault(
                        "413",
                        {"description": "body larger than KATO_MAX_BODY_BYTES", **error},
                    )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


REF_TEMPLATE = "#/components/schemas/{model}"
ERROR_REF = REF_TEMPLATE.format(model="ErrorPublic")
UNAVAILABLE_REF = REF_TEMPLATE.format(model="UnavailablePublic")


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """Build the app: migrate the database (``settings.db_url``, or ``engine`` if given) to the
    newest schema, then mount the routers. OpenAPI docs at ``/docs``.

    Also on ``app.state``: ``lookup_cache`` (:class:`LookupCache`), ``db_faults`` (the
    :class:`db.retry.FaultLog` of the health check and the cache's watcher) and
    ``request_faults`` (:class:`service.faults.RequestFaults`). Request bodies over
    ``settings.max_body_bytes`` get a 413; with ``settings.auth_reads`` every route but
    ``/healthz`` and ``/v1/ping`` needs a token; a database fault gets a 503 from every route
    (:mod:`service.faults`).
    """
    settings = settings or Settings()
    if engine is None:  # a pool with a connection per API thread (service.deps)
        engine = make_engine(
            settings.db_url, connections=settings.api_db_connections, timeouts=settings.db_timeouts
        )
    engine = init_db(engine)

    # FastAPIOffline: /docs and /redoc load Swagger UI and ReDoc from files the package ships,
    # not from a CDN (blank pages offline); validatorUrl null: no schema sent out for a badge.
    app = FastAPIOffline(
        title="Kato",
        version=__version__,
        description=DESCRIPTION,
        docs_url="/docs",
        redoc_url="/redoc",
        static_url="/docs/static",
        swagger_ui_parameters={"validatorUrl": None},
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory(engine)
    app.state.lookup_cache = LookupCache(
        settings.lookup_cache_seconds, settings.lookup_cache_entries
    )

    # Database faults are logged once, not per request: service.faults.
    app.state.db_faults = FaultLog(log, "API: database check")
    app.state.request_faults = RequestFaults(log)

    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(Exception, server_error)
    app.add_exception_handler(InvalidInput, _invalid_input)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, _method_not_allowed)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Inside the lookup fast path: only answers to valid URLs are ever cached.
    app.add_middleware(StrictURL)
    if not settings.auth_reads:
        app.add_middleware(LookupFastPath, cache=app.state.lookup_cache)
    app.add_middleware(HttpMethods)  # outermost: HEAD as GET, literal paths' 405s
    _document_common_errors(app)

    readers: dict[str, Any] = {}
    if settings.auth_reads:
        readers = {"dependencies": [Depends(require_reader)], "responses": AUTH_RESPONSES}
    app.include_router(_strict(health.router))
    for module in (operators, user_operators, gpus, configs, jobs, workers):
        app.include_router(_strict(module.router), **readers)
    user_operators.install(app)  # the stored user operators join this process's registry
    return app


def _strict(router: APIRouter) -> APIRouter:
    """``router``, checked to decode its JSON bodies strictly (:class:`StrictJSONRoute`)."""
    loose = [r.path for r in router.routes if not isinstance(r, StrictJSONRoute)]
    if router.route_class is not StrictJSONRoute or loose:
        raise TypeError(f"router {router.prefix!r}: use route_class=StrictJSONRoute ({loose})")
    return router


def create_app_from_env() -> FastAPI:
    """``create_app()`` with settings from the ``KATO_*`` environment: the factory that
    ``kato serve --workers N`` hands to uvicorn (each worker process builds its own app)."""
    return create_app(Settings())
