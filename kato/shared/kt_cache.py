"""Read and write Kernel Tuner cache files (plain or gzipped JSON).

The format (what ``../shared/datasets`` holds and Kernel Tuner's simulation mode replays)::

    {"device_name", "kernel_name", "problem_size", "tune_params_keys", "tune_params",
     "objective": "time",
     "cache": {"v1,v2,...": {<param>: value, ..., "time": ms, "times": [ms, ...],
                             "compile_time": ms, ...}
               | {<param>: value, ..., "time": "CompilationFailedConfig" | ...}}}

A key is the comma-joined parameter values in ``tune_params_keys`` order. A combination of
``tune_params`` that is absent from ``cache`` violates the kernel's restrictions; an entry whose
``time`` is a string failed on the GPU.

``kato export --format kt`` writes every combination of ``tune_params``, so that Kernel Tuner's
simulation mode replays the file without a restrictions function: a config Kato did not measure
is an entry with ``"time": "InvalidConfig"`` (what Kernel Tuner skips) and an
:data:`UNMEASURED` field saying why. :func:`load_cache` leaves those out, so to Kato they are
absent as before: not part of the recorded space.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Kernel Tuner's failure markers, as stored in an entry's "time".
FAILURE_MARKERS = ("CompilationFailedConfig", "RuntimeFailedConfig", "InvalidConfig")
#: The field of a stand-in entry for a config Kato did not measure (its value says why:
#: ``"invalid"``, the operator's constraints reject it for the shape; ``"not measured"``).
UNMEASURED = "kato_unmeasured"
#: The field of an entry that lists the other trials of its config (other jobs' measurements;
#: the entry itself is the fastest), so that a Kato export keeps every trial.
OTHER_TRIALS = "kato_other_trials"


def config_key(params: Sequence[str], config: Mapping[str, Any]) -> str:
    """Kernel Tuner's cache key: parameter values comma-joined in ``params`` order (also the
    key of a config's trial in Kato's tables, ``kato_trials.config_key``)."""
    return ",".join(str(config[name]) for name in params)


def unmeasured_entry(config: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """A stand-in for a config that was not measured: Kernel Tuner reads it as invalid."""
    return {**config, "time": "InvalidConfig", UNMEASURED: reason}


def higher_is_better(objective: str) -> bool:
    """Whether Kernel Tuner would maximise ``objective``: a rate (``GFLOP/s``, ``GB/s``, any
    name ending in ``/s``) or a FLOP count per second named without the slash (``gflops``)."""
    name = objective.strip().lower()
    return name.endswith("/s") or "flops" in name


@dataclass
class KernelTunerCache:
    """One cache file in memory. ``entries`` maps a key to its recorded entry."""

    device_name: str
    kernel_name: str
    problem_size: Any
    tune_params: dict[str, list[Any]]
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    objective: str = "time"
    extra: dict[str, Any] = field(default_factory=dict)  # any other top-level fields, kept

    @property
    def params(self) -> list[str]:
        return list(self.tune_params)

    def key(self, config: Mapping[str, Any]) -> str:
        return config_key(list(self.tune_params), config)

    @property
    def time_field(self) -> str:
        """The entry field that is minimised: the file's objective, or ``time`` when the
        objective is a rate to maximise (a file tuned for GFLOP/s still records every config's
        time, and for one problem size the fastest config has the highest rate). A file's own
        ``objective_higher_is_better`` field overrides the guess from the name.

        Raises:
            ValueError: the objective is to be maximised and the entries have no ``time``.
        """
        flag = self.extra.get("objective_higher_is_better")
        maximise = bool(flag) if flag is not None else higher_is_better(self.objective)
        if not maximise:
            return self.objective
        if any("time" in e for e in self.entries.values()):
            return "time"
        raise ValueError(
            f"the cache's objective {self.objective!r} is to be maximised and its entries have "
            "no 'time' to minimise instead; record the time too (Kernel Tuner always does)"
        )

    def ok_entries(self) -> dict[str, dict[str, Any]]:
        """Entries that ran and have a numeric :attr:`time_field`."""
        field_name = self.time_field
        return {k: e for k, e in self.entries.items() if isinstance(e.get(field_name), int | float)}

    def best(self) -> tuple[str, dict[str, Any]]:
        """The key and entry with the lowest :attr:`time_field` (the fastest config).

        Raises:
            ValueError: if no entry has a numeric objective.
        """
        ok = self.ok_entries()
        if not ok:
            raise ValueError(f"no successful measurement in cache of {self.kernel_name!r}")
        field_name = self.time_field
        key = min(ok, key=lambda k: ok[k][field_name])
        return key, ok[key]

    def to_json(self) -> dict[str, Any]:
        return {
            "device_name": self.device_name,
            "kernel_name": self.kernel_name,
            "problem_size": self.problem_size,
            "tune_params_keys": self.params,
            "tune_params": self.tune_params,
            "objective": self.objective,
            **self.extra,
            "cache": self.entries,
        }


#: T4 ``invalidity`` -> Kernel Tuner's failure marker; "correct" is a measurement, and
#: "constraints" (the config violates the space's restrictions) is absent from the space.
_T4_MARKERS = {"compile": "CompilationFailedConfig"}
_T4_TIME_UNITS = {"milliseconds": 1.0, "ms": 1.0, "seconds": 1e3, "s": 1e3, "microseconds": 1e-3}


def from_t4(data: Mapping[str, Any], name: str = "<t4>") -> KernelTunerCache:
    """A T4 results document (schema 1.0.0: ``{"schema_version", "results": [{"configuration",
    "invalidity", "measurements", "times", ...}], "metadata"}``, what Kernel Tuner's
    ``get_t4_results`` and ``kato export --format t4`` write) as a cache.

    ``tune_params`` are the values seen per parameter (sorted where all are numbers); a
    config's time is its ``time`` measurement (milliseconds, converted from the metadata's
    ``timeunit``), or the mean of its runtimes; a compile failure becomes Kernel Tuner's marker,
    any other failure a runtime failure; configs outside the restrictions are left out.

    Raises:
        ValueError: no result has a configuration.
    """
    meta = data.get("metadata") or {}
    unit = str(meta.get("timeunit", "milliseconds")).lower()
    scale = _T4_TIME_UNITS.get(unit, 1.0)
    results = [r for r in data.get("results", []) if isinstance(r.get("configuration"), dict)]
    if not results:
        raise ValueError(f"{name}: a T4 file without any result with a configuration")
    names = list(results[0]["configuration"])
    seen: dict[str, dict[Any, None]] = {n: {} for n in names}
    entries: dict[str, dict[str, Any]] = {}
    for r in results:
        config = r["configuration"]
        if list(config) != names or r.get("invalidity") == "constraints":
            continue
        for n in names:
            seen[n][config[n]] = None
        entry: dict[str, Any] = dict(config)
        if r.get("invalidity", "correct") == "correct":
            entry["time"] = _t4_time(r, scale)
            if entry["time"] is None:
                entry["time"] = "RuntimeFailedConfig"
        else:
            entry["time"] = _T4_MARKERS.get(str(r.get("invalidity")), "RuntimeFailedConfig")
        entries[",".join(str(config[n]) for n in names)] = entry
    tune_params = {}
    for n, values in seen.items():
        vals = list(values)
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
        tune_params[n] = sorted(vals) if numeric else vals
    kato = meta.get("kato") if isinstance(meta.get("kato"), dict) else {}
    return KernelTunerCache(
        device_name=str(meta.get("device_name", kato.get("gpu_model", "unknown"))),
        kernel_name=str(meta.get("kernel_name", kato.get("operator", name))),
        problem_size=meta.get("problem_size"),
        tune_params=tune_params,
        entries=entries,
        extra={"kato": dict(kato)} if kato else {},  # what problem it is for (a replay checks)
    )


def _t4_time(result: Mapping[str, Any], scale: float) -> float | None:
    for m in result.get("measurements") or []:
        if m.get("name") == "time" and isinstance(m.get("value"), int | float):
            unit = str(m.get("unit", "")).lower()
            return float(m["value"]) * _T4_TIME_UNITS.get(unit, scale)
    runtimes = (result.get("times") or {}).get("runtimes") or []
    ok = [float(t) for t in runtimes if isinstance(t, int | float)]
    return sum(ok) / len(ok) * scale if ok else None


def load_cache(path: str | Path) -> KernelTunerCache:
    """Load a Kernel Tuner cache file (or a T4 results file, :func:`from_t4`); ``.gz`` files
    are decompressed.

    Raises:
        ValueError: if the file is not a Kernel Tuner cache (the message says what is missing).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    # Kernel Tuner writes an unfinished file while tuning (no closing braces): accept that too.
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = json.loads(text.rstrip().rstrip(",") + "}}")
    if isinstance(data, dict) and "results" in data and "cache" not in data:
        return from_t4(data, name=path.name)
    missing = [k for k in ("tune_params_keys", "tune_params", "cache") if k not in data]
    if missing:
        raise ValueError(f"{path}: not a Kernel Tuner cache file (missing {', '.join(missing)})")
    keys = list(data["tune_params_keys"])
    tune_params = {name: list(data["tune_params"][name]) for name in keys}
    known = {
        "device_name",
        "kernel_name",
        "problem_size",
        "tune_params_keys",
        "tune_params",
        "objective",
        "cache",
    }
    return KernelTunerCache(
        device_name=str(data.get("device_name", "unknown")),
        kernel_name=str(data.get("kernel_name", "unknown")),
        problem_size=data.get("problem_size"),
        tune_params=tune_params,
        entries={
            k: e for k, e in data["cache"].items() if not (isinstance(e, dict) and UNMEASURED in e)
        },
        objective=str(data.get("objective", "time")),
        extra={k: v for k, v in data.items() if k not in known},
    )


def save_cache(cache: KernelTunerCache, path: str | Path) -> None:
    """Write ``cache`` atomically (temp file + rename); gzip when the name ends in ``.gz``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(cache.to_json(), indent=None, separators=(",", ":")).encode()
    if path.suffix == ".gz":
        payload = gzip.compress(payload, mtime=0)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; a cache file is for sharing
    os.replace(tmp, path)
