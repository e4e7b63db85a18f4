"""Fixtures of the user-operator tests: the committed test folders."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def vector_add_dir() -> Path:
    return DATA / "vector_add"
