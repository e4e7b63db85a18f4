"""Constant-memory arrays of user operators on the GPU: every variant of a row filter whose
taps are in ``__constant__`` memory verified against a float64 reference (a Python one, and a
reference kernel that reads the same constants), a missing global reported as a launch error,
and ``kato.tune_kernel(..., cmem_args=...)`` run on the device as Kernel Tuner's convolution
example is."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels.registry import register
from kato.kernels.user import definition
from kato.kernels.user.spec import UserOperatorSpec
from kato.tuner.backends.base import TrialStatus
from user_ops.test_constants import CONV, FILTER, _op, _spec

import kato

REFERENCE = """
__constant__ float d_filter[FILTER];
extern "C" __global__ void conv_reference(float *out, const float *in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float acc = 0.0f;
        for (int j = 0; j < FILTER; j++) acc += in[i + j] * d_filter[j];
        out[i] = acc;
    }
}
"""


@pytest.mark.parametrize("n", [1, 257, 1_000_003])
def test_every_variant_reads_its_constants(n):
    from kato.tuner.backends.pycuda import PyCudaBackend

    op = register(_op(name=f"gpu_conv_constants_{n}"))
    backend = PyCudaBackend(op, (n, FILTER), "float32", repeats=3, warmup=1, seed=0)
    try:
        for bx in op.params["block_size_x"]:
            result = backend.evaluate({"block_size_x": bx})
            assert result.ok, (bx, result.error)
    finally:
        backend.close()


def test_a_reference_kernel_reads_the_same_constants():
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = _spec(
        name="gpu_conv_constants_ref",
        verify=True,
        reference={"template": "reference.cu", "kernel_name": "conv_reference",
                   "block": ["128"], "grid": ["ceil(n / 128)"], "defines": {"FILTER": "f"}},
    )  # fmt: skip
    op = register(UserOperatorSpec(definition(spec, {"conv.cu": CONV, "reference.cu": REFERENCE})))
    n = 100_003
    backend = PyCudaBackend(op, (n, FILTER), "float32", repeats=3, warmup=1, seed=0)
    try:
        x = backend.problem.args[1].astype(np.float64)
        taps = backend.problem.constants["d_filter"].astype(np.float64)
        want = np.lib.stride_tricks.sliding_window_view(x, FILTER)[:n] @ taps
        np.testing.assert_allclose(backend.problem.references[0], want, rtol=1e-5, atol=1e-5)
        for bx in op.params["block_size_x"]:
            assert backend.evaluate({"block_size_x": bx}).ok
    finally:
        backend.close()


def test_a_constant_the_kernel_does_not_declare_is_a_launch_error():
    from kato.tuner.backends.pycuda import PyCudaBackend

    op = register(_op(
        name="gpu_conv_constants_missing",
        constants=[{"name": "d_filter", "dtype": "float32", "size": "f"},
                   {"name": "d_missing", "dtype": "float32", "size": "f"}],
    ))  # fmt: skip
    backend = PyCudaBackend(op, (1000, FILTER), "float32", repeats=3, warmup=1, seed=0)
    try:
        result = backend.evaluate({"block_size_x": 64})
        assert result.status is TrialStatus.LAUNCH_ERROR
        assert "declares no __constant__ d_missing" in result.error
        assert backend.healthy()  # nothing ran: the context is fine
    finally:
        backend.close()


def test_tune_kernel_with_cmem_args_on_the_device(tmp_path):
    n = 1 << 20
    rng = np.random.default_rng(0)
    image = rng.standard_normal(n + FILTER - 1).astype(np.float32)
    taps = rng.standard_normal(FILTER).astype(np.float32)
    answer = np.lib.stride_tricks.sliding_window_view(image.astype(np.float64), FILTER) @ taps
    results, env = kato.tune_kernel(
        "conv", CONV, n, [np.zeros(n, np.float32), image, np.int32(n)],
        {"block_size_x": [32, 64, 128, 256, 512, 1024]}, answer=[answer, None, None],
        atol=1e-4, defines={"FILTER": FILTER}, cmem_args={"d_filter": taps},
        db=f"sqlite:///{tmp_path / 'kato.db'}", name="gpu_conv_cmem",
    )  # fmt: skip
    assert env["status"] == "done", env
    assert len(results) == 6 and all(r["status"] == "ok" for r in results), results
    print("cmem conv", env["best_config"], env["best_time"], env["configs_per_minute"])
