"""Request and response bodies (pydantic v2): ``XCreate`` comes in, ``XPublic`` goes out.

Ranges are checked here so that no input reaches the database or a spec out of range: shape
entries are 1 .. 2**31-1, integers fit a 32-bit column, floats are finite. Limits that depend on
the settings (largest budget, largest batch) are checked by the routes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from db.models import BestConfig, Job, Trial, Worker
from db.queries import StoredConfig
from kernels.spec import InvalidInput

MAX_DIM = 2**31 - 1
MAX_RANK = 8
MAX_INT32 = 2**31 - 1
_SHAPE_SEPARATOR = re.compile(r"\s*[x,X]\s*")
_INTEGER = re.compile(r"[+-]?\d{1,19}")

#: tuner.search.STRATEGIES (a test holds them equal); the first, "forest", is the default.
Strategy = Literal["forest", "tpe", "hybrid", "random", "grid"]
JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]


def parse_shape_text(text: str) -> list[int]:
    """``"4096x4096"`` or ``"4096,4096"`` -> ``[4096, 4096]`` (dimensions checked 1 .. 2**31-1).

    Raises:
        InvalidInput: (a ``ValueError``) naming what is wrong.
    """
    parts = _SHAPE_SEPARATOR.split(text.strip()) if text.strip() else []
    if not parts or not all(_INTEGER.fullmatch(p) for p in parts):
        raise InvalidInput(
            f"shape must be integers separated by 'x' or ',' (e.g. 4096x4096), got {text[:100]!r}"
        )
    return check_dims([int(p) for p in parts])


def check_dims(dims: Sequence[int]) -> list[int]:
    """``dims`` as a list, checked: 1 to :data:`MAX_RANK` dimensions, each 1 .. 2**31-1.

    Raises:
        InvalidInput: (a ``ValueError``) naming what is wrong.
    """
    if not dims:
        raise InvalidInput("shape must have at least one dimension")
    if len(dims) > MAX_RANK:
        raise InvalidInput(f"shape has {len(dims)} dimensions; at most {MAX_RANK} are supported")
    bad = [d for d in dims if not 1 <= d <= MAX_DIM]
    if bad:
        raise InvalidInput(f"every dimension must be between 1 and {MAX_DIM}, got {bad[0]}")
    return list(dims)


def _shape_from_text(value: Any) -> Any:
    return parse_shape_text(value) if isinstance(value, str) else value


def plain(value: Any) -> Any:
    """numpy scalars (as a spec may return them) -> Python scalars, so they serialise."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)
    return item() if callable(item) and not isinstance(value, str | bytes) else value


Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
Shape = Annotated[
    list[Dim],
    BeforeValidator(_shape_from_text),
    Field(
        min_length=1,
        max_length=MAX_RANK,
        description='dimensions, as a list or a string "4096x4096" / "4096,4096"',
        examples=[[4096, 4096]],
    ),
]


# --- jobs ------------------------------------------------------------------------------------


class JobCreate(BaseModel):
    """A tuning request: measure up to ``budget`` configs of an operator on a GPU model."""

    model_config = ConfigDict(extra="forbid")

    operator: str = Field(min_length=1, max_length=64, examples=["softmax"])
    shape: Shape
    dtype: str = Field(min_length=1, max_length=32, examples=["float16"])
    gpu: str = Field(min_length=1, max_length=64, examples=["H200"])
    budget: int | None = Field(
        default=None,
        ge=1,
        le=MAX_INT32,
        description="configs to measure (default and maximum: the service's settings)",
    )
    budget_seconds: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="wall-clock limit of the job, from its first start (shared by every worker "
        "on it; a resumed job gets what is left)",
    )
    strategy: Strategy = "forest"
    seed: int = Field(default=0, ge=0, le=MAX_INT32)


class JobBatchCreate(BaseModel):
    """Several tuning requests, validated all or none (at most the service's ``max_batch``)."""

    model_config = ConfigDict(extra="forbid")

    jobs: list[JobCreate] = Field(min_length=1)


class JobPublic(BaseModel):
    id: str
    status: JobStatus
    operator: str
    operator_version: str
    shape: list[int]
    dtype: str
    gpu: str
    budget: int
    budget_seconds: float | None
    strategy: str
    seed: int
    trials_done: int
    best_time_ms: float | None
    best_config: dict[str, Any] | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested: bool
    note: str | None = None

    @classmethod
    def from_job(cls, job: Job, note: str | None = None) -> JobPublic:
        return cls(
            id=job.id,
            status=job.status,  # type: ignore[arg-type]
            operator=job.operator,
            operator_version=job.operator_version,
            shape=job.shape,
            dtype=job.dtype,
            gpu=job.gpu_model,
            budget=job.budget_configs,
            budget_seconds=job.budget_seconds,
            strategy=job.strategy,
            seed=job.seed,
            trials_done=job.trials_done,
            best_time_ms=job.best_time_ms,
            best_config=job.best_config,
            error=job.error,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            cancel_requested=job.cancel_requested,
            note=note,
        )


