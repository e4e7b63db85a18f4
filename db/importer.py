"""Import results exported by ``kato export`` (or written by Kernel Tuner) into a database.

Reads T4 JSON and Kernel Tuner cache files (plain or ``.gz``; format detected from the content),
checks every file before anything is written, then writes all of them in one transaction.

Contract:

- **Idempotent**: jobs keep their ids, a trial is unique per ``(job, config key)``, and a best
  config replaces a stored one only when strictly faster: importing twice changes nothing.
- **Kato's own exports** carry everything in their Kato block (:mod:`db.export`).
- **Foreign files** (Kernel Tuner's caches and T4 output, or Kato's older caches with only
  ``kato_operator``/``dtype`` fields) need what they lack from ``overrides`` (``operator``,
  ``shape``, ``dtype``, ``gpu``; for these files an override also replaces what their own
  fields say, e.g. ``operator_version``): their trials become one ``done`` job whose id is
  derived from the content (so a second import finds it), and the fastest measurement becomes
  a best config.
- **Overrides and Kato metadata**: in a file with a Kato block an override only fills a field
  the block lacks; one that disagrees with the block is an :class:`InvalidImport`, and so is a
  top-level field of a Kernel Tuner file that disagrees with its Kato block.
- **Types** (:mod:`db.formats`, pydantic, strict): every stored field is checked for its type
  and range, so an imported file cannot make the API fail later.
- **The operator**: a file is imported only for an operator registered here
  (:func:`kernels.get_operator`), with a shape of its rank and one of its dtypes
  (``spec.validate``) and exactly its parameters. At the operator's current version every
  config must be a point of its space (``spec.check_params``), and every measured one, every
  best config and every job's best config must pass its constraints for the file's shape and
  dtype (``spec.check``). Results of another version are checked for the parameter names only
  (this code cannot know that version's space); they are stored with a warning, never served.
- **Consistency**: a best config naming a job of the file, and every job's own best, is one
  of that job's measured trials in the file, at its time; a best config of no job (or of a job
  not in the file) is kept as it is. A compute capability is ``major.minor`` (or ``unknown``)
  and, for a GPU the catalog lists, that GPU's.
- **Errors**: :class:`InvalidImport` names the file and what is wrong; nothing is written. Any
  other exception raised while reading a file becomes one too (naming the file, the original
  chained).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter
from sqlalchemy import select
from sqlalchemy.orm import Session

from db.formats import (
    KT_MARKERS,
    RESOURCES,
    T4_INVALIDITY,
    TIME_UNITS,
    Config,
    Dtype,
    KatoBlock,
    KTDocument,
    KTEntry,
    Name,
    Positive,
    Resources,
    Shape,
    T4Document,
    T4Kato,
    T4Metadata,
    T4Result,
    ValidationError,
    Version,
    describe,
    show,
)
from db.models import BestConfig, Job, Trial, utcnow
from db.queries import UNCOUNTED_TRIAL_STATUSES, shape_key, trial_time
from kato.errors import KatoError
from tuner.kt_cache import OTHER_TRIALS, UNMEASURED

TRIAL_STATUSES = tuple(T4_INVALIDITY)
#: T4 ``invalidity`` -> Kato status, the first listed where several map to one ("runtime" is
#: ``launch_error``; a ``crashed`` trial keeps its status in the file's ``kato`` object).
_INVALIDITY_STATUS: dict[str, str] = {}
for _status, _invalidity in T4_INVALIDITY.items():
    _INVALIDITY_STATUS.setdefault(_invalidity, _status)
_JOB_STATUSES = ("done", "failed", "cancelled")
_PROBLEM_FIELDS = ("operator", "operator_version", "shape", "dtype", "gpu_model")
_FLAGS = {
    "operator": "--operator",
    "operator_version": "--operator-version",
    "shape": "--shape",
    "dtype": "--dtype",
    "gpu_model": "--gpu",
}
#: TypeAdapters by the id of their (module-level, never freed) annotated type.
_ADAPTERS: dict[int, TypeAdapter] = {}
_RAW_TRIALS = list[dict[str, Any]]


class InvalidImport(KatoError, ValueError):
    """A file that cannot be imported; the message names the file and the problem."""


@dataclass
class ParsedTrial:
    job_id: str
    number: int
    config: dict[str, Any]
    status: str
    time_ms: float | None
    times_ms: list[float]
    compile_time_s: float | None
    resources: dict[str, Any]
    error: str | None
    created_at: Any
    where: str = ""  # the record in the file, for messages


@dataclass
class ParsedBundle:
    """One file's problem, jobs, trials and best configs, checked.

    ``jobs`` and ``best`` are dicts of :class:`db.formats.JobRecord` /
    :class:`db.formats.BestRecord` fields, plus ``where`` (the record in the file).
    ``echoes``: top-level fields of a Kernel Tuner file that repeat its Kato block, as
    ``(label, value, problem field)``: they must agree with it.
    """

    path: Path
    operator: str
    operator_version: str
    shape: list[int]
    dtype: str
    gpu_model: str
    params: list[str]
    jobs: list[dict[str, Any]] = field(default_factory=list)
    trials: list[ParsedTrial] = field(default_factory=list)
    best: list[dict[str, Any]] = field(default_factory=list)
    echoes: list[tuple[str, Any, str]] = field(default_factory=list)


@dataclass
class ImportReport:
    files: int = 0
    jobs_added: int = 0
    jobs_present: int = 0
    trials_added: int = 0
    trials_present: int = 0
    best_added: int = 0
    best_replaced: int = 0
    best_kept: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- reading ---------------------------------------------------------------------------------


def _fail(path: Path, message: str) -> InvalidImport:
    return InvalidImport(f"{path}: {message}")


def _parse(path: Path, kind: Any, data: Any, prefix: str = "") -> Any:
    """``data`` validated as ``kind`` (a pydantic model or an annotated type); a validation
    error becomes an :class:`InvalidImport` naming the fields (under ``prefix``)."""
    try:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind.model_validate(data)
        adapter = _ADAPTERS.get(id(kind))
        if adapter is None:
            adapter = _ADAPTERS[id(kind)] = TypeAdapter(kind)
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise _fail(path, describe(exc, prefix)) from None


def _load_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise _fail(path, f"cannot read: {exc}") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(path, f"not JSON: {exc}") from None
    # A lone surrogate escape (\ud800) decodes to a string no database can store.
    if re.search(rb"\\u[dD][89a-fA-F]", raw):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _fail(path, "a string holds a lone surrogate escape (not text)") from None
    return data


#: Characters no GPU model name may hold: path separators and what a Windows file name cannot
#: (export writes a file per GPU model; a name is also shown and logged).
_GPU_FORBIDDEN = set('/\\:*?"<>|')
#: Names Windows reserves for devices, with or without an extension (``CON``, ``nul.txt``).
_RESERVED_NAME = re.compile(r"^(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(\..*)?$", re.IGNORECASE)
#: Longest GPU model name, as the API takes it (``service.schemas.JobIn.gpu``).
GPU_NAME_MAX = 64


def gpu_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a GPU model name, or None: the API's rules (printable text, 1 to
    :data:`GPU_NAME_MAX` characters) and no path-like or reserved name (a path separator or
    ``:*?"<>|``, ``.``/``..`` or a name starting or ending with a dot or a blank, ``CON``,
    ``NUL``, ``COM1``...)."""
    if not 1 <= len(name) <= GPU_NAME_MAX:
        return f"must be 1 to {GPU_NAME_MAX} characters"
    if not name.isprintable():
        return "must be printable text, without control or invisible characters"
    bad = sorted(set(name) & _GPU_FORBIDDEN)
    if bad:
        return f"must not hold {' '.join(bad)} (a GPU model name is not a path)"
    if name.strip(" .") != name:
        return "must not start or end with a dot or a blank (a GPU model name is not a path)"
    if _RESERVED_NAME.match(name):
        return "is a name reserved for a device on Windows, not a GPU model"
    return None


