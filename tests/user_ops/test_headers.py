"""Headers beside a folder operator's template (``#include "add.cuh"``): read with the
folder, stored with the definition (``POST /v1/operators``), inlined when a variant or the
reference is rendered (``#pragma once`` and include guards as the preprocessor has them), part
of the version; and the include rules unchanged for everything else (no path, no ``..``, no
host file, no header the spec does not list, no other spelling of a quoted include)."""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from kato.kernels import get_operator
from kato.kernels.spec import InvalidInput
from kato.kernels.user import definition, load_folder, spec_from_folder
from kato.kernels.user.model import MAX_INLININGS
from kato.kernels.user.spec import UserOperatorSpec
from kato.service.app import create_app
from kato.service.settings import Settings
from kato.tuner.nvcc import compile_kernel

from user_ops.test_stored_operators import _token, bearer

FOLDER = Path(__file__).resolve().parent / "data" / "vector_add_header"
SHAPE = (1000,)


def _parts() -> tuple[dict, dict[str, str]]:
    spec = tomllib.loads((FOLDER / "kato.toml").read_text())
    files = {p.name: p.read_text() for p in FOLDER.iterdir() if p.name != "kato.toml"}
    return spec, files


def _refused(says: str, spec_changes=None, **file_changes) -> None:
    spec, files = _parts()
    files |= file_changes
    with pytest.raises(InvalidInput, match=says):
        definition(spec | (spec_changes or {}), {k: v for k, v in files.items() if v is not None})


def test_headers_are_read_with_the_folder_and_inlined(tmp_path):
    op = spec_from_folder(FOLDER)
    assert set(op.definition.files) == {"vector_add.cu", "reference.cu", "add.cuh", "stride.h"}
    config = {"block_size_x": 128, "tile_size_x": 4}
    source = op.render(config, SHAPE, "float32")
    assert '#include "' not in source and "#pragma once" not in source
    assert source.count("void add_at(") == 1 and source.count("#define STRIDE_H") == 2
    compile_kernel(source, "vector_add", arch="sm_90", cache_dir=tmp_path)
    reference = op.device_reference(SHAPE, "float32")
    assert reference.source.count("void add_at(") == 1
    compile_kernel(reference.source, "vector_add_reference", arch="sm_90", cache_dir=tmp_path)


def test_a_header_is_part_of_the_version():
    spec, files = _parts()
    one = UserOperatorSpec(definition(spec, files))
    files["stride.h"] = files["stride.h"].replace("// The distance", "// the distance")
    assert UserOperatorSpec(definition(spec, files)).version != one.version


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CPU emulation")
def test_every_variant_with_its_headers_matches_a_float64_reference(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from cuda_emulation import Case, cuda_include_dir, run_cases

    if cuda_include_dir() is None:
        pytest.skip("needs the CUDA headers")
    d = load_folder(FOLDER)
    op = UserOperatorSpec(d, reference=lambda args, shape, dtype: [args[1] + args[2].astype("f8")])
    cases = [
        Case(op, {"block_size_x": bx, "tile_size_x": t}, shape, "float32")
        for bx, t, shape in ((32, 1, (1,)), (64, 8, (97,)), (1024, 2, (4097,)), (256, 4, (4097,)))
    ]
    # One program per case: the headers' functions are not in a namespace of their own.
    assert run_cases(cases, tmp_path, np.random.default_rng(0), binaries=len(cases)) == []


@pytest.mark.parametrize(
    ("says", "spec_changes", "files"),
    [
        ("names none of the operator's headers \\(add.cuh, stride.h\\); list", None,
         {"vector_add.cu": '#include "other.h"\n__global__ void vector_add() {}'}),
        ("not allowed", None, {"vector_add.cu": '#include "../add.cuh"\n'}),
        ("not allowed", None, {"vector_add.cu": '#include "/etc/passwd"\n'}),
        ("not allowed", None, {"vector_add.cu": '#include "sub/add.cuh"\n'}),
        ("not allowed", None, {"vector_add.cu": '#include </etc/passwd>\n'}),
        ("not allowed", None, {"add.cuh": '#include "/etc/passwd"\n'}),
        ("not allowed", None, {"add.cuh": '#include <../../etc/passwd>\n'}),
        ("not allowed", None, {"vector_add.cu": '%:include "add.cuh"\n'}),  # not inlined: refused
        ("not allowed", None, {"vector_add.cu": 'int a;\r#include "add.cuh"\n'}),
        ("not allowed", None, {"vector_add.cu": '#inc\\\nlude "add.cuh"\n'}),
        ("must be a plain .h", {"headers": ["../add.cuh"]}, {}),
        ("must be a plain .h", {"headers": ["/etc/passwd"]}, {}),
        ("must be a plain .h", {"headers": ["sub/add.cuh"]}, {}),
        ("must be a plain .h", {"headers": ["add.so"]}, {}),
        ("other than the templates", {"headers": ["add.cuh", "add.cuh"]}, {}),
        ("files named by the spec are missing: stride.h", None, {"stride.h": None}),
        ("files the spec does not name: extra.h", None, {"extra.h": "int x;"}),
        ("headers include each other: .* -> add.cuh -> stride.h -> add.cuh", None,
         {"stride.h": '#include "add.cuh"\n'}),
        (f"more than {MAX_INLININGS} header inclusions", None,
         {"stride.h": "", "add.cuh": '#include "stride.h"\n' * 200,
          "vector_add.cu": '#include "add.cuh"\n' * 60}),
    ],
)  # fmt: skip
def test_include_rules_hold_with_headers(says, spec_changes, files):
    _refused(says, spec_changes, **files)


def test_a_pragma_once_header_is_inlined_once_and_others_each_time():
    spec, files = _parts()
    files["stride.h"] = "int counted;\n"  # no guard: each include is a copy
    files["vector_add.cu"] = '#include "add.cuh"\n#include "add.cuh"\n#include "stride.h"\n'
    source = UserOperatorSpec(definition(spec, files)).render(
        {"block_size_x": 32, "tile_size_x": 1}, SHAPE, "float32"
    )
    assert source.count("void add_at(") == 1 and source.count("int counted;") == 2


def test_stored_through_the_api_with_its_headers(tmp_path):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}"))
    spec, files = _parts()
    body = {"spec": spec | {"name": "api_header_va"}, "files": files}
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            secret = _token(app, operators=True)
            r = client.post("/v1/operators", json=body, headers=bearer(secret))
            assert r.status_code == 201, r.text
            bad = body | {"files": files | {"add.cuh": '#include "../../etc/passwd"\n'}}
            r = client.post("/v1/operators", json=bad, headers=bearer(secret))
            assert r.status_code == 422 and "not allowed" in r.text
        op = get_operator("api_header_va")
        assert op.definition.files["stride.h"] == files["stride.h"]
        source = op.render({"block_size_x": 64, "tile_size_x": 2}, SHAPE, "float32")
        assert "#define ELEMENT_STRIDE block_size_x" in source
    finally:
        app.state.engine.dispose()
