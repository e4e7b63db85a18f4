"""Import results exported by ``kato export`` (or written by Kernel Tuner) into a database.

Reads T4 JSON and Kernel Tuner cache files (plain or ``.gz``; format detected from the content),
validates every file before anything is written, then writes all of them in one transaction.

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
  the block lacks; one that disagrees with the block is an :class:`InvalidImport`.
- **Validation**: every field that is stored is checked for its type and range first: integers
  are ints (not bools) that fit a 32-bit column, floats are finite, strings fit their column,
  dates parse and lie between 2000 and tomorrow, job ids are 32 lowercase hex digits (as Kato
  makes them), so an imported file cannot make the API fail later.
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
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.export import RESOURCES, T4_INVALIDITY
from db.models import JOB_STATUSES, BestConfig, Job, Trial, utcnow
from db.queries import UNCOUNTED_TRIAL_STATUSES, shape_key

TRIAL_STATUSES = tuple(T4_INVALIDITY)
#: T4 ``invalidity`` -> Kato status, the first listed where several map to one ("runtime" is
#: ``launch_error``; a ``crashed`` trial keeps its status in the file's ``kato`` object).
_INVALIDITY_STATUS: dict[str, str] = {}
for _status, _invalidity in T4_INVALIDITY.items():
    _INVALIDITY_STATUS.setdefault(_invalidity, _status)
_KT_MARKERS = {
    "CompilationFailedConfig": "compile_error",
    "RuntimeFailedConfig": "launch_error",
    "InvalidConfig": "invalid",
    "ErrorConfig": "launch_error",
}
_JOB_STATUSES = ("done", "failed", "cancelled")
#: Bounds of what is stored: the Integer columns are 32-bit on PostgreSQL.
MAX_INT32 = 2**31 - 1
MAX_RANK = 8
#: Kato's job ids (db.models.new_job_id: uuid4 hex; imported foreign jobs: a sha256 prefix).
_JOB_ID = re.compile(r"[0-9a-f]{32}")
_EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
#: String columns' lengths (db.models).
_PROBLEM_LENGTHS = {"operator": 64, "operator_version": 64, "dtype": 32, "gpu_model": 64}
_PROBLEM_FIELDS = ("operator", "operator_version", "shape", "dtype", "gpu_model")
_MAX_CONFIG_KEY = 1024


class InvalidImport(ValueError):
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
    created_at: datetime | None


@dataclass
class ParsedBundle:
    """One file's problem, jobs, trials and best configs, validated."""

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


