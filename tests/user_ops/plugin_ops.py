"""Entry points of a pretend installed package (``tests/user_ops/test_registry_entry_points``):
one good operator from a folder with a Python reference, and ways of being broken."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kato.kernels.user import definition, load_folder
from kato.kernels.user.spec import UserOperatorSpec

FOLDER = Path(__file__).resolve().parent / "data" / "vector_add"


def _reference(args, shape, dtype):
    return [args[1].astype(np.float64) + args[2]]


def operators() -> list[UserOperatorSpec]:
    d = load_folder(FOLDER)
    spec = d.spec.model_dump() | {"name": "plugin_vector_add"}
    return [UserOperatorSpec(definition(spec, d.files), reference=_reference)]


def broken() -> list[UserOperatorSpec]:
    raise RuntimeError("this package's operator is broken")


def clash() -> UserOperatorSpec:
    d = load_folder(FOLDER)
    return UserOperatorSpec(definition(d.spec.model_dump() | {"name": "softmax"}, d.files))


NOT_A_SPEC = 42
