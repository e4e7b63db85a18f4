"""A user operator's ``[backward]`` section: the spec model's checks of its names, the checks
against the backward operator it names, the version, and registration through the API (the
backward operator first; 422 with the reason otherwise; ``GET`` shows the section).

The gradients themselves, on torch tensors: tests/user_ops/test_user_kernel_grad.py."""

from __future__ import annotations

import copy
import shutil
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kato.db import operators as stored
from kato.db import tokens
from kato.kernels.spec import InvalidInput
from kato.kernels.user import definition, load_folder, spec_from_folder
from kato.kernels.user.backward import check_backward
from kato.kernels.user.spec import UserOperatorSpec
from kato.service.app import create_app
from kato.service.settings import Settings


def _spec(folder: Path) -> dict:
    return tomllib.loads((folder / "kato.toml").read_text())


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.glob("*.cu")}


def _with(spec: dict, path: str, value, *more) -> dict:
    """``spec`` with the dotted ``path`` set to ``value`` (None: removed), then ``more`` (path,
    value, path, value...); a deep copy."""
    spec = copy.deepcopy(spec)
    if more:
        spec = _with(spec, *more)
    *parents, last = path.split(".")
    node = spec
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return spec


def test_the_example_folders_load_with_their_backward(scaled_mul_dir, scaled_mul_backward_dir):
    forward = spec_from_folder(scaled_mul_dir)
    section = forward.model.backward
    assert section.operator == "scaled_mul_backward_test"
    assert section.inputs == {"grad_y": "grad:y", "a": "a", "b": "b", "alpha": "alpha", "n": "n"}
    assert section.gradients == {"grad_a": "a", "grad_b": "b"}
    assert forward.describe()["backward"] == {
        "operator": "scaled_mul_backward_test",
        "inputs": section.inputs,
        "gradients": section.gradients,
    }
    backward = spec_from_folder(scaled_mul_backward_dir)
    assert backward.describe()["backward"] is None
    check_backward(forward.model, backward.model)  # they fit


def test_the_version_leaves_the_backward_section_and_description_out(scaled_mul_dir):
    """Adding, changing or removing the section (or editing the description) keeps the version,
    so the results stored under it stay served; what decides a variant's code, launch or check
    (the template's text, a tunable's values, a restriction) still changes it."""
    spec, files = _spec(scaled_mul_dir), _files(scaled_mul_dir)

    def version(spec: dict, files: dict = files) -> str:
        return UserOperatorSpec(definition(spec, files)).version

    with_it = version(spec)
    swapped = _with(spec, "backward.gradients", {"grad_a": "b", "grad_b": "a"})
    same = {
        "without": version(_with(spec, "backward", None)),
        "swapped": version(swapped),
        "other description": version(_with(spec, "description", "y = alpha a b")),
        "no description": version(_with(spec, "description", None, "backward", None)),
    }
    assert same == dict.fromkeys(same, with_it)
    template = spec["template"]
    different = [
        version(spec, files | {template: files[template] + "\n// edited\n"}),
        version(_with(spec, "tune_params.tile_size_x", [1, 2, 4, 8])),
        version(_with(spec, "restrictions", ["block_size_x * tile_size_x <= 2048"])),
    ]
    assert with_it not in different and len(set(different)) == 3


def _one_dim(name: str, arguments: list[dict], **extra) -> dict:
    return {
        "name": name,
        "template": "k.cu",
        "kernel_name": "k",
        "shape": ["n"],
        "tune_params": {"block_size_x": [64, 128]},
        "arguments": arguments,
        "verify": False,
    } | extra