def _gpu(path: Path, where: str, value: Any) -> str:
    """A GPU model as the catalog names it (a well-formed name it does not list is kept,
    cleaned, and warned about in the report: :func:`_gpu_warnings`)."""
    from kernels.spec import InvalidInput
    from tuner.gpus import normalize_gpu_name

    name = _parse(path, Name, value, where)
    try:
        name = normalize_gpu_name(name)
    except InvalidInput as exc:
        raise _fail(path, f"{where}: {exc}") from None
    why = gpu_name_problem(name)
    if why is not None:
        raise _fail(path, f"{where}: GPU model {show(name)} {why}")
    return _parse(path, Name, name, where)


def _shape_text(path: Path, where: str, value: str) -> list[int]:
    """A shape given as text (``4096x4096``, ``4096,4096``), as on the command line."""
    parts = re.split(r"\s*[x,X]\s*", value.strip()) if value.strip() else []
    if not parts or not all(re.fullmatch(r"[0-9]{1,10}", p) for p in parts):
        raise _fail(path, f"{where} must look like 4096x4096, got {show(value)}")
    return _parse(path, Shape, [int(p) for p in parts], where)


def _value(path: Path, where: str, name: str, value: Any) -> Any:
    """One problem field, checked and normalised (a GPU model by the catalog)."""
    if name == "shape":
        if isinstance(value, str) and where.startswith("--"):
            return _shape_text(path, where, value)
        return _parse(path, Shape, value, where)
    if name == "gpu_model":
        return _gpu(path, where, value)
    kind = {"operator": Name, "operator_version": Version, "dtype": Dtype}[name]
    return _parse(path, kind, value, where)


def _spec(path: Path, operator: str) -> Any:
    from kernels import get_operator
    from kernels.spec import InvalidInput

    try:
        return get_operator(operator)
    except InvalidInput as exc:
        raise _fail(path, f"{exc}; Kato imports results only of the operators it has") from None


