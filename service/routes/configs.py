"""Lookups: the config to use for an operator, shape, dtype and GPU model. Never touches a GPU.

``POST /v1/configs/batch`` answers many lookups in one request (the client's ``prefetch``); it is
a read and stays open like ``GET``. ``match=exact`` serves only a config tuned for exactly the
shape asked for (else the default); ``match=nearest`` (the default) also serves the nearest one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from db import queries
from kernels import InvalidInput, OperatorSpec
from service.deps import SessionDep
from service.schemas import (
    ConfigPublic,
    Shape,
    format_compute_capability,
    parse_shape_text,
    plain,
)
from service.validation import operator_or_404, resolve_problem

router = APIRouter(prefix="/v1/configs", tags=["configs"])

Match = Literal["exact", "nearest"]
#: Most lookups in one ``POST /v1/configs/batch``.
MAX_BATCH_LOOKUPS = 1000


def _applies(spec: OperatorSpec, config: dict[str, Any], shape: list[int], dtype: str) -> bool:
    """Whether a stored config (tuned for some shape) is valid for this shape."""
    try:
        return spec.check(config, shape, dtype) is None
    except (KeyError, TypeError, ValueError, ArithmeticError):  # a config of an older space
        return False


@router.get(
    "/{operator}",
    responses={
        404: {"description": "no such operator"},
        422: {"description": "bad shape, dtype or GPU model, or a shape too large for the GPU"},
    },
)
def get_config(
    operator: str,
    session: SessionDep,
    shape: Annotated[
        str, Query(max_length=200, description='"4096,4096" or "4096x4096"', examples=["4096x4096"])
    ],
    dtype: Annotated[str, Query(max_length=32, examples=["float16"])],
    gpu: Annotated[str, Query(max_length=64, examples=["H200"])],
    match: Annotated[Match, Query(description="exact: no nearest-shape fallback")] = "nearest",
) -> ConfigPublic:
    """The best tuned config for this request (``exact``), else the one tuned for the nearest
    shape on this GPU model (``nearest``; not with ``match=exact``), else the operator's default
    config (``default``)."""
    return answer_lookup(session, operator, parse_shape_text(shape), dtype, gpu, match)


def answer_lookup(
    session: Session, operator: str, shape: list[int], dtype: str, gpu: str, match: Match
) -> ConfigPublic:
    """The config to serve for one lookup (``exact``, ``nearest`` or ``default``).

    Raises:
        HTTPException: 404 for an unknown operator.
        InvalidInput: bad shape, dtype or GPU model, or a shape too large for the GPU.
    """
    spec = operator_or_404(operator)
    problem = resolve_problem(spec, shape, dtype, gpu)
    row, source = queries.lookup_best_config(
        session,
        operator=spec.name,
        operator_version=spec.version,
        shape=problem.shape,
        dtype=problem.dtype,
        gpu_model=problem.gpu_model,
        accept=lambda config: _applies(spec, config, problem.shape, problem.dtype),
    )
    if row is not None and (match == "nearest" or source == "exact"):
        return ConfigPublic.from_row(row, source, problem.shape, problem.gpu_model)
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


class LookupRequest(BaseModel):
    """One lookup of a batch: the query parameters of ``GET /v1/configs/{operator}``."""

    model_config = ConfigDict(extra="forbid")

    operator: str = Field(min_length=1, max_length=64, examples=["softmax"])
    shape: Shape
    dtype: str = Field(min_length=1, max_length=32, examples=["float16"])
    gpu: str = Field(min_length=1, max_length=64, examples=["H200"])
    match: Match = "nearest"


class LookupBatch(BaseModel):
    """Several lookups, answered in order (at most 1000)."""

    model_config = ConfigDict(extra="forbid")

    lookups: list[LookupRequest] = Field(min_length=1, max_length=MAX_BATCH_LOOKUPS)


class LookupResult(BaseModel):
    """The answer to one lookup of a batch: ``result`` (``status`` 200), or ``status`` and
    ``detail``, what ``GET`` would have answered (404 unknown operator, 422 bad input)."""

    status: int
    result: ConfigPublic | None = None
    detail: str | None = None


class LookupBatchResult(BaseModel):
    results: list[LookupResult]


@router.post("/batch", responses={422: {"description": "malformed body or too many lookups"}})
def lookup_batch(body: LookupBatch, session: SessionDep) -> LookupBatchResult:
    """Answer up to 1000 lookups in one request (a client's prefetch), in order. A lookup that
    fails (unknown operator, bad input) gets its own ``status`` and ``detail``; the others are
    answered."""
    results = []
    for item in body.lookups:
        try:
            answer = answer_lookup(
                session, item.operator, list(item.shape), item.dtype, item.gpu, item.match
            )
        except HTTPException as exc:
            results.append(LookupResult(status=exc.status_code, detail=str(exc.detail)))
        except InvalidInput as exc:
            results.append(LookupResult(status=422, detail=str(exc)))
        else:
            results.append(LookupResult(status=200, result=answer))
    return LookupBatchResult(results=results)
