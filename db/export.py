"""Export Kato's results and trials: Kernel Tuner cache files and T4 JSON.

The unit of export is a *bundle*: everything stored for one problem (operator, operator version,
shape, dtype, GPU model): the trials of its jobs and its best configs. One bundle becomes one file:

- **Kernel Tuner cache** (``kt``): the operator's parameter space as ``tune_params``, one entry per
  measured config with ``time`` (the median, ms), ``times`` (every timed batch), ``compile_time``
  (ms) and Kato's resource fields; a failed config's ``time`` is Kernel Tuner's failure marker.
  A config measured by several jobs is one entry, the fastest, with the others' trials in its
  ``kato_other_trials`` (so an import gets every trial back). A best config no trial of the file
  measured is an entry of its own. Every other combination of ``tune_params`` is an entry too,
  ``"time": "InvalidConfig"`` with ``kato_unmeasured`` saying why (``invalid``: the operator's
  constraints reject it for this shape; ``not measured``), so Kernel Tuner's simulation mode
  replays the file as it is, without a restrictions function, and skips them (Kato's readers
  leave them out: :func:`kato.shared.kt_cache.load_cache`, :mod:`db.importer`). Kernel Tuner reads
  plain JSON only and appends ``.json`` to a name without it: the files of a directory export
  end in ``.kt.json``; a ``.gz`` name is gzipped, for Kato alone.
- **T4** (``t4``): the auto-tuning community's results format (schema 1.0.0, as Kernel Tuner's
  ``get_t4_results`` writes it): ``{"schema_version", "results": [{"timestamp",
  "configuration", "objectives", "times", "invalidity", "correctness", "measurements"}],
  "metadata": {"timeunit": "milliseconds", ...}}``, one result per trial (all jobs kept).

Both carry the same Kato block (KT: the top-level ``kato`` field; T4: ``metadata.kato``) so
another Kato installation can import them (:mod:`db.importer`)::

    {"format": 1, "operator", "operator_version", "shape", "dtype", "gpu_model", "params",
     "jobs": [{"id", "status", "budget_configs", ...}],
     "best": [{"compute_capability", "cuda_version", "config", "time_ms", "job_id",
               "updated_at", "default_ms"?, "framework_ms"?, "framework"?,
               "compiled_ms"?, "compiled"?}]}

and each trial its job, number and Kato status (KT: ``kato_job``, ``kato_number``,
``kato_status`` in the entry; T4: a ``kato`` object in the result).

Every record is built as the :mod:`db.formats` model the importer reads it as (``model_construct``:
what is stored is written as it is, not checked again) and written by its ``model_dump``, so the
field names and their nesting are the reader's by construction.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kato.db import queries
from kato.db.formats import (
    KATO_FORMAT,
    RESOURCES,
    T4_INVALIDITY,
    T4_SCHEMA_VERSION,
    BestRecord,
    JobRecord,
    KatoBlock,
    KTEntry,
    T4Document,
    T4Kato,
    T4Measurement,
    T4Metadata,
    T4Result,
    T4Times,
)
from kato.db.models import RESERVED, BestConfig, Job, Trial
from kato.kernels import get_operator
from sqlalchemy import select
from sqlalchemy.orm import Session

from kato.errors import InvalidInput, KatoError
from kato.shared.gpus import find_gpu
from kato.shared.kt_cache import OTHER_TRIALS, KernelTunerCache, save_cache, unmeasured_entry

FORMATS = ("t4", "kt")
#: The most stand-in entries a Kernel Tuner export writes (matmul's space has 62,208 configs);
#: a larger product (only an operator not registered here, by the values seen) gets none.
MAX_STAND_INS = 250_000

_MARKERS = {"compile_error": "CompilationFailedConfig", "invalid": "InvalidConfig"}


class ExportError(KatoError, ValueError):
    """Nothing to export, or the output cannot hold what was selected (the message says)."""


@dataclass
class Bundle:
    """Everything stored for one problem: jobs (with trials, in job then trial order) and best
    configs."""

    operator: str
    operator_version: str
    shape: list[int]
    dtype: str
    gpu_model: str
    jobs: list[Job] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    best: list[BestConfig] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (
            self.operator,
            self.operator_version,
            queries.shape_key(self.shape),
            self.dtype,
            self.gpu_model,
        )

    def tune_params(self) -> dict[str, list[Any]]:
        """The parameter space in Kernel Tuner key order: the operator's, where it is registered
        and its parameters are the ones measured (with any other value seen appended: a config
        of another version); else the values seen, in first-seen order."""
        configs = [t.config for t in self.trials] + [b.config for b in self.best]
        space: dict[str, list[Any]] = {}
        spec = _registered(self.operator)
        if spec is not None and all(set(c) == set(spec.params) for c in configs):
            space = {k: list(v) for k, v in spec.params.items()}
        for config in configs:
            for name, value in config.items():
                values = space.setdefault(name, [])
                if value not in values:
                    values.append(value)
        return space


def _registered(operator: str) -> Any:
    """The operator's spec, or None where it is not registered here."""
    try:
        return get_operator(operator)
    except InvalidInput:
        return None


