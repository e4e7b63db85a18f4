"""Which GPU model this process runs on, for lookups that do not name one.

Probes, in order: ``KATO_GPU`` (an explicit model name); PyTorch (when already imported, or
importable, and CUDA is available: ``torch.cuda.get_device_name`` of the current device); PyCUDA
(``pycuda.driver.Device(0).name()``, no context created); ``nvidia-smi``. The name is normalised
with :func:`kato.shared.gpus.normalize_gpu_name` ("NVIDIA H200" -> "H200").
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable

from kato import env
from kato.errors import KatoError
from kato.shared.gpus import normalize_gpu_name


class GpuNotDetected(KatoError, RuntimeError):
    """No GPU model could be found: pass ``gpu=`` (e.g. ``"H200"``) or set ``KATO_GPU``."""


def _visible_index() -> int:
    """The physical index of the first device CUDA_VISIBLE_DEVICES exposes (0 if unset)."""
    first = (env.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _from_env() -> str | None:
    return (env.get("KATO_GPU") or "").strip() or None


def _from_torch() -> str | None:
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    try:
        torch = importlib.import_module("torch")
        if not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:  # a broken install or driver: try the next probe
        return None


def _from_pycuda() -> str | None:
    if importlib.util.find_spec("pycuda") is None:
        return None
    try:
        driver = importlib.import_module("pycuda.driver")
        driver.init()
        return str(driver.Device(0).name()) if driver.Device.count() else None
    except Exception:
        return None


def _from_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        return None  # every device hidden from CUDA
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    index = _visible_index()
    return names[index] if index < len(names) else None


#: The probes, in the order they are tried; each returns a raw device name or ``None``.
PROBES: tuple[Callable[[], str | None], ...] = (
    _from_env,
    _from_torch,
    _from_pycuda,
    _from_nvidia_smi,
)


def normalize(name: str) -> str:
    """The canonical model name (``kato.shared.gpus.normalize_gpu_name``)."""
    return normalize_gpu_name(name)


def detect_gpu(probes: tuple[Callable[[], str | None], ...] = PROBES) -> str:
    """The normalised model name of this process's GPU.

    Raises:
        GpuNotDetected: no probe found one; the message says how to name the GPU instead.
    """
    for probe in probes:
        name = probe()
        if name:
            return normalize(name)
    raise GpuNotDetected(
        "no GPU detected (tried KATO_GPU, torch.cuda, PyCUDA and nvidia-smi): pass gpu='H200' "
        "(any catalog model name) to KatoClient(...) or config(...), or set KATO_GPU"
    )
