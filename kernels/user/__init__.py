"""User operators: kernels from outside Kato, declared by a folder or registered by a package.

- :mod:`kernels.user.model`: the declarative spec (``kato.toml``), a pydantic model;
- :mod:`kernels.user.expr`: the safe evaluation of its expressions (no ``eval``);
- :mod:`kernels.user.spec`: :class:`UserOperatorSpec`, the :class:`~kernels.spec.OperatorSpec`
  built from it;
- :mod:`kernels.user.folder`: reading a folder.

``docs/user_kernels.md`` describes the format and the ways to register one.
"""

from kato.kernels.user.expr import ExpressionError
from kato.kernels.user.folder import SPEC_FILE, definition, load_folder
from kato.kernels.user.model import OperatorDefinition, OperatorModel
from kato.kernels.user.spec import DeviceReference, UserOperatorSpec


def spec_from_folder(path, **options) -> UserOperatorSpec:
    """The :class:`UserOperatorSpec` of a folder (``options``: ``reference=`` a Python
    reference, for packages)."""
    from pathlib import Path

    return UserOperatorSpec(load_folder(path), source_dir=Path(path), **options)


__all__ = [
    "SPEC_FILE",
    "DeviceReference",
    "ExpressionError",
    "OperatorDefinition",
    "OperatorModel",
    "UserOperatorSpec",
    "definition",
    "load_folder",
    "spec_from_folder",
]
