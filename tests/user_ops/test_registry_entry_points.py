"""Operators of installed packages, through the ``kato.operators`` entry point group."""

from __future__ import annotations

import importlib.metadata
import logging

import numpy as np
import pytest
from kato.kernels import registry


@pytest.fixture
def entry_points(monkeypatch):
    """Install pretend entry points and let the registry load them afresh."""

    def install(*values: str) -> None:
        eps = importlib.metadata.EntryPoints(
            importlib.metadata.EntryPoint(f"ep{i}", value, registry.ENTRY_POINT_GROUP)
            for i, value in enumerate(values)
        )
        real = importlib.metadata.entry_points

        def fake(**kwargs):
            if kwargs.get("group") == registry.ENTRY_POINT_GROUP:
                return eps
            return real(**kwargs)

        monkeypatch.setattr(importlib.metadata, "entry_points", fake)
        monkeypatch.setattr(registry, "_entry_points_loaded", False)

    yield install
    registry._OPERATORS.pop("plugin_vector_add", None)


def test_a_package_operator_is_registered_and_broken_ones_skipped(entry_points, caplog):
    softmax = registry.get_operator("softmax")
    entry_points(
        "user_ops.plugin_ops:broken",
        "user_ops.plugin_ops:NOT_A_SPEC",
        "user_ops.plugin_ops:clash",
        "no_such_module_anywhere:thing",
        "user_ops.plugin_ops:operators",
    )
    with caplog.at_level(logging.WARNING, logger="kato.kernels.registry"):
        names = [spec.name for spec in registry.list_operators()]
    assert "plugin_vector_add" in names
    assert registry.get_operator("softmax") is softmax  # a package cannot replace a built-in
    text = caplog.text
    assert "this package's operator is broken" in text
    assert "'softmax' is a built-in operator" in text
    assert "no_such_module_anywhere" in text
    assert "not OperatorSpec instances" in text
    op = registry.get_operator("plugin_vector_add")
    problem = op.make_problem((100,), "float32", np.random.default_rng(0))
    expected = problem.args[1].astype(np.float64) + problem.args[2]
    np.testing.assert_array_equal(problem.references[0], expected)  # the package's reference


def test_entry_points_are_loaded_once(entry_points, monkeypatch):
    entry_points("user_ops.plugin_ops:operators")
    registry.list_operators()
    calls = []
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **k: calls.append(k) or [])
    registry.get_operator("plugin_vector_add")
    registry.list_operators()
    assert calls == []


def test_a_failing_source_adds_nothing_and_breaks_nothing(caplog):
    def source():
        raise ConnectionError("database down")

    registry.add_source(source)
    try:
        with caplog.at_level(logging.WARNING, logger="kato.kernels.registry"):
            assert registry.get_operator("relu").name == "relu"
        assert "database down" in caplog.text
    finally:
        registry.remove_source(source)
