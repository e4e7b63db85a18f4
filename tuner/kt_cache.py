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

    def ok_entries(self) -> dict[str, dict[str, Any]]:
        """Entries that ran and have a numeric objective."""
        return {
            k: e for k, e in self.entries.items() if isinstance(e.get(self.objective), int | float)
        }

    def best(self) -> tuple[str, dict[str, Any]]:
        """The key and entry with the lowest objective.

        Raises:
            ValueError: if no entry has a numeric objective.
        """
        ok = self.ok_entries()
        if not ok:
            raise ValueError(f"no successful measurement in cache of {self.kernel_name!r}")
        key = min(ok, key=lambda k: ok[k][self.objective])
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
