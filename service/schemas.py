"""Request and response bodies (pydantic v2): ``XCreate`` comes in, ``XPublic`` goes out.

Ranges are checked here so that no input reaches the database or a spec out of range: shape
entries are 1 .. 2**31-1, integers fit a 32-bit column, floats are finite. Limits that depend on
the settings (largest budget, largest batch) are checked by the routes.

Types are strict, as the importer's are: request bodies are validated in pydantic's strict mode
(:class:`StrictBody`: an integer is a JSON integer, not ``true``, ``4096.0`` or ``"4096"``);
where text is parsed into numbers (shape strings, integer query parameters) only ASCII digits
count; names (operator, dtype, GPU) are printable text (:data:`Name`). Text that is not valid
Unicode never gets this far (:mod:`service.strict`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from annotated_types import Interval
from kato.db.models import BestConfig, Job, Trial, Worker, utcnow
from kato.db.queries import StoredConfig
from kato.kernels.spec import InvalidInput
from kato.service.strict import parse_shape
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from kato.shared.status import JOB_STATUSES, TERMINAL_STATUSES

MAX_DIM = 2**31 - 1
MAX_RANK = 8
MAX_INT32 = 2**31 - 1
# ASCII only: str patterns' \d and \s also match other scripts' digits and spaces, which int()
# then reads ("\u0664\u0660\u0669\u0666" is 4096).
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")
#: The shortest ``budget_seconds``: the worker checks the clock between trials, and one trial
#: (compile, verify, time) takes about a second, so a shorter budget could not be honoured.
MIN_BUDGET_SECONDS = 1.0
#: The OpenAPI description of :data:`Name`'s check (control characters are the part a JSON
#: Schema pattern can say; the check refuses every character ``str.isprintable`` does).
NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]+$"

#: tuner.search.STRATEGIES (a test holds them equal); the first, "forest", is the default.
Strategy = Literal["forest", "tpe", "hybrid", "random", "grid"]
JobStatus = Literal[JOB_STATUSES]  # type: ignore[valid-type]
#: What a 503 says is wrong with the database (service.faults).
FaultKind = Literal["unreachable", "busy", "pool_exhausted", "read_only", "disk_full"]


def parse_shape_text(text: str) -> list[int]:
    """``"4096x4096"`` or ``"4096,4096"`` -> ``[4096, 4096]`` (dimensions checked 1 .. 2**31-1).

    Raises:
        InvalidInput: (a ``ValueError``) naming what is wrong.
    """
    return check_dims(parse_shape(text))


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


def printable(value: str) -> str:
    """``value`` if every character of it is printable (``str.isprintable``: no control,
    format, surrogate, private-use or unassigned character, no separator but the ASCII space).

    Raises:
        ValueError: naming the first character that is not.
    """
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(
            f"must be printable text, without control or invisible characters; "
            f"got U+{ord(bad):04X} in {value[:100]!r}"
        )
    return value


def ascii_integer(value: Any) -> Any:
    """A query parameter's text as an ``int`` when it is ASCII digits (an optional sign); any
    other text is refused (pydantic alone also reads ``" 10"``, ``"1_0"`` and ``"10.0"``)."""
    if isinstance(value, str):
        if not _INTEGER.fullmatch(value):
            raise ValueError(f"must be an integer in ASCII digits, got {value[:40]!r}")
        return int(value)
    return value


def query_flag(value: Any) -> Any:
    """A query parameter's text as a ``bool``: ``true`` or ``false`` (any case), nothing else
    (pydantic alone also reads ``yes``, ``on``, ``1``, ``t``...)."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"must be true or false, got {value[:40]!r}")
        return value.lower() == "true"
    return value


#: An operator, dtype or GPU model name: printable text (``"H200\u0000"`` is not H200).
Name = Annotated[str, AfterValidator(printable)]
#: The ``limit`` query parameter of a listing: 1 .. 1000, in ASCII digits (the range before
#: the text check, so that the OpenAPI schema shows it as the integer's minimum and maximum).
ListLimit = Annotated[int, Interval(ge=1, le=1000), BeforeValidator(ascii_integer)]
#: A boolean query parameter: ``true`` or ``false``.
QueryFlag = Annotated[bool, BeforeValidator(query_flag)]


