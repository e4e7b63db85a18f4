"""Pydantic models of the result files Kato reads: T4 JSON, Kernel Tuner cache files, and the
Kato block that ``kato export`` adds to both (:mod:`db.export` writes them, :mod:`db.importer`
reads them through these models).

Types are strict: an integer is a JSON integer (not ``true``, not ``1.0``, not ``"1"``) that
fits its 32-bit column, a number is finite, a string fits its column and holds no control
characters, a date is ISO 8601 from 2000 to tomorrow, a job id is 32 lowercase hex digits. What
the models cannot know (the operator's space, rank and dtypes; whether a best config is one of
the file's measurements) :mod:`db.importer` checks after them. Fields a model does not name
are ignored (a later Kato may add some); the ones it names are checked.

A document is read in two steps: its envelope (:class:`T4Document`, :class:`KTDocument`: the
problem it names, its parameters, its Kato block), then its trials (``trials()``: each record
validated and converted to milliseconds, as :class:`TrialRecord`), so that a file naming no
problem is refused for that before its records are looked at. Every problem is a
:class:`FormatError` naming the field (``results[3].times.runtimes[0]: ...``); the reader
prefixes the file. :mod:`db.export` builds its files from the same models (``model_construct``
then ``model_dump``), so their field names and nesting are the ones read here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal, Self

from kato.db.models import utcnow
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kato.errors import KatoError

# Kato's fields of a Kernel Tuner entry (a stand-in for a config not measured; its config's other
# trials) are defined where the cache is replayed; the one leaf for both is issue 33's item 1.
from kato.shared.kt_cache import OTHER_TRIALS, UNMEASURED
from kato.shared.status import JOB_STATUSES

#: The Kato block's format this code writes and reads.
KATO_FORMAT = 1
#: The T4 schema ``kato export`` writes, and the majors this code reads (T4 1.x:
#: ``get_t4_results``, ``kato export``; a later minor only adds fields).
T4_SCHEMA_VERSION = "1.0.0"
T4_SUPPORTED_MAJORS = (1,)
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
#: T4 ``invalidity`` -> Kato status, the first listed where several map to one ("runtime" is
#: ``launch_error``; a ``crashed`` trial keeps its status in the result's ``kato`` object).
INVALIDITY_STATUS: dict[str, str] = {}
for _status, _invalidity in T4_INVALIDITY.items():
    INVALIDITY_STATUS.setdefault(_invalidity, _status)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class FormatError(KatoError, ValueError):
    """A document that is not a valid file of its format; the message names the field (the
    importer makes it an ``InvalidImport`` naming the file too)."""


#: The error type of a check a model makes beyond its fields' types (its message is whole).
_CHECK = "kato_format"


def check_failed(message: str, *, at: tuple[int | str, ...] = (), inline: bool = False):
    """The error a validator raises for a check of its own: shown as ``<field>: message`` (or
    ``<field> message`` with ``inline``) without the input, ``at`` locating it below the field
    being validated (a list's item)."""
    return PydanticCustomError(
        _CHECK, "{message}", {"message": message, "at": at, "inline": inline}
    )


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


def _schema_version(value: str) -> str:
    """A T4 ``schema_version`` this code reads: ``MAJOR.MINOR[.PATCH]`` of a supported major
    (another major may mean other things)."""
    supported = ", ".join(f"{m}.x" for m in T4_SUPPORTED_MAJORS)
    match = re.fullmatch(r"([0-9]{1,4})\.[0-9]{1,4}(?:\.[0-9]{1,4})?", value)
    if match is None:
        raise check_failed(f"{show(value)} is not a version like 1.0.0; Kato reads T4 schema "
                           f"{supported}", inline=True)  # fmt: skip
    if int(match[1]) not in T4_SUPPORTED_MAJORS:
        raise check_failed(f"{show(value)} is not supported: Kato reads T4 schema {supported} "
                           f"(kato export writes {T4_SCHEMA_VERSION})", inline=True)  # fmt: skip
    return value


def _distinct(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        raise check_failed(f"must be distinct parameter names, got {show(names)}", inline=True)
    return names


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
#: Written as ``datetime.isoformat()`` (a naive value, as SQLite returns it, stays naive).
Timestamp = Annotated[
    datetime,
    PlainValidator(_timestamp),
    PlainSerializer(lambda value: value.isoformat(), return_type=str, when_used="json"),
]
ParamValue = Annotated[int | float | str, PlainValidator(_param_value)]
Config = Annotated[dict[Name, ParamValue], AfterValidator(_config_length)]
#: A file's parameter names, in its order.
ParamNames = Annotated[list[Name], AfterValidator(_distinct)]
Dimension = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]
Shape = Annotated[list[Dimension], Field(min_length=1, max_length=MAX_RANK)]
TrialStatus = Literal[tuple(T4_INVALIDITY)]  # type: ignore[valid-type]
JobStatus = Literal[tuple(JOB_STATUSES)]  # type: ignore[valid-type]
Invalidity = Literal[tuple(dict.fromkeys(T4_INVALIDITY.values()))]  # type: ignore[valid-type]
TimeUnit = Annotated[
    Literal["milliseconds", "ms", "seconds", "s", "microseconds"], BeforeValidator(_lower)
]
TIME_UNITS = {"milliseconds": 1.0, "ms": 1.0, "seconds": 1e3, "s": 1e3, "microseconds": 1e-3}
SchemaVersion = Annotated[str, Field(strict=True), AfterValidator(_schema_version)]

#: The fields that name a file's problem (the result key without the GPU's compute capability
#: and CUDA version, which are per best config).
PROBLEM_FIELDS = ("operator", "operator_version", "shape", "dtype", "gpu_model")


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore")
    _where: str = PrivateAttr(default="")

    @property
    def where(self) -> str:
        """The record's place in its file (``kato.jobs[0]``), for messages; ``""`` if unset."""
        return self._where

    def located(self, where: str) -> Self:
        """The record, its place in its file set to ``where``."""
        self._where = where
        return self


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

    compute_capability: ComputeCapability | None = None
    cuda_version: CudaVersion | None = None
    config: Config
    time_ms: Positive
    job_id: JobId | None = None
    updated_at: Timestamp | None = None
    #: The figures stored beside the winner (migration 0006), absent from older files: the
    #: default config's time on the shape, PyTorch's op on the same inputs and its name.
    default_ms: Positive | None = None
    framework_ms: Positive | None = None
    framework: Name | None = None
    #: The same op compiled by torch.compile and what that was (migration 0009).
    compiled_ms: Positive | None = None
    compiled: Name | None = None


class KatoBlock(_Record):
    """What ``kato export`` adds to a file (KT: the top-level ``kato``; T4: ``metadata.kato``).

    A job is listed once; its trials name it (KT: ``kato_job``, T4: ``kato.job``)."""

    format: Annotated[int, Field(strict=True, ge=1, le=KATO_FORMAT)] | None = None
    operator: Name | None = None
    operator_version: Version | None = None
    shape: Shape | None = None
    dtype: Dtype | None = None
    gpu_model: Name | None = None
    params: ParamNames | None = None
    jobs: list[JobRecord] | None = None
    best: list[BestRecord] = []

    @field_validator("jobs")
    @classmethod
    def _listed_once(cls, jobs: list[JobRecord] | None) -> list[JobRecord] | None:
        seen: set[str] = set()
        for i, job in enumerate(jobs or []):
            if job.id in seen:
                raise check_failed(f"job {job.id} is listed twice", at=(i,))
            seen.add(job.id)
        return jobs

    @property
    def lists_jobs(self) -> bool:
        """Whether the block says which jobs the trials belong to (a Kato export does: then
        the file's jobs and best configs are the block's, else the reader makes them up)."""
        return self.jobs is not None or self.format is not None


# --- one trial, whatever the format ----------------------------------------------------------


@dataclass
class TrialRecord:
    """One trial of a file, validated, its times in milliseconds (compile time in seconds, as
    stored). ``job_id`` is ``""`` where the file does not say; ``where`` names the record."""

    job_id: str
    number: int
    config: dict[str, Any]
    status: str
    time_ms: float | None
    times_ms: list[float]
    compile_time_s: float | None
    resources: dict[str, Any]
    error: str | None
    created_at: datetime | None
    where: str = ""


class Resources(_Record):
    """The resource fields of one trial (from an entry, or a T4 result's measurements)."""

    registers: Count | None = None
    shared_static_bytes: Count | None = None
    shared_dynamic_bytes: Count | None = None
    local_bytes: Count | None = None
    blocks_per_sm: Count | None = None
    occupancy: Fraction | None = None


class _Document(_Record):
    """What T4 and Kernel Tuner documents share: a Kato block, and where each problem field
    lies in the file (for messages)."""

    #: Where the Kato block lies in the file.
    BLOCK_AT: ClassVar[str] = "kato"

    @property
    def block(self) -> KatoBlock | None:
        raise NotImplementedError

    @property
    def kato_export(self) -> bool:
        """Whether the file is Kato's own export (it has a Kato block naming anything)."""
        return self.block is not None and bool(self.block.model_fields_set)

    def problem_fields(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The problem fields the file names (unchecked, None where absent) and where each
        lies in the file: the Kato block's."""
        block = self.block
        own = block.model_dump(include=set(PROBLEM_FIELDS)) if block else {}
        return own, {name: f"{self.BLOCK_AT}.{name}" for name in PROBLEM_FIELDS}

    def echoes(self) -> list[tuple[str, Any, str]]:
        """Fields outside the Kato block that repeat it, as ``(label, value, the block's
        field)``: a reader holds them to agree with the block. None here."""
        return []


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
    """One entry of a Kernel Tuner cache's ``cache``, or one of its ``kato_other_trials`` (its
    parameters are fields of their own, read by :meth:`KTDocument.trials`). ``time`` is a
    measurement exactly where ``kato_status`` (if given) is ``ok``."""

    time: Annotated[float | str, PlainValidator(_kt_time)]
    times: list[Milliseconds] | None = None
    error: Text | None = None
    compile_time: Milliseconds | None = None
    registers: Count | None = None
    shared_static_bytes: Count | None = None
    shared_dynamic_bytes: Count | None = None
    local_bytes: Count | None = None
    blocks_per_sm: Count | None = None
    occupancy: Fraction | None = None
    timestamp: Timestamp | None = None
    kato_job: JobId | None = None
    kato_number: Count | None = None
    kato_status: TrialStatus | None = None

    @model_validator(mode="after")
    def _status_fits_time(self) -> KTEntry:
        if isinstance(self.time, str):
            if self.status == "ok":
                raise check_failed(f"kato_status 'ok' but time is {self.time!r}")
        elif self.status != "ok":
            raise check_failed(f"kato_status {self.status!r} but time is a measurement")
        return self

    @property
    def status(self) -> str:
        """Kato's status of the trial: ``kato_status``, else the one ``time`` stands for."""
        if self.kato_status is not None:
            return self.kato_status
        return KT_MARKERS[self.time] if isinstance(self.time, str) else "ok"

    def trial(self, config: dict[str, Any], index: int, where: str) -> TrialRecord:
        """The entry as the trial ``index`` of the file (its number unless it names one)."""
        return TrialRecord(
            job_id=self.kato_job or "",
            number=self.kato_number if self.kato_number is not None else index,
            config=config,
            status=self.status,
            time_ms=self.time if self.status == "ok" else None,  # type: ignore[arg-type]
            times_ms=list(self.times or []),
            compile_time_s=self.compile_time / 1000 if self.compile_time is not None else None,
            resources={name: getattr(self, name) for name in RESOURCES},
            error=self.error,
            created_at=self.timestamp,
            where=where,
        )


class KTDocument(_Document):
    """A Kernel Tuner cache file (what Kernel Tuner writes, and ``kato export --format kt``).

    ``cache`` is read as raw entries by :meth:`trials`: an entry Kato wrote as a stand-in for a
    config it did not measure (``kato_unmeasured``) is no trial and is not checked as one.
    """

    device_name: Text | None = None
    kernel_name: Text | None = None
    problem_size: Any = None  # checked as a shape only where it is used
    tune_params_keys: Annotated[list[Name], Field(min_length=1), AfterValidator(_distinct)]
    tune_params: dict[Name, list[ParamValue]]
    objective: Text | None = None
    cache: dict[str, dict[str, Any]]
    kato_operator: Name | None = None
    kato_operator_version: Version | None = None
    dtype: Dtype | None = None
    compute_capability: ComputeCapability | None = None
    cuda_version: CudaVersion | None = None
    kato: KatoBlock | None = None

    @property
    def block(self) -> KatoBlock | None:
        return self.kato

    def problem_fields(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The Kato block's problem fields in a Kato export; else (Kernel Tuner's cache, or an
        older Kato one) what its top-level fields say."""
        if self.kato_export:
            return super().problem_fields()
        fields = {
            "operator": "kato_operator",
            "operator_version": "kato_operator_version",
            "dtype": "dtype",
            "shape": "problem_size",
            "gpu_model": "device_name",
        }
        return {name: getattr(self, field) for name, field in fields.items()}, fields

    def params(self) -> list[str]:
        """The parameter names, in the file's key order."""
        return list(self.tune_params_keys)

    def echoes(self) -> list[tuple[str, Any, str]]:
        """In a Kato export, the top-level fields that repeat its Kato block."""
        if not self.kato_export:
            return []
        return [
            ("kato_operator", self.kato_operator, "operator"),
            ("kato_operator_version", self.kato_operator_version, "operator_version"),
            ("dtype", self.dtype, "dtype"),
            ("problem_size", self.problem_size, "shape"),
            ("device_name", self.device_name, "gpu_model"),
            ("compute_capability", self.compute_capability, "compute_capability"),
            ("cuda_version", self.cuda_version, "cuda_version"),
        ]

    def trials(self) -> list[TrialRecord]:
        """Every measured entry and its other trials, in file order, numbered by that order
        where they name no number. Left out: stand-ins (:data:`UNMEASURED`) and, in a Kato
        export, an entry of no job (a best config written as an entry; the block has it).

        Raises:
            FormatError: an entry without all parameters, keyed by other values than its
                parameters', or not a valid entry.
        """
        keys = self.tune_params_keys
        out: list[TrialRecord] = []
        for key, raw in self.cache.items():
            where = f"cache[{show(key)}]"
            if UNMEASURED in raw or (self.kato_export and "kato_job" not in raw):
                continue
            missing = [p for p in keys if p not in raw]
            if missing:
                raise FormatError(f"{where}: missing parameter(s) {', '.join(missing)}")
            config = parse(Config, {p: raw[p] for p in keys}, where)
            if key != ",".join(str(config[p]) for p in keys):
                raise FormatError(f"{where}: the key is not the entry's parameters "
                                  f"{show(config)} in tune_params_keys order")  # fmt: skip
            out.append(parse(KTEntry, raw, where).trial(config, len(out), where))
            others = parse(_RAW_ENTRIES, raw.get(OTHER_TRIALS) or [], where)
            for j, other in enumerate(others):
                at = f"{where}.{OTHER_TRIALS}[{j}]"
                out.append(parse(KTEntry, other, at).trial(config, len(out), at))
        return out


# --- T4 results files ------------------------------------------------------------------------


class T4Times(_Record):
    runtimes: list[Milliseconds] | None = None
    compilation_time: Milliseconds | None = None
    compilation: Milliseconds | None = None  # what some writers call it


class T4Measurement(_Record):
    name: Text
    value: Any = None  # typed by name (:class:`Resources`, the time) by :class:`T4Result`
    unit: Text | None = None


class T4Kato(_Record):
    """Kato's fields of one T4 result."""

    job: JobId | None = None
    number: Count | None = None
    status: TrialStatus | None = None
    error: Text | None = None


class _Measured(_Record):
    """A measured result's ``time`` measurement (in the document's time unit)."""

    time: Positive


class _T4Values(_Record):
    """A T4 result's measurements by name, typed: what :class:`T4Result` checks them as."""

    measurements: Resources


class _T4Time(_Record):
    measurements: _Measured


class T4Result(_Record):
    """One T4 result: a trial. Its ``kato.status`` (where given) is one its ``invalidity``
    stands for; a measured one has a positive ``time`` measurement; the resource measurements
    are :class:`Resources`."""

    timestamp: Timestamp | None = None
    configuration: Config
    objectives: Any = None  # written as ["time"]; not read
    times: T4Times
    invalidity: Invalidity
    correctness: Any
    measurements: list[T4Measurement] | None = None
    kato: T4Kato | None = None
    _time: float | None = PrivateAttr(default=None)
    _resources: Resources = PrivateAttr(default_factory=Resources)

    @model_validator(mode="after")
    def _measured_as_said(self) -> T4Result:
        if T4_INVALIDITY[self.status] != self.invalidity:
            raise check_failed(f"kato.status {self.status!r} is not the T4 invalidity "
                               f"{self.invalidity!r}")  # fmt: skip
        values = {m.name: m.value for m in self.measurements or []}
        if self.status == "ok":
            time = {"measurements": {"time": values.get("time")}}
            self._time = _T4Time.model_validate(time).measurements.time
        resources = {k: values.get(k) for k in RESOURCES}
        self._resources = _T4Values.model_validate({"measurements": resources}).measurements
        return self

    @property
    def status(self) -> str:
        """Kato's status of the trial: ``kato.status``, else the one ``invalidity`` stands for."""
        if self.kato is not None and self.kato.status is not None:
            return self.kato.status
        return INVALIDITY_STATUS[self.invalidity]

    def trial(self, index: int, scale: float, where: str) -> TrialRecord:
        """The result as the trial ``index`` of the file, its times multiplied by ``scale``
        (the document's unit -> ms).

        Raises:
            FormatError: a time that is out of range in milliseconds.
        """

        def ms(value: float, at: str) -> float:
            scaled = value * scale
            if not math.isfinite(scaled):
                raise FormatError(f"{where}{at}: {value!r} is out of range in milliseconds")
            return scaled

        kato = self.kato or T4Kato()
        compile_ms = self.times.compilation_time
        if compile_ms is None:
            compile_ms = self.times.compilation
        return TrialRecord(
            job_id=kato.job or "",
            number=kato.number if kato.number is not None else index,
            config=dict(self.configuration),
            status=self.status,
            time_ms=None if self._time is None else ms(self._time, ".measurements.time"),
            times_ms=[ms(t, ".times.runtimes") for t in self.times.runtimes or []],
            compile_time_s=None if compile_ms is None else ms(compile_ms, ".times") / 1000,
            resources=self._resources.model_dump(),
            error=kato.error,
            created_at=self.timestamp,
            where=where,
        )


class T4Metadata(_Record):
    timeunit: TimeUnit = "milliseconds"
    kato: KatoBlock | None = None


class T4Document(_Document):
    """A T4 results document's envelope; its ``results`` are read one by one as
    :class:`T4Result` by :meth:`trials`, once the problem they belong to is known."""

    BLOCK_AT: ClassVar[str] = "metadata.kato"

    schema_version: SchemaVersion
    results: list[dict[str, Any]]
    metadata: T4Metadata | None = None

    @property
    def block(self) -> KatoBlock | None:
        return self.metadata.kato if self.metadata else None

    def params(self) -> list[str]:
        """The parameter names: the Kato block's, else the first result's configuration's.

        Raises:
            FormatError: neither names any.
        """
        params = self.block.params if self.block and self.block.params else None
        first = self.results[0].get("configuration") if self.results else None
        if not params and isinstance(first, dict):
            params = list(first)
        if not params:
            raise FormatError("metadata.kato.params: no parameter names (an empty file?)")
        return list(params)

    def trials(self) -> list[TrialRecord]:
        """Every result as a trial, in file order, times in milliseconds.

        Raises:
            FormatError: a result that is not valid.
        """
        scale = TIME_UNITS[(self.metadata or T4Metadata()).timeunit]
        return [
            parse(T4Result, raw, f"results[{i}]").trial(i, scale, f"results[{i}]")
            for i, raw in enumerate(self.results)
        ]


# --- reading and messages --------------------------------------------------------------------

#: TypeAdapters by their type (held here, so equal types written anew share one).
_ADAPTERS: dict[Any, TypeAdapter] = {}
_RAW_ENTRIES = list[dict[str, Any]]


def parse(kind: Any, data: Any, where: str = "") -> Any:
    """``data`` validated as ``kind`` (a model or an annotated type of this module).

    Raises:
        FormatError: naming the fields that are wrong (below ``where``, the value's place).
    """
    try:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind.model_validate(data)
        adapter = _ADAPTERS.get(kind)
        if adapter is None:
            adapter = _ADAPTERS[kind] = TypeAdapter(kind)
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise FormatError(describe(exc, where)) from None


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
    """The first ``limit`` problems of ``error``, each as ``field: what is wrong, got value``
    (a model's own check, :func:`check_failed`: as its message says, without the value)."""
    problems = error.errors(include_url=False)
    parts = []
    for problem in problems[:limit]:
        if problem["type"] == _CHECK:
            ctx = problem["ctx"]
            place = where(prefix, (*problem["loc"], *ctx["at"]))
            parts.append(f"{place}{' ' if ctx['inline'] else ': '}{ctx['message']}")
            continue
        message = problem["msg"].removeprefix("Value error, ")
        text = f"{where(prefix, problem['loc'])}: {message}"
        if problem["type"] != "missing":
            text += f", got {show(problem['input'])}"
        parts.append(text)
    if len(problems) > limit:
        parts.append(f"and {len(problems) - limit} more")
    return "; ".join(parts)
