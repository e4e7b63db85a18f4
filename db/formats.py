"""Pydantic models of the result files Kato reads: T4 JSON, Kernel Tuner cache files, and the
Kato block that ``kato export`` adds to both (:mod:`db.export` writes them, :mod:`db.importer`
reads them through these models).

Types are strict: an integer is a JSON integer (not ``true``, not ``1.0``, not ``"1"``) that
fits its 32-bit column, a number is finite, a string fits its column and holds no control
characters, a date is ISO 8601 from 2000 to tomorrow, a job id is 32 lowercase hex digits. What
the models cannot know (the operator's space, rank and dtypes; whether a best config is one of
the file's measurements) :mod:`db.importer` checks after them. Fields a model does not name
are ignored (a later Kato may add some); the ones it names are checked.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator
from pydantic import ValidationError as ValidationError  # re-exported for the importer

from db.models import JOB_STATUSES, utcnow

#: The Kato block's format this code writes and reads.
KATO_FORMAT = 1
#: Bounds of what is stored: the Integer columns are 32-bit on PostgreSQL.
MAX_INT32 = 2**31 - 1
MAX_RANK = 8
MAX_CONFIG_KEY = 1024
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)

#: Kato's trial statuses -> T4 ``invalidity`` (a ``crashed`` trial is a runtime failure to T4).
T4_INVALIDITY = {
    "ok": "correct",
    "compile_error": "compile",
    "launch_error": "runtime",
    "verify_error": "correctness",
    "timeout": "timeout",
    "crashed": "runtime",
    "invalid": "constraints",
}
#: Kernel Tuner's failure markers (an entry's ``time``) -> the Kato status they stand for.
KT_MARKERS = {
    "CompilationFailedConfig": "compile_error",
    "RuntimeFailedConfig": "launch_error",
    "InvalidConfig": "invalid",
    "ErrorConfig": "launch_error",
}
#: Per-trial resource fields (with their T4 unit).
RESOURCES = {
    "registers": "",
    "shared_static_bytes": "B",
    "shared_dynamic_bytes": "B",
    "local_bytes": "B",
    "blocks_per_sm": "",
    "occupancy": "",
}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def show(value: Any) -> str:
    """``repr(value)``, cut to a length a message can hold."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


# --- value types -----------------------------------------------------------------------------


