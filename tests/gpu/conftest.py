"""GPU tests: run on a machine with a CUDA device and PyCUDA (the H200 through the device tool).

Every test here carries the ``gpu`` marker and skips, with the reason, where no device is found.
"""

from __future__ import annotations

import pytest


def _device_reason() -> str | None:
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        return f"PyCUDA not importable ({exc}); install kato[cuda] on a machine with a GPU"
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return "no CUDA device visible"
    except Exception as exc:  # no driver
        return f"CUDA driver unavailable: {exc}"
    return None


_REASON = _device_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON:
                item.add_marker(pytest.mark.skip(reason=_REASON))
