"""Checks shared by the lookup and the job routes: operator, shape, dtype, GPU model, budget.

Everything here raises :class:`kernels.spec.InvalidInput` with a message saying what to fix; the
app turns it into a 422 (routes turn an unknown operator in a path into a 404).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from fastapi import HTTPException, status

from kernels import InvalidInput, OperatorSpec, get_operator
from service.schemas import JobCreate
from service.settings import Settings


def gpu_catalog() -> ModuleType:
    """The GPU catalog module, ``tuner.gpus`` (imported on first use; it needs no GPU)."""
    return importlib.import_module("tuner.gpus")


def operator_or_404(name: str) -> OperatorSpec:
    """The operator named in a URL path; 404 (listing the known ones) if there is none."""
    try:
        return get_operator(name)
    except InvalidInput as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"  # decimal GB, as GPU memory sizes are quoted ("H200 141GB")


def check_fits(spec: OperatorSpec, shape: Sequence[int], dtype: str, gpu: Any) -> None:
    """Reject a problem whose buffers cannot fit the GPU model's memory.

    The bytes are the spec's :meth:`~kernels.spec.OperatorSpec.buffer_bytes` of the validated
    shape, the one owner of what an operator allocates: a product of the dimensions is no size
    (matmul's M x N x K is its work, its buffers are M*K + K*N + M*N elements).
    """
    needed = spec.buffer_bytes(shape, dtype)
    if isinstance(needed, bool) or not isinstance(needed, int) or needed < 0:
        # A spec bug (a float, a numpy integer that may have wrapped): never a user's error.
        raise TypeError(f"{spec.name}.buffer_bytes returned {needed!r}, not a byte count")
    memory = getattr(gpu, "memory_bytes", None)
    if memory and needed > memory:
        raise InvalidInput(
            f"shape {'x'.join(map(str, shape))} in {dtype} needs {_gb(needed)} of device memory; "
            f"{gpu.name} has {_gb(memory)}"
        )


@dataclass(frozen=True)
class Problem:
    """A validated request: the operator's spec, the shape, dtype and the canonical GPU model."""

    spec: OperatorSpec
    shape: list[int]
    dtype: str
    gpu: Any  # tuner.gpus.GpuSpec

    @property
    def gpu_model(self) -> str:
        return str(self.gpu.name)


def resolve_problem(spec: OperatorSpec, shape: Sequence[int], dtype: str, gpu: str) -> Problem:
    """Validate shape and dtype against ``spec``, canonicalise the GPU name, check memory."""
    checked = list(spec.validate(shape, dtype))
    gpu_spec = gpu_catalog().get_gpu(gpu)  # UnknownGpu is an InvalidInput
    check_fits(spec, checked, dtype, gpu_spec)
    return Problem(spec, checked, dtype, gpu_spec)


def job_fields(body: JobCreate, settings: Settings) -> dict[str, Any]:
    """Validate a job request; return the keyword arguments of ``db.queries.create_job``."""
    problem = resolve_problem(get_operator(body.operator), body.shape, body.dtype, body.gpu)
    budget = body.budget if body.budget is not None else settings.default_budget_configs
    if budget > settings.max_budget_configs:
        raise InvalidInput(
            f"budget must be at most {settings.max_budget_configs} configs, got {budget}"
        )
    if body.budget_seconds is not None and body.budget_seconds > settings.max_budget_seconds:
        raise InvalidInput(
            f"budget_seconds must be at most {settings.max_budget_seconds:g}, "
            f"got {body.budget_seconds:g}"
        )
    return {
        "operator": problem.spec.name,
        "operator_version": problem.spec.version,
        "shape": problem.shape,
        "dtype": problem.dtype,
        "gpu_model": problem.gpu_model,
        "budget_configs": budget,
        "budget_seconds": body.budget_seconds,
        "strategy": body.strategy,
        "seed": body.seed,
    }
