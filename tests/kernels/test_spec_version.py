"""An operator's version covers the Python spec, not only its template and space: a change to
its defines, launch geometry, checks or tolerances gives stored winners a stale version."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
from kato.kernels.spec import code_fingerprint

SOURCE = '''"""Module doc."""
import math


class A:
    """Class doc."""

    def f(self, x: int) -> float:
        """Function doc."""
        return math.sqrt(x) + 1  # a comment
'''


def test_comments_docstrings_and_layout_do_not_count() -> None:
    relaid = (
        "import math\nclass A:\n    '''Another doc.'''\n    def f(self, x: int) -> float:\n"
        "        return (math.sqrt(x)\n                + 1)\n"
    )
    assert code_fingerprint(relaid) == code_fingerprint(SOURCE)


def test_code_counts() -> None:
    assert code_fingerprint(SOURCE.replace("+ 1", "+ 2")) != code_fingerprint(SOURCE)
    assert code_fingerprint(SOURCE.replace("x: int", "x: float")) != code_fingerprint(SOURCE)


def test_the_fingerprint_is_the_same_on_every_python() -> None:
    """Pinned: the service's versions must not depend on the Python it runs under (the H200
    runs 3.12, CI 3.11; 3.12 added ``type_params`` to every class and function node)."""
    digest = hashlib.sha256(code_fingerprint(SOURCE)).hexdigest()[:16]
    assert digest == "89515265e3f09b7c"


SPEC_MODULE = """
from pathlib import Path

from kato.kernels.softmax import SoftmaxSpec


class Variant(SoftmaxSpec):
    name = "softmax_variant"

    def tolerance(self, dtype):
        return (0.0, {rtol})
"""


def _load(tmp_path: Path, name: str, rtol: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(SPEC_MODULE.format(rtol=rtol)))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Variant()


@pytest.fixture
def variants(tmp_path: Path):
    names = ["kato_variant_a", "kato_variant_b", "kato_variant_c"]
    yield lambda i, rtol: _load(tmp_path, names[i], rtol)
    for name in names:
        sys.modules.pop(name, None)


def test_a_tolerance_change_in_a_spec_module_changes_its_version(variants) -> None:
    from kato.kernels import get_operator

    a, same, looser = variants(0, "1e-4"), variants(1, "1e-4"), variants(2, "1e-3")
    assert a.version == same.version
    assert looser.version != a.version
    # The subclass's own module counts on top of the one it inherits from.
    assert a.version != get_operator("softmax").version