def _load_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise _fail(path, f"cannot read: {exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(path, f"not JSON: {exc}") from None


def _show(value: Any) -> str:
    """``repr(value)``, cut to a length a message can hold."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _int(path: Path, where: str, value: Any, low: int = 0, high: int = MAX_INT32) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(path, f"{where} must be an integer from {low} to {high}, got {_show(value)}")
    return value


def _float(
    path: Path,
    where: str,
    value: Any,
    *,
    scale: float = 1.0,
    positive: bool = False,
    high: float = math.inf,
) -> float:
    """A finite number >= 0 (> 0 with ``positive``, <= ``high``), times ``scale``."""
    low_ok = _number(value) and (value > 0 if positive else value >= 0) and value <= high
    scaled = float(value) * scale if low_ok else math.nan
    if not math.isfinite(scaled):
        kind = "positive" if positive else "non-negative"
        bound = f" (at most {high})" if high != math.inf else ""
        raise _fail(path, f"{where} must be a finite {kind} number{bound}, got {_show(value)}")
    return scaled


def _optional_float(path: Path, where: str, value: Any, **kwargs: Any) -> float | None:
    return None if value is None else _float(path, where, value, **kwargs)


def _time(path: Path, where: str, value: Any, scale: float = 1.0) -> float:
    if not _number(value) or value <= 0 or not math.isfinite(float(value) * scale):
        raise _fail(path, f"{where}: time must be a positive number, got {_show(value)}")
    return float(value) * scale


def _string(path: Path, where: str, value: Any, max_length: int | None = None) -> str | None:
    """``None``, or a string of at most ``max_length`` characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _fail(path, f"{where} must be a string, got {_show(value)}")
    if max_length is not None and len(value) > max_length:
        raise _fail(path, f"{where} is longer than {max_length} characters: {_show(value)}")
    return value


def _job_id(path: Path, where: str, value: Any) -> str:
    if not isinstance(value, str) or not _JOB_ID.fullmatch(value):
        raise _fail(path, f"{where} must be a Kato job id (32 lowercase hex digits), got "
                    f"{_show(value)}")  # fmt: skip
    return value


def _datetime(path: Path, where: str, value: Any) -> datetime | None:
    """``None``, or an ISO 8601 date and time from 2000 to tomorrow (UTC where no zone)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _fail(path, f"{where} must be an ISO 8601 date, got {_show(value)}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise _fail(path, f"{where} must be an ISO 8601 date, got {_show(value)}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    try:
        parsed = parsed.astimezone(UTC)
        in_range = _EARLIEST <= parsed <= utcnow() + timedelta(days=1)
    except OverflowError:  # beyond year 9999 in UTC
        in_range = False
    if not in_range:
        raise _fail(path, f"{where} must lie between 2000 and tomorrow, got {_show(value)}")
    return parsed


def _resources(path: Path, where: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The per-trial resource fields: counts are ints, ``occupancy`` a fraction."""
    out: dict[str, Any] = {}
    for name in RESOURCES:
        value = values.get(name)
        if value is None:
            out[name] = None
        elif name == "occupancy":
            out[name] = _float(path, f"{where}: {name}", value, high=1.0)
        else:
            out[name] = _int(path, f"{where}: {name}", value)
    return out


def _params(path: Path, where: str, value: Any) -> list[str]:
    if (
        not isinstance(value, list)
        or not all(isinstance(p, str) and p for p in value)
        or len(set(value)) != len(value)
    ):
        raise _fail(path, f"{where} must be a list of distinct parameter names")
    return value


def _shape(path: Path, where: str, value: Any) -> list[int]:
    shape = value
    if isinstance(value, str):
        parts = re.split(r"\s*[x,X]\s*", value.strip()) if value.strip() else []
        if not parts or not all(re.fullmatch(r"[+-]?\d{1,19}", p) for p in parts):
            raise _fail(path, f"{where} must look like 4096x4096, got {_show(value)}")
        shape = [int(p) for p in parts]
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        or not all(1 <= d <= MAX_INT32 for d in shape)
    ):
        raise _fail(
            path,
            f"{where} must be a list of 1 to {MAX_RANK} integers from 1 to {MAX_INT32}, "
            f"got {_show(value)}",
        )
    return shape


def _problem_value(path: Path, where: str, name: str, value: Any) -> Any:
    """One field of the problem, checked and normalised (a GPU model by the catalog)."""
    if name == "shape":
        return _shape(path, where, value)
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, f"{where} must be a non-empty string, got {_show(value)}")
    if name == "gpu_model":
        from tuner.gpus import normalize_gpu_name

        try:
            value = normalize_gpu_name(value)
        except ValueError as exc:
            raise _fail(path, f"{where}: {exc}") from None
    limit = _PROBLEM_LENGTHS[name]
    if len(value) > limit:
        raise _fail(path, f"{where} is longer than {limit} characters: {_show(value)}")
    return value