def name_field(max_length: int, example: str, **kwargs: Any) -> Any:
    """``Field`` of a :data:`Name` in a body: 1 .. ``max_length`` characters, documented with
    :data:`NAME_PATTERN`."""
    return Field(
        min_length=1,
        max_length=max_length,
        examples=[example],
        json_schema_extra={"pattern": NAME_PATTERN},
        **kwargs,
    )


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


class StrictBody(BaseModel):
    """A request body: no unknown fields, strict types (``true`` is not 1, ``"5"`` not 5, an
    integer field takes no float; a float field takes an integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --- jobs ------------------------------------------------------------------------------------


class JobCreate(StrictBody):
    """A tuning request: measure up to ``budget`` configs of an operator on a GPU model."""

    operator: Name = name_field(64, "softmax")
    shape: Shape
    dtype: Name = name_field(32, "float16")
    gpu: Name = name_field(64, "H200")
    budget: int | None = Field(
        default=None,
        ge=1,
        le=MAX_INT32,
        description="configs to measure (default and maximum: the service's settings)",
    )
    # The ranges of budget_seconds and seed are checked by service.validation.job_fields, the
    # one check of every front (kato tune too), with its message; the schema only shows them.
    budget_seconds: (
        Annotated[float, Field(json_schema_extra={"minimum": MIN_BUDGET_SECONDS})] | None
    ) = Field(
        default=None,
        allow_inf_nan=False,
        description="wall-clock limit of the job in seconds, at least 1, from its first start "
        "(shared by every worker on it; a resumed job gets what is left; the clock is checked "
        "between trials)",
    )
    strategy: Strategy = "forest"
    seed: int = Field(default=0, json_schema_extra={"minimum": 0, "maximum": MAX_INT32})


class JobBatchCreate(StrictBody):
    """Several tuning requests, validated all or none (at most the service's ``max_batch``)."""

    # fail_fast: the first bad job's errors, not those of every job of a long batch.
    jobs: list[JobCreate] = Field(min_length=1, fail_fast=True)


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
    elapsed_s: float | None = Field(
        default=None,
        description="seconds since the job started (to its end, once finished); null: queued",
    )
    eta_s: float | None = Field(
        default=None,
        description="estimated seconds left of a running job: its mean time per config so far "
        "times the configs left of its budget, capped by what is left of budget_seconds; null "
        "before its first config, or once it ended",
    )
    batch_id: str | None = Field(
        default=None, description="the batch it was submitted in (GET /v1/jobs/batch/{id})"
    )
    gpu_busy_s: float | None = Field(
        default=None,
        description="seconds the GPU was held for the job's measurements (verify and timed "
        "launches, every worker's runs added up); null until a run of it ended",
    )
    gpu_busy_fraction: float | None = Field(
        default=None,
        description="gpu_busy_s over the job's wall time (started_at to finished_at); null "
        "until it ended",
    )

    @classmethod
    def from_job(cls, job: Job, note: str | None = None, now: datetime | None = None) -> JobPublic:
        elapsed, eta = progress_estimate(job, now)
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
            elapsed_s=elapsed,
            eta_s=eta,
            batch_id=job.batch_id,
            gpu_busy_s=job.gpu_busy_s,
            gpu_busy_fraction=job.gpu_busy_fraction,
        )


def _aware(t: datetime) -> datetime:
    """Timestamps of a row not read back yet may be naive; every stored one is UTC."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def progress_estimate(job: Job, now: datetime | None = None) -> tuple[float | None, float | None]:
    """(seconds since ``job`` started, estimated seconds left) as :class:`JobPublic` reports
    them. The estimate assumes the configs left cost what the measured ones did on average
    (compiles and search included), which the first configs overstate when nvcc warms up."""
    if job.started_at is None:
        return None, None
    start, end = (_aware(t) for t in (job.started_at, job.finished_at or now or utcnow()))
    elapsed = max((end - start).total_seconds(), 0.0)
    if job.status != "running" or job.trials_done <= 0:
        return elapsed, None
    left = max(job.budget_configs - job.trials_done, 0) * elapsed / job.trials_done
    if job.budget_seconds is not None:
        left = min(left, max(job.budget_seconds - elapsed, 0.0))
    return elapsed, left


class BatchKey(BaseModel):
    """One job of a batch, as the batch's progress shows it."""

    job_id: str
    operator: str
    shape: list[int]
    dtype: str
    status: JobStatus
    trials_done: int
    budget: int
    best_time_ms: float | None
    gpu_busy_fraction: float | None


