"""Fixtures of the kernel tests."""

from __future__ import annotations

import shutil

import cuda_emulation
import pytest
from compile_harness import SAMPLE_IDS, SAMPLES


@pytest.fixture
def norm_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host-C++ emulation (``cuda_emulation``) set up for the layernorm and batchnorm_stats
    templates: their extra device functions, float scalar arguments. Skips where g++ or nvcc's
    CUDA headers are missing."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    include = cuda_emulation.cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    monkeypatch.setattr(cuda_emulation, "HEADER", cuda_emulation.HEADER + cuda_emulation.NORM_EXTRA)
    monkeypatch.setattr(cuda_emulation, "_literal", cuda_emulation.float_literal)


@pytest.fixture(scope="module", params=SAMPLES, ids=SAMPLE_IDS)
def sample_pairs(request: pytest.FixtureRequest) -> bool:
    """Whether a compile module's covering sample takes every pair of parameter values
    (``-m slow``) or every value (the default run): its fixtures compile, and its tests check,
    each in turn."""
    return request.param


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A compile module's tests share one worker under xdist (``--dist loadgroup``, set in
    pyproject's addopts): its module-scoped fixture then compiles the variants once, where two
    workers would each compile them all (matmul's twice over took 500+ s each on a cold run)."""
    for item in items:
        if item.path.name.endswith("_compile.py") and item.path.parent.name == "kernels":
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
