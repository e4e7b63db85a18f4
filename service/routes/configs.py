"""Lookups: the config to use for an operator, shape, dtype and GPU model. Never touches a GPU."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from db import queries
from kernels import OperatorSpec
from service.deps import SessionDep
from service.schemas import ConfigPublic, format_compute_capability, parse_shape_text, plain
from service.validation import operator_or_404, resolve_problem

router = APIRouter(prefix="/v1/configs", tags=["configs"])


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
) -> ConfigPublic:
    """The best tuned config for this request (``exact``), else the one tuned for the nearest
    shape on this GPU model (``nearest``), else the operator's default config (``default``)."""
    spec = operator_or_404(operator)
    problem = resolve_problem(spec, parse_shape_text(shape), dtype, gpu)
    row, source = queries.lookup_best_config(
        session,
        operator=spec.name,
        operator_version=spec.version,
        shape=problem.shape,
        dtype=problem.dtype,
        gpu_model=problem.gpu_model,
        accept=lambda config: _applies(spec, config, problem.shape, problem.dtype),
    )
    if row is not None:
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
