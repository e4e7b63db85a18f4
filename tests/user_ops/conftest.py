"""Fixtures of the user-operator tests: the committed test folders."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def vector_add_dir() -> Path:
    return DATA / "vector_add"


@pytest.fixture
def scaled_mul_dir() -> Path:
    """y = alpha * a * b, whose [backward] names scaled_mul_backward_test."""
    return DATA / "scaled_mul"


@pytest.fixture
def scaled_mul_backward_dir() -> Path:
    return DATA / "scaled_mul_backward"