def _problem(
    path: Path,
    own: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    labels: Mapping[str, str],
    kato_export: bool,
) -> dict[str, Any]:
    """operator, operator_version, shape, dtype, gpu_model: from ``own`` (the file's fields),
    and ``overrides``.

    In a file with a Kato block (``kato_export``) an override fills only a field the block
    lacks, and one that disagrees with it is an error; in a foreign file an override replaces
    what the file's own fields say. ``labels`` names each field in the file, for messages.
    The operator must be registered here; its version is the current one where none is given.
    """
    given = {("gpu_model" if k == "gpu" else k): v for k, v in overrides.items() if v is not None}
    merged: dict[str, Any] = {}
    conflicts = []
    for name in _PROBLEM_FIELDS:
        flag = _FLAGS[name]
        override = _value(path, flag, name, given[name]) if name in given else None
        mine = own.get(name)
        if mine is not None and (kato_export or override is None):
            mine = _value(path, labels[name], name, mine)
        else:
            mine = None
        if override is None or mine is None:
            merged[name] = override if override is not None else mine
        elif override != mine:
            conflicts.append(f"{flag} {show(override)} conflicts with the file's {labels[name]} "
                             f"{show(mine)}")  # fmt: skip
        else:
            merged[name] = mine
    if conflicts:
        raise _fail(path, f"{'; '.join(conflicts)} (overrides are for files without Kato metadata)")
    missing = [k for k in ("operator", "shape", "dtype", "gpu_model") if merged[k] is None]
    if missing:
        names = ", ".join(_FLAGS[m] for m in missing)
        raise _fail(path, f"no Kato metadata for {', '.join(missing)}: pass {names}")
    spec = _spec(path, merged["operator"])
    if merged["operator_version"] is None:
        merged["operator_version"] = spec.version
    return merged


def _params(path: Path, where: str, params: Sequence[str] | None) -> list[str]:
    if not params:
        raise _fail(path, f"{where}: no parameter names (an empty file?)")
    if len(set(params)) != len(params):
        raise _fail(path, f"{where} must be distinct parameter names, got {show(list(params))}")
    return list(params)


def _names(config: Mapping[str, Any], params: Sequence[str]) -> str | None:
    """Why ``config`` does not have exactly the parameters ``params``, or None."""
    missing = [p for p in params if p not in config]
    if missing:
        return f"missing parameter(s) {', '.join(missing)}"
    unknown = sorted(set(config) - set(params))
    return f"unknown parameter(s) {', '.join(unknown)}" if unknown else None


def _milliseconds(path: Path, where: str, value: float, scale: float) -> float:
    scaled = value * scale
    if not math.isfinite(scaled):
        raise _fail(path, f"{where}: {value!r} is out of range in milliseconds")
    return scaled


#: The T4 schema majors this importer reads (T4 1.x: ``get_t4_results``, ``kato export``).
T4_SUPPORTED_MAJORS = (1,)


def _t4_version(path: Path, value: str) -> None:
    """A T4 ``schema_version`` this importer reads: ``MAJOR.MINOR[.PATCH]`` of a supported
    major (a later minor only adds fields; another major may mean other things)."""
    supported = ", ".join(f"{m}.x" for m in T4_SUPPORTED_MAJORS)
    match = re.fullmatch(r"([0-9]{1,4})\.[0-9]{1,4}(?:\.[0-9]{1,4})?", value)
    if match is None:
        raise _fail(path, f"schema_version {show(value)} is not a version like 1.0.0; "
                    f"Kato reads T4 schema {supported}")  # fmt: skip
    if int(match[1]) not in T4_SUPPORTED_MAJORS:
        raise _fail(path, f"schema_version {show(value)} is not supported: Kato reads T4 "
                    f"schema {supported} (kato export writes 1.0.0)")  # fmt: skip


def _parse_t4(path: Path, data: dict[str, Any], overrides: Mapping[str, Any]) -> ParsedBundle:
    doc = _parse(path, T4Document, data)
    _t4_version(path, doc.schema_version)
    metadata = doc.metadata or T4Metadata()
    block = metadata.kato
    scale = TIME_UNITS[metadata.timeunit]
    labels = {name: f"metadata.kato.{name}" for name in _PROBLEM_FIELDS}
    own = block.model_dump(include=set(_PROBLEM_FIELDS)) if block else {}
    kato_export = block is not None and bool(block.model_fields_set)
    problem = _problem(path, own, overrides, labels=labels, kato_export=kato_export)
    params = block.params if block and block.params else None
    first = doc.results[0].get("configuration") if doc.results else None
    if not params and isinstance(first, dict):
        params = list(first)
    bundle = ParsedBundle(path, params=_params(path, "metadata.kato.params", params), **problem)
    for i, raw in enumerate(doc.results):
        where = f"results[{i}]"
        result = _parse(path, T4Result, raw, where)
        kato = result.kato or T4Kato()
        status = kato.status or _INVALIDITY_STATUS[result.invalidity]
        if T4_INVALIDITY[status] != result.invalidity:
            raise _fail(path, f"{where}: kato.status {status!r} is not the T4 invalidity "
                        f"{result.invalidity!r}")  # fmt: skip
        measurements: dict[str, Any] = {m.name: m.value for m in result.measurements or []}
        time_ms = None
        if status == "ok":
            measured = _parse(
                path, Positive, measurements.get("time"), f"{where}.measurements.time"
            )
            time_ms = _milliseconds(path, f"{where}.measurements.time", measured, scale)
        compile_ms = result.times.compilation_time
        if compile_ms is None:
            compile_ms = result.times.compilation
        resources = _parse(
            path, Resources, {k: measurements.get(k) for k in RESOURCES}, f"{where}.measurements"
        )
        bundle.trials.append(
            ParsedTrial(
                job_id=kato.job or "",
                number=kato.number if kato.number is not None else i,
                config=dict(result.configuration),
                status=status,
                time_ms=time_ms,
                times_ms=[
                    _milliseconds(path, f"{where}.times.runtimes", t, scale)
                    for t in result.times.runtimes or []
                ],
                compile_time_s=None
                if compile_ms is None
                else _milliseconds(path, f"{where}.times", compile_ms, scale) / 1000,
                resources=resources.model_dump(),
                error=kato.error,
                created_at=result.timestamp,
                where=where,
            )
        )
    _complete(bundle, path, block, "metadata.kato", None, None)
    return bundle