_K = {"k.cu": "__global__ void k() {}"}
_INT_OUT = [
    {"name": "y", "dtype": "float32", "size": "n", "output": True},
    {"name": "count", "dtype": "int32", "size": "1", "output": True},
    {"name": "x", "dtype": "float32", "size": "n"},
    {"name": "index", "dtype": "int32", "size": "n"},
]


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("backward.inputs.grad_y", "grad:z", "'grad:z' names no output of scaled_mul_test"),
        ("backward.inputs.grad_y", "grad:a", "'grad:a' names no output of scaled_mul_test"),
        ("backward.inputs.a", "c", "'c' is not an argument of scaled_mul_test"),
        ("backward.inputs.a", "grad: y", "'grad: y' names no output"),  # no blank
        ("backward.gradients.grad_a", "alpha", "input alpha is a scalar, passed as a number"),
        ("backward.gradients.grad_a", "n", "input n is a scalar"),
        ("backward.gradients.grad_a", "y", "'y' is not an input of scaled_mul_test"),
        ("backward.gradients.grad_a", "q", "'q' is not an input of scaled_mul_test"),
        ("backward.gradients.grad_a", "b", "grad_b: the gradient of b is already grad_a's"),
        ("backward.gradients", {}, "backward.gradients: Dictionary should have at least 1"),
        ("backward.gradients.grad_y", "a", "grad_y are both in inputs and in gradients"),
        ("backward.gradients.grad-a", "a", "'grad-a' must be a C identifier"),
        ("backward.operator", "Scaled Mul", "backward.operator: String should match pattern"),
        ("backward.operator", None, "backward.operator: Field required"),
        ("backward.extra", 1, "backward.extra: Extra inputs are not permitted"),
        ("backward.inputs.a", 3, "backward.inputs.a: Input should be a valid string"),
    ],
)
def test_bad_backward_sections_are_refused_naming_the_field(scaled_mul_dir, path, value, says):
    spec = _with(_spec(scaled_mul_dir), path, value)
    with pytest.raises(InvalidInput) as raised:
        definition(spec, _files(scaled_mul_dir))
    assert says in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    ("backward", "says"),
    [
        (
            {"operator": "b", "inputs": {"g": "grad:count"}, "gradients": {"gx": "x"}},
            "output count is int32, not floating point at every dtype of integer_out",
        ),
        (
            {"operator": "b", "inputs": {"g": "grad:y"}, "gradients": {"gi": "index"}},
            "input index is int32, not floating point",
        ),
    ],
)
def test_integer_arrays_have_no_gradient(backward, says):
    with pytest.raises(InvalidInput, match=says):
        definition(_one_dim("integer_out", _INT_OUT, backward=backward), _K)
    # the request's dtype: a gradient only where every dtype taken is a floating-point one
    args = [
        {"name": "y", "dtype": "dtype", "size": "n", "output": True},
        {"name": "x", "dtype": "dtype", "size": "n"},
    ]
    section = {"operator": "b", "inputs": {"g": "grad:y"}, "gradients": {"gx": "x"}}
    definition(_one_dim("any_float", args, dtypes=["float32", "bfloat16"], backward=section), _K)
    with pytest.raises(InvalidInput, match="output y is dtype, not floating point at every"):
        definition(_one_dim("with_int", args, dtypes=["float32", "int32"], backward=section), _K)


def test_an_operator_without_outputs_takes_no_backward():
    args = [{"name": "x", "dtype": "float32", "size": "n"}]
    section = {"operator": "b", "inputs": {"x": "x"}, "gradients": {"gx": "x"}}
    with pytest.raises(InvalidInput, match="has no output, so nothing to differentiate"):
        definition(_one_dim("in_place", args, backward=section), _K)


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (  # an input of the backward operator left unfed
            "backward.inputs.n", None,
            "scaled_mul_test backward.inputs: scaled_mul_backward_test's inputs n are not fed",
        ),
        ("backward.inputs.m", "n", "backward.inputs.m: scaled_mul_backward_test has no input m"),
        (("backward.inputs.grad_a", "a", "backward.gradients.grad_a", None), None,
         "backward.inputs.grad_a: grad_a is an output of scaled_mul_backward_test: map it in "
         "backward.gradients"),
        (("backward.gradients.grad_c", "a", "backward.gradients.grad_a", None), None,
         "gradients.grad_c: scaled_mul_backward_test has no output grad_c"),
        ("backward.gradients.grad_b", None, "backward.gradients: scaled_mul_backward_test's "
                                            "outputs grad_b are no input's gradient"),
        ("backward.inputs.b", "alpha", "inputs.b: scaled_mul_backward_test's b is an array; "
                                       "'alpha' is a scalar"),
        ("backward.inputs.alpha", "a", "inputs.alpha: scaled_mul_backward_test's alpha is a "
                                       "scalar; 'a' is an array"),
        ("backward.inputs.alpha", "y", "'y' is an array"),
        ("backward.inputs.n", "alpha", "inputs.n: scaled_mul_backward_test's n is int32, "
                                       "scaled_mul_test's alpha is float32"),
    ],
)  # fmt: skip
def test_a_section_that_does_not_fit_the_backward_operator_is_refused(
    scaled_mul_dir, scaled_mul_backward_dir, path, value, says
):
    changes = path if isinstance(path, tuple) else (path, value)
    forward = definition(_with(_spec(scaled_mul_dir), *changes), _files(scaled_mul_dir))
    backward = load_folder(scaled_mul_backward_dir)
    with pytest.raises(InvalidInput) as raised:
        check_backward(forward.spec, backward.spec)
    assert says in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("arguments.2.dtype", "float16", "inputs.grad_y: scaled_mul_backward_test's grad_y is "
                                         "float16, scaled_mul_test's y is float32 (at dtype "
                                         "float32)"),
        ("arguments.0.dtype", "float16", "gradients.grad_a: scaled_mul_backward_test's grad_a "
                                         "is float16, scaled_mul_test's a is float32"),
        ("arguments.2.size", "n + 1", "inputs.grad_y: scaled_mul_backward_test's grad_y is "
                                      "n + 1 = 18 at n=17, scaled_mul_test's y is n = 17"),
        ("arguments.1.size", "2 * n", "gradients.grad_b: scaled_mul_backward_test's grad_b is "
                                      "2 * n = 34 at n=17"),
        ("arguments.6.value", "2 * n", "inputs.n: scaled_mul_backward_test's n is 2 * n = 34"),
        ("dtypes", ["float16"], "scaled_mul_backward_test takes dtypes float16, but "
                                "scaled_mul_test runs at float32 too"),
        ("constants", [{"name": "taps", "dtype": "float32", "size": "4"}],
         "constant-memory array taps is not one of scaled_mul_test's (none)"),
    ],
)  # fmt: skip
def test_a_backward_operator_of_other_types_or_sizes_is_refused(
    scaled_mul_dir, scaled_mul_backward_dir, path, value, says
):
    forward = load_folder(scaled_mul_dir)
    changed = _with(_spec(scaled_mul_backward_dir), path, value)
    backward = definition(changed, _files(scaled_mul_backward_dir))
    with pytest.raises(InvalidInput) as raised:
        check_backward(forward.spec, backward.spec)
    assert says in str(raised.value), str(raised.value)