def _problem(
    path: Path,
    meta: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    labels: Mapping[str, str],
    kato_export: bool,
) -> dict[str, Any]:
    """operator, operator_version, shape, dtype, gpu_model: from ``meta``, and ``overrides``.

    In a file with a Kato block (``kato_export``) an override fills only a field the block
    lacks, and one that disagrees with it is an error; in a foreign file an override replaces
    what the file's own fields say. ``labels`` names each field in the file, for messages.
    """
    given = {("gpu_model" if k == "gpu" else k): v for k, v in overrides.items() if v is not None}
    merged: dict[str, Any] = {}
    conflicts = []
    for name in _PROBLEM_FIELDS:
        flag = "--gpu" if name == "gpu_model" else f"--{name.replace('_', '-')}"
        own, override = meta.get(name), given.get(name)
        if own is not None and own != "" and own != []:
            own = _problem_value(path, labels[name], name, own)
        else:
            own = None
        if override is not None:
            override = _problem_value(path, flag, name, override)
        if override is None or own is None or not kato_export:
            merged[name] = override if override is not None else own
        elif override != own:
            conflicts.append(f"{flag} {_show(override)} conflicts with the file's {labels[name]} "
                             f"{_show(own)}")  # fmt: skip
        else:
            merged[name] = own
    if conflicts:
        raise _fail(path, f"{'; '.join(conflicts)} (overrides are for files without Kato metadata)")
    missing = [k for k in ("operator", "shape", "dtype", "gpu_model") if merged[k] is None]
    if missing:
        names = ", ".join(f"--{'gpu' if m == 'gpu_model' else m}" for m in missing)
        raise _fail(path, f"no Kato metadata for {', '.join(missing)}: pass {names}")
    if merged["operator_version"] is None:
        try:
            from kernels import get_operator

            merged["operator_version"] = get_operator(merged["operator"]).version
        except Exception:
            raise _fail(path, f"unknown operator {merged['operator']!r} and no version") from None
    return merged


def _config(path: Path, where: str, value: Any, params: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, f"{where}: configuration must be an object, got {type(value).__name__}")
    if set(value) != set(params):
        raise _fail(
            path,
            f"{where}: configuration has {_show(sorted(value))}, expected the parameters "
            f"{_show(list(params))}",
        )
    for name, v in value.items():
        if not isinstance(v, int | float | str) or isinstance(v, bool):
            raise _fail(path, f"{where}: parameter {name} has a {type(v).__name__} value")
        if isinstance(v, float) and not math.isfinite(v):
            raise _fail(path, f"{where}: parameter {name} is {v!r}, not a finite number")
        if isinstance(v, int) and not -(2**63) <= v < 2**63:
            raise _fail(path, f"{where}: parameter {name} is out of the 64-bit range")
    if len(",".join(str(value[p]) for p in params)) > _MAX_CONFIG_KEY:
        raise _fail(path, f"{where}: configuration is longer than {_MAX_CONFIG_KEY} characters")
    return {name: value[name] for name in params}


def _job(path: Path, where: str, job: Any, params: Sequence[str]) -> dict[str, Any]:
    """One entry of ``kato.jobs``, every field checked (absent ones are ``None``)."""
    if not isinstance(job, dict):
        raise _fail(path, f"{where} must be an object")
    if "id" not in job:
        raise _fail(path, f"{where} needs an id")
    status = job.get("status")
    if status is not None and (not isinstance(status, str) or status not in JOB_STATUSES):
        raise _fail(path, f"{where}.status must be one of {', '.join(JOB_STATUSES)}, got "
                    f"{_show(status)}")  # fmt: skip
    best_config = job.get("best_config")
    if best_config is not None:
        best_config = _config(path, f"{where}.best_config", best_config, params)
    trials_done = job.get("trials_done")
    if trials_done is not None:
        _int(path, f"{where}.trials_done", trials_done)  # recounted from the trials
    budget = job.get("budget_configs")
    if budget is not None:
        budget = _int(path, f"{where}.budget_configs", budget, low=1)
    return {
        "id": _job_id(path, f"{where}.id", job.get("id")),
        "status": status,
        "budget_configs": budget,
        "budget_seconds": _optional_float(
            path, f"{where}.budget_seconds", job.get("budget_seconds"), positive=True
        ),
        "strategy": _string(path, f"{where}.strategy", job.get("strategy"), 16),
        "seed": None if job.get("seed") is None else _int(path, f"{where}.seed", job["seed"]),
        "best_time_ms": _optional_float(
            path, f"{where}.best_time_ms", job.get("best_time_ms"), positive=True
        ),
        "best_config": best_config,
        "error": _string(path, f"{where}.error", job.get("error")),
        "created_at": _datetime(path, f"{where}.created_at", job.get("created_at")),
        "started_at": _datetime(path, f"{where}.started_at", job.get("started_at")),
        "finished_at": _datetime(path, f"{where}.finished_at", job.get("finished_at")),
    }