def _kt_trial(
    path: Path, where: str, raw: Mapping[str, Any], config: dict[str, Any], index: int
) -> ParsedTrial:
    """One trial of a Kernel Tuner cache: an entry, or one of an entry's other trials."""
    entry = _parse(path, KTEntry, raw, where)
    if isinstance(entry.time, str):
        status = entry.kato_status or KT_MARKERS[entry.time]
        if status == "ok":
            raise _fail(path, f"{where}: kato_status 'ok' but time is {entry.time!r}")
    else:
        status = entry.kato_status or "ok"
        if status != "ok":
            raise _fail(path, f"{where}: kato_status {status!r} but time is a measurement")
    resources = {name: getattr(entry, name) for name in RESOURCES}
    return ParsedTrial(
        job_id=entry.kato_job or "",
        number=entry.kato_number if entry.kato_number is not None else index,
        config=config,
        status=status,
        time_ms=entry.time if status == "ok" else None,  # type: ignore[arg-type]
        times_ms=list(entry.times or []),
        compile_time_s=entry.compile_time / 1000 if entry.compile_time is not None else None,
        resources=resources,
        error=entry.error,
        created_at=entry.timestamp,
        where=where,
    )


def _parse_kt(path: Path, data: dict[str, Any], overrides: Mapping[str, Any]) -> ParsedBundle:
    doc = _parse(path, KTDocument, data)
    keys = _params(path, "tune_params_keys", doc.tune_params_keys)
    block = doc.kato
    kato_export = block is not None and bool(block.model_fields_set)
    if kato_export:
        labels = {name: f"kato.{name}" for name in _PROBLEM_FIELDS}
        own = block.model_dump(include=set(_PROBLEM_FIELDS))
    else:  # a Kernel Tuner cache, or an older Kato one: what its extra fields say
        labels = {
            "operator": "kato_operator",
            "operator_version": "kato_operator_version",
            "dtype": "dtype",
            "shape": "problem_size",
            "gpu_model": "device_name",
        }
        own = {
            "operator": doc.kato_operator,
            "operator_version": doc.kato_operator_version,
            "dtype": doc.dtype,
            "shape": doc.problem_size,
            "gpu_model": doc.device_name,
        }
    problem = _problem(path, own, overrides, labels=labels, kato_export=kato_export)
    bundle = ParsedBundle(path, params=keys, **problem)
    if kato_export:
        bundle.echoes = [
            ("kato_operator", doc.kato_operator, "operator"),
            ("kato_operator_version", doc.kato_operator_version, "operator_version"),
            ("dtype", doc.dtype, "dtype"),
            ("problem_size", doc.problem_size, "shape"),
            ("device_name", doc.device_name, "gpu_model"),
            ("compute_capability", doc.compute_capability, "compute_capability"),
            ("cuda_version", doc.cuda_version, "cuda_version"),
        ]
    index = 0
    for key, raw in doc.cache.items():
        where = f"cache[{show(key)}]"
        if UNMEASURED in raw:
            continue  # a stand-in Kato wrote for a config it did not measure
        if kato_export and "kato_job" not in raw:
            continue  # a best config written as an entry; the best list has it
        missing = [p for p in keys if p not in raw]
        if missing:
            raise _fail(path, f"{where}: missing parameter(s) {', '.join(missing)}")
        config = _parse(path, Config, {p: raw[p] for p in keys}, where)
        if key != ",".join(str(config[p]) for p in keys):
            raise _fail(path, f"{where}: the key is not the entry's parameters "
                        f"{show(config)} in tune_params_keys order")  # fmt: skip
        bundle.trials.append(_kt_trial(path, where, raw, config, index))
        index += 1
        others = _parse(path, _RAW_TRIALS, raw.get(OTHER_TRIALS) or [], where)
        for j, other in enumerate(others):
            bundle.trials.append(
                _kt_trial(path, f"{where}.{OTHER_TRIALS}[{j}]", other, config, index)
            )
            index += 1
    _complete(bundle, path, block, "kato", doc.compute_capability, doc.cuda_version)
    return bundle


def _complete(
    bundle: ParsedBundle,
    path: Path,
    block: KatoBlock | None,
    prefix: str,
    compute_capability: str | None,
    cuda_version: str | None,
) -> None:
    """The jobs and best configs: a Kato export's own, or a foreign file's made up."""
    if block is not None and (block.jobs is not None or block.format is not None):
        bundle.jobs = []
        seen: set[str] = set()
        for i, job in enumerate(block.jobs or []):
            if job.id in seen:
                raise _fail(path, f"{prefix}.jobs[{i}]: job {job.id} is listed twice")
            seen.add(job.id)
            bundle.jobs.append({**job.model_dump(), "where": f"{prefix}.jobs[{i}]"})
        bundle.best = [
            {
                **best.model_dump(),
                "compute_capability": best.compute_capability or "unknown",
                "cuda_version": best.cuda_version or "unknown",
                "where": f"{prefix}.best[{i}]",
            }
            for i, best in enumerate(block.best)
        ]
        stray = {t.job_id for t in bundle.trials} - seen
        if stray:
            raise _fail(path, f"trials of jobs not listed in {prefix}.jobs: {sorted(stray)[:3]}")
    else:
        _finish_foreign(bundle, compute_capability, cuda_version)