class BatchProgress(BaseModel):
    """A batch's progress as one view: trials done of its total budget, the jobs in each
    status, the best so far per key, its GPU busy time, and the time it has taken and an
    estimate of what is left."""

    batch_id: str
    jobs: int
    status_counts: dict[str, int] = Field(description="jobs per status")
    trials_done: int
    budget: int = Field(description="the batch's total budget: the sum of its jobs' budgets")
    elapsed_s: float | None = Field(
        description="seconds from its first job's start to now (to its last job's end once "
        "every job ended); null: none started"
    )
    eta_s: float | None = Field(
        description="estimated seconds left: the batch's mean time per trial so far times the "
        "trials left of its budget (ended jobs' unused budget left out); null before its "
        "first trial or once every job ended"
    )
    gpu_busy_s: float | None = Field(
        description="the GPU busy time of its ended jobs, added up; null: none ended yet"
    )
    gpu_busy_fraction: float | None = Field(
        description="gpu_busy_s over elapsed_s once every job ended (one worker's GPU: above "
        "1 when several GPUs tuned it); null before"
    )
    keys: list[BatchKey]

    @classmethod
    def from_jobs(
        cls, batch_id: str, jobs: list[Job], now: datetime | None = None
    ) -> BatchProgress:
        now = now or utcnow()
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.status] = counts.get(job.status, 0) + 1
        ended = [j for j in jobs if j.status in TERMINAL_STATUSES]
        started = [_aware(j.started_at) for j in jobs if j.started_at is not None]
        all_ended = len(ended) == len(jobs)
        elapsed = eta = None
        done = sum(j.trials_done for j in jobs)
        # What is left: the unused budget of running and queued jobs (an ended job's is not).
        left = sum(
            max(j.budget_configs - j.trials_done, 0)
            for j in jobs
            if j.status not in TERMINAL_STATUSES
        )
        if started:
            last = max(_aware(j.finished_at or now) for j in jobs)
            end = last if all_ended else _aware(now)
            elapsed = max((end - min(started)).total_seconds(), 0.0)
            if not all_ended and done > 0:
                eta = left * elapsed / done
        busy = [j.gpu_busy_s for j in ended if j.gpu_busy_s is not None]
        busy_s = sum(busy) if busy else None
        fraction = busy_s / elapsed if all_ended and busy_s is not None and elapsed else None
        return cls(
            batch_id=batch_id,
            jobs=len(jobs),
            status_counts=counts,
            trials_done=done,
            budget=sum(j.budget_configs for j in jobs),
            elapsed_s=elapsed,
            eta_s=eta,
            gpu_busy_s=busy_s,
            gpu_busy_fraction=fraction,
            keys=[
                BatchKey(
                    job_id=j.id,
                    operator=j.operator,
                    shape=j.shape,
                    dtype=j.dtype,
                    status=j.status,  # type: ignore[arg-type]
                    trials_done=j.trials_done,
                    budget=j.budget_configs,
                    best_time_ms=j.best_time_ms,
                    gpu_busy_fraction=j.gpu_busy_fraction,
                )  # fmt: skip
                for j in jobs
            ],
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
    #: The worker measuring the config while ``status`` is ``running`` (a reservation: no
    #: result yet), else the one that measured it; None for an imported trial.
    reserved_by: str | None = None

    @classmethod
    def from_trial(cls, trial: Trial) -> TrialPublic:
        return cls.model_validate(trial)


# --- lookups ---------------------------------------------------------------------------------


class ConfigPublic(BaseModel):
    """The config to use for a request, and where it comes from.

    ``exact``: tuned for this shape; ``nearest``: tuned for ``tuned_shape``, the closest shape
    tuned on this GPU model, served because it beat the default config there by more than
    ``KATO_NEAREST_MIN_GAIN``; ``default``: nothing tuned (or no neighbour known to beat the
    default), the operator's default config.

    Every figure is measured on ``tuned_shape`` (on a ``nearest`` answer, the neighbour's
    figures, not this shape's; on a ``default`` answer there are none): ``time_ms`` the served
    config, ``default_ms`` the operator's default config, ``framework_ms`` PyTorch's own op on
    the same inputs (``framework`` names it and its version), ``speedup`` = ``framework_ms /
    time_ms`` (above 1: Kato's config is faster), ``compiled_ms`` the same op compiled by
    ``torch.compile`` (``compiled`` names it: the bar inside a compiled graph),
    ``compiled_speedup`` = ``compiled_ms / time_ms``; each null where not measured.
    """

    operator: str
    operator_version: str
    shape: list[int]
    dtype: str
    gpu: str
    config: dict[str, Any]
    source: Literal["exact", "nearest", "default"]
    tuned_shape: list[int] | None = Field(
        default=None,
        description="the shape the served config was tuned for, and on which every figure "
        "of this answer was measured (on a nearest answer: the neighbour's, not this shape's)",
    )
    time_ms: float | None = Field(default=None, description="the served config on tuned_shape (ms)")
    compute_capability: str | None = None
    cuda_version: str | None = None
    default_ms: float | None = Field(
        default=None, description="the default config's time on tuned_shape (ms)"
    )
    framework_ms: float | None = Field(
        default=None, description="PyTorch's own op on tuned_shape, same inputs (ms)"
    )
    framework: str | None = Field(
        default=None, description='what framework_ms timed, e.g. "torch 2.13.0+cu130"'
    )
    speedup: float | None = Field(
        default=None, description="framework_ms / time_ms: above 1, Kato's config is faster"
    )
    compiled_ms: float | None = Field(
        default=None,
        description="PyTorch's op compiled by torch.compile (Inductor) on tuned_shape, same "
        "inputs (ms)",
    )
    compiled: str | None = Field(
        default=None, description='what compiled_ms timed, e.g. "torch.compile 2.14.1 inductor"'
    )
    compiled_speedup: float | None = Field(
        default=None,
        description="compiled_ms / time_ms: above 1, Kato's config is faster than the compiled op",
    )

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
            default_ms=row.default_ms,
            framework_ms=row.framework_ms,
            framework=row.framework if row.framework_ms is not None else None,
            speedup=_ratio(row.framework_ms, row.time_ms),
            compiled_ms=row.compiled_ms,
            compiled=row.compiled if row.compiled_ms is not None else None,
            compiled_speedup=_ratio(row.compiled_ms, row.time_ms),
        )


