"""User operators on a real GPU: a folder's variants verified against its reference kernel
(run by the backend, in process and in the isolated child), a wrong variant caught, a template
that does not compile and a reference kernel that faults each reported, never a crash."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from kernels.registry import register
from kernels.user import definition, load_folder
from kernels.user.spec import UserOperatorSpec
from tuner.backends.base import TrialStatus
from tuner.backends.isolated import BackendSpec, ChildStartError, IsolatedBackend

FOLDER = Path(__file__).resolve().parent.parent / "user_ops" / "data" / "vector_add"
N = 1_000_003  # not a multiple of any block or tile


def _op(name: str, **files: str) -> UserOperatorSpec:
    d = load_folder(FOLDER)
    spec = d.spec.model_dump() | {"name": name}
    return register(UserOperatorSpec(definition(spec, d.files | files)))


def _configs(op):
    for values in itertools.product(*op.params.values()):
        config = dict(zip(op.params, values, strict=True))
        if op.check(config, (N,), "float32") is None:
            yield config


def test_every_variant_matches_the_reference_kernel():
    from tuner.backends.pycuda import PyCudaBackend

    op = _op("gpu_vector_add")
    backend = PyCudaBackend(op, (N,), "float32", repeats=3, warmup=1, seed=0)
    try:
        a, b = backend.problem.args[1], backend.problem.args[2]
        np.testing.assert_array_equal(
            backend.problem.references[0], (a + b).astype(np.float64)
        )  # the reference kernel's own output, float32 sums
        for config in _configs(op):
            result = backend.evaluate(config)
            assert result.ok, (config, result.error)
            assert result.time_ms > 0
    finally:
        backend.close()


def test_a_wrong_variant_fails_verification():
    from tuner.backends.pycuda import PyCudaBackend

    template = load_folder(FOLDER).files["vector_add.cu"].replace("if (i < n)", "if (i < n - 1)")
    op = _op("gpu_vector_add_wrong", **{"vector_add.cu": template})
    backend = PyCudaBackend(op, (N,), "float32", repeats=3, warmup=1, seed=0)
    try:
        result = backend.evaluate({"block_size_x": 256, "tile_size_x": 2})
        assert result.status is TrialStatus.VERIFY_ERROR, result.error
        assert "1 of 1000003 elements" in result.error
    finally:
        backend.close()


def test_a_template_that_does_not_compile_is_a_compile_error():
    from tuner.backends.pycuda import PyCudaBackend

    op = _op("gpu_vector_add_broken", **{"vector_add.cu": "__global__ void vector_add( {"})
    backend = PyCudaBackend(op, (N,), "float32", repeats=3, warmup=1, seed=0)
    try:
        result = backend.evaluate({"block_size_x": 256, "tile_size_x": 2})
        assert result.status is TrialStatus.COMPILE_ERROR
        assert "error" in result.error
    finally:
        backend.close()


FAULTING_REFERENCE = """
extern "C" __global__ void vector_add_reference(float *c, const float *a, const float *b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    c[i + (1 << 30)] = a[i] + b[i];  // far past the end: an illegal address
}
"""


def test_a_faulting_reference_kernel_fails_the_job_with_its_reason():
    from tuner.backends.pycuda import ReferenceKernelError

    op = _op("gpu_vector_add_faulting_ref", **{"reference.cu": FAULTING_REFERENCE})
    spec = BackendSpec(kind="pycuda", operator=op.name, shape=(N,), dtype="float32")
    backend = None
    with pytest.raises(ChildStartError) as info:
        backend = IsolatedBackend(spec, trial_timeout_s=120)
        backend.evaluate({"block_size_x": 256, "tile_size_x": 2})
    if backend is not None:
        backend.close()
    assert ReferenceKernelError.__name__ in str(info.value)
    assert "vector_add_reference" in str(info.value)


def test_isolated_child_measures_a_parent_only_operator():
    op = _op("gpu_vector_add_isolated")
    backend = IsolatedBackend(
        BackendSpec(kind="pycuda", operator=op.name, shape=(N,), dtype="float32"),
        trial_timeout_s=120,
    )
    try:
        ok = [backend.evaluate(c) for c in list(_configs(op))[:6]]
        assert all(r.ok for r in ok), [r.error for r in ok if not r.ok]
    finally:
        backend.close()