def _synthetic_job(bundle: ParsedBundle) -> str:
    """A job id derived from the problem and the trials, so that a re-import finds it."""
    digest = hashlib.sha256()
    digest.update(json.dumps([bundle.operator, bundle.operator_version, bundle.shape,
                              bundle.dtype, bundle.gpu_model]).encode())  # fmt: skip
    for t in bundle.trials:
        digest.update(json.dumps([t.config, t.status, t.time_ms], default=str).encode())
    return digest.hexdigest()[:32]


def _finish_foreign(
    bundle: ParsedBundle, compute_capability: str | None, cuda_version: str | None
) -> None:
    """Give a foreign file's trials a job and its fastest measurement a best config."""
    job_id = _synthetic_job(bundle)
    for t in bundle.trials:
        t.job_id = job_id
    ok = [t for t in bundle.trials if t.status == "ok" and t.time_ms is not None]
    fastest = min(ok, key=lambda t: t.time_ms or 0.0, default=None)
    bundle.jobs = [
        {
            "id": job_id,
            "status": "done",
            "budget_configs": max(len(bundle.trials), 1),
            "strategy": "imported",
            "best_time_ms": fastest.time_ms if fastest else None,
            "best_config": fastest.config if fastest else None,
            "where": "the file",
        }
    ]
    if fastest is not None:
        from tuner.gpus import find_gpu

        gpu = find_gpu(bundle.gpu_model)
        cc = compute_capability or (
            ".".join(map(str, gpu.compute_capability)) if gpu else "unknown"
        )
        bundle.best = [
            {
                "config": fastest.config,
                "time_ms": fastest.time_ms,
                "compute_capability": cc,
                "cuda_version": cuda_version or "unknown",
                "job_id": job_id,
                "updated_at": None,
                "where": "compute_capability" if compute_capability else "the file",
            }
        ]


# --- checking against the operator and the file's own measurements ----------------------------


def _one_of(value: Any, allowed: Sequence[Any]) -> bool:
    """Whether ``value`` is one of ``allowed`` with the same type: ``2.0`` and ``True`` are not
    the int ``2`` and ``1`` of a space (they would render other source, or be stored as
    another config key)."""
    return any(type(value) is type(a) and value == a for a in allowed)


def config_outside(spec: Any, config: Mapping[str, Any]) -> str | None:
    """Why ``config`` is not a point of ``spec``'s space (a parameter missing or unknown, or a
    value not among the parameter's values with their exact type), or None."""
    why = spec.check_params(config)
    if why is not None:
        return why
    for name, values in spec.params.items():
        value = config[name]
        if not _one_of(value, values):
            kinds = "/".join(sorted({type(v).__name__ for v in values}))
            return f"{name}={value!r} is a {type(value).__name__}, not a {kinds} of {values}"
    return None


def space_outside(
    spec: Any, tune_params: Mapping[str, Sequence[Any]], *, values: bool = True
) -> str | None:
    """Why a space of ``tune_params`` (each parameter's values) does not lie inside ``spec``'s
    space: other parameter names, or (with ``values``: the operator's current version) a value
    that is not one of the operator's, by :func:`config_outside`'s rule. None if it does."""
    if set(tune_params) != set(spec.params):
        return (
            f"parameters {show(list(tune_params))} are not {spec.name}'s "
            f"({', '.join(spec.params)}): it is not a {spec.name} space"
        )
    if values:
        for name, given in tune_params.items():
            bad = [v for v in given if not _one_of(v, spec.params[name])]
            if bad:
                return (
                    f"{name} values {show(bad)} are not among {spec.name}'s {name} values "
                    f"{spec.params[name]}: it is not a {spec.name} space"
                )
    return None


def _check_operator(bundle: ParsedBundle) -> None:
    """The file's problem and every config it holds, against the registered operator (see the
    module docstring); puts ``bundle.params`` in the operator's order."""
    from kernels.spec import InvalidInput

    path, spec = bundle.path, _spec(bundle.path, bundle.operator)
    try:
        spec.validate(bundle.shape, bundle.dtype)
    except InvalidInput as exc:
        raise _fail(path, str(exc)) from None
    why = space_outside(spec, {p: () for p in bundle.params}, values=False)
    if why is not None:
        raise _fail(path, why.replace("it is not", "the file is not"))
    bundle.params = list(spec.params)
    current = bundle.operator_version == spec.version
    problem = f"{spec.name} {'x'.join(map(str, bundle.shape))} {bundle.dtype}"

    def reason(config: Mapping[str, Any], measured: bool) -> str | None:
        why = _names(config, spec.params)
        if why is None and current:
            why = config_outside(spec, config)
            if why is not None:
                return f"{why}: not a point of {spec.name}'s space"
            if measured:
                why = spec.check(config, bundle.shape, bundle.dtype)
                return f"the config is not valid for {problem}: {why}" if why else None
        return why

    for t in bundle.trials:
        why = reason(t.config, t.status == "ok")
        if why is not None:
            what = "measured as ok, but " if t.status == "ok" and "not valid" in why else ""
            raise _fail(path, f"{t.where}: {what}{why}")
    for record, name in [(j, "best_config") for j in bundle.jobs] + [
        (b, "config") for b in bundle.best
    ]:
        config = record.get(name)
        why = None if config is None else reason(config, True)
        if why is not None:
            raise _fail(path, f"{record['where']}.{name}: {why}")