def _ratio(baseline_ms: float | None, time_ms: float | None) -> float | None:
    """``baseline_ms / time_ms`` where both are measured, else None."""
    return baseline_ms / time_ms if baseline_ms is not None and time_ms else None


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
    #: A user operator's ``[backward]`` section (docs/user_kernels.md, "Gradients"), if any.
    backward: dict[str, Any] | None = None


def format_compute_capability(value: Any) -> Any:
    """``(9, 0)`` -> ``"9.0"``; strings and ``None`` pass through."""
    if isinstance(value, list | tuple):
        return ".".join(str(v) for v in value)
    return value


class GpuPublic(BaseModel):
    """A GPU model of the catalog (``kato.shared.gpus``); further catalog fields pass through."""

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


class UnavailablePublic(BaseModel):
    """A 503: the database cannot serve the request now; the request itself is fine and may be
    sent again after ``Retry-After`` seconds. ``fault`` says what is wrong."""

    detail: str
    fault: FaultKind
    retryable: bool


class HealthPublic(BaseModel):
    """``/healthz``: ``status`` ``ok``; ``degraded`` with ``db`` ``read-only`` (reads are
    answered, writes get 503); ``error`` (a 503) with ``db`` naming the fault, e.g.
    ``unreachable (OperationalError)``."""

    status: Literal["ok", "degraded", "error"]
    db: str
    detail: str | None = None


def error_responses(**descriptions: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for a route: ``error_responses(e404="no such job")`` declares a
    404 whose body is :class:`ErrorPublic`, so the OpenAPI schema documents every status the
    route answers with (the schemathesis test checks that it does)."""
    return {
        int(key.removeprefix("e")): {"model": ErrorPublic, "description": text}
        for key, text in descriptions.items()
    }