def _jobs(path: Path, meta: Mapping[str, Any], params: Sequence[str]) -> list[dict[str, Any]]:
    jobs = meta.get("jobs", [])
    if not isinstance(jobs, list):
        raise _fail(path, "kato.jobs must be a list")
    out = [_job(path, f"kato.jobs[{i}]", job, params) for i, job in enumerate(jobs)]
    seen: set[str] = set()
    for i, job in enumerate(out):
        if job["id"] in seen:
            raise _fail(path, f"kato.jobs[{i}]: job {job['id']} is listed twice")
        seen.add(job["id"])
    return out


def _best(path: Path, meta: Mapping[str, Any], params: Sequence[str]) -> list[dict[str, Any]]:
    best = meta.get("best", [])
    if not isinstance(best, list):
        raise _fail(path, "kato.best must be a list")
    out = []
    for i, row in enumerate(best):
        where = f"kato.best[{i}]"
        if not isinstance(row, dict):
            raise _fail(path, f"{where} must be an object")
        job_id = row.get("job_id")
        out.append(
            {
                "config": _config(path, where, row.get("config"), params),
                "time_ms": _time(path, where, row.get("time_ms")),
                "compute_capability": _string(
                    path, f"{where}.compute_capability", row.get("compute_capability"), 16
                )
                or "unknown",
                "cuda_version": _string(path, f"{where}.cuda_version", row.get("cuda_version"), 32)
                or "unknown",
                "job_id": None if job_id is None else _job_id(path, f"{where}.job_id", job_id),
                "updated_at": _datetime(path, f"{where}.updated_at", row.get("updated_at")),
            }
        )
    return out


def _synthetic_job(bundle: ParsedBundle, path: Path) -> str:
    """A job id derived from the problem and the trials, so that a re-import finds it."""
    digest = hashlib.sha256()
    digest.update(json.dumps([bundle.operator, bundle.operator_version, bundle.shape,
                              bundle.dtype, bundle.gpu_model]).encode())  # fmt: skip
    for t in bundle.trials:
        digest.update(json.dumps([t.config, t.status, t.time_ms], default=str).encode())
    return digest.hexdigest()[:32]


def _finish_foreign(bundle: ParsedBundle, path: Path, meta: Mapping[str, Any]) -> None:
    """Give a foreign file's trials a job and its fastest measurement a best config."""
    job_id = _synthetic_job(bundle, path)
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
        }
    ]
    if fastest is not None and not bundle.best:
        from tuner.gpus import find_gpu

        gpu = find_gpu(bundle.gpu_model)
        cc = _string(path, "compute_capability", meta.get("compute_capability"), 16) or (
            ".".join(map(str, gpu.compute_capability)) if gpu else "unknown"
        )
        cuda = _string(path, "cuda_version", meta.get("cuda_version"), 32)
        bundle.best = [
            {
                "config": fastest.config,
                "time_ms": fastest.time_ms,
                "compute_capability": cc,
                "cuda_version": cuda or "unknown",
                "job_id": job_id,
                "updated_at": None,
            }
        ]


