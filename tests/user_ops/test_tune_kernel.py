"""``kato.tune_kernel`` with Kernel Tuner's arguments, on the replay backend (a recorded space
of the kernel: Kernel Tuner's simulation mode), locally and through a service; ``kato.lookup``
serves the winner."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from kato.db import tokens
from kato.kernels.spec import InvalidInput
from kato.service.app import create_app
from kato.service.settings import Settings
from kato.tuner.factories import replay_backend_factory
from kato.tuner.worker import Worker

import kato
from kato.kernel_tuner import operator_from_arguments
from user_ops.recording import record

KERNEL = """
__global__ void vector_add(float *c, float *a, float *b, int n) {
    int i = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
    for (int t = 0; t < tile_size_x; t++, i += block_size_x) {
        if (i < n) c[i] = a[i] + b[i];
    }
}
"""
N = 1 << 20


def _problem():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(N).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    c = np.zeros_like(a)
    args = [c, a, b, np.int32(N)]
    tune_params = {"block_size_x": [32, 64, 128, 256, 512, 1024], "tile_size_x": [1, 2, 4, 8]}
    kw = {
        "grid_div_x": ["block_size_x", "tile_size_x"],
        "restrictions": ["block_size_x * tile_size_x <= 4096"],
        "answer": [a + b, None, None, None],
    }
    return args, tune_params, kw


@pytest.fixture
def recorded(tmp_path):
    args, tune_params, kw = _problem()
    op, _ = operator_from_arguments("vector_add", KERNEL, N, args, tune_params, **kw)
    path, best = record(op, (N,), tmp_path / "vector_add.json")
    return path, best, op


def test_brute_force_on_the_recorded_space_finds_its_best(recorded, tmp_path):
    path, best, op = recorded
    args, tune_params, kw = _problem()
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    results, env = kato.tune_kernel(
        "vector_add", KERNEL, N, args, tune_params, cache=str(path), simulation_mode=True,
        db=db, **kw,
    )  # fmt: skip
    assert len(results) == 23  # every valid config: 24 less 1024 x 8
    assert all(set(tune_params) <= set(r) and isinstance(r["time"], float) for r in results)
    fastest = min(results, key=lambda r: r["time"])
    assert {k: fastest[k] for k in tune_params} == best
    assert env["best_config"] == best and env["best_time"] == fastest["time"]
    assert env["gpu_model"] == "H200" and env["problem_size"] == [N]
    assert env["strategy"] == "grid" and env["status"] == "done"
    assert env["kato_operator"] == "vector_add" and env["kato_operator_version"] == op.version
    # Kernel Tuner's own output writer takes Kato's results as they are.
    from kernel_tuner.file_utils import get_t4_results

    t4 = get_t4_results(results, tune_params)
    assert len(t4["results"]) == 23
    assert {m["name"] for m in t4["results"][0]["measurements"]} >= {"time"}
    found = kato.lookup("vector_add", N, gpu="H200", db=db)
    assert found["config"] == best and found["source"] == "exact"
    near = kato.lookup("vector_add", N * 2, gpu="H200", db=db)
    assert near["config"] == best and near["source"] == "nearest"
    # Arrays sized by the problem: one version at every problem size (lookups and warm start
    # cross sizes); a size that is no expression of it stays a number.
    small = [np.zeros(4096, np.float32)] * 3 + [np.int32(4096)]
    other, spec = operator_from_arguments(
        "vector_add", KERNEL, 4096, small, tune_params,
        **(kw | {"answer": [np.zeros(4096), None, None, None]}),
    )  # fmt: skip
    assert [a["size"] for a in spec["arguments"][:3]] == ["x"] * 3
    assert other.version == op.version
    _, odd = operator_from_arguments("vector_add", KERNEL, 4096, [np.zeros(4097, np.float32)],
                                     tune_params)  # fmt: skip
    assert odd["arguments"][0]["size"] == "4097"
    assert kato.lookup("vector_add", N, gpu="A100", db=db) is None


def test_a_budget_runs_kato_search(recorded, tmp_path):
    path, _, _ = recorded
    args, tune_params, kw = _problem()
    results, env = kato.tune_kernel(
        "vector_add", KERNEL, N, args, tune_params, cache=str(path), simulation_mode=True,
        strategy="bayes_opt", strategy_options={"max_fevals": 8},
        db=f"sqlite:///{tmp_path / 'kato.db'}", **kw,
    )  # fmt: skip
    assert len(results) == 8
    assert len({tuple(r[k] for k in tune_params) for r in results}) == 8  # no config twice
    assert env["strategy"] == "forest" and env["budget"] == 8


def test_failures_are_kernel_tuners_markers(recorded, tmp_path):
    """A failed config's time is Kernel Tuner's own ErrorConfig (its helpers skip it)."""
    import json

    from kernel_tuner import util

    path, best, _ = recorded
    data = json.loads(path.read_text())
    failed_key = next(k for k in data["cache"] if data["cache"][k]["block_size_x"] == 32)
    data["cache"][failed_key]["time"] = "CompilationFailedConfig"
    path.write_text(json.dumps(data))
    args, tune_params, kw = _problem()
    results, _ = kato.tune_kernel(
        "vector_add", KERNEL, N, args, tune_params, cache=str(path), simulation_mode=True,
        db=f"sqlite:///{tmp_path / 'kato.db'}", **kw,
    )  # fmt: skip
    failed = [r for r in results if r["status"] != "ok"]
    assert len(failed) == 1 and isinstance(failed[0]["time"], util.CompilationFailedConfig)
    assert {k: util.get_best_config(results, "time")[k] for k in tune_params} == best


def test_metrics_are_added_as_kernel_tuner_does(recorded, tmp_path):
    path, _, _ = recorded
    args, tune_params, kw = _problem()
    metrics = {
        "GB/s": lambda p: 3 * 4 * N / 1e9 / (p["time"] / 1e3),
        "double": lambda p: 2 * p["GB/s"],  # reads the metric before it
    }
    results, _ = kato.tune_kernel(
        "vector_add", KERNEL, N, args, tune_params, cache=str(path), simulation_mode=True,
        metrics=metrics, db=f"sqlite:///{tmp_path / 'kato.db'}", **kw,
    )  # fmt: skip
    for row in results:
        assert row["GB/s"] == pytest.approx(12 * N / 1e6 / row["time"])
        assert row["double"] == 2 * row["GB/s"]
    with pytest.raises(InvalidInput, match="metrics must map names to functions"):
        kato.tune_kernel("vector_add", KERNEL, N, args, tune_params, metrics={"x": "time"}, **kw)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"restrictions": [3]}, "or functions of the tunables, not int"),
        ({"restrictions": lambda p: True, "service": "http://kato"}, "run only in a local"),
        ({"verify": lambda *a, **k: True, "service": "http://kato"}, "run only in a local"),
        ({"verify": "numpy.allclose"}, "verify must be a function"),
        ({"lang": "OpenCL"}, "CUDA"),
        ({"answer": [None]}, "answer has 1 entries"),
        ({"restrictions": ["block_size_x * unroll <= 4"]}, "unknown name 'unroll'"),
        ({"grid_div_x": ["block_size_x.__class__"]}, "attribute access"),
        ({"objective": "GFLOP/s"}, "minimises time"),
    ],
)
def test_refused_arguments(change, says):
    args, tune_params, kw = _problem()
    with pytest.raises(InvalidInput, match=says.replace("(", r"\(")):
        kato.tune_kernel("vector_add", KERNEL, N, args, tune_params, **(kw | change))


def test_arguments_that_cannot_be_passed():
    _, tune_params, _ = _problem()
    with pytest.raises(InvalidInput, match="numpy arrays and numpy scalars"):
        kato.tune_kernel("vector_add", KERNEL, N, [[1.0, 2.0], 3], tune_params)
    with pytest.raises(InvalidInput, match="problem_size must have 1 to 3 dimensions >= 1"):
        kato.tune_kernel("vector_add", KERNEL, (0,), [np.zeros(4, np.float32)], tune_params)
    with pytest.raises(InvalidInput, match="problem_size 1 'n': unknown name 'n'"):
        kato.tune_kernel("vector_add", KERNEL, ("n",), [np.zeros(4, np.float32)], tune_params)
    with pytest.raises(InvalidInput, match="simulation_mode replays a cache file"):
        kato.tune_kernel("vector_add", KERNEL, 4, [np.zeros(4, np.float32)], tune_params,
                         simulation_mode=True)  # fmt: skip


def test_through_a_service(recorded, tmp_path, monkeypatch):
    """service=URL registers the operator, submits a job, a replay worker of the service runs
    it, and the trials come back in Kernel Tuner's shape."""
    del recorded  # this process registered "vector_add" locally: the service's is another name
    args, tune_params, kw = _problem()
    op, _ = operator_from_arguments(
        "vector_add", KERNEL, N, args, tune_params, name="vector_add_svc", **kw
    )
    path, best = record(op, (N,), tmp_path / "svc" / "vector_add_svc.json")
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'service.db'}"))
    with app.state.session_factory() as session:
        token, secret = tokens.create_token(session, "kt")
        token.operators = True
        session.commit()

    def client(base_url, headers, timeout):
        del base_url, timeout
        return TestClient(app, headers=headers, raise_server_exceptions=False)

    monkeypatch.setattr(httpx, "Client", client)
    # The worker checks its recordings' operators when it starts: the operator is registered
    # first (tune_kernel's own registration then finds it stored, unchanged).
    _, spec = operator_from_arguments(
        "vector_add", KERNEL, N, args, tune_params, name="vector_add_svc", fixed=False, **kw
    )
    with client("http://kato", {"Authorization": f"Bearer {secret}"}, 30) as c:
        r = c.post("/v1/operators", json={"spec": spec, "files": op.definition.files})
        assert r.status_code == 201, r.text
    worker = Worker(
        app.state.session_factory, app.state.settings.db_url, ["H200"],
        replay_backend_factory(path.parent), worker_id="w-kt", poll_seconds=0.02,
    )  # fmt: skip
    thread = threading.Thread(target=worker.run_forever, kwargs={"max_jobs": 1})
    thread.start()
    try:
        results, env = kato.tune_kernel(
            "vector_add", KERNEL, N, args, tune_params, service="http://kato", token=secret,
            gpu="H200", timeout_s=60, name="vector_add_svc", **kw,
        )  # fmt: skip
    finally:
        worker.stop()
        thread.join(30)
        app.state.engine.dispose()
    assert env["status"] == "done", env
    assert len(results) == 23 and env["best_config"] == best
