"""Import results exported by ``kato export`` (or written by Kernel Tuner) into a database.

Reads T4 JSON and Kernel Tuner cache files (plain or ``.gz``; format detected from the content),
validates every file before anything is written, then writes all of them in one transaction.

Contract:

- **Idempotent**: jobs keep their ids, a trial is unique per ``(job, config key)``, and a best
  config replaces a stored one only when strictly faster: importing twice changes nothing.
- **Kato's own exports** carry everything in their Kato block (:mod:`db.export`).
- **Foreign files** (Kernel Tuner's caches and T4 output, or Kato's older caches with only
  ``kato_operator``/``dtype`` fields) need what they lack from ``overrides`` (``operator``,
  ``shape``, ``dtype``, ``gpu``): their trials become one ``done`` job whose id is derived from
  the content (so a second import finds it), and the fastest measurement becomes a best config.
- **Errors**: :class:`InvalidImport` names the file and what is wrong; nothing is written.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.export import RESOURCES, T4_INVALIDITY
from db.models import BestConfig, Job, Trial, utcnow
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


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _time(path: Path, where: str, value: Any) -> float:
    if not _number(value) or value <= 0:
        raise _fail(path, f"{where}: time must be a positive number, got {value!r}")
    return float(value)


def _parse_datetime(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _problem(path: Path, meta: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """operator, operator_version, shape, dtype, gpu_model: from ``meta``, else ``overrides``."""
    merged = dict(meta)
    for name, value in overrides.items():
        if value is not None:
            merged["gpu_model" if name == "gpu" else name] = value
    missing = [k for k in ("operator", "shape", "dtype", "gpu_model") if not merged.get(k)]
    if missing:
        names = ", ".join(f"--{'gpu' if m == 'gpu_model' else m}" for m in missing)
        raise _fail(path, f"no Kato metadata for {', '.join(missing)}: pass {names}")
    shape = merged["shape"]
    if isinstance(shape, str):
        try:
            shape = [int(p) for p in shape.replace("x", ",").split(",") if p.strip()]
        except ValueError:
            raise _fail(path, f"shape must look like 4096x4096, got {shape!r}") from None
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    ):
        raise _fail(path, f"shape must be a list of positive integers, got {shape!r}")
    for name in ("operator", "dtype", "gpu_model"):
        if not isinstance(merged[name], str):
            raise _fail(path, f"{name} must be a string, got {merged[name]!r}")
    from tuner.gpus import normalize_gpu_name

    version = merged.get("operator_version")
    if not version:
        try:
            from kernels import get_operator

            version = get_operator(merged["operator"]).version
        except Exception:
            raise _fail(path, f"unknown operator {merged['operator']!r} and no version") from None
    return {
        "operator": merged["operator"],
        "operator_version": str(version),
        "shape": shape,
        "dtype": merged["dtype"],
        "gpu_model": normalize_gpu_name(merged["gpu_model"]),
    }


def _config(path: Path, where: str, value: Any, params: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, f"{where}: configuration must be an object, got {type(value).__name__}")
    if set(value) != set(params):
        raise _fail(
            path, f"{where}: configuration has {sorted(value)}, expected the parameters {params}"
        )
    for name, v in value.items():
        if not isinstance(v, int | float | str) or isinstance(v, bool):
            raise _fail(path, f"{where}: parameter {name} has a {type(v).__name__} value")
    return {name: value[name] for name in params}


def _jobs(path: Path, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    jobs = meta.get("jobs", [])
    if not isinstance(jobs, list):
        raise _fail(path, "kato.jobs must be a list")
    for i, job in enumerate(jobs):
        if not isinstance(job, dict) or not isinstance(job.get("id"), str) or not job["id"]:
            raise _fail(path, f"kato.jobs[{i}] needs an id")
        if len(job["id"]) > 32:
            raise _fail(path, f"kato.jobs[{i}]: id longer than 32 characters")
    return jobs


def _best(path: Path, meta: Mapping[str, Any], params: Sequence[str]) -> list[dict[str, Any]]:
    best = meta.get("best", [])
    if not isinstance(best, list):
        raise _fail(path, "kato.best must be a list")
    out = []
    for i, row in enumerate(best):
        where = f"kato.best[{i}]"
        if not isinstance(row, dict):
            raise _fail(path, f"{where} must be an object")
        out.append(
            {
                "config": _config(path, where, row.get("config"), params),
                "time_ms": _time(path, where, row.get("time_ms")),
                "compute_capability": str(row.get("compute_capability") or "unknown"),
                "cuda_version": str(row.get("cuda_version") or "unknown"),
                "job_id": row.get("job_id") if isinstance(row.get("job_id"), str) else None,
                "updated_at": _parse_datetime(row.get("updated_at")),
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
        cc = meta.get("compute_capability") or (
            ".".join(map(str, gpu.compute_capability)) if gpu else "unknown"
        )
        bundle.best = [
            {
                "config": fastest.config,
                "time_ms": fastest.time_ms,
                "compute_capability": str(cc),
                "cuda_version": str(meta.get("cuda_version") or "unknown"),
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
    scale = {"milliseconds": 1.0, "ms": 1.0, "seconds": 1e3, "s": 1e3, "microseconds": 1e-3}
    if unit not in scale:
        raise _fail(path, f"T4: unsupported metadata.timeunit {unit!r}")
    problem = _problem(path, meta, overrides)
    params = meta.get("params")
    if not params and results and isinstance(results[0], dict):
        params = list(results[0].get("configuration") or {})
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise _fail(path, "kato.params must be a list of parameter names")
    bundle = ParsedBundle(path, params=params, **problem)
    for i, result in enumerate(results):
        where = f"results[{i}]"
        if not isinstance(result, dict):
            raise _fail(path, f"{where} must be an object")
        for required in ("configuration", "times", "invalidity", "correctness"):
            if required not in result:
                raise _fail(path, f"{where}: missing {required!r} (required by the T4 schema)")
        invalidity = result["invalidity"]
        if invalidity not in _INVALIDITY_STATUS:
            raise _fail(path, f"{where}: invalidity {invalidity!r} is not a T4 value")
        kato = result.get("kato") if isinstance(result.get("kato"), dict) else {}
        status = kato.get("status", _INVALIDITY_STATUS[invalidity])
        if status not in TRIAL_STATUSES:
            raise _fail(path, f"{where}: unknown status {status!r}")
        times = result["times"] if isinstance(result["times"], dict) else {}
        measurements = {
            m.get("name"): m.get("value")
            for m in result.get("measurements") or []
            if isinstance(m, dict)
        }
        time_ms = None
        if status == "ok":
            time_ms = _time(path, where, measurements.get("time")) * scale[unit]
        runtimes = times.get("runtimes") or []
        if not isinstance(runtimes, list) or not all(_number(t) for t in runtimes):
            raise _fail(path, f"{where}: times.runtimes must be a list of numbers")
        compile_ms = times.get("compilation_time", times.get("compilation"))
        bundle.trials.append(
            ParsedTrial(
                job_id=str(kato.get("job") or ""),
                number=int(kato.get("number", i)),
                config=_config(path, where, result["configuration"], params),
                status=status,
                time_ms=time_ms,
                times_ms=[float(t) * scale[unit] for t in runtimes],
                compile_time_s=compile_ms * scale[unit] / 1000 if _number(compile_ms) else None,
                resources={k: measurements.get(k) for k in RESOURCES},
                error=kato.get("error"),
                created_at=_parse_datetime(result.get("timestamp")),
            )
        )
    _complete(bundle, path, meta)
    return bundle


def _parse_kt(path: Path, data: dict[str, Any], overrides: Mapping[str, Any]) -> ParsedBundle:
    keys, space, entries = data["tune_params_keys"], data["tune_params"], data["cache"]
    if not isinstance(keys, list) or not isinstance(space, dict) or not isinstance(entries, dict):
        raise _fail(path, "Kernel Tuner cache: malformed tune_params_keys, tune_params or cache")
    meta = data.get("kato") if isinstance(data.get("kato"), dict) else {}
    if not meta:  # a Kernel Tuner cache, or an older Kato one: what its extra fields say
        meta = {
            "operator": data.get("kato_operator"),
            "operator_version": data.get("kato_operator_version"),
            "dtype": data.get("dtype"),
            "shape": data.get("problem_size"),
            "gpu_model": data.get("device_name"),
            "compute_capability": data.get("compute_capability"),
            "cuda_version": data.get("cuda_version"),
        }
    problem = _problem(path, meta, overrides)
    bundle = ParsedBundle(path, params=list(keys), **problem)
    kato_export = isinstance(data.get("kato"), dict)
    for i, (key, entry) in enumerate(entries.items()):
        where = f"cache[{key!r}]"
        if not isinstance(entry, dict):
            raise _fail(path, f"{where} must be an object")
        if kato_export and "kato_job" not in entry:
            continue  # a best config written as an entry; the best list has it
        value = entry.get("time")
        if isinstance(value, str):
            if value not in _KT_MARKERS:
                raise _fail(path, f"{where}: unknown failure marker {value!r}")
            status = entry.get("kato_status", _KT_MARKERS[value])
        else:
            status = "ok"
        if status not in TRIAL_STATUSES:
            raise _fail(path, f"{where}: unknown status {status!r}")
        times = entry.get("times") or []
        if not isinstance(times, list) or not all(_number(t) for t in times):
            raise _fail(path, f"{where}: times must be a list of numbers")
        compile_ms = entry.get("compile_time")
        bundle.trials.append(
            ParsedTrial(
                job_id=str(entry.get("kato_job") or ""),
                number=int(entry.get("kato_number", i)),
                config=_config(path, where, {p: entry.get(p) for p in keys}, keys),
                status=status,
                time_ms=_time(path, where, value) if status == "ok" else None,
                times_ms=[float(t) for t in times],
                compile_time_s=compile_ms / 1000 if _number(compile_ms) else None,
                resources={k: entry.get(k) for k in RESOURCES},
                error=entry.get("error") if isinstance(entry.get("error"), str) else None,
                created_at=_parse_datetime(entry.get("timestamp")),
            )
        )
    _complete(bundle, path, meta)
    return bundle


def _complete(bundle: ParsedBundle, path: Path, meta: Mapping[str, Any]) -> None:
    if meta.get("jobs") is not None or meta.get("format"):
        bundle.jobs = _jobs(path, meta)
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
    data = _load_json(path)
    if not isinstance(data, dict):
        raise _fail(path, "expected a JSON object")
    overrides = overrides or {}
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
    created = _parse_datetime(meta.get("created_at")) or utcnow()
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
        strategy=str(meta.get("strategy") or "imported")[:16],
        seed=int(meta.get("seed") or 0),
        status=status,
        trials_done=sum(t.status not in UNCOUNTED_TRIAL_STATUSES for t in trials),
        best_time_ms=meta.get("best_time_ms"),
        best_config=meta.get("best_config"),
        error=error,
        created_at=created,
        started_at=_parse_datetime(meta.get("started_at")),
        finished_at=_parse_datetime(meta.get("finished_at")) or created,
        cancel_requested=False,
    )


def _config_key(bundle: ParsedBundle, config: Mapping[str, Any]) -> str:
    return ",".join(str(config[p]) for p in bundle.params)


def _write_bundle(session: Session, bundle: ParsedBundle, report: ImportReport) -> None:
    by_job: dict[str, list[ParsedTrial]] = {}
    for t in bundle.trials:
        by_job.setdefault(t.job_id, []).append(t)
    for meta in bundle.jobs:
        if session.get(Job, meta["id"]) is not None:
            report.jobs_present += 1
        else:
            session.add(_new_job(bundle, meta, by_job.get(meta["id"], [])))
            report.jobs_added += 1
    session.flush()
    for job_id, trials in by_job.items():
        stored = set(session.scalars(select(Trial.config_key).where(Trial.job_id == job_id)))
        for t in trials:
            key = _config_key(bundle, t.config)
            if key in stored:
                report.trials_present += 1
                continue
            stored.add(key)
            session.add(
                Trial(
                    job_id=job_id,
                    number=t.number,
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


def import_bundles(session: Session, bundles: Sequence[ParsedBundle]) -> ImportReport:
    """Write parsed bundles in one transaction and commit (rolled back on any error)."""
    report = ImportReport(files=len(bundles))
    try:
        for bundle in bundles:
            _write_bundle(session, bundle, report)
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
) -> ImportReport:
    """Validate every file under ``paths`` first, then import them all (one transaction).

    Raises:
        InvalidImport: any file is invalid (nothing is written).
    """
    bundles = [read_file(p, overrides) for p in expand(paths)]
    return import_bundles(session, bundles)


__all__ = [
    "ImportReport",
    "InvalidImport",
    "ParsedBundle",
    "expand",
    "import_bundles",
    "import_paths",
    "read_file",
]