class TrialPublic(BaseModel):
    """One measured config of a job, failures included."""

    model_config = ConfigDict(from_attributes=True)

    number: int
    config: dict[str, Any]
    config_key: str
    status: str
    time_ms: float | None
    times_ms: list[float]
    compile_time_s: float | None
    registers: int | None
    shared_static_bytes: int | None
    shared_dynamic_bytes: int | None
    local_bytes: int | None
    blocks_per_sm: int | None
    occupancy: float | None
    error: str | None
    created_at: datetime

    @classmethod
    def from_trial(cls, trial: Trial) -> TrialPublic:
        return cls.model_validate(trial)


# --- lookups ---------------------------------------------------------------------------------


class ConfigPublic(BaseModel):
    """The config to use for a request, and where it comes from.

    ``exact``: tuned for this shape; ``nearest``: tuned for ``tuned_shape``, the closest shape
    tuned on this GPU model; ``default``: nothing tuned, the operator's default config.
    ``time_ms`` is the measured time on ``tuned_shape``.
    """

    operator: str
    operator_version: str
    shape: list[int]
    dtype: str
    gpu: str
    config: dict[str, Any]
    source: Literal["exact", "nearest", "default"]
    tuned_shape: list[int] | None = None
    time_ms: float | None = None
    compute_capability: str | None = None
    cuda_version: str | None = None

    @classmethod
    def from_row(
        cls, row: BestConfig | StoredConfig, source: str, shape: list[int], gpu: str
    ) -> ConfigPublic:
        """The answer serving ``row`` (a stored row, or its loaded copy) for ``shape``."""
        return cls(
            operator=row.operator,
            operator_version=row.operator_version,
            shape=shape,
            dtype=row.dtype,
            gpu=gpu,
            config=dict(row.config),
            source=source,  # type: ignore[arg-type]
            tuned_shape=list(row.shape),
            time_ms=row.time_ms,
            compute_capability=row.compute_capability,
            cuda_version=row.cuda_version,
        )


class OperatorPublic(BaseModel):
    """An operator Kato can tune (``OperatorSpec.describe()``)."""

    name: str
    description: str
    version: str
    dtypes: list[str]
    rank: int
    shape_names: list[str]
    params: dict[str, list[Any]]
    space_size: int


def format_compute_capability(value: Any) -> Any:
    """``(9, 0)`` -> ``"9.0"``; strings and ``None`` pass through."""
    if isinstance(value, list | tuple):
        return ".".join(str(v) for v in value)
    return value


class GpuPublic(BaseModel):
    """A GPU model of the catalog (``tuner.gpus``); further catalog fields pass through."""

    model_config = ConfigDict(extra="allow")

    name: str
    full_name: str | None = None
    aliases: list[str] = []
    compute_capability: Annotated[str | None, BeforeValidator(format_compute_capability)] = None
    sm_count: int | None = None
    memory_bytes: int | None = None
    memory_bandwidth_gbs: float | None = None
    l2_bytes: int | None = None


# --- workers ---------------------------------------------------------------------------------


class WorkerPublic(BaseModel):
    """A worker process as it last reported itself. ``live``: its heartbeat is younger than the
    service's lease and it did not stop; ``status`` is what it last said (``idle``, ``busy``,
    ``stopped``)."""

    id: str
    hostname: str
    pid: int
    gpu_models: list[str]
    devices: list[dict[str, Any]]
    backend: str
    status: str
    live: bool
    current_job_id: str | None
    started_at: datetime
    heartbeat_at: datetime

    @classmethod
    def from_worker(cls, worker: Worker, live: bool) -> WorkerPublic:
        return cls(
            id=worker.id,
            hostname=worker.hostname,
            pid=worker.pid,
            gpu_models=list(worker.gpu_models or []),
            devices=list(worker.devices or []),
            backend=worker.backend,
            status=worker.status,
            live=live,
            current_job_id=worker.current_job_id,
            started_at=worker.started_at,
            heartbeat_at=worker.heartbeat_at,
        )


# --- errors ----------------------------------------------------------------------------------


class ErrorPublic(BaseModel):
    """Every 4xx body: ``detail`` says what to fix; for malformed input it lists the field
    errors (``loc``, ``msg``, ``type``, ...), as FastAPI does."""

    detail: str | list[dict[str, Any]]


def error_responses(**descriptions: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for a route: ``error_responses(e404="no such job")`` declares a
    404 whose body is :class:`ErrorPublic`, so the OpenAPI schema documents every status the
    route answers with (the schemathesis test checks that it does)."""
    return {
        int(key.removeprefix("e")): {"model": ErrorPublic, "description": text}
        for key, text in descriptions.items()
    }