def _compute_capability(path: Path, where: str, value: str, gpu_model: str) -> None:
    from tuner.gpus import find_gpu

    gpu = find_gpu(gpu_model)
    if gpu is None or value == "unknown":
        return
    own = ".".join(map(str, gpu.compute_capability))
    if value != own:
        raise _fail(path, f"{where}: the compute capability of the {gpu.name} is {own}, "
                    f"not {value!r}")  # fmt: skip


def _check_records(bundle: ParsedBundle) -> None:
    """The file against itself (see the module docstring): one trial per job and config; each
    job's best, and each best config naming a job of the file, one of its measurements; the
    compute capabilities; top-level fields that repeat the Kato block."""
    path = bundle.path
    measured: dict[tuple[str, str], ParsedTrial] = {}
    seen: dict[tuple[str, str], str] = {}
    for t in bundle.trials:
        key = (t.job_id, ",".join(str(t.config[p]) for p in bundle.params))
        if key in seen:
            raise _fail(path, f"{t.where}: job {t.job_id} has this config already ({seen[key]})")
        seen[key] = t.where
        if t.status == "ok":
            measured[key] = t

    def backed(job_id: str, config: Mapping[str, Any], time_ms: float) -> bool:
        t = measured.get((job_id, ",".join(str(config[p]) for p in bundle.params)))
        return t is not None and math.isclose(t.time_ms or 0.0, time_ms, rel_tol=1e-9)

    jobs = {job["id"] for job in bundle.jobs}
    for job in bundle.jobs:
        config, time_ms = job.get("best_config"), job.get("best_time_ms")
        if (config, time_ms) != (None, None) and (
            config is None or time_ms is None or not backed(job["id"], config, time_ms)
        ):
            raise _fail(path, f"{job['where']}: its best_config {show(config)} at "
                        f"{show(time_ms)} ms is not among the job's measured trials in the "
                        "file")  # fmt: skip
    for best in bundle.best:
        if best["job_id"] in jobs and not backed(best["job_id"], best["config"], best["time_ms"]):
            raise _fail(path, f"{best['where']}: config {show(best['config'])} at "
                        f"{best['time_ms']!r} ms is not among the file's measured trials of "
                        f"job {best['job_id']}")  # fmt: skip
        _compute_capability(path, best["where"], best["compute_capability"], bundle.gpu_model)
    problem = {name: getattr(bundle, name) for name in _PROBLEM_FIELDS}
    for label, value, name in bundle.echoes:
        if value is None:
            continue
        if name in problem:
            try:
                theirs = _value(path, label, name, value)
            except InvalidImport:
                theirs = value  # not even a value of the field: it disagrees
            if theirs != problem[name]:
                raise _fail(path, f"{label} {show(value)} disagrees with kato.{name} "
                            f"{show(problem[name])}")  # fmt: skip
            continue
        if name == "compute_capability":
            _compute_capability(path, label, value, bundle.gpu_model)
        known = sorted({b[name] for b in bundle.best})
        if known and value not in known:
            raise _fail(path, f"{label} {show(value)} disagrees with the Kato block's best "
                        f"configs ({', '.join(known)})")  # fmt: skip


