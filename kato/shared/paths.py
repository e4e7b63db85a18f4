"""Kato's places on disk that more than one layer uses."""

from __future__ import annotations

from pathlib import Path

from kato import env


def compile_cache_dir() -> Path:
    """``$KATO_COMPILE_CACHE`` if set, else ``~/.cache/kato/cubin``: the cubin cache (tuner's nvcc)
    beside which a user operator's inlined template is written (kernels.user)."""
    where = env.get("KATO_COMPILE_CACHE")
    return Path(where).expanduser() if where else Path.home() / ".cache" / "kato" / "cubin"
