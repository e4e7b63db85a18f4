"""Shared fixtures: where recorded tuning spaces live."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import DATASETS, dataset_files


@pytest.fixture(scope="session")
def shared_datasets() -> list[Path]:
    files = dataset_files()
    if not files:
        pytest.skip(f"no Kernel Tuner cache files under {DATASETS} (set KATO_DATASETS)")
    return files