def _parse_t4(path: Path, data: dict[str, Any], overrides: Mapping[str, Any]) -> ParsedBundle:
    results = data.get("results")
    if not isinstance(results, list):
        raise _fail(path, "T4: 'results' must be a list")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _fail(path, "T4: 'metadata' must be an object")
    meta = metadata.get("kato") or {}
    if not isinstance(meta, dict):
        raise _fail(path, "T4: metadata.kato must be an object")
    unit = str(metadata.get("timeunit", "milliseconds")).lower()
    scales = {"milliseconds": 1.0, "ms": 1.0, "seconds": 1e3, "s": 1e3, "microseconds": 1e-3}
    if unit not in scales:
        raise _fail(path, f"T4: unsupported metadata.timeunit {_show(unit)}")
    scale = scales[unit]
    labels = {name: f"metadata.kato.{name}" for name in _PROBLEM_FIELDS}
    problem = _problem(path, meta, overrides, labels=labels, kato_export=bool(meta))
    params = meta.get("params")
    if not params and results and isinstance(results[0], dict):
        first = results[0].get("configuration")
        params = list(first) if isinstance(first, dict) else params
    bundle = ParsedBundle(path, params=_params(path, "kato.params", params), **problem)
    for i, result in enumerate(results):
        where = f"results[{i}]"
        if not isinstance(result, dict):
            raise _fail(path, f"{where} must be an object")
        for required in ("configuration", "times", "invalidity", "correctness"):
            if required not in result:
                raise _fail(path, f"{where}: missing {required!r} (required by the T4 schema)")
        invalidity = result["invalidity"]
        if not isinstance(invalidity, str) or invalidity not in _INVALIDITY_STATUS:
            raise _fail(path, f"{where}: invalidity {_show(invalidity)} is not a T4 value")
        kato = result.get("kato")
        if kato is None:
            kato = {}
        elif not isinstance(kato, dict):
            raise _fail(path, f"{where}.kato must be an object")
        status = kato.get("status", _INVALIDITY_STATUS[invalidity])
        if not isinstance(status, str) or status not in TRIAL_STATUSES:
            raise _fail(path, f"{where}: unknown status {_show(status)}")
        times = result["times"]
        if not isinstance(times, dict):
            raise _fail(path, f"{where}.times must be an object")
        listed = result.get("measurements")
        listed = [] if listed is None else listed
        if not isinstance(listed, list):
            raise _fail(path, f"{where}.measurements must be a list")
        measurements: dict[str, Any] = {}
        for j, m in enumerate(listed):
            if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                raise _fail(path, f"{where}.measurements[{j}] must be an object with a name")
            measurements[m["name"]] = m.get("value")
        time_ms = None
        if status == "ok":
            time_ms = _time(path, where, measurements.get("time"), scale)
        runtimes = times.get("runtimes") or []
        if not isinstance(runtimes, list):
            raise _fail(path, f"{where}: times.runtimes must be a list of numbers")
        runtimes_ms = [
            _float(path, f"{where}: times.runtimes[{j}]", t, scale=scale)
            for j, t in enumerate(runtimes)
        ]
        compile_ms = _optional_float(
            path,
            f"{where}: times.compilation_time",
            times.get("compilation_time", times.get("compilation")),
            scale=scale,
        )
        job = kato.get("job")
        bundle.trials.append(
            ParsedTrial(
                job_id=_string(path, f"{where}.kato.job", job) or "",
                number=_int(path, f"{where}.kato.number", kato.get("number", i)),
                config=_config(path, where, result["configuration"], params),
                status=status,
                time_ms=time_ms,
                times_ms=runtimes_ms,
                compile_time_s=compile_ms / 1000 if compile_ms is not None else None,
                resources=_resources(path, f"{where}.measurements", measurements),
                error=_string(path, f"{where}.kato.error", kato.get("error")),
                created_at=_datetime(path, f"{where}.timestamp", result.get("timestamp")),
            )
        )
    _complete(bundle, path, meta)
    return bundle


