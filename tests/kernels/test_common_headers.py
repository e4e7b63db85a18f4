"""The shared CUDA headers (kernels/common): inlined by render, hashed into the version."""

from __future__ import annotations

from pathlib import Path

import kato.kernels.spec  # noqa: F401
import pytest
from kato.kernels import get_operator, list_operators
from kato.kernels.spec import COMMON_HEADERS, included_headers, template_source

from kato import kernels

RMSNORM = get_operator("rmsnorm")
VEC_HEADER = COMMON_HEADERS / "kato_vec.cuh"
CONVERT_HEADER = COMMON_HEADERS / "kato_convert.cuh"
ROWS_HEADER = COMMON_HEADERS / "kato_rows.cuh"


def test_render_inlines_the_shared_headers_in_place_of_their_includes() -> None:
    config = RMSNORM.default_config((64, 1024), "bfloat16")
    source = RMSNORM.render(config, (64, 1024), "bfloat16")
    assert '#include "../common/' not in source
    texts = [h.read_text().rstrip("\n") for h in (VEC_HEADER, CONVERT_HEADER, ROWS_HEADER)]
    assert [source.count(text) for text in texts] == [1, 1, 1]
    # Inside the template's namespace, in the order each uses the one before (Raw, from_float).
    places = [source.index(text) for text in texts]
    assert source.index("namespace KATO_NS {") < places[0] < places[1] < places[2]
    assert source.count("struct RawOf;") == 1


def test_included_headers_are_the_common_ones_in_order() -> None:
    assert included_headers(RMSNORM.template) == [VEC_HEADER, CONVERT_HEADER, ROWS_HEADER]


def test_other_includes_are_left_to_the_compiler(tmp_path: Path) -> None:
    template = tmp_path / "op.cu"
    template.write_text('#include <cuda_fp16.h>\n#include "mine.cuh"\nint x;\n')
    (tmp_path / "mine.cuh").write_text("int y;\n")
    assert template_source(template) == template.read_text()
    assert included_headers(template) == []


def test_every_template_including_a_common_header_renders_without_it() -> None:
    users = [s for s in list_operators() if included_headers(s.template)]
    assert RMSNORM in users
    for spec in users:
        text = template_source(spec.template)
        assert '#include "../common/' not in text and "struct RawOf;" in text, spec.name


def test_the_version_follows_the_shared_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = RMSNORM.version
    common = tmp_path / "common"
    common.mkdir()
    (tmp_path / "op").mkdir()
    template = tmp_path / "op" / "rmsnorm.cu"
    template.write_text(RMSNORM.template.read_text())
    for header in (VEC_HEADER, CONVERT_HEADER, ROWS_HEADER):
        (common / header.name).write_text(header.read_text())
    monkeypatch.setattr(kernels.spec, "COMMON_HEADERS", common)
    copy = type(RMSNORM)()
    monkeypatch.setattr(copy, "template", template)
    assert copy.version == expected  # the same bytes: the same version
    (common / "kato_rows.cuh").write_text(ROWS_HEADER.read_text() + "\n// changed\n")
    changed = type(RMSNORM)()
    monkeypatch.setattr(changed, "template", template)
    assert changed.version != expected
