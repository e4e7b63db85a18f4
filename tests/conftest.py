"""Shared fixtures: where recorded tuning spaces live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from paths import DATASETS, dataset_files


@pytest.fixture(scope="session")
def shared_datasets() -> list[Path]:
    """The committed benchmark-hub spaces (data/datasets, or KATO_DATASETS): a missing folder is a
    broken checkout or setting, so it fails instead of skipping the search tests."""
    files = dataset_files()
    if not files:
        pytest.fail(f"no Kernel Tuner cache files (**/cachefiles/**/*.json.gz) under {DATASETS}")
    return files


@pytest.fixture(scope="session")
def cubin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the kernel compile checks keep their binaries, across test runs.

    ``tuner.nvcc`` keys an entry by the source, options, arch and the exact ``nvcc --version``
    text, writes it atomically and checks its checksum on load: a hit is the binary and the
    resource usage nvcc would produce now, so only changed variants are compiled again (a cold
    run compiles every variant: most of the suite's time on 2 cores). ``KATO_TEST_CUBIN_CACHE``
    names the directory (default ``~/.cache/kato/test-cubins``); ``off`` uses a fresh one.
    """
    env = os.environ.get("KATO_TEST_CUBIN_CACHE", "")
    if env == "off":
        return tmp_path_factory.mktemp("cubins")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "kato" / "test-cubins"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def fresh_kato_torch():
    """kato_torch's configuration and dynamo's caches reset around a test (the user-kernel
    torch tests: a compiled graph or a policy must not leak into the next test)."""
    import torch

    import kato_torch

    kato_torch.configure(client=None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    kato_torch.configure(client=None)
