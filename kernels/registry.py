"""Operator registry: name -> spec instance. Operators register themselves on import.

Besides the built-in sub-packages, operators come from:

- installed packages, through the entry point group ``kato.operators`` (loaded once, on first
  use): each entry point names an :class:`OperatorSpec`, a list of them, a callable returning
  either, or a module that registers its operators when imported. One that fails to load, or
  that would replace a built-in operator, is logged and skipped: it never breaks the registry;
- sources added with :func:`add_source` (the database's stored user operators,
  ``db.operators``), asked on every lookup; a source caches for itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from kato.kernels.spec import InvalidInput, OperatorSpec

log = logging.getLogger(__name__)

_OPERATORS: dict[str, OperatorSpec] = {}
#: The entry point group installed packages register operators under.
ENTRY_POINT_GROUP = "kato.operators"
_entry_points_loaded = False
#: Callables returning operators to register (see :func:`add_source`).
_SOURCES: list[Callable[[], Iterable[OperatorSpec]]] = []

#: Sub-packages imported on first use; each calls :func:`register` for its operator(s).
_BUILTIN_MODULES = (
    "kato.kernels.softmax",
    "kato.kernels.transpose",
    "kato.kernels.sort",
    "kato.kernels.layernorm",
    "kato.kernels.batchnorm_stats",
    "kato.kernels.reduce_sum",
    "kato.kernels.reduce_sum_all",
    "kato.kernels.relu",
    "kato.kernels.matmul",
    "kato.kernels.rmsnorm",
    "kato.kernels.rmsnorm_backward",
    "kato.kernels.softmax_backward",
    "kato.kernels.cross_entropy",
    "kato.kernels.cross_entropy_backward",
    "kato.kernels.layernorm_backward",
    "kato.kernels.add_rmsnorm",
    "kato.kernels.add_layernorm",
    "kato.kernels.batchnorm",
    "kato.kernels.batchnorm_backward",
    "kato.kernels.batchnorm_relu",
    "kato.kernels.batchnorm_relu_backward",
    "kato.kernels.layernorm_relu",
    "kato.kernels.layernorm_relu_backward",
)


def register(spec: OperatorSpec) -> OperatorSpec:
    """Add ``spec`` to the registry under ``spec.name`` (idempotent for the same name)."""
    _OPERATORS[spec.name] = spec
    return spec


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _specs_of(obj: Any) -> list[OperatorSpec]:
    """What an entry point names, as operators (a module registered its own on import)."""
    if isinstance(obj, ModuleType):
        return []
    if callable(obj) and not isinstance(obj, OperatorSpec):
        obj = obj()
    if isinstance(obj, OperatorSpec):
        return [obj]
    if not isinstance(obj, Iterable):
        raise TypeError(f"not OperatorSpec instances: {type(obj).__name__}")
    items = list(obj)
    bad = [type(item).__name__ for item in items if not isinstance(item, OperatorSpec)]
    if bad:
        raise TypeError(f"not OperatorSpec instances: {', '.join(bad)}")
    return items


def _load_entry_points() -> None:
    """Register the operators of every ``kato.operators`` entry point, once per process."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    builtin = set(_OPERATORS)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            specs = _specs_of(entry.load())
        except Exception as exc:  # a broken package must not take the registry down
            log.warning("operator entry point %s (%s) skipped: %s", entry.name, entry.value, exc)
            continue
        for spec in specs:
            if spec.name in builtin:
                log.warning(
                    "operator entry point %s skipped: %r is a built-in operator",
                    entry.name, spec.name,
                )  # fmt: skip
                continue
            register(spec)


def add_source(source: Callable[[], Iterable[OperatorSpec]]) -> None:
    """Ask ``source`` for operators on every :func:`list_operators` and :func:`get_operator`
    call and register what it returns (a newer version replaces an older one of the same
    name). It must be cheap (cache for itself) and never raise for a bad operator: it logs and
    leaves that one out. Adding the same source twice adds it once."""
    if source not in _SOURCES:
        _SOURCES.append(source)


def remove_source(source: Callable[[], Iterable[OperatorSpec]]) -> None:
    if source in _SOURCES:
        _SOURCES.remove(source)


def _load_all() -> None:
    _load_builtins()
    _load_entry_points()
    for source in list(_SOURCES):
        try:
            for spec in source():
                if _OPERATORS.get(spec.name) is not spec:
                    register(spec)
        except Exception as exc:  # a source that cannot answer (database down) adds nothing
            log.warning("operator source %r unavailable: %s", source, exc)


def list_operators() -> list[OperatorSpec]:
    """All registered operators, sorted by name."""
    _load_all()
    return [_OPERATORS[name] for name in sorted(_OPERATORS)]


def get_operator(name: str) -> OperatorSpec:
    """The spec registered as ``name``.

    Raises:
        InvalidInput: if no operator has that name (the message lists the known ones).
    """
    _load_all()
    try:
        return _OPERATORS[name]
    except KeyError:
        known = ", ".join(sorted(_OPERATORS)) or "none"
        raise InvalidInput(f"unknown operator {name!r}; known operators: {known}") from None
