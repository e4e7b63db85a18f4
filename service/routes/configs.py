"""Lookups: the config to use for an operator, shape, dtype and GPU model. Never touches a GPU.

This is the hot path. The route is ``async``: an answer cached in this process
(:class:`service.lookup_cache.LookupCache`, ``app.state.lookup_cache``) is served on the event
loop without a thread hop or a database session; a miss validates the request, runs the query
in the thread pool with a short-lived session, and caches the encoded answer.

``POST /v1/configs/batch`` answers many lookups in one request (the client's ``prefetch``); it is
a read and stays open like ``GET``, and answers every lookup as ``GET`` would, from one session
that reads each (operator, version, dtype, GPU model) group once per batch. ``match=exact``
serves only a config tuned for exactly the shape asked for (else the default);
``match=nearest`` (the default) also serves the nearest one, where it beat the default config
on its own shape by more than ``KATO_NEAREST_MIN_GAIN``. What is served is decided by
:class:`service.lookup.Lookups`, the one owner of the selection; this module validates,
caches and shapes the answers. Answers carry the figures stored beside the served winner
(``default_ms``, ``framework_ms``, ``framework``, ``speedup``, ``compiled_ms``, ``compiled``,
``compiled_speedup``), measured on ``tuned_shape``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import Response
from kato.kernels import InvalidInput, OperatorSpec
from kato.service.lookup import Lookups, Match
from kato.service.lookup_cache import raw_key, wants_fresh
from kato.service.schemas import (
    NAME_PATTERN,
    ConfigPublic,
    Name,
    StrictBody,
    check_dims,
    error_responses,
    format_compute_capability,
    name_field,
    parse_shape_text,
    plain,
)
from kato.service.strict import StrictJSONRoute
from kato.service.validation import Problem, operator_or_404, resolve_problem
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

router = APIRouter(prefix="/v1/configs", tags=["configs"], route_class=StrictJSONRoute)

#: How a name parameter's check shows in the OpenAPI schema.
_NAME = {"pattern": NAME_PATTERN}
#: Most lookups in one ``POST /v1/configs/batch``.
MAX_BATCH_LOOKUPS = 1000


def _default_answer(spec: OperatorSpec, problem: Problem) -> ConfigPublic:
    """The answer when nothing stored is served: the operator's default config."""
    return ConfigPublic(
        operator=spec.name,
        operator_version=spec.version,
        shape=problem.shape,
        dtype=problem.dtype,
        gpu=problem.gpu_model,
        config=plain(spec.default_config(problem.shape, problem.dtype)),
        source="default",
        compute_capability=format_compute_capability(
            getattr(problem.gpu, "compute_capability", None)
        ),
    )


def _public(lookups: Lookups, spec: OperatorSpec, problem: Problem, match: Match) -> ConfigPublic:
    """The answer of ``lookups`` (:mod:`service.lookup`) for a validated request."""
    row, source = lookups.pick(spec, problem.shape, problem.dtype, problem.gpu_model, match)
    if row is not None:
        return ConfigPublic.from_row(row, source, problem.shape, problem.gpu_model)
    return _default_answer(spec, problem)


def _lookups(request: Request, session: Session, *, batch: bool = False) -> Lookups:
    settings = request.app.state.settings
    return Lookups(
        session,
        max_distance=settings.nearest_max_distance,
        min_gain=settings.nearest_min_gain,
        batch=batch,
    )


def lookup(
    request: Request, spec: OperatorSpec, problem: Problem, match: Match = "nearest"
) -> ConfigPublic:
    """The answer for a validated request, from the database (blocking: run it in a thread).
    With ``match="exact"`` a config tuned for another shape is not served (the default is)."""
    with request.app.state.session_factory() as session:
        return _public(_lookups(request, session), spec, problem, match)


