"""Settings are read in one place: the service's by ``service.settings.Settings``, every other
environment variable through ``kato.env``, where it is declared with its reader and meaning."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kato import env

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("db", "kato", "kato_client", "kato_torch", "kernels", "service", "tuner")


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that touch ``os.environ`` or ``os.getenv`` (``os.environ[...]``, ``from os
    import environ``, ...)."""
    names = ("environ", "getenv", "putenv")
    lines = []
    for node in ast.walk(tree):
        attribute = isinstance(node, ast.Attribute) and node.attr in names
        imported = isinstance(node, ast.ImportFrom) and node.module == "os"
        if attribute or (imported and any(a.name in names for a in node.names)):
            lines.append(node.lineno)
    return lines


def test_no_module_but_kato_env_reads_the_environment() -> None:
    found = {}
    for path in _sources():
        if path == REPO / "kato" / "env.py":
            continue
        lines = _environment_reads(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(REPO))] = lines
    assert found == {}, f"read the environment through kato.env.get: {found}"


def test_every_variable_read_is_declared_with_its_reader() -> None:
    """Every ``env.get("NAME")`` in the packages names a declared variable (a misspelt name
    would raise at run time; this finds it before), and every declared one is read somewhere."""
    read = set()
    for path in _sources():
        read |= set(re.findall(r"env\.get\(\s*\"([A-Z_]+)\"", path.read_text()))
    assert read - env.VARIABLES.keys() == set()
    # Read through tuner.framework.ENV_ENABLED and ENV_COMPILED (constants).
    assert env.VARIABLES.keys() - read == {"KATO_FRAMEWORK_BASELINE", "KATO_FRAMEWORK_COMPILED"}
    for variable in env.VARIABLES.values():
        assert variable.reader and variable.meaning.strip()


def test_get_reads_the_environment_now_and_refuses_an_undeclared_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KATO_COMPILE_CACHE", raising=False)
    assert env.get("KATO_COMPILE_CACHE") is None
    monkeypatch.setenv("KATO_COMPILE_CACHE", " /x ")
    assert env.get("KATO_COMPILE_CACHE") == " /x "  # as set: each reader has its own rules
    assert env.get("KATO_GPU", {"KATO_GPU": "H200"}) == "H200"
    with pytest.raises(KeyError, match="KATO_COMPILE_CAHCE is not a declared"):
        env.get("KATO_COMPILE_CAHCE")
    with pytest.raises(KeyError, match="not a declared"):
        env.set_for_children("KATO_NOPE", "1")
