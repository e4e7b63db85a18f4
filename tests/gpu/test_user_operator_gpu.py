"""User operators on a real GPU: a folder's variants verified against its reference kernel
(run by the backend, in process and in the isolated child), a wrong variant caught, a template
that does not compile and a reference kernel that faults each reported, never a crash."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from kato.kernels.registry import register
from kato.kernels.user import definition, load_folder
from kato.kernels.user.spec import UserOperatorSpec
from kato.tuner.backends.base import TrialStatus
from kato.tuner.backends.isolated import BackendSpec, ChildStartError, IsolatedBackend

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
    from kato.tuner.backends.pycuda import PyCudaBackend

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
    from kato.tuner.backends.pycuda import PyCudaBackend

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
    from kato.tuner.backends.pycuda import PyCudaBackend

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
    from kato.tuner.backends.pycuda import ReferenceKernelError

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


KERNEL = """
__global__ void vector_add(float *c, const float *a, const float *b, int n) {
    int i = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
    for (int t = 0; t < tile_size_x; t++, i += block_size_x) {
        if (i < n) c[i] = a[i] + b[i];
    }
}
"""


def _kt_problem(n: int = 1_000_003):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    args = [np.zeros_like(a), a, b, np.int32(n)]
    params = {"block_size_x": [64, 128, 256, 512, 1024], "tile_size_x": [1, 2, 4]}
    return n, a, b, args, params


def test_tune_kernel_on_the_gpu_then_replay_its_cache(tmp_path):
    import kato

    n, a, b, args, params = _kt_problem()
    cache = tmp_path / "vector_add.json"
    results, env = kato.tune_kernel(
        "vector_add", KERNEL, n, args, params, grid_div_x=["block_size_x", "tile_size_x"],
        answer=[a + b, None, None, None], cache=str(cache), db=f"sqlite:///{tmp_path}/a.db",
        name="gpu_kt_vector_add",
    )  # fmt: skip
    assert env["status"] == "done", env
    assert len(results) == 15 and all(isinstance(r["time"], float) for r in results), results
    assert env["configs_per_minute"] > 0
    replayed, env2 = kato.tune_kernel(
        "vector_add", KERNEL, n, args, params, grid_div_x=["block_size_x", "tile_size_x"],
        answer=[a + b, None, None, None], cache=str(cache), simulation_mode=True,
        db=f"sqlite:///{tmp_path}/b.db", name="gpu_kt_vector_add",
    )  # fmt: skip
    assert env2["best_config"] == env["best_config"]
    found = kato.lookup("vector_add", n, gpu=env["gpu_model"], db=f"sqlite:///{tmp_path}/a.db",
                        name="gpu_kt_vector_add")  # fmt: skip
    assert found["config"] == env["best_config"]


def test_tune_kernel_with_a_wrong_answer_fails_every_config(tmp_path):
    import kato

    n, a, b, args, params = _kt_problem(4099)
    results, env = kato.tune_kernel(
        "vector_add", KERNEL, n, args, params, grid_div_x=["block_size_x", "tile_size_x"],
        answer=[a + b + 1, None, None, None], db=f"sqlite:///{tmp_path}/a.db",
        name="gpu_kt_wrong", quiet=True,
    )  # fmt: skip
    assert results and all(r["status"] == "verify_error" for r in results), results
    assert env["best_config"] is None


def test_a_worker_tunes_a_stored_operator_in_its_isolated_child(tmp_path):
    """Stored in the database only: the worker's registry source finds it, the isolated child
    receives it, the reference kernel runs there, and the job ends done."""
    from kato.db import operators as stored
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator, registry
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.worker import Worker

    db_url = f"sqlite:///{tmp_path}/kato.db"
    engine = init_db(db_url)
    sessions = session_factory(engine)
    d = load_folder(FOLDER)
    defn = definition(d.spec.model_dump() | {"name": "gpu_stored_vector_add"}, d.files)
    with sessions() as session:
        stored.add_operator(session, defn)
    source = stored.use_database(sessions)
    try:
        op = get_operator("gpu_stored_vector_add")
        model = describe_device(0).model
        with sessions() as session:
            job = queries.create_job(
                session, operator=op.name, operator_version=op.version, shape=[N],
                dtype="float32", gpu_model=model, budget_configs=10,
            )  # fmt: skip
            job_id = job.id
        worker = Worker(sessions, db_url, [model], pycuda_backend_factory(0, isolate=True),
                        worker_id="w-gpu-user", poll_seconds=0.05)  # fmt: skip
        assert worker.run_forever(max_jobs=1) == 1
        with sessions() as session:
            job = queries.get_job(session, job_id)
            assert job.status == "done", job.error
            trials = queries.job_trials(session, job_id)
            assert len(trials) == 10 and all(t.status == "ok" for t in trials)
    finally:
        registry.remove_source(source)
        engine.dispose()
