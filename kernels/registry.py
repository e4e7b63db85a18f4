"""Operator registry: name -> spec instance. Operators register themselves on import."""

from __future__ import annotations

import importlib

from kernels.spec import InvalidInput, OperatorSpec

_OPERATORS: dict[str, OperatorSpec] = {}

#: Sub-packages imported on first use; each calls :func:`register` for its operator(s).
_BUILTIN_MODULES = (
    "kernels.softmax",
    "kernels.transpose",
    "kernels.sort",
    "kernels.layernorm",
    "kernels.batchnorm_stats",
    "kernels.reduce_sum",
    "kernels.reduce_sum_all",
    "kernels.relu",
    "kernels.matmul",
    "kernels.rmsnorm",
    "kernels.rmsnorm_backward",
    "kernels.softmax_backward",
    "kernels.cross_entropy",
    "kernels.cross_entropy_backward",
    "kernels.layernorm_backward",
)


def register(spec: OperatorSpec) -> OperatorSpec:
    """Add ``spec`` to the registry under ``spec.name`` (idempotent for the same name)."""
    _OPERATORS[spec.name] = spec
    return spec


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def list_operators() -> list[OperatorSpec]:
    """All registered operators, sorted by name."""
    _load_builtins()
    return [_OPERATORS[name] for name in sorted(_OPERATORS)]


def get_operator(name: str) -> OperatorSpec:
    """The spec registered as ``name``.

    Raises:
        InvalidInput: if no operator has that name (the message lists the known ones).
    """
    _load_builtins()
    try:
        return _OPERATORS[name]
    except KeyError:
        known = ", ".join(sorted(_OPERATORS)) or "none"
        raise InvalidInput(f"unknown operator {name!r}; known operators: {known}") from None
