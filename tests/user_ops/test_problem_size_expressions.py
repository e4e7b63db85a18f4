"""``problem_size`` as expressions of the tunables (Kernel Tuner's reduction example's
``problem_size="num_blocks"``): evaluated per config by the safe evaluator, the grid following
it, the result key the data's size; tuned in simulation mode; callables and bad expressions
refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from kato.kernels.spec import InvalidInput

import kato
from kato.kernel_tuner import operator_from_arguments, problem_shape
from user_ops.recording import record

# Kernel Tuner's examples/cuda/reduction.py kernel: each block writes one partial sum.
SUM_FLOATS = """
__global__ void sum_floats(float *sum_global, const float *array, int n) {
    int ti = threadIdx.x;
    int x = blockIdx.x * block_size_x + threadIdx.x;
    int step_size = num_blocks * block_size_x;
    float sum = 0.0f;
    for (int i = x; i < n; i += step_size) sum += array[i];
    __shared__ float sh_mem[block_size_x];
    sh_mem[ti] = sum;
    __syncthreads();
    for (unsigned int s = block_size_x / 2; s > 0; s >>= 1) {
        if (ti < s) sh_mem[ti] += sh_mem[ti + s];
        __syncthreads();
    }
    if (ti == 0) sum_global[blockIdx.x] = sh_mem[0];
}
"""
N = 1_000_003
TUNE = {"block_size_x": [2**i for i in range(5, 11)], "num_blocks": [2**i for i in range(5, 11)]}


def _args():
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    return [np.zeros(max(TUNE["num_blocks"]), np.float32), x, np.int32(N)]


def test_the_grid_follows_the_expression():
    op, spec = operator_from_arguments(
        "sum_floats", SUM_FLOATS, "num_blocks", _args(), TUNE, grid_div_x=[]
    )
    assert spec["problem_size"] == ["num_blocks"] and spec["shape"] == ["x"]
    assert [a["size"] for a in spec["arguments"][:2]] == ["1024", "x"]
    for bx in TUNE["block_size_x"]:
        for nb in TUNE["num_blocks"]:
            config = {"block_size_x": bx, "num_blocks": nb}
            launch = op.launch(config, (N,), "float32")
            assert launch.grid == (nb, 1, 1) and launch.block == (bx, 1, 1)
            assert f"#define num_blocks {nb}" in op.render(config, (N,), "float32")
    # A tuple mixing expressions and ints, with grid_div_x left to its default (block_size_x).
    op2, spec2 = operator_from_arguments(
        "sum_floats", SUM_FLOATS, ("num_blocks * block_size_x", 1), _args(), TUNE
    )
    assert spec2["problem_size"] == ["num_blocks * block_size_x", "1"]
    assert op2.launch({"block_size_x": 64, "num_blocks": 32}, (N,), "float32").grid == (32, 1, 1)


def test_the_shape_is_the_datas_size():
    assert problem_shape("num_blocks", _args()) == ((N,), ["num_blocks"])
    assert problem_shape(("num_blocks",), _args(), shape=(7, 3)) == ((7, 3), ["num_blocks"])
    assert problem_shape((4096, 2), _args()) == ((4096, 2), None)


def test_tuned_in_simulation_mode(tmp_path):
    args = _args()
    op, _ = operator_from_arguments("sum_floats", SUM_FLOATS, "num_blocks", args, TUNE,
                                    grid_div_x=[])  # fmt: skip
    path, best = record(op, (N,), tmp_path / "sum_floats.json")
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    results, env = kato.tune_kernel(
        "sum_floats", SUM_FLOATS, "num_blocks", args, TUNE, grid_div_x=[], cache=str(path),
        simulation_mode=True, db=db,
    )  # fmt: skip
    assert env["status"] == "done" and env["problem_size"] == [N] and len(results) == 36
    assert env["best_config"] == best
    assert kato.lookup("sum_floats", N, gpu="H200", db=db)["config"] == best


@pytest.mark.parametrize(
    ("problem_size", "says"),
    [
        (lambda p: p["num_blocks"], "a Python function cannot be sent"),
        (("num_blocks", lambda p: 1), "a Python function cannot be sent"),
        ("num_blocks.bit_length()", "may be called, not .num_blocks.bit_length."),
        ("num_blocks.real", "attribute"),
        ("__import__('os')", "unknown function '__import__'"),
        ("num_threads", "unknown name 'num_threads'"),
        (("num_blocks", 1, 1, 1), "1 to 3 ints or expression strings"),
        (("num_blocks", 2.5), "1 to 3 ints or expression strings"),
    ],
)
def test_bad_problem_sizes_are_refused(problem_size, says):
    with pytest.raises(InvalidInput, match=says):
        operator_from_arguments("sum_floats", SUM_FLOATS, problem_size, _args(), TUNE)


# Kernel Tuner's reduction example unrolls its loop by a tunable: ``#pragma unroll N`` takes no
# macro in nvcc, so the value must reach the kernel as a constant, and 0 means "no pragma".
UNROLLED = """
__global__ void sum_unrolled(float *out, const float *x, int n) {
    float s = 0.0f;
    #pragma unroll loop_unroll_factor_0
    for (int i = threadIdx.x; i < 256; i += block_size_x) s += x[i % n];
    out[threadIdx.x] = s;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("factor", [0, 1, 8])
def test_loop_unroll_factor_follows_kernel_tuner(factor, tmp_path):
    from kato.tuner.nvcc import compile_kernel

    tune = {"block_size_x": [32, 64], "loop_unroll_factor_0": [0, 1, 8]}
    args = [np.zeros(64, np.float32), np.ones(256, np.float32), np.int32(256)]
    op, _ = operator_from_arguments("sum_unrolled", UNROLLED, 64, args, tune)
    source = op.render({"block_size_x": 32, "loop_unroll_factor_0": factor}, (64,), "float32")
    assert "#define loop_unroll_factor_0" not in source
    if factor == 0:
        assert "#pragma unroll loop_unroll_factor_0" not in source
        assert "constexpr int loop_unroll_factor_0" not in source
    else:
        assert f"constexpr int loop_unroll_factor_0 = {factor};" in source
        assert "#pragma unroll loop_unroll_factor_0" in source
    assert compile_kernel(source, "sum_unrolled", arch="sm_90", cache_dir=tmp_path).cubin