def _dump(record: Any) -> dict[str, Any]:
    """A constructed record as JSON values: the fields it was given, timestamps in ISO 8601."""
    return record.model_dump(mode="json", exclude_unset=True)


def _job_record(job: Job) -> JobRecord:
    return JobRecord.model_construct(
        **{name: getattr(job, name) for name in JobRecord.model_fields}
    )


def _best_record(row: BestConfig) -> BestRecord:
    fields = {
        "compute_capability": row.compute_capability,
        "cuda_version": row.cuda_version,
        "config": dict(row.config),
        "time_ms": row.time_ms,
        "job_id": row.job_id,
        "updated_at": row.updated_at,
    }
    # The figures beside the winner, where measured (older readers ignore unknown fields).
    for name in ("default_ms", "framework_ms", "framework", "compiled_ms", "compiled"):
        if getattr(row, name) is not None:
            fields[name] = getattr(row, name)
    return BestRecord.model_construct(**fields)


def _kato_record(bundle: Bundle, params: Sequence[str]) -> KatoBlock:
    return KatoBlock.model_construct(
        format=KATO_FORMAT,
        operator=bundle.operator,
        operator_version=bundle.operator_version,
        shape=list(bundle.shape),
        dtype=bundle.dtype,
        gpu_model=bundle.gpu_model,
        params=list(params),
        jobs=[_job_record(job) for job in bundle.jobs],
        best=[_best_record(row) for row in bundle.best],
    )


def kato_block(bundle: Bundle, params: Sequence[str]) -> dict[str, Any]:
    """The Kato metadata of a bundle (see the module docstring)."""
    return _dump(_kato_record(bundle, params))


# --- selecting ---------------------------------------------------------------------------------


def collect(
    session: Session,
    *,
    job_ids: Sequence[str] | None = None,
    operator: str | None = None,
    gpu: str | None = None,
    dtype: str | None = None,
) -> list[Bundle]:
    """The bundles to export, sorted by problem.

    With ``job_ids``: those jobs' trials, plus the best configs of their problems. Otherwise every
    job with trials and every best config matching ``operator``/``gpu``/``dtype`` (all when
    none is given). ``gpu`` is matched by its canonical catalog name.

    Raises:
        ExportError: a job id that does not exist.
    """
    if gpu is not None:
        found = find_gpu(gpu)
        gpu = found.name if found else gpu
    bundles: dict[tuple[str, ...], Bundle] = {}

    def bundle_for(obj: Job | BestConfig) -> Bundle:
        b = Bundle(obj.operator, obj.operator_version, list(obj.shape), obj.dtype, obj.gpu_model)
        return bundles.setdefault(b.key, b)

    if job_ids:
        jobs = []
        for job_id in job_ids:
            job = queries.get_job(session, job_id)
            if job is None:
                raise ExportError(f"no job {job_id!r}")
            jobs.append(job)
    else:
        stmt = select(Job).where(Job.id.in_(select(Trial.job_id).distinct()))
        stmt = _filtered(stmt, Job, operator, gpu, dtype).order_by(Job.created_at, Job.id)
        jobs = list(session.scalars(stmt))
    for job in jobs:
        bundle = bundle_for(job)
        bundle.jobs.append(job)
        # A reservation (a config being measured right now, db.ledger) is not a result.
        bundle.trials.extend(t for t in queries.job_trials(session, job.id) if t.status != RESERVED)

    stmt = _filtered(select(BestConfig), BestConfig, operator, gpu, dtype)
    for row in session.scalars(stmt.order_by(BestConfig.id)):
        if job_ids:
            b = Bundle(
                row.operator, row.operator_version, list(row.shape), row.dtype, row.gpu_model
            )
            if b.key not in bundles:
                continue
        bundle_for(row).best.append(row)
    return [bundles[k] for k in sorted(bundles)]


def _filtered(stmt: Any, model: Any, operator: str | None, gpu: str | None, dtype: str | None):
    if operator is not None:
        stmt = stmt.where(model.operator == operator)
    if gpu is not None:
        stmt = stmt.where(model.gpu_model == gpu)
    if dtype is not None:
        stmt = stmt.where(model.dtype == dtype)
    return stmt


# --- Kernel Tuner cache ----------------------------------------------------------------------