def test_sizes_are_not_compared_across_other_shape_names(scaled_mul_dir, scaled_mul_backward_dir):
    """With other shape names nothing says how the shapes relate (the backward's n need not be
    the forward's): the backward reads its shape from its arguments when it runs, and its call
    checks every size then."""
    forward = load_folder(scaled_mul_dir)
    spec = _with(_spec(scaled_mul_backward_dir), "arguments.2.size", "n + 1")
    files = _files(scaled_mul_backward_dir)
    with pytest.raises(InvalidInput, match="grad_y is n \\+ 1 = 18 at n=17"):
        check_backward(forward.spec, definition(spec, files).spec)
    spec["shape"] = ["n", "m"]
    check_backward(forward.spec, definition(spec, files).spec)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("folder", ["scaled_mul", "scaled_mul_backward"])
def test_the_example_kernels_compile(folder, tmp_path):
    """The GPU test's kernels (tests/gpu/test_user_kernel_grad_gpu.py): two variants of each
    and its reference kernel go through nvcc and ptxas for sm_90, without spilling."""
    from kato.tuner.nvcc import compile_kernel

    from user_ops.conftest import DATA

    spec = spec_from_folder(DATA / folder)
    for config in (
        {"block_size_x": 64, "tile_size_x": 4},
        {"block_size_x": 1024, "tile_size_x": 1},
    ):
        compiled = compile_kernel(
            spec.render(config, (1000,), "float32"), spec.kernel_name, arch="sm_90",
            cache_dir=tmp_path,
        )  # fmt: skip
        assert compiled.cubin and 0 < compiled.registers <= 32 and compiled.spill_bytes == 0
    reference = spec.device_reference((1000,), "float32")
    assert compile_kernel(
        reference.source, reference.kernel_name, arch="sm_90", cache_dir=tmp_path
    ).cubin


# --- the API ------------------------------------------------------------------------------------


@pytest.fixture
def app(tmp_path):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}"))
    yield app
    app.state.engine.dispose()


def _secret(app) -> str:
    with app.state.session_factory() as session:
        token, secret = tokens.create_token(session, "t")
        token.operators = True
        session.commit()
        return secret


def _bodies(scaled_mul_dir, scaled_mul_backward_dir) -> tuple[dict, dict]:
    """The two folders as API bodies, renamed (the registry of this process may hold the
    folders' own names, which a stored operator cannot take)."""
    backward = _spec(scaled_mul_backward_dir) | {"name": "api_scaled_mul_backward"}
    forward = _spec(scaled_mul_dir) | {"name": "api_scaled_mul"}
    forward["backward"] = forward["backward"] | {"operator": "api_scaled_mul_backward"}
    return (
        {"spec": forward, "files": _files(scaled_mul_dir)},
        {"spec": backward, "files": _files(scaled_mul_backward_dir)},
    )


