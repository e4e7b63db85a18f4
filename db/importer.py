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
  and range by the models of the two formats, so an imported file cannot make the API fail
  later; this module checks only what a model cannot know (below) and builds rows from the
  validated models.
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

from kato.db.formats import (
    PROBLEM_FIELDS,
    BestRecord,
    Dtype,
    FormatError,
    JobRecord,
    KTDocument,
    Name,
    Shape,
    T4Document,
    TrialRecord,
    Version,
    parse,
    show,
)
from kato.db.models import BestConfig, Job, Trial, utcnow
from kato.db.queries import UNCOUNTED_TRIAL_STATUSES, shape_key, trial_time
from kato.kernels import get_operator
from sqlalchemy import select
from sqlalchemy.orm import Session

from kato.errors import InvalidInput, KatoError
from kato.shared.gpus import find_gpu, normalize_gpu_name
from kato.shared.status import TERMINAL_STATUSES

#: What :func:`import_bundles` calls once its rows are committed: (session, the imported jobs'
#: ids) -> warnings for the report.
AfterCommit = Callable[[Session, Sequence[str]], list[str]]
_FLAGS = {
    "operator": "--operator",
    "operator_version": "--operator-version",
    "shape": "--shape",
    "dtype": "--dtype",
    "gpu_model": "--gpu",
}


class InvalidImport(KatoError, ValueError):
    """A file that cannot be imported; the message names the file and the problem."""