def _kt_entry(trial: Trial) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if trial.status == "ok":
        fields.update(time=trial.time_ms, times=list(trial.times_ms or []))
    else:
        fields.update(time=_MARKERS.get(trial.status, "RuntimeFailedConfig"), error=trial.error)
    if trial.compile_time_s is not None:
        fields["compile_time"] = trial.compile_time_s * 1000.0
    entry = KTEntry.model_construct(
        **fields,
        **{name: getattr(trial, name) for name in RESOURCES},
        timestamp=trial.created_at,
        kato_job=trial.job_id,
        kato_number=trial.number,
        kato_status=trial.status,
    )
    return {**trial.config, **_dump(entry)}


def _faster(new: dict[str, Any], old: dict[str, Any]) -> bool:
    new_t, old_t = new.get("time"), old.get("time")
    if not isinstance(new_t, int | float):
        return False
    return not isinstance(old_t, int | float) or new_t < old_t


def _measured_entry(entries: list[dict[str, Any]], params: Sequence[str]) -> dict[str, Any]:
    """One config's entries (one per job) as one: the fastest, the others in its
    :data:`OTHER_TRIALS` (without the parameters, which are the entry's)."""
    best = entries[0]
    for entry in entries[1:]:
        best = entry if _faster(entry, best) else best
    others = [{k: v for k, v in e.items() if k not in params} for e in entries if e is not best]
    return {**best, OTHER_TRIALS: others} if others else best


def _stand_ins(bundle: Bundle, cache: KernelTunerCache) -> None:
    """An :func:`unmeasured_entry` for every combination of ``tune_params`` the cache lacks,
    saying whether the operator's constraints reject it for the bundle's shape."""
    if math.prod(len(v) for v in cache.tune_params.values()) > MAX_STAND_INS:
        return
    spec = _registered(bundle.operator)
    if spec is None or spec.version != bundle.operator_version:
        spec = None  # another version's constraints are not known here
    names = list(cache.tune_params)
    for values in itertools.product(*cache.tune_params.values()):
        config = dict(zip(names, values, strict=True))
        key = cache.key(config)
        if key in cache.entries:
            continue
        reason = "not measured"
        if spec is not None:
            try:
                rejected = spec.check(config, bundle.shape, bundle.dtype) is not None
            except Exception:  # a value this code's check does not take
                rejected = False
            reason = "invalid" if rejected else reason
        cache.entries[key] = unmeasured_entry(config, reason)


def bundle_to_kt(bundle: Bundle) -> KernelTunerCache:
    """A bundle as a Kernel Tuner cache (see the module docstring)."""
    tune_params = bundle.tune_params()
    gpu = find_gpu(bundle.gpu_model)
    spec = _registered(bundle.operator)
    kernel_name = spec.kernel_name if spec is not None else bundle.operator
    latest = max(bundle.best, key=lambda r: r.updated_at, default=None)
    cache = KernelTunerCache(
        device_name=gpu.full_name if gpu and gpu.full_name else bundle.gpu_model,
        kernel_name=kernel_name,
        problem_size=list(bundle.shape),
        tune_params=tune_params,
        extra={
            "kato_operator": bundle.operator,
            "kato_operator_version": bundle.operator_version,
            "dtype": bundle.dtype,
            "compute_capability": latest.compute_capability if latest else None,
            "cuda_version": latest.cuda_version if latest else None,
            "kato": kato_block(bundle, list(tune_params)),
        },
    )
    by_key: dict[str, list[dict[str, Any]]] = {}
    for trial in bundle.trials:
        by_key.setdefault(cache.key(trial.config), []).append(_kt_entry(trial))
    for key, entries in by_key.items():
        cache.entries[key] = _measured_entry(entries, list(tune_params))
    for row in sorted(bundle.best, key=lambda r: r.time_ms):  # no trial of the file has them
        entry = KTEntry.model_construct(time=row.time_ms, times=[])
        cache.entries.setdefault(cache.key(row.config), {**row.config, **_dump(entry)})
    _stand_ins(bundle, cache)
    return cache


def job_to_cache(session: Session, job_id: str) -> KernelTunerCache:
    """The trials of job ``job_id`` (and its problem's best configs) as a Kernel Tuner cache.

    Raises:
        KeyError: if there is no such job.
    """
    try:
        (bundle,) = collect(session, job_ids=[job_id])
    except ExportError:
        raise KeyError(f"no job {job_id}") from None
    return bundle_to_kt(bundle)


# --- T4 --------------------------------------------------------------------------------------


