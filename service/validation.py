"""Checks shared by every front that looks up or creates jobs (the REST routes, ``kato tune``,
``kato retune``): operator, shape, dtype, GPU model, memory fit, budget, seed.

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
from kato.kernels import InvalidInput, OperatorSpec, get_operator
from kato.service.schemas import MAX_INT32, MIN_BUDGET_SECONDS, JobCreate
from kato.service.settings import Settings


def gpu_catalog() -> ModuleType:
    """The GPU catalog module, ``kato.shared.gpus`` (imported on first use; it needs no GPU)."""
    return importlib.import_module("kato.shared.gpus")


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
    gpu: Any  # kato.shared.gpus.GpuSpec

    @property
    def gpu_model(self) -> str:
        return str(self.gpu.name)


@dataclass(frozen=True)
class UnlistedGpu:
    """A GPU model the catalog does not list (a device's own, measured; never a request's):
    nothing is known of it but its name, so no memory check applies."""

    name: str
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None


def resolve_problem(
    spec: OperatorSpec, shape: Sequence[int], dtype: str, gpu: str, *, device_gpu: bool = False
) -> Problem:
    """Validate shape and dtype against ``spec``, canonicalise the GPU name, check memory.

    ``device_gpu``: ``gpu`` names a device that measures (``kato tune``'s, a stored result's),
    not a model a request asks for: one the catalog does not list is taken as it is
    (:class:`UnlistedGpu`, results of unlisted GPUs are stored under their own names) instead
    of refused, and its memory is not checked.
    """
    checked = list(spec.validate(shape, dtype))
    catalog = gpu_catalog()
    found = catalog.find_gpu(gpu) if device_gpu else catalog.get_gpu(gpu)  # UnknownGpu: 422
    gpu_spec = found if found is not None else UnlistedGpu(gpu)
    check_fits(spec, checked, dtype, gpu_spec)
    return Problem(spec, checked, dtype, gpu_spec)


@dataclass(frozen=True)
class JobRequest:
    """A tuning request from any front (``POST /v1/jobs``, ``kato tune``): the fields of
    :class:`service.schemas.JobCreate`, which :func:`job_fields` takes too. ``budget``: None
    for the service's default."""

    operator: str
    shape: Sequence[int]
    dtype: str
    gpu: str
    budget: int | None = None
    budget_seconds: float | None = None
    strategy: str = "forest"
    seed: int = 0


def check_budget(budget: int | None, budget_seconds: float | None, settings: Settings) -> int:
    """The job's budget of configs (``budget``, else ``KATO_DEFAULT_BUDGET_CONFIGS``), within
    ``KATO_MAX_BUDGET_CONFIGS``, and ``budget_seconds`` from :data:`MIN_BUDGET_SECONDS` to
    ``KATO_MAX_BUDGET_SECONDS``."""
    budget = budget if budget is not None else settings.default_budget_configs
    if budget > settings.max_budget_configs:
        raise InvalidInput(
            f"budget must be at most {settings.max_budget_configs} configs, got {budget}"
        )
    if budget_seconds is not None:
        if not budget_seconds >= MIN_BUDGET_SECONDS:  # NaN too: no comparison holds for it
            raise InvalidInput(
                f"budget_seconds must be at least {MIN_BUDGET_SECONDS:g}, got {budget_seconds:g}"
            )
        if budget_seconds > settings.max_budget_seconds:
            raise InvalidInput(
                f"budget_seconds must be at most {settings.max_budget_seconds:g}, "
                f"got {budget_seconds:g}"
            )
    return budget


def check_seed(seed: int) -> int:
    """The search's seed, from 0 to :data:`MAX_INT32` (what the samplers and the database's
    integer column take)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_INT32:
        raise InvalidInput(f"seed must be from 0 to {MAX_INT32}, got {seed!r}")
    return seed


def job_fields(
    body: JobRequest | JobCreate, settings: Settings, *, device_gpu: bool = False
) -> dict[str, Any]:
    """Validate a job request; return the keyword arguments of ``db.queries.create_job``.

    The one validation of a new job, whichever front it comes from (the REST routes,
    ``kato tune``; ``kato retune`` checks its keys with :func:`resolve_problem` and its budget
    with :func:`check_budget`): operator, shape and dtype by the spec, the GPU model by the
    catalog, the buffers against its memory, the budgets against the settings, the seed's
    range. Raises :class:`~kernels.spec.InvalidInput` saying what to fix. ``device_gpu``:
    ``body.gpu`` is the measuring device's model (``kato tune``; see :func:`resolve_problem`).
    """
    spec = get_operator(body.operator)
    problem = resolve_problem(spec, body.shape, body.dtype, body.gpu, device_gpu=device_gpu)
    budget = check_budget(body.budget, body.budget_seconds, settings)
    seed = check_seed(body.seed)
    return {
        "operator": problem.spec.name,
        "operator_version": problem.spec.version,
        "shape": problem.shape,
        "dtype": problem.dtype,
        "gpu_model": problem.gpu_model,
        "budget_configs": budget,
        "budget_seconds": body.budget_seconds,
        "strategy": body.strategy,
        "seed": seed,
    }


def batch_fields(
    bodies: Sequence[JobRequest | JobCreate], settings: Settings, token_id: str | None = None
) -> list[dict[str, Any]]:
    """:func:`job_fields` of every job of a batch (at most ``KATO_MAX_BATCH``), each with
    ``token_id``; the first invalid job rejects the batch, its index in the message."""
    if len(bodies) > settings.max_batch:
        raise InvalidInput(
            f"a batch holds at most {settings.max_batch} jobs (KATO_MAX_BATCH), got {len(bodies)}"
        )
    fields = []
    for index, body in enumerate(bodies):
        try:
            fields.append({**job_fields(body, settings), "token_id": token_id})
        except InvalidInput as exc:
            raise InvalidInput(f"jobs[{index}]: {exc}") from None
    return fields
