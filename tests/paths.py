"""Where the tests find recorded data (importable as ``paths``: ``tests`` is on pythonpath)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Brute-forced Kernel Tuner cache files from other GPUs (the workplace's ../shared/datasets).
DATASETS = Path(os.environ.get("KATO_DATASETS", REPO.parent / "shared" / "datasets"))
#: Spaces Kato recorded itself on real GPUs, committed with the code.
RECORDED = REPO / "tests" / "data" / "recorded"
#: Whole spaces Kato brute-forced on the H200 (``h200_session.sh spaces``), Kernel Tuner format.
SPACES = REPO / "data" / "spaces"


def dataset_files() -> list[Path]:
    return sorted(DATASETS.glob("**/cachefiles/**/*.json.gz"))


def space_files() -> list[Path]:
    return sorted(SPACES.glob("**/*.json.gz"))
