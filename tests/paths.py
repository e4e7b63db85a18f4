"""Where the tests find recorded data (importable as ``paths``: ``tests`` is on pythonpath)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Brute-forced Kernel Tuner cache files from other GPUs (the FAIR Benchmark Hub's, MIT licence),
#: committed under data/datasets so that a plain clone runs every replay test; KATO_DATASETS
#: points at another folder of the same layout.
DATASETS = Path(os.environ.get("KATO_DATASETS", REPO / "data" / "datasets"))
#: Spaces Kato recorded itself on real GPUs, committed with the code.
RECORDED = REPO / "tests" / "data" / "recorded"
#: Whole spaces Kato brute-forced on the H200 (``h200_session.sh spaces``), Kernel Tuner format:
#: ``h200`` the eleven of the search-quality table (``benchmarks/search_quality.py``'s default),
#: ``h200-holdout`` eighteen more recorded after the default search was settled (other kernels:
#: matmul, transpose, reduce_sum; other shapes and dtypes of the first eleven's operators),
#: ``h200-misses`` the spaces of cases where a real tuning job on the H200 missed the best
#: config (recorded to find out why; the search was changed with them in view).
SPACES = REPO / "data" / "spaces"
TABLE_SPACES = SPACES / "h200"
HOLDOUT_SPACES = SPACES / "h200-holdout"
MISSED_SPACES = SPACES / "h200-misses"


def dataset_files() -> list[Path]:
    return sorted(DATASETS.glob("**/cachefiles/**/*.json.gz"))


def space_files() -> list[Path]:
    """Every recorded space (all three folders)."""
    return sorted(SPACES.glob("**/*.json.gz"))


def table_space_files() -> list[Path]:
    """The recorded spaces of the search-quality table."""
    return sorted(TABLE_SPACES.glob("*.json.gz"))


def holdout_space_files() -> list[Path]:
    return sorted(HOLDOUT_SPACES.glob("*.json.gz"))


def missed_space_files() -> list[Path]:
    return sorted(MISSED_SPACES.glob("*.json.gz"))