def read_file(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ParsedBundle:
    """Parse and check one file (T4 or Kernel Tuner cache, detected from its content).

    Raises:
        InvalidImport: unreadable, not JSON, neither format, or invalid content.
    """
    path = Path(path)
    try:
        return _read(path, overrides or {})
    except InvalidImport:
        raise
    except Exception as exc:  # a case no check above foresaw: still this file's fault
        raise _fail(path, f"cannot import: {type(exc).__name__}: {exc}") from exc


def _read(path: Path, overrides: Mapping[str, Any]) -> ParsedBundle:
    data = _load_json(path)
    if not isinstance(data, dict):
        raise _fail(path, "expected a JSON object")
    if "results" in data and "schema_version" in data:
        bundle = _parse_t4(path, data, overrides)
    elif all(k in data for k in ("tune_params_keys", "tune_params", "cache")):
        bundle = _parse_kt(path, data, overrides)
    else:
        raise _fail(
            path,
            "neither T4 (schema_version, results) nor a Kernel Tuner cache "
            "(tune_params_keys, tune_params, cache)",
        )
    _check_operator(bundle)
    _check_records(bundle)
    return bundle


def expand(paths: Sequence[str | Path]) -> list[Path]:
    """Files named, plus ``*.json``/``*.json.gz`` files under directories named (sorted).

    Raises:
        InvalidImport: a path that does not exist, or a directory without such files.
    """
    files: list[Path] = []
    for item in map(Path, paths):
        if item.is_dir():
            found = sorted(p for p in item.rglob("*") if p.name.endswith((".json", ".json.gz")))
            if not found:
                raise InvalidImport(f"{item}: no .json or .json.gz files in this directory")
            files.extend(found)
        elif item.is_file():
            files.append(item)
        else:
            raise InvalidImport(f"{item}: no such file or directory")
    return files


# --- writing ---------------------------------------------------------------------------------


def _new_job(bundle: ParsedBundle, meta: Mapping[str, Any], trials: list[ParsedTrial]) -> Job:
    status = meta.get("status") if meta.get("status") in _JOB_STATUSES else "cancelled"
    error = meta.get("error")
    if meta.get("status") not in _JOB_STATUSES and meta.get("status"):
        error = f"imported while {meta.get('status')}"
    created = meta.get("created_at") or utcnow()
    return Job(
        id=meta["id"],
        operator=bundle.operator,
        operator_version=bundle.operator_version,
        shape=list(bundle.shape),
        shape_key=shape_key(bundle.shape),
        dtype=bundle.dtype,
        gpu_model=bundle.gpu_model,
        budget_configs=int(meta.get("budget_configs") or max(len(trials), 1)),
        budget_seconds=meta.get("budget_seconds"),
        strategy=meta.get("strategy") or "imported",
        seed=meta.get("seed") or 0,
        status=status,
        trials_done=sum(t.status not in UNCOUNTED_TRIAL_STATUSES for t in trials),
        best_time_ms=meta.get("best_time_ms"),
        best_config=meta.get("best_config"),
        error=error,
        created_at=created,
        started_at=meta.get("started_at"),
        finished_at=meta.get("finished_at") or created,
        cancel_requested=False,
    )


def _config_key(bundle: ParsedBundle, config: Mapping[str, Any]) -> str:
    return ",".join(str(config[p]) for p in bundle.params)


def _free_numbers(wanted: Sequence[int], held: set[int]) -> list[int]:
    """Numbers for new trials of a job whose stored trials hold ``held``: each keeps the number
    its file gives it unless a stored trial or an earlier one of the file has it; a repeat (an
    export written before numbers were unique per job) takes the lowest number still free."""
    taken = set(held)
    out: list[int | None] = []
    for number in wanted:
        out.append(None if number in taken else number)
        taken.add(number)
    free = (n for n in itertools.count() if n not in taken)
    return [number if number is not None else next(free) for number in out]


def _write_bundle(session: Session, bundle: ParsedBundle, report: ImportReport) -> None:
    by_job: dict[str, list[ParsedTrial]] = {}
    for t in bundle.trials:
        by_job.setdefault(t.job_id, []).append(t)
    for meta in bundle.jobs:
        present = session.get(Job, meta["id"])
        if present is not None:
            problem = (bundle.operator, bundle.operator_version, shape_key(bundle.shape),
                       bundle.dtype, bundle.gpu_model)  # fmt: skip
            stored = (present.operator, present.operator_version, present.shape_key,
                      present.dtype, present.gpu_model)  # fmt: skip
            if stored != problem:
                raise _fail(bundle.path, f"job {meta['id']} is stored for another problem "
                            f"({'|'.join(stored)}), not {'|'.join(problem)}")  # fmt: skip
            report.jobs_present += 1
        else:
            session.add(_new_job(bundle, meta, by_job.get(meta["id"], [])))
            report.jobs_added += 1
    session.flush()
    for job_id, trials in by_job.items():
        stored = set(session.scalars(select(Trial.config_key).where(Trial.job_id == job_id)))
        new = []
        for t in trials:
            key = _config_key(bundle, t.config)
            if key in stored:
                report.trials_present += 1
                continue
            stored.add(key)
            new.append((t, key))
        held = set(session.scalars(select(Trial.number).where(Trial.job_id == job_id)))
        numbers = _free_numbers([t.number for t, _ in new], held)
        for (t, key), number in zip(new, numbers, strict=True):
            session.add(
                Trial(
                    job_id=job_id,
                    number=number,
                    config=t.config,
                    config_key=key,
                    status=t.status,
                    time_ms=t.time_ms,
                    times_ms=t.times_ms,
                    compile_time_s=t.compile_time_s,
                    error=t.error,
                    created_at=t.created_at or utcnow(),
                    **{k: v for k, v in t.resources.items() if v is not None},
                )
            )
            report.trials_added += 1
    session.flush()
    for best in bundle.best:
        _upsert_best(session, bundle, best, report)


def _upsert_best(
    session: Session, bundle: ParsedBundle, best: dict[str, Any], report: ImportReport
) -> None:
    """Insert, or replace a stored best that is strictly slower; keeps ``updated_at``."""
    row = session.scalars(
        select(BestConfig).where(
            BestConfig.operator == bundle.operator,
            BestConfig.operator_version == bundle.operator_version,
            BestConfig.shape_key == shape_key(bundle.shape),
            BestConfig.dtype == bundle.dtype,
            BestConfig.gpu_model == bundle.gpu_model,
            BestConfig.compute_capability == best["compute_capability"],
            BestConfig.cuda_version == best["cuda_version"],
        )
    ).first()
    job_id = best["job_id"] if best["job_id"] and session.get(Job, best["job_id"]) else None
    updated = best["updated_at"] or utcnow()
    figures = _figures(session, bundle, best, job_id)
    if row is None:
        session.add(
            BestConfig(
                operator=bundle.operator,
                operator_version=bundle.operator_version,
                shape=list(bundle.shape),
                shape_key=shape_key(bundle.shape),
                dtype=bundle.dtype,
                gpu_model=bundle.gpu_model,
                compute_capability=best["compute_capability"],
                cuda_version=best["cuda_version"],
                config=best["config"],
                time_ms=best["time_ms"],
                job_id=job_id,
                updated_at=updated,
                **figures,
            )
        )
        session.flush()
        report.best_added += 1
    elif best["time_ms"] < row.time_ms:
        row.config, row.time_ms, row.job_id, row.updated_at = (
            best["config"],
            best["time_ms"],
            job_id,
            updated,
        )
        for name, value in figures.items():
            setattr(row, name, value)
        report.best_replaced += 1
    else:
        # The stored winner stays; figures it lacks come from the file (they are the key's).
        for name, value in figures.items():
            if getattr(row, name) is None:
                setattr(row, name, value)
        report.best_kept += 1


def _figures(
    session: Session, bundle: ParsedBundle, best: dict[str, Any], job_id: str | None
) -> dict[str, Any]:
    """The figures a best record brings (``default_ms``, ``framework_ms`` with ``framework``),
    only those it has. A file without ``default_ms`` (older than migration 0006, or Kernel
    Tuner's) gets it from its own measurements where it can: the best's job's trial of the
    operator's default config for the shape, at the current version of the operator (an older
    version's default may be another config)."""
    figures = {}
    if best.get("framework_ms") is not None:
        figures["framework_ms"] = best["framework_ms"]
        figures["framework"] = best.get("framework")
    default_ms = best.get("default_ms")
    if default_ms is None and job_id is not None:
        from kernels import get_operator

        try:
            spec = get_operator(bundle.operator)
            if spec.version == bundle.operator_version:
                default = spec.default_config(list(bundle.shape), bundle.dtype)
                default_ms = trial_time(session, job_id, _config_key(bundle, default))
        except Exception:  # no default for this shape: nothing to fill in
            default_ms = None
    if default_ms is not None:
        figures["default_ms"] = default_ms
    return figures


def import_bundles(
    session: Session,
    bundles: Sequence[ParsedBundle],
    *,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> ImportReport:
    """Write parsed bundles in one transaction and commit (rolled back on any error).

    ``on_progress``: called with ``("write", bundles written, len(bundles))`` after each one."""
    report = ImportReport(files=len(bundles))
    try:
        for done, bundle in enumerate(bundles, 1):
            _write_bundle(session, bundle, report)
            if on_progress is not None:
                on_progress("write", done, len(bundles))
        session.commit()
    except Exception:
        session.rollback()
        raise
    report.warnings = _version_warnings(bundles) + _gpu_warnings(bundles)
    # Optuna's view of the imported jobs (optuna-dashboard), once their rows are committed.
    from db.studies import record_job_studies

    report.warnings += record_job_studies(session, [j["id"] for b in bundles for j in b.jobs])
    return report


def _gpu_warnings(bundles: Sequence[ParsedBundle]) -> list[str]:
    """A GPU model the catalog does not list is stored as named, unchecked: say so once."""
    from tuner.gpus import find_gpu

    unknown = sorted({b.gpu_model for b in bundles if find_gpu(b.gpu_model) is None})
    return [
        f"GPU model {name!r} is not in Kato's catalog: its results are stored under that "
        "name, their compute capability and the GPU's limits unchecked; check the name "
        "(`GET /v1/gpus` lists the catalog)"
        for name in unknown
    ]


def _version_warnings(bundles: Sequence[ParsedBundle]) -> list[str]:
    """Results for another version of a local operator are stored but never served."""
    out = []
    try:
        from kernels import get_operator
    except Exception:  # pragma: no cover
        return out
    seen = set()
    for b in bundles:
        if (b.operator, b.operator_version) in seen:
            continue
        seen.add((b.operator, b.operator_version))
        try:
            local = get_operator(b.operator).version
        except Exception:
            out.append(f"operator {b.operator!r} is not known here: its results are not served")
            continue
        if local != b.operator_version:
            out.append(
                f"{b.operator} results are for version {b.operator_version}, this installation "
                f"has {local}: they are stored but not served"
            )
    return out


def import_paths(
    session: Session,
    paths: Sequence[str | Path],
    overrides: Mapping[str, Any] | None = None,
    *,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> ImportReport:
    """Validate every file under ``paths`` first, then import them all (one transaction).

    ``on_progress``: called with ``("check", files checked, files)`` after each file is read
    and checked, then as :func:`import_bundles` calls it (the CLI draws a progress bar).

    Raises:
        InvalidImport: any file is invalid (nothing is written).
    """
    files = expand(paths)
    bundles = []
    for done, path in enumerate(files, 1):
        bundles.append(read_file(path, overrides))
        if on_progress is not None:
            on_progress("check", done, len(files))
    return import_bundles(session, bundles, on_progress=on_progress)


__all__ = [
    "ImportReport",
    "InvalidImport",
    "ParsedBundle",
    "expand",
    "import_bundles",
    "import_paths",
    "read_file",
]
