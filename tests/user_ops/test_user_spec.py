"""UserOperatorSpec from a folder: validation, Kernel Tuner's geometry, rendering, problems."""

from __future__ import annotations

import itertools
import shutil
import tomllib
from pathlib import Path

import kernel_tuner.util as kt_util
import numpy as np
import pytest
from kato.kernels.spec import InvalidInput
from kato.kernels.user import definition, load_folder, spec_from_folder
from kato.kernels.user.spec import UserOperatorSpec


def _spec_dict(folder: Path) -> dict:
    return tomllib.loads((folder / "kato.toml").read_text())


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.glob("*.cu")}


def _refused(folder: Path, says: str, **changes) -> None:
    spec = _spec_dict(folder) | changes
    with pytest.raises(InvalidInput) as info:
        definition(spec, _files(folder))
    assert says in str(info.value), str(info.value)


def test_folder_loads(vector_add_dir):
    spec = spec_from_folder(vector_add_dir)
    assert spec.name == "vector_add_test"
    assert spec.params == {
        "block_size_x": (32, 64, 128, 256, 512, 1024),
        "tile_size_x": (1, 2, 4, 8),
    }
    assert spec.shape_names == ("n",)
    assert spec.describe()["user"] is True
    assert spec.bytes_moved((1000,), "float32") == 12000
    assert spec.buffer_bytes((1000,), "float32") == 12000
    # the restriction block_size_x * tile_size_x <= 4096 removes 1024x8 only
    valid = [
        dict(zip(spec.params, v, strict=True))
        for v in itertools.product(*spec.params.values())
        if spec.check(dict(zip(spec.params, v, strict=True)), (1000,), "float32") is None
    ]
    assert len(valid) == 23
    assert {"block_size_x": 1024, "tile_size_x": 8} not in valid
    reason = spec.check({"block_size_x": 1024, "tile_size_x": 8}, (1000,), "float32")
    assert "block_size_x * tile_size_x <= 4096" in reason
    assert "not one of" in spec.check({"block_size_x": 48, "tile_size_x": 1}, (1000,), "float32")


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"restrictions": ["block_size_x * unroll <= 1024"]}, "unknown name 'unroll'"),
        ({"restrictions": ["().__class__"]}, "attribute access"),
        ({"restrictions": ["__import__('os').system('x')"]}, "__import__"),
        ({"grid_div_x": ["block_size_x.bit_length()"]}, "may be called"),
        ({"bytes": "9**9**9 > 1"}, ""),  # parses; refused when evaluated (below)
        ({"bytes": "block_size_x * 4"}, "unknown name 'block_size_x'"),  # shape only
        ({"name": "Vector Add"}, "name"),
        ({"template": "../etc/passwd.cu"}, "plain .cu"),
        ({"tune_params": {"block_size_x": []}}, "1 to 1024 values"),
        ({"tune_params": {"block_size_x": [1, 1]}}, "twice"),
        ({"tune_params": {"n": [1, 2]}}, "names used twice"),
        ({"dtypes": ["float8"]}, "unknown"),
        ({"kernel_name": "vector add"}, "C identifier"),
        ({"verify": True, "reference": None}, "no reference"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_bad_specs_refused(vector_add_dir, changes, says):
    if changes.get("reference", 1) is None:
        spec = _spec_dict(vector_add_dir)
        del spec["reference"]
        with pytest.raises(InvalidInput, match=says):
            definition(spec, {"vector_add.cu": "x"})
        return
    if "bytes" in changes and not says:
        d = definition(_spec_dict(vector_add_dir) | changes, _files(vector_add_dir))
        with pytest.raises(InvalidInput, match="at most 64"):
            UserOperatorSpec(d).bytes_moved((10,), "float32")
        return
    _refused(vector_add_dir, says, **changes)


def test_folder_errors(tmp_path, vector_add_dir):
    with pytest.raises(InvalidInput, match="not a directory"):
        load_folder(tmp_path / "missing")
    with pytest.raises(InvalidInput, match="no kato.toml"):
        load_folder(tmp_path)
    folder = tmp_path / "op"
    shutil.copytree(vector_add_dir, folder)
    (folder / "reference.cu").unlink()
    with pytest.raises(InvalidInput, match="'reference.cu', which is not a file"):
        load_folder(folder)
    (folder / "kato.toml").write_text("name = [")
    with pytest.raises(InvalidInput, match="not valid TOML"):
        load_folder(folder)


def test_files_must_match_the_spec(vector_add_dir):
    files = _files(vector_add_dir)
    with pytest.raises(InvalidInput, match="missing: reference.cu"):
        definition(_spec_dict(vector_add_dir), {"vector_add.cu": files["vector_add.cu"]})
    with pytest.raises(InvalidInput, match="does not name: extra.cu"):
        definition(_spec_dict(vector_add_dir), files | {"extra.cu": ""})


def _two_d(**extra) -> UserOperatorSpec:
    spec = {
        "name": "tiles",
        "template": "k.cu",
        "kernel_name": "k",
        "shape": ["rows", "cols"],
        "problem_size": ["cols", "rows"],
        "tune_params": {
            "block_size_x": [16, 32, 64],
            "block_size_y": [1, 2, 4, 8],
            "tile_size_x": [1, 2],
            "tile_size_y": [1, 4],
        },
        "grid_div_x": ["block_size_x", "tile_size_x"],
        "grid_div_y": ["block_size_y * tile_size_y"],
        "restrictions": ["block_size_x * block_size_y >= 32"],
        "arguments": [{"name": "out", "dtype": "float32", "size": "rows * cols", "output": True}],
        "verify": False,
        **extra,
    }
    return UserOperatorSpec(definition(spec, {"k.cu": "__global__ void k(float *out) {}"}))


def test_geometry_matches_kernel_tuner():
    """Grid and block of every config equal Kernel Tuner's own functions' answers."""
    spec = _two_d()
    shape = (1000, 777)
    for values in itertools.product(*spec.params.values()):
        params = dict(zip(spec.params, values, strict=True))
        launch = spec.launch(params, shape, "float32")
        names = list(spec.block_size_names)
        problem = kt_util.get_problem_size((777, 1000), params)
        grid_div = (
            ["block_size_x", "tile_size_x"],
            ["block_size_y * tile_size_y"],
            None,
        )
        assert launch.grid == kt_util.get_grid_dimensions(problem, params, grid_div, names)
        assert launch.block == kt_util.get_thread_block_dimensions(params, names)


def test_default_divisors_and_block_names():
    """A short block_size_names list is padded with Kernel Tuner's defaults (Kernel Tuner
    itself indexes past its end); a missing grid_div_* divides by that dimension's block size
    name where it is a tunable."""
    spec = _two_d(grid_div_x=None, grid_div_y=None, block_size_names=["block_size_y"])
    assert spec.block_size_names == ("block_size_y", "block_size_y", "block_size_z")
    params = {"block_size_x": 32, "block_size_y": 8, "tile_size_x": 2, "tile_size_y": 4}
    launch = spec.launch(params, (100, 300), "float32")
    assert launch.block == (8, 8, 1)
    assert launch.grid == (38, 13, 1)  # ceil(300 / 8), ceil(100 / 8)


def test_render_defines_like_kernel_tuner(vector_add_dir):
    spec = spec_from_folder(vector_add_dir)
    source = spec.render({"block_size_x": 128, "tile_size_x": 4}, (1000,), "float32")
    lines = source.splitlines()
    assert lines[:8] == [
        "#define grid_size_x 2",
        "#define grid_size_y 1",
        "#define grid_size_z 1",
        "#define block_size_x 128",
        "#define block_size_y 1",
        "#define block_size_z 1",
        "#define tile_size_x 4",
        "#define kernel_tuner 1",
    ]
    assert lines[8] == 'extern "C" {'  # no extern "C" in the template: wrapped, as PyCUDA does


def test_problem_and_reference_kernel(vector_add_dir):
    spec = spec_from_folder(vector_add_dir)
    problem = spec.make_problem((1000,), "float32", np.random.default_rng(1))
    c, a, b, n = problem.args
    assert c.dtype == a.dtype == np.float32 and c.size == 1000 and not c.any()
    assert a.std() > 0.5 and (a != 0).all() and not np.array_equal(a, b)
    assert n == np.int32(1000) and isinstance(n, np.int32)
    assert problem.outputs == [0] and problem.references == []  # the device fills them
    ref = spec.device_reference((1000,), "float32")
    assert ref.kernel_name == "vector_add_reference"
    assert ref.launch.grid == (4, 1, 1) and ref.launch.block == (256, 1, 1)
    assert "#define n" not in ref.source  # shape names are arguments, never macros


def test_python_reference_and_answer(vector_add_dir):
    d = load_folder(vector_add_dir)

    def reference(args, shape, dtype):
        return [args[1].astype(np.float64) + args[2]]

    spec = UserOperatorSpec(d, reference=reference)
    problem = spec.make_problem((64,), "float32", np.random.default_rng(0))
    expected = problem.args[1].astype(np.float64) + problem.args[2]
    np.testing.assert_array_equal(problem.references[0], expected)
    assert spec.device_reference((64,), "float32") is None
    a = np.arange(8, dtype=np.float32)
    fixed = UserOperatorSpec(d, arguments=[np.zeros(8), a, a, 8], answer=[2 * a, None, None, None])
    problem = fixed.make_problem((8,), "float32", np.random.default_rng(0))
    np.testing.assert_array_equal(problem.args[1], a)
    np.testing.assert_array_equal(problem.references[0], 2 * a)
    assert problem.outputs == [0]
    with pytest.raises(InvalidInput, match="one per argument"):
        UserOperatorSpec(d, answer=[None])


def test_version_covers_template_and_spec(vector_add_dir, tmp_path):
    base = spec_from_folder(vector_add_dir).version
    assert base == spec_from_folder(vector_add_dir).version  # stable
    folder = tmp_path / "op"
    shutil.copytree(vector_add_dir, folder)
    (folder / "vector_add.cu").write_text((folder / "vector_add.cu").read_text() + "\n// x\n")
    changed_template = spec_from_folder(folder).version
    text = (folder / "kato.toml").read_text().replace("<= 4096", "<= 2048")
    (folder / "kato.toml").write_text(text)
    changed_spec = spec_from_folder(folder).version
    assert len({base, changed_template, changed_spec}) == 3


def test_expression_failure_is_an_invalid_config():
    spec = _two_d(restrictions=["rows // (block_size_x - 16) > 0"])
    reason = spec.check(
        {"block_size_x": 16, "block_size_y": 2, "tile_size_x": 1, "tile_size_y": 1},
        (10, 10),
        "float32",
    )
    assert "division by zero" in reason


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_rendered_variants_compile(vector_add_dir, tmp_path):
    """Two variants and the reference kernel go through nvcc and ptxas; a template that does not
    compile is a CompileError (a compile_error trial in the backend), not a crash."""
    from kato.tuner.nvcc import CompileError, compile_kernel

    spec = spec_from_folder(vector_add_dir)
    for config in (
        {"block_size_x": 128, "tile_size_x": 4},
        {"block_size_x": 1024, "tile_size_x": 1},
    ):
        compiled = compile_kernel(
            spec.render(config, (1000,), "float32"), spec.kernel_name, arch="sm_90",
            cache_dir=tmp_path,
        )  # fmt: skip
        assert compiled.cubin and compiled.registers > 0
    ref = spec.device_reference((1000,), "float32")
    assert compile_kernel(ref.source, ref.kernel_name, arch="sm_90", cache_dir=tmp_path).cubin
    files = _files(vector_add_dir) | {"vector_add.cu": "__global__ void vector_add( {"}
    broken = UserOperatorSpec(definition(_spec_dict(vector_add_dir), files))
    with pytest.raises(CompileError):
        compile_kernel(
            broken.render({"block_size_x": 128, "tile_size_x": 4}, (1000,), "float32"),
            broken.kernel_name, arch="sm_90", cache_dir=tmp_path,
        )  # fmt: skip


@pytest.mark.parametrize(
    "line",
    [
        '#include "/etc/passwd"',
        "#include </etc/passwd>",
        "#include <../../../etc/passwd>",
        "#define F </etc/passwd>\n#include F",
        '#/**/include "x.cuh"',
        '#\\\ninclude "/etc/shadow"',
        'const char *s = "/*";\n#include "/etc/passwd"\n// */',
        "#include_next <stdio.h>",
        '#line 1 "x"',
        # Spellings nvcc 13 honours (each echoed a host file in nvcc's errors when accepted),
        # and a trigraph, which ISO modes of a host preprocessor honour:
        '%:include "/etc/passwd"',  # the digraph of '#'
        '\f#include "/etc/passwd"',  # a form feed before '#'
        '\v#include "/etc/passwd"',
        'int a;\r#include "/etc/passwd"',  # a lone CR ends a line
        'const char *s = "/*";\n/**/#include "/etc/passwd"',  # the stripper eats the line
        '#inc\\ \nlude "/etc/passwd"',  # backslash, blank, newline: still a splice
        '#inc\\\r\nlude "/etc/passwd"',
        '??=include "/etc/passwd"',  # a trigraph
    ],
)
def test_templates_may_include_system_headers_only(vector_add_dir, line):
    """nvcc runs on the workers and its errors reach the user: no file of the host can be
    pulled in by an include."""
    files = _files(vector_add_dir)
    files["vector_add.cu"] = line + "\n" + files["vector_add.cu"]
    with pytest.raises(InvalidInput, match="not allowed"):
        definition(_spec_dict(vector_add_dir), files)
    files["vector_add.cu"] = (
        "#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
        + (_files(vector_add_dir)["vector_add.cu"])
    )
    definition(_spec_dict(vector_add_dir), files)  # system headers are fine


def test_float_divisors_truncate_like_kernel_tuner():
    """Kernel Tuner takes int() of each divisor (its spmv example: block_size_x/threads_per_row)."""
    spec = UserOperatorSpec(
        definition(
            {
                "name": "spmv_like",
                "template": "k.cu",
                "kernel_name": "k",
                "shape": ["rows"],
                "tune_params": {"block_size_x": [32, 48, 96, 1024], "threads_per_row": [1, 32]},
                "grid_div_x": ["block_size_x/threads_per_row"],
                "arguments": [{"name": "y", "dtype": "float32", "size": "rows"}],
                "verify": False,
            },
            {"k.cu": "__global__ void k(float *y) {}"},
        )
    )
    for values in itertools.product(*spec.params.values()):
        params = dict(zip(spec.params, values, strict=True))
        grid = spec.launch(params, (131072,), "float32").grid
        expected = kt_util.get_grid_dimensions(
            (131072, 1, 1), params, (["block_size_x/threads_per_row"], None, None),
            list(spec.block_size_names),
        )  # fmt: skip
        assert grid == expected, params


@pytest.mark.parametrize(
    "value",
    ["'1\\n#include \"/etc/passwd\"'", "'1\\r%:include \"/etc/passwd\"'", "'x\\\\'"],
)
def test_define_strings_cannot_start_a_directive(vector_add_dir, value):
    """A define's value is written into a #define line of the rendered source: a string
    constant holding a line break or a backslash would put an #include after it."""
    spec = _spec_dict(vector_add_dir) | {"defines": {"X": value}}
    with pytest.raises(InvalidInput, match="printable ASCII"):
        definition(spec, _files(vector_add_dir))


def test_rendered_source_of_a_plain_define_string_compiles_its_template(vector_add_dir):
    """A printable string value is rendered as written (a type name, say)."""
    spec = _spec_dict(vector_add_dir) | {"defines": {"ACC": "'float'"}}
    op = UserOperatorSpec(definition(spec, _files(vector_add_dir)))
    source = op.render({"block_size_x": 128, "tile_size_x": 4}, (1000,), "float32")
    assert "#define ACC float\n" in source


def test_include_check_is_linear_in_the_text():
    """Templates are up to a megabyte: many '#' or '%:' take one pass, not one per mark."""
    import time

    from kato.kernels.user.model import include_error

    start = time.perf_counter()
    text = "#include <cuda_fp16.h> // #x\n" * 30_000 + "%:" * 200_000
    assert include_error("t.cu", text) is None
    assert time.perf_counter() - start < 5.0


# Shapes (rows, cols) that make each size-dependent check bite somewhere: a restriction naming
# cols, a grid_div naming rows, y grids over CUDA's 65535 blocks, a define that divides by rows.
SHAPES = [(1, 1), (3, 2), (7, 5), (1000, 777), (70000, 3), (600000, 40), (3, 70000)]


def _sized_and_not() -> UserOperatorSpec:
    """A spec whose every kind of check comes in a size-dependent and a size-independent form."""
    return _two_d(
        tune_params={
            "block_size_x": [16, 32, 64, 128],
            "block_size_y": [1, 2, 4, 8, 16],
            "tile_size_x": [1, 2, 3],
            "tile_size_y": [1, 4],
            "s": [0, 64, 100000],
        },
        restrictions=["block_size_x * block_size_y >= 32", "tile_size_x <= cols"],
        grid_div_x=["block_size_x", "tile_size_x"],
        grid_div_y=["block_size_y * tile_size_y", "1 if rows > 5 else 2"],
        shared_memory="s * tile_size_y",
        defines={"EVERY": "16 // (tile_size_x - 3)", "SOME": "64 // (rows - 3 * tile_size_y)"},
    )


def _every(spec: UserOperatorSpec) -> list[dict]:
    names = list(spec.params)
    return [dict(zip(names, v, strict=True)) for v in itertools.product(*spec.params.values())]


def test_the_size_independent_check_refuses_only_what_every_size_refuses():
    """check_any_size keeps each check that reads no shape name: what it refuses, check refuses
    at every shape; every config valid at some shape passes it; and the checks that name the
    shape are left out (it passes configs that some shape refuses for them)."""
    spec = _sized_and_not()
    configs = _every(spec)
    any_size = [c for c in configs if spec.check_any_size(c, "float32") is None]
    valid_somewhere = [
        c for c in configs if any(spec.check(c, s, "float32") is None for s in SHAPES)
    ]
    assert all(c in any_size for c in valid_somewhere)
    for c in configs:
        if c not in any_size:
            assert all(spec.check(c, s, "float32") is not None for s in SHAPES)
    assert len(valid_somewhere) == len(any_size) < len(configs)  # the shapes cover them all
    # Each size-independent kind refuses on its own, with check's reason.
    base = {"block_size_x": 32, "block_size_y": 1, "tile_size_x": 1, "tile_size_y": 1, "s": 0}
    for change, says in [
        ({"block_size_x": 16}, "restriction block_size_x * block_size_y >= 32"),
        ({"block_size_x": 128, "block_size_y": 16}, "over CUDA's limits"),
        ({"tile_size_x": 3}, "division by zero"),
        ({"s": 100000, "tile_size_y": 4}, "B of dynamic shared memory"),
    ]:
        assert says in spec.check_any_size(base | change, "float32")
    # A size-dependent one never does: a restriction naming cols, a grid over 65535 blocks
    # of rows, a define dividing by zero at rows == 3.
    for change, shape, says in [
        ({"tile_size_x": 2}, (1, 1), "restriction tile_size_x <= cols"),
        ({}, (70000, 3), "grid (1, 70000, 1) is over"),
        ({}, (3, 2), "division by zero"),
    ]:
        assert says in spec.check(base | change, shape, "float32")
        assert spec.check_any_size(base | change, "float32") is None


def test_the_size_independent_screen_answers_as_the_check(monkeypatch):
    """screen_any_size on numpy columns gives check_any_size's answers, vectorised and one
    config at a time."""
    from kato.kernels.user import vector

    spec = _sized_and_not()
    configs = _every(spec)
    columns = {k: np.array([c[k] for c in configs]) for k in spec.params}
    expected = [spec.check_any_size(c, "float32") is None for c in configs]
    assert spec.screen_any_size("float32")(columns).tolist() == expected

    def refuse(*args, **kwargs):
        raise vector.NotVectorised("forced")

    monkeypatch.setattr(vector, "evaluate", refuse)
    assert spec.screen_any_size("float32")(columns).tolist() == expected
