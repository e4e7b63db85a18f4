"""Constant-memory arrays of a user operator (Kernel Tuner's ``cmem_args``): the spec's
``constants`` validated and versioned, their values made with the problem (fixed ones from
``kato.tune_kernel``), handed to a Python reference, and in each variant's cubin under the name
and size the backend uploads to (read with readelf); a tune in simulation mode. The upload
itself runs in tests/gpu/test_user_constants_gpu.py."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from kato.kernels.spec import InvalidInput
from kato.kernels.user import definition
from kato.kernels.user.spec import MAX_CONSTANT_BYTES, UserOperatorSpec
from kato.tuner.nvcc import compile_kernel

import kato
from kato.kernel_tuner import operator_from_arguments
from user_ops.recording import record

# A row filter from constant memory: out[i] = sum_j in[i + j] * d_filter[j].
CONV = """
__constant__ float d_filter[FILTER];
__global__ void conv(float *out, const float *in, int n) {
    int i = blockIdx.x * block_size_x + threadIdx.x;
    if (i < n) {
        float acc = 0.0f;
        for (int j = 0; j < FILTER; j++) acc += in[i + j] * d_filter[j];
        out[i] = acc;
    }
}
"""
FILTER = 17


def _spec(**changes) -> dict:
    return {
        "name": "conv_constants",
        "template": "conv.cu",
        "kernel_name": "conv",
        "shape": ["n", "f"],
        "problem_size": ["n"],
        "defines": {"FILTER": "f"},
        "tune_params": {"block_size_x": [32, 64, 128, 256]},
        "arguments": [
            {"name": "out", "dtype": "float32", "size": "n", "output": True},
            {"name": "in", "dtype": "float32", "size": "n + f - 1"},
            {"name": "n", "dtype": "int32", "value": "n"},
        ],
        "constants": [{"name": "d_filter", "dtype": "float32", "size": "f", "init": "uniform"}],
        "verify": False,
    } | changes


def _reference(args, shape, dtype, constants):
    n, f = shape
    window = np.lib.stride_tricks.sliding_window_view(args[1].astype(np.float64), f)[:n]
    return [window @ constants["d_filter"].astype(np.float64)]


def _op(**changes) -> UserOperatorSpec:
    return UserOperatorSpec(definition(_spec(**changes), {"conv.cu": CONV}), reference=_reference)


def test_constants_are_made_with_the_problem_and_reach_the_reference():
    op = _op()
    problem = op.make_problem((1000, FILTER), "float32", np.random.default_rng(1))
    ((name, values),) = problem.constants.items()
    assert name == "d_filter" and values.dtype == np.float32 and values.shape == (FILTER,)
    assert values.min() >= 0 and values.max() < 1 and len(set(values.tolist())) == FILTER
    n = 1000
    x = problem.args[1].astype(np.float64)
    want = [sum(x[i + j] * float(values[j]) for j in range(FILTER)) for i in (0, 1, n - 1)]
    np.testing.assert_allclose(problem.references[0][[0, 1, n - 1]], want, rtol=1e-12)


def test_constants_are_part_of_the_version():
    with_constants = _op()
    without = _op(constants=[])
    bigger = _op(constants=[{"name": "d_filter", "dtype": "float32", "size": "2 * f"}])
    assert len({with_constants.version, without.version, bigger.version}) == 3


@pytest.mark.parametrize(
    ("constants", "says"),
    [
        ([{"name": "d_filter", "dtype": "float32", "value": "f"}], "has a size and is read only"),
        (
            [{"name": "d_filter", "dtype": "float32", "size": "f", "output": True}],
            "has a size and is read only",
        ),
        ([{"name": "in", "dtype": "float32", "size": "f"}], "distinct from .*: in"),
        ([{"name": "block_size_x", "dtype": "float32", "size": "f"}], "block_size_x"),
        ([{"name": "FILTER", "dtype": "float32", "size": "f"}], "defines: FILTER"),
        ([{"name": "c", "dtype": "float32", "size": "g"}], "unknown name 'g'"),
        ([{"name": "c", "dtype": "float32", "size": "block_size_x"}], "unknown name"),
    ],
)
def test_bad_constants_are_refused(constants, says):
    with pytest.raises(InvalidInput, match=says):
        definition(_spec(constants=constants), {"conv.cu": CONV})


def test_constant_memory_is_bounded():
    op = _op()
    words = MAX_CONSTANT_BYTES // 4
    assert op.check({"block_size_x": 32}, (100, words), "float32") is None
    assert "constant memory holds 65536 B" in op.check({"block_size_x": 32}, (100, words + 1),
                                                         "float32")  # fmt: skip


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_each_variant_declares_the_global_the_backend_uploads_to(tmp_path):
    op = _op()
    shape = (4099, FILTER)
    problem = op.make_problem(shape, "float32", np.random.default_rng(0))
    for bx in op.params["block_size_x"]:
        compiled = compile_kernel(op.render({"block_size_x": bx}, shape, "float32"), "conv",
                                  arch="sm_90", cache_dir=tmp_path)  # fmt: skip
        cubin = tmp_path / f"conv{bx}.cubin"
        cubin.write_bytes(compiled.cubin)
        symbols = subprocess.run(["readelf", "-sW", str(cubin)], capture_output=True, text=True,
                                 check=True).stdout  # fmt: skip
        found = re.search(r"\s(\d+)\s+OBJECT\s+\S+\s+\S+\s+\S+\s+d_filter$", symbols, re.M)
        assert found, symbols
        assert int(found.group(1)) == problem.constants["d_filter"].nbytes


def test_tune_kernel_takes_cmem_args(tmp_path):
    n = 4096
    rng = np.random.default_rng(0)
    image = rng.standard_normal(n + FILTER - 1).astype(np.float32)
    filt = rng.standard_normal(FILTER).astype(np.float32)
    window = np.lib.stride_tricks.sliding_window_view(image.astype(np.float64), FILTER)
    answer = [window @ filt, None, None]
    args = [np.zeros(n, np.float32), image, np.int32(n)]
    kw = {"answer": answer, "defines": {"FILTER": FILTER}, "cmem_args": {"d_filter": filt}}
    tune_params = {"block_size_x": [32, 64, 128, 256]}
    op, spec = operator_from_arguments("conv", CONV, n, args, tune_params, **kw)
    assert spec["constants"] == [{"name": "d_filter", "dtype": "float32", "size": "17"}]
    problem = op.make_problem((n,), "float32", np.random.default_rng(5))
    np.testing.assert_array_equal(problem.constants["d_filter"], filt)  # the given values
    np.testing.assert_allclose(problem.references[0], window @ filt)
    path, best = record(op, (n,), tmp_path / "conv.json")
    results, env = kato.tune_kernel(
        "conv", CONV, n, args, tune_params, cache=str(path), simulation_mode=True,
        db=f"sqlite:///{tmp_path / 'kato.db'}", **kw,
    )  # fmt: skip
    assert env["status"] == "done" and env["best_config"] == best and len(results) == 4
    with pytest.raises(InvalidInput, match=r"cmem_args\['d_filter'\] is a list"):
        operator_from_arguments("conv", CONV, n, args, tune_params,
                                **(kw | {"cmem_args": {"d_filter": [1.0]}}))  # fmt: skip
    with pytest.raises(InvalidInput, match="constant d_filter has 3 elements"):
        UserOperatorSpec(op.definition, constants={"d_filter": np.zeros(3, np.float32)},
                         arguments=[a.item() if isinstance(a, np.generic) else a for a in args],
                         answer=answer).make_problem((n,), "float32", rng)  # fmt: skip
