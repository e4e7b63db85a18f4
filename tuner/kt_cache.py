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
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Kernel Tuner's failure markers, as stored in an entry's "time".
FAILURE_MARKERS = ("CompilationFailedConfig", "RuntimeFailedConfig", "InvalidConfig")


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
        return ",".join(str(config[name]) for name in self.tune_params)

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


def load_cache(path: str | Path) -> KernelTunerCache:
    """Load a Kernel Tuner cache file; ``.gz`` files are decompressed.

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
        entries=dict(data["cache"]),
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