def test_the_api_stores_the_backward_operator_first_and_shows_the_section(
    app, scaled_mul_dir, scaled_mul_backward_dir
):
    forward, backward = _bodies(scaled_mul_dir, scaled_mul_backward_dir)
    with TestClient(app, raise_server_exceptions=False) as client:
        auth = {"Authorization": f"Bearer {_secret(app)}"}
        r = client.post("/v1/operators", json=forward, headers=auth)
        assert r.status_code == 422, r.text
        assert "operator 'api_scaled_mul_backward' is not registered; register the backward " \
               "operator first" in r.json()["detail"]  # fmt: skip
        r = client.post("/v1/operators", json=backward, headers=auth)
        assert r.status_code == 201, r.text
        r = client.post("/v1/operators", json=forward, headers=auth)
        assert r.status_code == 201, r.text
        version = r.json()["version"]
        one = client.get("/v1/operators/api_scaled_mul").json()
        assert one["version"] == version
        assert one["backward"] == forward["spec"]["backward"]
        assert client.get("/v1/operators/api_scaled_mul_backward").json()["backward"] is None
        listed = {o["name"]: o for o in client.get("/v1/operators").json()}
        assert listed["api_scaled_mul"]["backward"]["operator"] == "api_scaled_mul_backward"
        assert listed["softmax"]["backward"] is None
        # The version leaves the section out: a changed or removed one replaces the stored
        # one in that version (200, named in updated), which every process then serves.
        changed = copy.deepcopy(forward)
        changed["spec"]["backward"]["gradients"] = {"grad_a": "b", "grad_b": "a"}
        removed = copy.deepcopy(forward)
        del removed["spec"]["backward"]
        for body, section in ((changed, changed["spec"]["backward"]), (removed, None)):
            r = client.post("/v1/operators", json=body, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json() == {"name": "api_scaled_mul", "version": version, "created": False,
                                "versions": 1, "updated": ["backward"]}  # fmt: skip
            assert client.get("/v1/operators/api_scaled_mul").json()["backward"] == section
        r = client.post("/v1/operators", json=removed, headers=auth)  # nothing to replace
        assert r.status_code == 200 and r.json()["updated"] == []


def test_a_backward_operator_another_process_stored_is_read_again(
    app, scaled_mul_dir, scaled_mul_backward_dir
):
    """An API process rereads the stored operators every few seconds: a backward operator that
    another process stored a moment ago is read again before a forward naming it is refused
    (with several API processes, the two POSTs may reach different ones)."""
    forward, backward = _bodies(scaled_mul_dir, scaled_mul_backward_dir)
    backward["spec"]["name"] = forward["spec"]["backward"]["operator"] = "other_scaled_mul_bwd"
    forward["spec"]["name"] = "other_scaled_mul"
    with TestClient(app, raise_server_exceptions=False) as client:
        auth = {"Authorization": f"Bearer {_secret(app)}"}
        assert client.get("/v1/operators").status_code == 200  # this process has read them
        with app.state.session_factory() as session:  # another process's POST
            stored.add_operator(session, stored.parse_definition(backward))
        r = client.post("/v1/operators", json=forward, headers=auth)
        assert r.status_code == 201, r.text
        shown = client.get("/v1/operators/other_scaled_mul").json()["backward"]
        assert shown == forward["spec"]["backward"]


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("backward.inputs.n", None, "api_scaled_mul_backward's inputs n are not fed"),
        ("backward.gradients.grad_a", "alpha", "input alpha is a scalar"),
        ("backward.inputs.grad_y", "grad:q", "'grad:q' names no output of api_scaled_mul"),
        ("backward.operator", "softmax", "'softmax' is one of Kato's own operators"),
        ("backward.operator", "no_such_op", "operator 'no_such_op' is not registered"),
    ],
)
def test_a_bad_backward_section_is_a_422_with_the_reason(
    app, scaled_mul_dir, scaled_mul_backward_dir, path, value, says
):
    forward, backward = _bodies(scaled_mul_dir, scaled_mul_backward_dir)
    forward["spec"] = _with(forward["spec"], path, value)
    with TestClient(app, raise_server_exceptions=False) as client:
        auth = {"Authorization": f"Bearer {_secret(app)}"}
        assert client.post("/v1/operators", json=backward, headers=auth).status_code == 201
        r = client.post("/v1/operators", json=forward, headers=auth)
    assert r.status_code == 422, r.text
    assert says in str(r.json()["detail"]), r.text