def _printable(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters")
    return value


def _job_id(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{32}", value):
        raise ValueError("must be a Kato job id (32 lowercase hex digits)")
    return value


def _timestamp(value: Any) -> datetime:
    """An ISO 8601 string from 2000 to tomorrow, as an aware UTC datetime (UTC where no zone)."""
    if not isinstance(value, str):
        raise ValueError("must be an ISO 8601 date as a string")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("must be an ISO 8601 date") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    try:
        parsed = parsed.astimezone(UTC)
        in_range = EARLIEST <= parsed <= utcnow() + timedelta(days=1)
    except OverflowError:  # beyond year 9999 in UTC
        in_range = False
    if not in_range:
        raise ValueError("must lie between 2000 and tomorrow")
    return parsed


def _param_value(value: Any) -> int | float | str:
    """A parameter's value: a 64-bit integer, a finite number or a short string."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"a parameter value is a number or a string, not {type(value).__name__}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ValueError("is out of the 64-bit range")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"is {value!r}, not a finite number")
    if isinstance(value, str) and (len(value) > 64 or _CONTROL.search(value)):
        raise ValueError("a string value has at most 64 printable characters")
    return value


def _config_length(config: dict[str, Any]) -> dict[str, Any]:
    if len(",".join(map(str, config.values()))) > MAX_CONFIG_KEY:
        raise ValueError(f"a configuration is at most {MAX_CONFIG_KEY} characters as a key")
    return config


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


Count = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]
PositiveCount = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]
Milliseconds = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)]
Text = Annotated[str, Field(strict=True)]
Name = Annotated[str, Field(strict=True, min_length=1, max_length=64), AfterValidator(_printable)]
Dtype = Annotated[str, Field(strict=True, min_length=1, max_length=32), AfterValidator(_printable)]
Strategy = Annotated[str, Field(strict=True, max_length=16), AfterValidator(_printable)]
#: Operator versions are 12 hex digits; any short word of letters, digits, ``._-`` is kept.
Version = Annotated[str, Field(strict=True, pattern=r"^[0-9A-Za-z][0-9A-Za-z._-]{0,63}$")]
ComputeCapability = Annotated[
    str, Field(strict=True, pattern=r"^(unknown|[0-9]{1,2}\.[0-9]{1,2})$", max_length=16)
]
CudaVersion = Annotated[str, Field(strict=True, pattern=r"^[0-9A-Za-z][0-9A-Za-z._+-]{0,31}$")]
JobId = Annotated[str, PlainValidator(_job_id)]
Timestamp = Annotated[datetime, PlainValidator(_timestamp)]
ParamValue = Annotated[int | float | str, PlainValidator(_param_value)]
Config = Annotated[dict[Name, ParamValue], AfterValidator(_config_length)]
Dimension = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]
Shape = Annotated[list[Dimension], Field(min_length=1, max_length=MAX_RANK)]
TrialStatus = Literal[tuple(T4_INVALIDITY)]  # type: ignore[valid-type]
JobStatus = Literal[tuple(JOB_STATUSES)]  # type: ignore[valid-type]
Invalidity = Literal[tuple(dict.fromkeys(T4_INVALIDITY.values()))]  # type: ignore[valid-type]
TimeUnit = Annotated[
    Literal["milliseconds", "ms", "seconds", "s", "microseconds"], BeforeValidator(_lower)
]
TIME_UNITS = {"milliseconds": 1.0, "ms": 1.0, "seconds": 1e3, "s": 1e3, "microseconds": 1e-3}


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- the Kato block --------------------------------------------------------------------------


class JobRecord(_Record):
    """One entry of ``kato.jobs``."""

    id: JobId
    status: JobStatus | None = None
    budget_configs: PositiveCount | None = None
    budget_seconds: Positive | None = None
    strategy: Strategy | None = None
    seed: Count | None = None
    trials_done: Count | None = None  # recounted from the trials
    best_time_ms: Positive | None = None
    best_config: Config | None = None
    error: Text | None = None
    created_at: Timestamp | None = None
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None


class BestRecord(_Record):
    """One entry of ``kato.best``: a winner for one compute capability and CUDA version."""

    config: Config
    time_ms: Positive
    compute_capability: ComputeCapability | None = None
    cuda_version: CudaVersion | None = None
    job_id: JobId | None = None
    updated_at: Timestamp | None = None
    #: The figures stored beside the winner (migration 0006), absent from older files: the
    #: default config's time on the shape, PyTorch's op on the same inputs and its name.
    default_ms: Positive | None = None
    framework_ms: Positive | None = None
    framework: Name | None = None


class KatoBlock(_Record):
    """What ``kato export`` adds to a file (KT: the top-level ``kato``; T4: ``metadata.kato``)."""

    format: Annotated[int, Field(strict=True, ge=1, le=KATO_FORMAT)] | None = None
    operator: Name | None = None
    operator_version: Version | None = None
    shape: Shape | None = None
    dtype: Dtype | None = None
    gpu_model: Name | None = None
    params: list[Name] | None = None
    jobs: list[JobRecord] | None = None
    best: list[BestRecord] = []


# --- Kernel Tuner cache files ----------------------------------------------------------------


def _kt_time(value: Any) -> float | str:
    if isinstance(value, str):
        if value not in KT_MARKERS:
            raise ValueError(
                f"is neither a time nor one of Kernel Tuner's markers {list(KT_MARKERS)}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a positive number of milliseconds or a failure marker")
    if not 0 < value < float("inf"):
        raise ValueError("time must be a positive number")
    return float(value)


class KTEntry(_Record):
    """One entry of a Kernel Tuner cache's ``cache`` (its parameters are fields of their own,
    read by the importer by ``tune_params_keys``)."""

    time: Annotated[float | str, PlainValidator(_kt_time)]
    times: list[Milliseconds] | None = None
    compile_time: Milliseconds | None = None
    registers: Count | None = None
    shared_static_bytes: Count | None = None
    shared_dynamic_bytes: Count | None = None
    local_bytes: Count | None = None
    blocks_per_sm: Count | None = None
    occupancy: Fraction | None = None
    timestamp: Timestamp | None = None
    error: Text | None = None
    kato_job: JobId | None = None
    kato_number: Count | None = None
    kato_status: TrialStatus | None = None


class KTDocument(_Record):
    """A Kernel Tuner cache file (what Kernel Tuner writes, and ``kato export --format kt``).

    ``cache`` is read as raw entries: an entry Kato wrote as a stand-in for a config it did not
    measure (``kato_unmeasured``) is no trial and is not checked as one.
    """

    device_name: Text | None = None
    kernel_name: Text | None = None
    problem_size: Any = None  # checked as a shape only where it is used
    tune_params_keys: Annotated[list[Name], Field(min_length=1)]
    tune_params: dict[Name, list[ParamValue]]
    objective: Text | None = None
    cache: dict[str, dict[str, Any]]
    kato_operator: Name | None = None
    kato_operator_version: Version | None = None
    dtype: Dtype | None = None
    compute_capability: ComputeCapability | None = None
    cuda_version: CudaVersion | None = None
    kato: KatoBlock | None = None


# --- T4 results files ------------------------------------------------------------------------


class T4Times(_Record):
    runtimes: list[Milliseconds] | None = None
    compilation_time: Milliseconds | None = None
    compilation: Milliseconds | None = None  # what some writers call it


class T4Measurement(_Record):
    name: Text
    value: Any = None  # typed by name (:class:`Resources`, the time) where it is used
    unit: Text | None = None


class T4Kato(_Record):
    """Kato's fields of one T4 result."""

    job: JobId | None = None
    number: Count | None = None
    status: TrialStatus | None = None
    error: Text | None = None


class T4Result(_Record):
    configuration: Config
    times: T4Times
    invalidity: Invalidity
    correctness: Any
    measurements: list[T4Measurement] | None = None
    timestamp: Timestamp | None = None
    kato: T4Kato | None = None


class T4Metadata(_Record):
    timeunit: TimeUnit = "milliseconds"
    kato: KatoBlock | None = None


class T4Document(_Record):
    """A T4 results document's envelope; its ``results`` are read one by one as
    :class:`T4Result` once the problem they belong to is known."""

    schema_version: Text
    results: list[dict[str, Any]]
    metadata: T4Metadata | None = None


class Resources(_Record):
    """The resource fields of one trial (from an entry, or a T4 result's measurements)."""

    registers: Count | None = None
    shared_static_bytes: Count | None = None
    shared_dynamic_bytes: Count | None = None
    local_bytes: Count | None = None
    blocks_per_sm: Count | None = None
    occupancy: Fraction | None = None


# --- messages --------------------------------------------------------------------------------


def where(prefix: str, loc: tuple[int | str, ...]) -> str:
    """A pydantic location as a path: ``kato.jobs[0].seed``, ``cache['128,1'].time``."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out or "the file"


def describe(error: ValidationError, prefix: str = "", limit: int = 3) -> str:
    """The first ``limit`` problems of ``error``, each as ``field: what is wrong, got value``."""
    problems = error.errors(include_url=False)
    parts = []
    for problem in problems[:limit]:
        message = problem["msg"].removeprefix("Value error, ")
        text = f"{where(prefix, problem['loc'])}: {message}"
        if problem["type"] != "missing":
            text += f", got {show(problem['input'])}"
        parts.append(text)
    if len(problems) > limit:
        parts.append(f"and {len(problems) - limit} more")
    return "; ".join(parts)
