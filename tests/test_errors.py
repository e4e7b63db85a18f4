"""One error hierarchy: every error Kato raises on purpose derives from ``kato.KatoError`` and
keeps the builtin base it had, so code that caught either keeps working."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kato import KatoError, ServiceError

#: (module, class name, the builtin base it must keep).
ERRORS = [
    ("kato.kernels.spec", "InvalidInput", ValueError),
    ("kato.shared.gpus", "UnknownGpu", ValueError),
    ("kato.kernels.user.expr", "ExpressionError", ValueError),
    ("kato.db.importer", "InvalidImport", ValueError),
    ("kato.db.formats", "FormatError", ValueError),
    ("kato.db.export", "ExportError", ValueError),
    ("kato.db.ids", "UnknownId", LookupError),
    ("kato.db.ids", "AmbiguousId", LookupError),
    ("kato.db.tokens", "QuotaExceeded", Exception),
    ("kato.tuner.nvcc", "CompileError", Exception),
    ("kato.tuner.nvcc", "NvccNotFoundError", RuntimeError),
    ("kato.tuner.trial_cost", "UnmeasurableTask", RuntimeError),
    ("kato.tuner.backends.isolated", "ChildStartError", RuntimeError),
    ("kato.tuner.backends.isolated", "TrialInterrupted", Exception),
    ("kato_client", "GpuNotDetected", RuntimeError),
    ("kato_client", "KatoUnavailable", RuntimeError),
    ("kato.remote", "ServiceError", RuntimeError),
]


@pytest.mark.parametrize(("module", "name", "base"), ERRORS)
def test_every_error_has_the_root_and_keeps_its_base(module: str, name: str, base: type) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, KatoError)
    assert issubclass(cls, base)


def test_the_client_error_is_the_root_and_its_answers_carry_a_status() -> None:
    import kato_client

    assert kato_client.KatoError is KatoError
    assert kato_client.ServiceError is ServiceError
    assert ServiceError("refused", 422).status == 422
    assert KatoError("any").status is None  # readable off every Kato error


def test_importing_kato_loads_nothing_else_of_the_project() -> None:
    """``kato.errors`` is a leaf every layer imports; the package must not pull the front door
    (and through it the kernels) in, or ``kernels.spec`` importing it would be a cycle."""
    code = (
        "import sys, kato; mods = [m for m in sys.modules if m.split('.')[0] in "
        "('kernels', 'tuner', 'db', 'service', 'kato_client')] + "
        "[m for m in sys.modules if m.startswith('kato.') and m != 'kato.errors']; print(mods)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import kato; print(kato.tune_kernel.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "kato.tune"
