"""The shared CUDA headers (kernels/common): inlined by render, hashed into the version."""

from __future__ import annotations

import re
import subprocess
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
ROW_LAYOUT = COMMON_HEADERS / "kato_row_layout.cuh"
DTYPE_HEADER = COMMON_HEADERS / "kato_dtype.cuh"


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
    assert included_headers(RMSNORM.template) == [
        DTYPE_HEADER,
        ROW_LAYOUT,
        VEC_HEADER,
        CONVERT_HEADER,
        ROWS_HEADER,
        COMMON_HEADERS / "kato_row_sum.cuh",
        COMMON_HEADERS / "kato_row_walk.cuh",
        COMMON_HEADERS / "kato_row_cache.cuh",
    ]


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
        assert '#include "../common/' not in text, spec.name
        for header in included_headers(spec.template):
            assert header.read_text().rstrip("\n") in text, (spec.name, header.name)


def test_the_version_follows_the_shared_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = RMSNORM.version
    common = tmp_path / "common"
    common.mkdir()
    (tmp_path / "op").mkdir()
    template = tmp_path / "op" / "rmsnorm.cu"
    template.write_text(RMSNORM.template.read_text())
    for header in included_headers(RMSNORM.template):
        (common / header.name).write_text(header.read_text())
    monkeypatch.setattr(kernels.spec, "COMMON_HEADERS", common)
    copy = type(RMSNORM)()
    monkeypatch.setattr(copy, "template", template)
    assert copy.version == expected  # the same bytes: the same version
    (common / "kato_rows.cuh").write_text(ROWS_HEADER.read_text() + "\n// changed\n")
    changed = type(RMSNORM)()
    monkeypatch.setattr(changed, "template", template)
    assert changed.version != expected


# --- the families' shared preludes (issue 33: the last copies moved into kernels/common) ------

CHANNEL = COMMON_HEADERS / "kato_channel.cuh"
ROW_WISE = (
    "layernorm",
    "rmsnorm",
    "add_rmsnorm",
    "add_layernorm",
    "rmsnorm_backward",
    "layernorm_backward",
    "softmax_backward",
    "cross_entropy",
    "cross_entropy_backward",
)
PER_CHANNEL = ("batchnorm_stats", "batchnorm", "batchnorm_backward")
#: What a row-wise template must define for the preprocessor (the element type's headers off:
#: they need the CUDA include path, which is not what these checks are about).
ROW_MACROS = {"VEC": 4, "ROW_THREADS": 32, "CACHE": 0, "IS_HALF": 0, "IS_BF16": 0}


_BOUNDED_KERNEL = re.compile(r'extern "C" __global__ void (__launch_bounds__\([^)]*\)) (\w+)\(')