def _t4_result(trial: Trial) -> dict[str, Any]:
    times = {"runtimes": list(trial.times_ms or [])}
    if trial.compile_time_s is not None:
        times["compilation_time"] = trial.compile_time_s * 1000.0
    measurements = []
    if trial.status == "ok" and trial.time_ms is not None:
        measurements.append(T4Measurement.model_construct(name="time", value=trial.time_ms,
                                                          unit="ms"))  # fmt: skip
    for name, unit in RESOURCES.items():
        value = getattr(trial, name)
        if value is not None:
            measurements.append(T4Measurement.model_construct(name=name, value=value, unit=unit))
    result = T4Result.model_construct(
        timestamp=trial.created_at,
        configuration=dict(trial.config),
        objectives=["time"],
        times=T4Times.model_construct(**times),
        invalidity=T4_INVALIDITY.get(trial.status, "runtime"),
        correctness=0 if trial.status == "verify_error" else 1,
        measurements=measurements,
        kato=T4Kato.model_construct(
            job=trial.job_id, number=trial.number, status=trial.status, error=trial.error
        ),  # fmt: skip
    )
    return _dump(result)


def bundle_to_t4(bundle: Bundle) -> dict[str, Any]:
    """A bundle as a T4 results document (see the module docstring)."""
    params = list(bundle.tune_params())
    metadata = T4Metadata.model_construct(
        timeunit="milliseconds", kato=_kato_record(bundle, params)
    )
    document = T4Document.model_construct(
        schema_version=T4_SCHEMA_VERSION,
        results=[_t4_result(t) for t in bundle.trials],
        metadata=metadata,
    )
    return _dump(document)


# --- files -----------------------------------------------------------------------------------


def _name_part(text: str) -> str:
    """``text`` as part of a file name: letters, digits and ``._+-`` only, no leading dot."""
    return re.sub(r"[^0-9A-Za-z._+-]+", "-", text).strip(".-") or "-"


def bundle_filename(bundle: Bundle, fmt: str) -> str:
    """``softmax_H200_4096x4096_float16_<version>.t4.json`` (``.kt.json`` for Kernel Tuner).

    Built from the bundle's fields made safe for a file name (a GPU model's spaces become
    ``-``); where that changed a field other than the GPU model (a name no registered operator
    has, stored by an older Kato), 8 hex digits of the fields are appended, so two bundles never
    share a name. Never a path: no separator, no leading dot.
    """
    raw = [bundle.operator, bundle.gpu_model, queries.shape_key(bundle.shape), bundle.dtype,
           bundle.operator_version]  # fmt: skip
    parts = [_name_part(p) for p in raw]
    name = "_".join(parts)
    if any(a != b for i, (a, b) in enumerate(zip(raw, parts, strict=True)) if i != 1):
        name += "_" + hashlib.sha256(json.dumps(raw).encode()).hexdigest()[:8]
    return f"{name}.{fmt}.json"


def _write_json(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` atomically (temp file + rename); gzip when the name ends in ``.gz``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    if path.name.endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_bundle(bundle: Bundle, path: Path, fmt: str) -> None:
    """Write one bundle to ``path`` (atomically) in ``fmt`` (``t4`` or ``kt``; ``.gz`` names
    are gzipped)."""
    if fmt == "kt":
        save_cache(bundle_to_kt(bundle), path)
    elif fmt == "t4":
        _write_json(bundle_to_t4(bundle), path)
    else:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def is_file_target(out: Path) -> bool:
    """A path naming one file (``.json`` or ``.json.gz``), as opposed to a directory."""
    return not out.is_dir() and (out.name.endswith(".json") or out.name.endswith(".json.gz"))


def export(bundles: Iterable[Bundle], out: str | Path, fmt: str = "t4") -> list[Path]:
    """Write ``bundles`` to ``out``: a file (``*.json``: exactly one bundle) or a directory (one
    file per bundle, named by :func:`bundle_filename`). Returns the paths written.

    Raises:
        ExportError: nothing selected, an unknown format, or several bundles for one file.
    """
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    bundles = list(bundles)
    out = Path(out)
    if not bundles:
        raise ExportError("nothing to export: no job trials or best configs match")
    if is_file_target(out):
        if len(bundles) > 1:
            raise ExportError(
                f"{len(bundles)} problems match but {out} is one file: give a directory, or "
                "narrow the selection (--job, --operator, --gpu, --dtype)"
            )
        write_bundle(bundles[0], out, fmt)
        return [out]
    paths = [out / bundle_filename(b, fmt) for b in bundles]
    root = out.resolve()
    for path in paths:  # the names are safe by construction; a path outside is a bug here
        if path.resolve().parent != root:
            raise ExportError(f"refusing to write {path}: not a file directly in {out}")
    if len(set(paths)) != len(paths):
        raise ExportError(f"two problems would share a file name in {out}")
    for bundle, path in zip(bundles, paths, strict=True):
        write_bundle(bundle, path, fmt)
    return paths


def kernel_tuner_reads(path: Path, fmt: str) -> bool:
    """Whether Kernel Tuner's simulation mode can open ``path`` as written in ``fmt`` (a
    Kernel Tuner cache in plain JSON, named ``.json``)."""
    return fmt == "kt" and path.name.endswith(".json")
