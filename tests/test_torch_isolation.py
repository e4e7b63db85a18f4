"""torch is an optional extra: only kato_torch (and GPU benchmarks/tests) may import it, and
tuner/torch_ops.py: PyTorch's own op per operator, which the framework baseline's measuring
child (tuner/framework.py) imports in a process of its own, where torch is the point; nothing
the service, the client or a worker imports at start imports it."""

from __future__ import annotations

import ast
import subprocess
import sys

from paths import REPO

PACKAGES = ("kernels", "tuner", "db", "service", "kato_client")
#: Modules of those packages that import torch at module level (each imported lazily only).
ALLOWED = {"tuner/torch_ops.py"}


def _module_level_imports(path) -> set[str]:
    """Top-level modules imported at module level (not inside functions) by ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_no_package_but_kato_torch_imports_torch_at_module_level() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if "torch" in _module_level_imports(path) and str(path.relative_to(REPO)) not in ALLOWED
    ]
    assert offenders == []
    assert all("torch" in _module_level_imports(REPO / name) for name in ALLOWED)
    assert "torch" in _module_level_imports(REPO / "kato_torch" / "ops.py")  # the check works


def test_importing_the_service_and_client_does_not_load_torch() -> None:
    code = (
        "import sys, kato.service.app, kato.service.cli, kato_client, kato.tuner.worker,"
        " kato.db.queries, kato.tuner.framework; from kato import kernels;"
        "kernels.list_operators();"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