@router.get(
    "/{operator}",
    response_model=ConfigPublic,
    responses=error_responses(
        e404="no such operator",
        e422="bad shape, dtype or GPU model, or a shape too large for the GPU",
    ),
)
async def get_config(
    operator: Annotated[str, Path(max_length=64, examples=["softmax"])],
    request: Request,
    shape: Annotated[
        str, Query(max_length=200, description='"4096,4096" or "4096x4096"', examples=["4096x4096"])
    ],
    dtype: Annotated[Name, Query(max_length=32, examples=["float16"], json_schema_extra=_NAME)],
    gpu: Annotated[Name, Query(max_length=64, examples=["H200"], json_schema_extra=_NAME)],
    match: Annotated[Match, Query(description="exact: no nearest-shape fallback")] = "nearest",
) -> Response:
    """The best tuned config for this request (``exact``), else the one tuned for the nearest
    shape on this GPU model (``nearest``; not with ``match=exact``), else the operator's default
    config (``default``)."""
    spec = operator_or_404(operator)
    cache = request.app.state.lookup_cache
    key = raw_key(request.url.path, request.scope.get("query_string", b""))
    body = None if wants_fresh(request.scope.get("headers", ())) else cache.get(key)
    if body is None:
        problem = resolve_problem(spec, parse_shape_text(shape), dtype, gpu)
        generation = cache.generation  # read before the database: see LookupCache.put
        answer = await run_in_threadpool(lookup, request, spec, problem, match)
        body = answer.model_dump_json().encode()
        cache.put(key, body, generation)
    return Response(body, media_type="application/json")


class LookupRequest(StrictBody):
    """One lookup of a batch: the query parameters of ``GET /v1/configs/{operator}``."""

    operator: Name = name_field(64, "softmax")
    # Checked per lookup (check_dims), not by the body's schema: a shape out of range is that
    # lookup's 422 in the answer, and the batch's other lookups are still answered.
    shape: list[int] | str = Field(
        max_length=200,
        description='dimensions, as a list or a string "4096x4096" / "4096,4096"',
        examples=[[4096, 4096]],
    )
    dtype: Name = name_field(32, "float16")
    gpu: Name = name_field(64, "H200")
    match: Match = "nearest"


class LookupBatch(StrictBody):
    """Several lookups, answered in order (at most 1000)."""

    # fail_fast: the first bad lookup's errors, not those of every lookup of the batch.
    lookups: list[LookupRequest] = Field(min_length=1, max_length=MAX_BATCH_LOOKUPS, fail_fast=True)


class LookupResult(BaseModel):
    """The answer to one lookup of a batch: ``result`` (``status`` 200), or ``status`` and
    ``detail``, what ``GET`` would have answered (404 unknown operator, 422 bad input)."""

    status: int
    result: ConfigPublic | None = None
    detail: str | None = None


class LookupBatchResult(BaseModel):
    results: list[LookupResult]


def _item_key(item: LookupRequest) -> Hashable:
    """What one lookup's answer depends on: every field of the item, as sent."""
    shape = item.shape if isinstance(item.shape, str) else tuple(item.shape)
    return (item.operator, shape, item.dtype, item.gpu, item.match)


def _answer_item(batch: Lookups, item: LookupRequest) -> LookupResult:
    """One lookup's result: its answer, or the status and detail ``GET`` would have given."""
    try:
        spec = operator_or_404(item.operator)
        dims = (
            parse_shape_text(item.shape) if isinstance(item.shape, str) else check_dims(item.shape)
        )
        problem = resolve_problem(spec, dims, item.dtype, item.gpu)
        answer = _public(batch, spec, problem, item.match)
    except HTTPException as exc:
        return LookupResult(status=exc.status_code, detail=str(exc.detail))
    except InvalidInput as exc:
        return LookupResult(status=422, detail=str(exc))
    return LookupResult(status=200, result=answer)


def _answer_batch(request: Request, lookups: list[LookupRequest]) -> list[LookupResult]:
    """The results of a batch, in order (blocking: run it in a thread).

    One session for the whole batch, one query per distinct (operator, dtype, GPU model)
    group at most, and a lookup repeated within the batch is answered once: its result object
    is reused (results are read-only from here on), errors included, as they too depend on the
    item alone.
    """
    results: list[LookupResult] = []
    # A session opens no connection until its first query: a batch of bad lookups costs none.
    with request.app.state.session_factory() as session:
        batch = _lookups(request, session, batch=True)
        answered: dict[Hashable, LookupResult] = {}
        for item in lookups:
            key = _item_key(item)
            result = answered.get(key)
            if result is None:
                result = answered[key] = _answer_item(batch, item)
            results.append(result)
    return results


@router.post(
    "/batch",
    response_model=LookupBatchResult,
    responses=error_responses(e422="malformed body or more than 1000 lookups"),
)
async def lookup_batch(body: LookupBatch, request: Request) -> LookupBatchResult:
    """Answer up to 1000 lookups in one request (a client's prefetch), in order. A lookup that
    fails (unknown operator, bad input) gets its own ``status`` and ``detail``; the others are
    answered."""
    results = await run_in_threadpool(_answer_batch, request, body.lookups)
    return LookupBatchResult(results=results)