def _preprocess(template: Path, macros: dict[str, object]) -> subprocess.CompletedProcess[str]:
    """``template`` through the C preprocessor as nvcc compiles the file itself: its
    ``#include "../common/..."`` lines resolve relative to its folder."""
    flags = [f"-D{name}={value}" for name, value in macros.items()]
    return subprocess.run(
        ["cpp", "-P", "-x", "c++", "-D__CUDACC__", *flags, str(template)],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("name", ROW_WISE)
def test_row_wise_templates_take_their_prelude_from_the_headers(name: str) -> None:
    template = get_operator(name).template
    headers = included_headers(template)
    assert headers[:5] == [DTYPE_HEADER, ROW_LAYOUT, VEC_HEADER, CONVERT_HEADER, ROWS_HEADER]
    text = template.read_text()
    # The template holds none of what the headers hold: its own code only.
    for held in (
        "#define IS_HALF",
        "#define LB_THREADS",
        "#define KATO_LAUNCH_BOUNDS",
        "constexpr int kThreadsPerRow",
        "float row_sum(float s, float* red)",
        "Raw load_cols(",
        "void chunk_range(",
    ):
        assert held not in text, held
    rendered = template_source(template)
    assert rendered.count("#define KATO_LAUNCH_BOUNDS __launch_bounds__(LB_THREADS)") == 1
    assert rendered.count("__device__ __forceinline__ float row_sum(") == 1


@pytest.mark.parametrize("name", ROW_WISE)
def test_the_row_layout_checks_and_defaults_hold_for_every_row_wise_template(name: str) -> None:
    template = get_operator(name).template
    macros = {**ROW_MACROS, "SPLIT": 1} if name.startswith("cross_entropy") else ROW_MACROS
    missing = _preprocess(template, {k: v for k, v in macros.items() if k != "VEC"})
    assert missing.returncode != 0 and "VEC must be defined" in missing.stderr
    block = _preprocess(template, {**macros, "ROW_THREADS": 0})
    assert block.returncode != 0 and "BLOCK_SIZE must be defined for ROW_THREADS 0" in block.stderr
    bounds = _preprocess(template, {**macros, "LB_THREADS": 256, "LB_MIN_BLOCKS": 3})
    assert bounds.returncode == 0, bounds.stderr
    # KATO_LAUNCH_BOUNDS from kato_row_layout.cuh, on the kernels with tuned bounds.
    found = _BOUNDED_KERNEL.findall(bounds.stdout)
    tuned = {bound for bound, kernel in found if kernel in KERNEL_LB[name]}
    assert tuned == {"__launch_bounds__(256, 3)"}, found
    default = _preprocess(template, macros)
    assert "__launch_bounds__(BLOCK_SIZE)" in default.stdout  # LB_THREADS defaults to BLOCK_SIZE


def test_softmax_maps_its_strategy_and_lanes_onto_the_row_layout() -> None:
    """softmax takes the row-wise prelude too: STRATEGY 0 is a row group of LANES lanes,
    STRATEGY 1 and 2 the block (ROW_THREADS 0; 2: both kernels), under
    __launch_bounds__(BLOCK_SIZE, MIN_BLOCKS)."""
    template = get_operator("softmax").template
    assert included_headers(template) == [
        DTYPE_HEADER,
        ROW_LAYOUT,
        VEC_HEADER,
        CONVERT_HEADER,
        ROWS_HEADER,
        COMMON_HEADERS / "kato_split.cuh",
    ]
    text = template.read_text()
    for held in (
        "#define IS_HALF",
        "#define LB_THREADS",
        "#define KATO_LAUNCH_BOUNDS",
        "constexpr int kThreadsPerRow",
        "constexpr int next_pow2",
        "kVecBytes <= 16",
    ):
        assert held not in text, held
    macros = {"BLOCK_SIZE": 256, "VEC": 4, "CACHE": 0, "IS_HALF": 0, "IS_BF16": 0}
    warp = _preprocess(template, {**macros, "STRATEGY": 0, "LANES": 8, "MIN_BLOCKS": 2})
    assert warp.returncode == 0, warp.stderr
    assert "constexpr int kThreadsPerRow = 8;" in warp.stdout
    assert "__launch_bounds__(256, 2) softmax_kernel(" in warp.stdout
    block = _preprocess(template, {**macros, "STRATEGY": 1})
    assert block.returncode == 0, block.stderr
    assert "constexpr int kThreadsPerRow = 256;" in block.stdout
    assert "__launch_bounds__(256) softmax_kernel(" in block.stdout
    pieces = _preprocess(template, {**macros, "STRATEGY": 2, "MIN_BLOCKS": 2})
    assert pieces.returncode == 0, pieces.stderr
    assert "constexpr int kThreadsPerRow = 256;" in pieces.stdout  # a block per piece of a row
    for kernel in ("softmax_split_stats(", "softmax_kernel("):
        assert f"__launch_bounds__(256, 2) {kernel}" in pieces.stdout, kernel
    for strategy in (1, 2):
        mixed = _preprocess(template, {**macros, "STRATEGY": strategy, "LANES": 8})
        assert mixed.returncode != 0
        assert "STRATEGY 1 and 2 (a block per row or piece) take LANES 32" in mixed.stderr
    # Every check and default softmax's own prelude had, from the layout or the template.
    asserts, defaults = _checks_and_defaults(template_source(template))
    assert asserts >= ROW_ASSERTS, ROW_ASSERTS - asserts
    assert 'STRATEGY == 0 || STRATEGY == 1, "STRATEGY must be 0 (warp) or 1 (block)"' in asserts
    want = {"DTYPE": "float", "MIN_BLOCKS": "0", "LANES": "32", "ITEMS": "1", "ROW_SPLIT": "0"}
    assert {k: defaults.get(k) for k in want} == want


#: The kernels of each row-wise template that take KATO_LAUNCH_BOUNDS (the others have fixed
#: bounds: the backward passes' column reductions, cross_entropy's combine).
KERNEL_LB = {
    "layernorm": {"layernorm_fwd"},
    "rmsnorm": {"rmsnorm_fwd"},
    "add_rmsnorm": {"add_rmsnorm_fwd"},
    "add_layernorm": {"add_layernorm_fwd"},
    "rmsnorm_backward": {"rmsnorm_bwd"},
    "layernorm_backward": {"layernorm_bwd"},
    "softmax_backward": {"softmax_backward_kernel"},
    "cross_entropy": {"cross_entropy_fwd"},
    "cross_entropy_backward": {"cross_entropy_bwd"},
}


@pytest.mark.parametrize("name", PER_CHANNEL)
def test_per_channel_templates_take_their_prelude_from_the_headers(name: str) -> None:
    template = get_operator(name).template
    expected = [DTYPE_HEADER, CHANNEL]
    if name != "batchnorm_stats":  # the two with an elementwise pass
        expected.append(COMMON_HEADERS / "kato_channel_apply.cuh")
    assert included_headers(template)[: len(expected)] == expected
    text = template.read_text()
    for held in ("#define UNROLL", "#define DTYPE", "#define APPLY", "kFinalizeThreads = 256"):
        assert held not in text, held
    macros = {"BLOCK_SIZE": 128, "VEC": 4, "IS_HALF": 0, "IS_BF16": 0}
    missing = _preprocess(template, {k: v for k, v in macros.items() if k != "BLOCK_SIZE"})
    assert missing.returncode != 0 and "BLOCK_SIZE must be defined" in missing.stderr
    done = _preprocess(template, macros)
    assert done.returncode == 0, done.stderr
    # kato_channel.cuh's UNROLL default (4) sizes the loads in flight of the channel pass.
    assert re.search(r"\bRaw \w+\[4\]", done.stdout)
    assert not re.search(r"\bRaw \w+\[UNROLL\]", done.stdout)


def _checks_and_defaults(source: str) -> tuple[set[str], dict[str, str]]:
    """The static_asserts (condition and message, whitespace folded) and the ``#ifndef X /
    #define X value`` defaults of a rendered source, comments dropped."""
    text = re.sub(r"//[^\n]*", "", source)
    asserts = {re.sub(r"\s+", " ", m) for m in re.findall(r"static_assert\((.*?)\);", text, re.S)}
    defaults = dict(re.findall(r"#ifndef (\w+)\s*\n\s*#define \1[ \t]+([^\n]*?)\s*\n", text))
    return asserts, defaults


_VEC_ASSERT = 'VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8"'
_BLOCK_ASSERT = (
    'BLOCK_SIZE % 32 == 0 && BLOCK_SIZE >= 32 && BLOCK_SIZE <= 1024, "BLOCK_SIZE must be a '
    'multiple of 32 in [32, 1024]"'
)
#: What every row-wise template checked and defaulted in its own prelude before issue 33 moved
#: the preludes into kato_row_layout.cuh (each template's text at b454b9f, headers inlined): a
#: header that drops one of them passes the preprocessor tests above but not this one.
ROW_ASSERTS = {
    _VEC_ASSERT,
    _BLOCK_ASSERT,
    'kVecBytes <= 16, "a vector must be at most 16 bytes"',
    'LB_THREADS % 32 == 0 && LB_THREADS >= 32 && LB_THREADS <= 1024, "LB_THREADS must be a '
    'multiple of 32 in [32, 1024]"',
    # 4 lanes since softmax's LANES (issue 31): the other operators' spaces stop at 8.
    "ROW_THREADS == 0 || ROW_THREADS == 4 || ROW_THREADS == 8 || ROW_THREADS == 16 || "
    'ROW_THREADS == 32, "ROW_THREADS must be 0 (block), 4, 8, 16 or 32"',
    'kThreadsPerRow >= VEC, "head and tail need one thread per element"',
}
ROW_DEFAULTS = {"DTYPE": "float", "LB_THREADS": "BLOCK_SIZE", "LB_MIN_BLOCKS": "0"}
#: The register cache's defaults, in the templates that had them.
ROW_CACHE_DEFAULTS = {"ITEMS": "1", "WB_REGS": "0"}
CHANNEL_ASSERTS = {
    _VEC_ASSERT,
    _BLOCK_ASSERT,
    'UNROLL >= 1 && UNROLL <= 8, "UNROLL must be in [1, 8]"',
    'kVecBytes <= 16, "a vector must be at most 16 bytes"',
}
CHANNEL_DEFAULTS = {"DTYPE": "float", "UNROLL": "4", "MIN_BLOCKS": "0"}
APPLY_ASSERTS = {
    'APPLY == 0 || APPLY == 1, "APPLY must be 0 or 1"',
    'APPLY_VEC == 1 || APPLY_VEC == 2 || APPLY_VEC == 4 || APPLY_VEC == 8, "APPLY_VEC must be '
    '1, 2, 4 or 8"',
    'kApplyBytes <= 16, "a vector must be at most 16 bytes"',
}
APPLY_DEFAULTS = {"APPLY": "0", "APPLY_VEC": "VEC"}


@pytest.mark.parametrize("name", ROW_WISE + PER_CHANNEL)
def test_no_template_lost_a_check_or_a_default_its_prelude_had(name: str) -> None:
    asserts, defaults = _checks_and_defaults(template_source(get_operator(name).template))
    if name in ROW_WISE:
        want_asserts, want_defaults = set(ROW_ASSERTS), dict(ROW_DEFAULTS)
        if not name.startswith(("cross_entropy", "softmax_backward")):
            want_defaults.update(ROW_CACHE_DEFAULTS)
        if name == "softmax_backward":
            want_defaults["ITEMS"] = "1"
    else:
        want_asserts, want_defaults = set(CHANNEL_ASSERTS), dict(CHANNEL_DEFAULTS)
        if name != "batchnorm_stats":
            want_asserts |= APPLY_ASSERTS
            want_defaults.update(APPLY_DEFAULTS)
    assert want_asserts <= asserts, want_asserts - asserts
    assert {k: defaults.get(k) for k in want_defaults} == want_defaults


def test_layernorm_takes_the_welford_partials_from_the_header() -> None:
    template = get_operator("layernorm").template
    assert COMMON_HEADERS / "kato_welford.cuh" in included_headers(template)
    text = template.read_text()
    for held in ("struct Stats {", "Stats merge(", "Stats vector_stats(", "struct RowSplit"):
        assert held not in text, held
    # The row-group butterfly is the header's, at the row's and the warps' widths.
    assert "warp_allreduce<kLanes>(" in text and "warp_allreduce<kWarpsPow2>(" in text


@pytest.mark.parametrize("name", ["reduce_sum", "reduce_sum_all"])
def test_the_sum_templates_share_their_summation_steps(name: str) -> None:
    template = get_operator(name).template
    headers = included_headers(template)
    assert headers[0] == DTYPE_HEADER
    assert headers[-4:] == [
        VEC_HEADER,
        CONVERT_HEADER,
        ROWS_HEADER,
        COMMON_HEADERS / "kato_pairwise.cuh",
    ]
    text = template.read_text()
    for held in ("#define IS_HALF", "float to_float(", "float vector_sum(", "void kahan_add("):
        assert held not in text, held
    rendered = template_source(template)
    assert rendered.count("__device__ __forceinline__ float pairwise(") == 1


def test_matmul_compiled_on_its_own_is_float32() -> None:
    """matmul's IS_HALF / IS_BF16 pick its code path: with neither given, neither 16-bit header
    is taken (cpp without the CUDA include path finds no cuda_fp16.h), unlike kato_dtype.cuh's
    default of both; a rendered source names both, as before."""
    template = get_operator("matmul").template
    assert DTYPE_HEADER in included_headers(template)
    tile = {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64}
    alone = _preprocess(template, tile)
    assert alone.returncode == 0, alone.stderr
    bf16 = _preprocess(template, {**tile, "IS_BF16": 1})
    assert bf16.returncode != 0 and "cuda_bf16.h" in bf16.stderr


NORM_BACKWARDS = ("rmsnorm_backward", "layernorm_backward")


@pytest.mark.parametrize("name", NORM_BACKWARDS)
def test_the_norm_backward_templates_take_their_column_reduce_from_the_header(name: str) -> None:
    """Stage 2 (the partial rows summed per column) is kato_partials.cuh's, rendered once."""
    template = get_operator(name).template
    assert COMMON_HEADERS / "kato_partials.cuh" in included_headers(template)
    text = template.read_text()
    for held in ("sums[threadIdx.y][threadIdx.x] = sum;", "#pragma unroll 4"):
        assert held not in text, held
    rendered = template_source(template)
    assert rendered.count("__device__ __forceinline__ void reduce_partials(") == 1
    # The kernel keeps its own shared tile (its PTX name is the kernel's, as before).
    assert "__shared__ float sums[32][33];" in text


#: The row-wise templates whose kernels walk the rows with kato_row_walk.cuh's row_walk().
ROW_WALKERS = (
    "rmsnorm",
    "add_rmsnorm",
    "add_layernorm",
    "softmax_backward",
    "cross_entropy",
)


@pytest.mark.parametrize("name", ROW_WALKERS)
def test_the_row_walk_is_the_headers(name: str) -> None:
    template = get_operator(name).template
    assert COMMON_HEADERS / "kato_row_walk.cuh" in included_headers(template)
    text = template.read_text()
    for held in ("const int group = lane / kn::kLanes;", "const long long stride = gridDim.x;"):
        assert held not in text, held
    assert text.count("= kn::row_walk();") == 1


@pytest.mark.parametrize("row_threads", [0, 8, 32])
def test_the_row_walk_keeps_each_mode_s_geometry(row_threads: int) -> None:
    """Block mode: one row group of BLOCK_SIZE threads per block, a block per step; warp mode:
    kLanes lanes per group, the warp's groups on consecutive rows."""
    macros = {**ROW_MACROS, "ROW_THREADS": row_threads, "BLOCK_SIZE": 256}
    done = _preprocess(get_operator("rmsnorm").template, macros)
    assert done.returncode == 0, done.stderr
    walk = done.stdout[done.stdout.index("RowWalk row_walk()") :]
    walk = walk[: walk.index("return w;")]
    if row_threads == 0:
        assert "w.groups = 1;" in walk and "w.stride = gridDim.x;" in walk
    else:
        assert "w.group = lane / kLanes;" in walk
        assert "w.groups = static_cast<int>(blockDim.x) / kLanes;" in walk


#: The templates that keep a row between passes (CACHE): the walkers but cross_entropy, and the
#: norm backwards.
ROW_CACHERS = (*(n for n in ROW_WALKERS if n != "cross_entropy"), *NORM_BACKWARDS)


@pytest.mark.parametrize("name", ROW_CACHERS)
def test_the_row_cache_is_checked_by_the_header(name: str) -> None:
    template = get_operator(name).template
    assert COMMON_HEADERS / "kato_row_cache.cuh" in included_headers(template)
    assert "CACHE must be" not in template.read_text()
    missing = _preprocess(template, {k: v for k, v in ROW_MACROS.items() if k != "CACHE"})
    assert missing.returncode != 0 and "CACHE must be defined" in missing.stderr
    asserts, _ = _checks_and_defaults(template_source(template))
    assert 'CACHE >= 0 && CACHE <= 2, "CACHE must be 0, 1 or 2"' in asserts
    assert 'CACHE != 2 || (ITEMS >= 1 && ITEMS <= 64), "CACHE 2 needs ITEMS in [1, 64]"' in asserts