def _parse_kt(path: Path, data: dict[str, Any], overrides: Mapping[str, Any]) -> ParsedBundle:
    keys, space, entries = data["tune_params_keys"], data["tune_params"], data["cache"]
    if not isinstance(keys, list) or not isinstance(space, dict) or not isinstance(entries, dict):
        raise _fail(path, "Kernel Tuner cache: malformed tune_params_keys, tune_params or cache")
    keys = _params(path, "tune_params_keys", keys)
    if data.get("kato") is not None and not isinstance(data["kato"], dict):
        raise _fail(path, "kato must be an object")
    meta = data.get("kato") or {}
    labels = {name: f"kato.{name}" for name in _PROBLEM_FIELDS}
    kato_export = bool(meta)
    if not meta:  # a Kernel Tuner cache, or an older Kato one: what its extra fields say
        labels = {
            "operator": "kato_operator",
            "operator_version": "kato_operator_version",
            "dtype": "dtype",
            "shape": "problem_size",
            "gpu_model": "device_name",
        }
        meta = {
            "operator": data.get("kato_operator"),
            "operator_version": data.get("kato_operator_version"),
            "dtype": data.get("dtype"),
            "shape": data.get("problem_size"),
            "gpu_model": data.get("device_name"),
            "compute_capability": data.get("compute_capability"),
            "cuda_version": data.get("cuda_version"),
        }
    problem = _problem(path, meta, overrides, labels=labels, kato_export=kato_export)
    bundle = ParsedBundle(path, params=list(keys), **problem)
    for i, (key, entry) in enumerate(entries.items()):
        where = f"cache[{_show(key)}]"
        if not isinstance(entry, dict):
            raise _fail(path, f"{where} must be an object")
        if kato_export and "kato_job" not in entry:
            continue  # a best config written as an entry; the best list has it
        value = entry.get("time")
        if isinstance(value, str):
            if value not in _KT_MARKERS:
                raise _fail(path, f"{where}: unknown failure marker {_show(value)}")
            status = entry.get("kato_status", _KT_MARKERS[value])
        else:
            status = "ok"
        if not isinstance(status, str) or status not in TRIAL_STATUSES:
            raise _fail(path, f"{where}: unknown status {_show(status)}")
        times = entry.get("times") or []
        if not isinstance(times, list):
            raise _fail(path, f"{where}: times must be a list of numbers")
        times_ms = [_float(path, f"{where}: times[{j}]", t) for j, t in enumerate(times)]
        compile_ms = _optional_float(path, f"{where}: compile_time", entry.get("compile_time"))
        bundle.trials.append(
            ParsedTrial(
                job_id=_string(path, f"{where}: kato_job", entry.get("kato_job")) or "",
                number=_int(path, f"{where}: kato_number", entry.get("kato_number", i)),
                config=_config(path, where, {p: entry.get(p) for p in keys}, keys),
                status=status,
                time_ms=_time(path, where, value) if status == "ok" else None,
                times_ms=times_ms,
                compile_time_s=compile_ms / 1000 if compile_ms is not None else None,
                resources=_resources(path, where, entry),
                error=_string(path, f"{where}: error", entry.get("error")),
                created_at=_datetime(path, f"{where}: timestamp", entry.get("timestamp")),
            )
        )
    _complete(bundle, path, meta)
    return bundle


def _complete(bundle: ParsedBundle, path: Path, meta: Mapping[str, Any]) -> None:
    if meta.get("jobs") is not None or meta.get("format"):
        bundle.jobs = _jobs(path, meta, bundle.params)
        bundle.best = _best(path, meta, bundle.params)
        known = {job["id"] for job in bundle.jobs}
        stray = {t.job_id for t in bundle.trials} - known
        if stray:
            raise _fail(path, f"trials of jobs not listed in kato.jobs: {sorted(stray)[:3]}")
    else:
        _finish_foreign(bundle, path, meta)


def read_file(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ParsedBundle:
    """Parse and validate one file (T4 or Kernel Tuner cache, detected from its content).

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
        return _parse_t4(path, data, overrides)
    if all(k in data for k in ("tune_params_keys", "tune_params", "cache")):
        return _parse_kt(path, data, overrides)
    raise _fail(
        path,
        "neither T4 (schema_version, results) nor a Kernel Tuner cache "
        "(tune_params_keys, tune_params, cache)",
    )


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
        report.best_replaced += 1
    else:
        report.best_kept += 1


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
    report.warnings = _version_warnings(bundles)
    return report


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
