"""Softmax on a real GPU: every dtype, awkward shapes, every valid variant verified."""

from __future__ import annotations

import time

import numpy as np
import pytest
from backend_conformance import BackendConformance
from kato.kernels import get_operator
from kato.kernels.limits import needs_shared_opt_in

AWKWARD = [
    (1, 1),
    (1, 4097),
    (3000, 3001),
    (65536, 128),
    (17, 333),
    (5, 1000003),
    (1, 32768),
    (4097, 7),
]
DTYPE_NAMES = ["float32", "float16", "bfloat16"]


@pytest.fixture(scope="module")
def spec():
    return get_operator("softmax")


def run_on_device(spec, config, shape, dtype, seed=0, offset=0):
    """Launch once outside the backend and return (output as float64, float64 reference);
    x and y ``offset`` elements past their allocation's start (a view's data pointer)."""
    import pycuda.autoprimaryctx  # noqa: F401 - a context for this process
    import pycuda.driver as cuda
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.nvcc import compile_kernel

    arch = describe_device(0).arch
    problem = spec.make_problem(shape, dtype, np.random.default_rng(seed))
    compiled = compile_kernel(spec.render(config, shape, dtype), spec.kernel_name, arch=arch)
    module = cuda.module_from_buffer(compiled.cubin)
    fn = module.get_function(spec.kernel_name)
    launch = spec.launch(config, shape, dtype)
    static = fn.get_attribute(cuda.function_attribute.SHARED_SIZE_BYTES)
    if needs_shared_opt_in(static, launch.shared_bytes):
        fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes)
    args, bufs = [], []
    for a in problem.args:
        if isinstance(a, np.ndarray):
            buf = cuda.mem_alloc(a.nbytes + 16)
            bufs.append(buf)
            at = int(buf) + offset * a.itemsize
            cuda.memcpy_htod(at, a)
            args.append(at)
        else:
            args.append(a)
    out_index = problem.outputs[0]
    out = np.empty_like(problem.args[out_index])
    cuda.memset_d8(args[out_index], 0xFF, out.nbytes)  # poison: NaN everywhere
    given = zip(args, problem.args, strict=True)
    pointers = [np.uintp(a) if isinstance(p, np.ndarray) else a for a, p in given]
    fn(*pointers, block=launch.block, grid=launch.grid, shared=launch.shared_bytes)
    cuda.Context.synchronize()
    cuda.memcpy_dtoh(out, args[out_index])
    return out.astype(np.float64), problem.references[0]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_default_config_matches_float64_reference(spec, shape, dtype):
    y, ref = run_on_device(spec, spec.default_config(shape, dtype), shape, dtype)
    atol, rtol = spec.tolerance(dtype)
    assert np.isfinite(y).all(), "some outputs were never written (poison left)"
    np.testing.assert_allclose(y, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize(
    # 12288 columns: float32 CACHE=1 rows of exactly 48 KiB, plus the static reduction array
    "shape",
    # Odd, prime and just-past-2^k row lengths split rows at every VEC > 1 (issue 31).
    [(3000, 3001), (257, 4096), (64, 130), (64, 12288), (9, 50257), (33, 127), (40, 3), (4097, 7)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_every_valid_variant_verifies(spec, shape, dtype):
    """The backend's device-side verification passes for every valid config of the space."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=1)
    try:
        valid = backend.space().valid_configs()
        assert valid
        backend.precompile(valid)  # all nvcc runs in parallel, then verify one by one
        failures = []
        for config in valid:
            calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
            error = backend.verify(calls)
            if error:
                failures.append((config, error))
        assert not failures, failures[:5]
        # Every config was asked for after precompile started it: none compiled inline.
        stats = backend.compile_stats
        assert (stats.ahead, stats.inline) == (len(valid), 0) and stats.wait_s >= 0
    finally:
        backend.close()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("offset", [1, 3])
def test_split_rows_from_a_shifted_pointer(spec, dtype, offset):
    """x and y a few elements past a 16-byte boundary (congruent, as a view and its output
    shifted alike): every VEC > 1 on odd rows, streaming and cached, verifies."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    shape = (37, 1001)
    checked = 0
    for vec in (2, 4, 8):
        if vec * itemsize > 16:
            continue
        for strategy, cache in ((0, 0), (0, 2), (1, 1), (1, 2)):
            config = {"BLOCK_SIZE": 256, "VEC": vec, "STRATEGY": strategy, "CACHE": cache}
            config["MIN_BLOCKS"] = 0
            config["LANES"] = 32
            if spec.check(config, shape, dtype) is not None:
                continue
            y, ref = run_on_device(spec, config, shape, dtype, seed=vec, offset=offset)
            atol, rtol = spec.tolerance(dtype)
            assert np.allclose(y, ref, atol=atol, rtol=rtol), (config, np.nanmax(abs(y - ref)))
            checked += 1
    assert checked >= 8


BROKEN = r"""
extern "C" __global__ void softmax_kernel(const float* x, float* y, int rows, int cols) {
    // Uniform output, and the very last element is never written (its poison stays).
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < (long long)rows * cols - 1) y[i] = 1.0f / cols;
}
"""


def test_verification_catches_a_wrong_kernel(spec, monkeypatch):
    """A wrong kernel is a recorded verify_error with its reason, never a timed success."""
    from kato.tuner.backends.base import TrialStatus
    from kato.tuner.backends.pycuda import PyCudaBackend

    shape, dtype = (64, 1000), "float32"
    backend = PyCudaBackend(spec, shape, dtype, repeats=2, seed=2)
    try:
        monkeypatch.setattr(spec, "render", lambda config, shape, dtype: BROKEN)
        config = spec.default_config(shape, dtype)
        launch = spec.launch(config, shape, dtype)
        # the broken kernel is 1-D over all elements: give it enough threads
        monkeypatch.setattr(
            spec,
            "launch",
            lambda c, s, d: type(launch)(
                grid=((s[0] * s[1] + 255) // 256, 1, 1), block=(256, 1, 1), shared_bytes=0
            ),
        )
        result = backend.evaluate(config)
        assert result.status is TrialStatus.VERIFY_ERROR
        assert "outside tolerance" in result.error
        assert result.time_ms is None
    finally:
        backend.close()


@pytest.fixture(scope="module")
def backend():
    from kato.tuner.backends.pycuda import PyCudaBackend

    b = PyCudaBackend(get_operator("softmax"), (4096, 4096), "float16", repeats=10)
    yield b
    b.close()


class TestPyCudaConformance(BackendConformance):
    sweep = 16

    @pytest.fixture
    def reference_config(self):
        return get_operator("softmax").default_config((4096, 4096), "float16")


def test_a_deferred_setup_is_made_at_the_first_measurement_while_configs_compile():
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec, shape, dtype = get_operator("softmax"), (1024, 1024), "float16"
    backend = PyCudaBackend(spec, shape, dtype, repeats=2, seed=3, defer_setup=True)
    try:
        assert not backend._prepared and backend.healthy()
        space = backend.space()
        configs = space.valid_configs()[:4]
        backend.precompile(configs)  # compiles run before any input exists
        deadline = time.monotonic() + 120
        while not backend.is_compiled(configs[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.is_compiled(configs[0])
        assert not backend.is_compiled(space.valid_configs()[-1])  # never queued
        result = backend.evaluate(configs[0])
        assert backend._prepared and result.ok and result.time_ms > 0
        assert backend.compile_stats.ahead >= 1
        assert backend.healthy()
    finally:
        backend.close()