@dataclass
class ParsedBundle:
    """One file's problem, jobs, trials and best configs, checked.

    ``jobs`` and ``best`` are the file's validated records, each located in the file (a foreign
    file's made up: :func:`_finish_foreign`); a best config's compute capability and CUDA
    version are ``unknown`` where the file does not say.
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
    jobs: list[JobRecord] = field(default_factory=list)
    trials: list[TrialRecord] = field(default_factory=list)
    best: list[BestRecord] = field(default_factory=list)
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


def _load_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise FormatError(f"cannot read: {exc}") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"not JSON: {exc}") from None
    # A lone surrogate escape (\ud800) decodes to a string no database can store.
    if re.search(rb"\\u[dD][89a-fA-F]", raw):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError("a string holds a lone surrogate escape (not text)") from None
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


def _gpu(where: str, value: Any) -> str:
    """A GPU model as the catalog names it (a well-formed name it does not list is kept,
    cleaned, and warned about in the report: :func:`_gpu_warnings`)."""
    name = parse(Name, value, where)
    try:
        name = normalize_gpu_name(name)
    except InvalidInput as exc:
        raise FormatError(f"{where}: {exc}") from None
    why = gpu_name_problem(name)
    if why is not None:
        raise FormatError(f"{where}: GPU model {show(name)} {why}")
    return parse(Name, name, where)


def _shape_text(where: str, value: str) -> list[int]:
    """A shape given as text (``4096x4096``, ``4096,4096``), as on the command line."""
    parts = re.split(r"\s*[x,X]\s*", value.strip()) if value.strip() else []
    if not parts or not all(re.fullmatch(r"[0-9]{1,10}", p) for p in parts):
        raise FormatError(f"{where} must look like 4096x4096, got {show(value)}")
    return parse(Shape, [int(p) for p in parts], where)


def _value(where: str, name: str, value: Any) -> Any:
    """One problem field, checked and normalised (a GPU model by the catalog)."""
    if name == "shape":
        if isinstance(value, str) and where.startswith("--"):
            return _shape_text(where, value)
        return parse(Shape, value, where)
    if name == "gpu_model":
        return _gpu(where, value)
    kind = {"operator": Name, "operator_version": Version, "dtype": Dtype}[name]
    return parse(kind, value, where)


def _spec(operator: str) -> Any:
    try:
        return get_operator(operator)
    except InvalidInput as exc:
        raise FormatError(f"{exc}; Kato imports results only of the operators it has") from None


def _problem(
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
    for name in PROBLEM_FIELDS:
        flag = _FLAGS[name]
        override = _value(flag, name, given[name]) if name in given else None
        mine = own.get(name)
        if mine is not None and (kato_export or override is None):
            mine = _value(labels[name], name, mine)
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
        raise FormatError(f"{'; '.join(conflicts)} (overrides are for files without Kato "
                          "metadata)")  # fmt: skip
    missing = [k for k in ("operator", "shape", "dtype", "gpu_model") if merged[k] is None]
    if missing:
        names = ", ".join(_FLAGS[m] for m in missing)
        raise FormatError(f"no Kato metadata for {', '.join(missing)}: pass {names}")
    spec = _spec(merged["operator"])
    if merged["operator_version"] is None:
        merged["operator_version"] = spec.version
    return merged


def _names(config: Mapping[str, Any], params: Sequence[str]) -> str | None:
    """Why ``config`` does not have exactly the parameters ``params``, or None."""
    missing = [p for p in params if p not in config]
    if missing:
        return f"missing parameter(s) {', '.join(missing)}"
    unknown = sorted(set(config) - set(params))
    return f"unknown parameter(s) {', '.join(unknown)}" if unknown else None


def _bundle(path: Path, doc: T4Document | KTDocument, overrides: Mapping[str, Any]) -> ParsedBundle:
    """The file's problem (its own fields and ``overrides``), its trials, jobs and best
    configs: a Kato export's own, or a foreign file's made up (:func:`_finish_foreign`)."""
    own, labels = doc.problem_fields()
    problem = _problem(own, overrides, labels=labels, kato_export=doc.kato_export)
    bundle = ParsedBundle(path, params=doc.params(), echoes=doc.echoes(), **problem)
    bundle.trials = doc.trials()
    block, prefix = doc.block, doc.BLOCK_AT
    if block is None or not block.lists_jobs:
        if isinstance(doc, KTDocument):  # what a Kernel Tuner file may say of its GPU
            _finish_foreign(bundle, doc.compute_capability, doc.cuda_version)
        else:
            _finish_foreign(bundle, None, None)
        return bundle
    bundle.jobs = [job.located(f"{prefix}.jobs[{i}]") for i, job in enumerate(block.jobs or [])]
    bundle.best = [
        best.model_copy(
            update={
                "compute_capability": best.compute_capability or "unknown",
                "cuda_version": best.cuda_version or "unknown",
            }
        ).located(f"{prefix}.best[{i}]")
        for i, best in enumerate(block.best)
    ]
    stray = {t.job_id for t in bundle.trials} - {job.id for job in bundle.jobs}
    if stray:
        raise FormatError(f"trials of jobs not listed in {prefix}.jobs: {sorted(stray)[:3]}")
    return bundle


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
    job = JobRecord(
        id=job_id,
        status="done",
        budget_configs=max(len(bundle.trials), 1),
        strategy="imported",
        best_time_ms=fastest.time_ms if fastest else None,
        best_config=fastest.config if fastest else None,
    )
    bundle.jobs = [job.located("the file")]
    if fastest is not None:
        gpu = find_gpu(bundle.gpu_model)
        cc = compute_capability or (
            ".".join(map(str, gpu.compute_capability)) if gpu else "unknown"
        )
        best = BestRecord(
            config=fastest.config,
            time_ms=fastest.time_ms,
            compute_capability=cc,
            cuda_version=cuda_version or "unknown",
            job_id=job_id,
        )
        bundle.best = [best.located("compute_capability" if compute_capability else "the file")]


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
    spec = _spec(bundle.operator)
    try:
        spec.validate(bundle.shape, bundle.dtype)
    except InvalidInput as exc:
        raise FormatError(str(exc)) from None
    why = space_outside(spec, {p: () for p in bundle.params}, values=False)
    if why is not None:
        raise FormatError(why.replace("it is not", "the file is not"))
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
            raise FormatError(f"{t.where}: {what}{why}")
    records = [(j, "best_config", j.best_config) for j in bundle.jobs]
    for record, name, config in records + [(b, "config", b.config) for b in bundle.best]:
        why = None if config is None else reason(config, True)
        if why is not None:
            raise FormatError(f"{record.where}.{name}: {why}")


def _compute_capability(where: str, value: str, gpu_model: str) -> None:
    gpu = find_gpu(gpu_model)
    if gpu is None or value == "unknown":
        return
    own = ".".join(map(str, gpu.compute_capability))
    if value != own:
        raise FormatError(f"{where}: the compute capability of the {gpu.name} is {own}, "
                          f"not {value!r}")  # fmt: skip


def _check_records(bundle: ParsedBundle) -> None:
    """The file against itself (see the module docstring): one trial per job and config; each
    job's best, and each best config naming a job of the file, one of its measurements; the
    compute capabilities; top-level fields that repeat the Kato block."""
    measured: dict[tuple[str, str], TrialRecord] = {}
    seen: dict[tuple[str, str], str] = {}
    for t in bundle.trials:
        key = (t.job_id, _config_key(bundle, t.config))
        if key in seen:
            raise FormatError(f"{t.where}: job {t.job_id} has this config already ({seen[key]})")
        seen[key] = t.where
        if t.status == "ok":
            measured[key] = t

    def backed(job_id: str, config: Mapping[str, Any], time_ms: float) -> bool:
        t = measured.get((job_id, _config_key(bundle, config)))
        return t is not None and math.isclose(t.time_ms or 0.0, time_ms, rel_tol=1e-9)

    jobs = {job.id for job in bundle.jobs}
    for job in bundle.jobs:
        config, time_ms = job.best_config, job.best_time_ms
        if (config, time_ms) != (None, None) and (
            config is None or time_ms is None or not backed(job.id, config, time_ms)
        ):
            raise FormatError(f"{job.where}: its best_config {show(config)} at "
                              f"{show(time_ms)} ms is not among the job's measured trials in "
                              "the file")  # fmt: skip
    for best in bundle.best:
        if best.job_id in jobs and not backed(best.job_id, best.config, best.time_ms):
            raise FormatError(f"{best.where}: config {show(best.config)} at {best.time_ms!r} ms "
                              f"is not among the file's measured trials of job "
                              f"{best.job_id}")  # fmt: skip
        _compute_capability(best.where, best.compute_capability or "unknown", bundle.gpu_model)
    _check_echoes(bundle)


def _check_echoes(bundle: ParsedBundle) -> None:
    """Top-level fields of a Kernel Tuner export that repeat its Kato block agree with it."""
    problem = {name: getattr(bundle, name) for name in PROBLEM_FIELDS}
    for label, value, name in bundle.echoes:
        if value is None:
            continue
        if name in problem:
            try:
                theirs = _value(label, name, value)
            except FormatError:
                theirs = value  # not even a value of the field: it disagrees
            if theirs != problem[name]:
                raise FormatError(f"{label} {show(value)} disagrees with kato.{name} "
                                  f"{show(problem[name])}")  # fmt: skip
            continue
        if name == "compute_capability":
            _compute_capability(label, value, bundle.gpu_model)
        known = sorted({getattr(b, name) for b in bundle.best})
        if known and value not in known:
            raise FormatError(f"{label} {show(value)} disagrees with the Kato block's best "
                              f"configs ({', '.join(known)})")  # fmt: skip


def read_file(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ParsedBundle:
    """Parse and check one file (T4 or Kernel Tuner cache, detected from its content).

    Raises:
        InvalidImport: unreadable, not JSON, neither format, or invalid content.
    """
    path = Path(path)
    try:
        return _read(path, overrides or {})
    except FormatError as exc:
        raise _fail(path, str(exc)) from None
    except Exception as exc:  # a case no check above foresaw: still this file's fault
        raise _fail(path, f"cannot import: {type(exc).__name__}: {exc}") from exc


def _read(path: Path, overrides: Mapping[str, Any]) -> ParsedBundle:
    data = _load_json(path)
    if not isinstance(data, dict):
        raise FormatError("expected a JSON object")
    if "results" in data and "schema_version" in data:
        bundle = _bundle(path, parse(T4Document, data), overrides)
    elif all(k in data for k in ("tune_params_keys", "tune_params", "cache")):
        bundle = _bundle(path, parse(KTDocument, data), overrides)
    else:
        raise FormatError(
            "neither T4 (schema_version, results) nor a Kernel Tuner cache "
            "(tune_params_keys, tune_params, cache)"
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


def _new_job(bundle: ParsedBundle, meta: JobRecord, trials: list[TrialRecord]) -> Job:
    status = meta.status if meta.status in TERMINAL_STATUSES else "cancelled"
    error = meta.error
    if meta.status not in TERMINAL_STATUSES and meta.status:
        error = f"imported while {meta.status}"
    created = meta.created_at or utcnow()
    return Job(
        id=meta.id,
        operator=bundle.operator,
        operator_version=bundle.operator_version,
        shape=list(bundle.shape),
        shape_key=shape_key(bundle.shape),
        dtype=bundle.dtype,
        gpu_model=bundle.gpu_model,
        budget_configs=int(meta.budget_configs or max(len(trials), 1)),
        budget_seconds=meta.budget_seconds,
        strategy=meta.strategy or "imported",
        seed=meta.seed or 0,
        status=status,
        trials_done=sum(t.status not in UNCOUNTED_TRIAL_STATUSES for t in trials),
        best_time_ms=meta.best_time_ms,
        best_config=meta.best_config,
        error=error,
        created_at=created,
        started_at=meta.started_at,
        finished_at=meta.finished_at or created,
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
    by_job: dict[str, list[TrialRecord]] = {}
    for t in bundle.trials:
        by_job.setdefault(t.job_id, []).append(t)
    for meta in bundle.jobs:
        present = session.get(Job, meta.id)
        if present is not None:
            problem = (bundle.operator, bundle.operator_version, shape_key(bundle.shape),
                       bundle.dtype, bundle.gpu_model)  # fmt: skip
            stored = (present.operator, present.operator_version, present.shape_key,
                      present.dtype, present.gpu_model)  # fmt: skip
            if stored != problem:
                raise _fail(bundle.path, f"job {meta.id} is stored for another problem "
                            f"({'|'.join(stored)}), not {'|'.join(problem)}")  # fmt: skip
            report.jobs_present += 1
        else:
            session.add(_new_job(bundle, meta, by_job.get(meta.id, [])))
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
    session: Session, bundle: ParsedBundle, best: BestRecord, report: ImportReport
) -> None:
    """Insert, or replace a stored best that is strictly slower; keeps ``updated_at``."""
    row = session.scalars(
        select(BestConfig).where(
            BestConfig.operator == bundle.operator,
            BestConfig.operator_version == bundle.operator_version,
            BestConfig.shape_key == shape_key(bundle.shape),
            BestConfig.dtype == bundle.dtype,
            BestConfig.gpu_model == bundle.gpu_model,
            BestConfig.compute_capability == best.compute_capability,
            BestConfig.cuda_version == best.cuda_version,
        )
    ).first()
    job_id = best.job_id if best.job_id and session.get(Job, best.job_id) else None
    updated = best.updated_at or utcnow()
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
                compute_capability=best.compute_capability,
                cuda_version=best.cuda_version,
                config=best.config,
                time_ms=best.time_ms,
                job_id=job_id,
                updated_at=updated,
                **figures,
            )
        )
        session.flush()
        report.best_added += 1
    elif best.time_ms < row.time_ms:
        row.config, row.time_ms, row.job_id, row.updated_at = (
            best.config,
            best.time_ms,
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
    session: Session, bundle: ParsedBundle, best: BestRecord, job_id: str | None
) -> dict[str, Any]:
    """The figures a best record brings (``default_ms``, ``framework_ms`` with ``framework``,
    ``compiled_ms`` with ``compiled``),
    only those it has. A file without ``default_ms`` (older than migration 0006, or Kernel
    Tuner's) gets it from its own measurements where it can: the best's job's trial of the
    operator's default config for the shape, at the current version of the operator (an older
    version's default may be another config)."""
    figures = {}
    if best.framework_ms is not None:
        figures["framework_ms"] = best.framework_ms
        figures["framework"] = best.framework
    if best.compiled_ms is not None:
        figures["compiled_ms"] = best.compiled_ms
        figures["compiled"] = best.compiled
    default_ms = best.default_ms
    if default_ms is None and job_id is not None:
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
    after_commit: AfterCommit | None = None,
) -> ImportReport:
    """Write parsed bundles in one transaction and commit (rolled back on any error).

    ``on_progress``: called with ``("write", bundles written, len(bundles))`` after each one.
    ``after_commit``: called once the rows are committed with the session and the ids of the
    bundles' jobs; the warnings it returns join the report's (``kato import`` writes the
    imported jobs' Optuna studies so, :func:`tuner.imported_studies.record_job_studies`)."""
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
    if after_commit is not None:
        report.warnings += after_commit(session, [j.id for b in bundles for j in b.jobs])
    return report


def _gpu_warnings(bundles: Sequence[ParsedBundle]) -> list[str]:
    """A GPU model the catalog does not list is stored as named, unchecked: say so once."""
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
    after_commit: AfterCommit | None = None,
) -> ImportReport:
    """Validate every file under ``paths`` first, then import them all (one transaction).

    ``on_progress``: called with ``("check", files checked, files)`` after each file is read
    and checked, then as :func:`import_bundles` calls it (the CLI draws a progress bar).
    ``after_commit``: as :func:`import_bundles` takes it.

    Raises:
        InvalidImport: any file is invalid (nothing is written).
    """
    files = expand(paths)
    bundles = []
    for done, path in enumerate(files, 1):
        bundles.append(read_file(path, overrides))
        if on_progress is not None:
            on_progress("check", done, len(files))
    return import_bundles(session, bundles, on_progress=on_progress, after_commit=after_commit)


__all__ = [
    "ImportReport",
    "InvalidImport",
    "ParsedBundle",
    "expand",
    "import_bundles",
    "import_paths",
    "read_file",
]
