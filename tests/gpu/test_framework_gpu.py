"""The framework baseline on the GPU: every operator's torch equivalent checked against the
float64 references and timed (tuner/torch_ops.py), eager and compiled by torch.compile
(Inductor), in its own process (tuner/framework.py), and a worker's job storing both beside the
winner for the API to report as ``speedup`` and ``compiled_speedup``.

    python3 -m pytest -q -s tests/gpu/test_framework_gpu.py
    python3 -m pytest -q -s tests/gpu/test_framework_gpu.py -k compiled   # the compiled one
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the framework baseline times PyTorch's op")

from fastapi.testclient import TestClient  # noqa: E402
from kato.db import tokens  # noqa: E402
from kato.kernels import list_operators  # noqa: E402
from kato.kernels.user import UserOperatorSpec  # noqa: E402
from kato.service.app import create_app  # noqa: E402
from kato.service.settings import Settings  # noqa: E402
from kato.tuner import framework, torch_ops  # noqa: E402

from kato.shared.gpus import normalize_gpu_name  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

#: Awkward shapes per rank (odd, prime, past a power of two), small enough to check fast.
SHAPES = {1: (100_003,), 2: (37, 4097), 3: (129, 257, 65), 4: (4, 16, 13, 13)}
#: A shape per rank where the op moves far more than the L2 (the timing's plausibility check).
LARGE = {"softmax": (32768, 4096), "relu": (1 << 27,), "reduce_sum_all": (1 << 27,)}


def cases():
    for spec in list_operators():
        if isinstance(spec, UserOperatorSpec):
            continue
        for dtype in spec.dtypes:
            yield pytest.param(spec, dtype, id=f"{spec.name}-{dtype}")


@pytest.mark.parametrize(("spec", "dtype"), cases())
def test_every_equivalent_agrees_with_the_references_and_is_timed(spec, dtype):
    """Torch's op computes the operator: it passes Kato's check, or it fails only by its
    precision (the same op on float64 copies of the inputs agrees). Kato's inputs are built to
    be hard (layer norm rows offset by 1e4), and torch's float32 kernels lose digits there."""
    result = torch_ops.measure(spec, SHAPES[spec.rank], dtype, seed=0, repeats=5)
    if result.status == "mismatch":
        problem = spec.make_problem(SHAPES[spec.rank], dtype, np.random.default_rng(0))
        assert torch_ops.float64_disagreement(spec, dtype, problem, "cuda") is None, result.detail
    else:
        assert result.status == "ok", result.detail
    assert result.framework == f"torch {torch.__version__}"
    assert len(result.times_ms) == 5 and all(t > 0 for t in result.times_ms)


def compiled_cases():
    """Every built-in operator at its first dtype: each compiles for seconds."""
    for spec in list_operators():
        if not isinstance(spec, UserOperatorSpec):
            yield pytest.param(spec, spec.dtypes[0], id=f"{spec.name}-{spec.dtypes[0]}")


@pytest.mark.parametrize(("spec", "dtype"), compiled_cases())
def test_every_equivalent_compiled_is_checked_and_timed(spec, dtype):
    """torch.compile of each equivalent (Inductor) compiles, is checked against the references
    (a mismatch is timed all the same, as the eager one is) and timed like the eager op."""
    eager = torch_ops.measure(spec, SHAPES[spec.rank], dtype, seed=0, repeats=5)
    t0 = time.monotonic()
    result = torch_ops.measure_compiled(spec, SHAPES[spec.rank], dtype, seed=0, repeats=5)
    print(
        f"{spec.name} {dtype}: eager {eager.time_ms:.4f} ms, compiled {result.status} "
        f"{result.time_ms or float('nan'):.4f} ms ({time.monotonic() - t0:.1f} s) "
        f"{result.op}: {result.detail}"
    )
    assert result.framework == f"torch.compile {torch.__version__} inductor"
    assert result.timed, result.detail
    assert len(result.times_ms) == 5 and all(t > 0 for t in result.times_ms)


@pytest.mark.parametrize("operator", sorted(LARGE))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_timing_is_the_gpus_at_a_plausible_bandwidth(operator, dtype):
    """A memory-bound op streaming well past the L2 reads as 0.5-5.5 TB/s on the H200 (4.8
    TB/s peak): slower means the host's launch rate was timed, faster that an event lied."""
    spec = next(s for s in list_operators() if s.name == operator)
    shape = LARGE[operator]
    result = torch_ops.measure(spec, shape, dtype, seed=0)
    assert result.ok, result.detail
    rate = spec.bytes_moved(shape, dtype) / (result.time_ms * 1e-3) / 1e12
    spread = max(result.times_ms) / min(result.times_ms)
    print(
        f"{operator} {shape} {dtype}: {result.time_ms:.4f} ms, {rate:.2f} TB/s, spread {spread:.3f}"
    )
    assert 0.5 < rate < 5.5, rate
    assert spread < 1.3, result.times_ms


def test_the_child_measures_on_the_jobs_gpu_and_skips_another_model():
    model = normalize_gpu_name(torch.cuda.get_device_name(0))
    result = framework.measure_in_child(
        "softmax", (4096, 4096), "float16", gpu_model=model, compiled=True
    )
    assert result.ok and result.time_ms > 0, result.detail
    compiled = result.compiled
    assert compiled is not None and compiled.ok and compiled.time_ms > 0, compiled
    print(f"softmax 4096x4096 float16: eager {result.time_ms:.4f} ms, {compiled.framework} "
          f"{compiled.time_ms:.4f} ms")  # fmt: skip
    other = framework.measure_in_child("softmax", (4096, 4096), "float16", gpu_model="T4")
    assert other.status == "skipped" and "the job ran on a T4" in other.detail


def test_a_tuning_job_stores_the_baseline_and_the_api_reports_the_speedup(tmp_path):
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.worker import Worker

    model = describe_device(0).model
    db_url = f"sqlite:///{tmp_path}/kato.db"
    app = create_app(Settings(db_url=db_url))
    with TestClient(app) as client:
        with app.state.session_factory() as session:
            client.headers["Authorization"] = f"Bearer {tokens.create_token(session, 'fw')[1]}"
        job = {"operator": "softmax", "shape": [8192, 4096], "dtype": "bfloat16", "gpu": model,
               "budget": 8}  # fmt: skip
        assert client.post("/v1/jobs", json=job).status_code == 202
        factory = pycuda_backend_factory(0, isolate=True)
        outcome = Worker(app.state.session_factory, db_url, [model], factory).run_once()
        assert outcome is not None and outcome.status == "done", outcome
        query = {"shape": "8192x4096", "dtype": "bfloat16", "gpu": model}
        deadline = time.monotonic() + 10
        answer = client.get("/v1/configs/softmax", params=query).json()
        while answer["source"] == "default" and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = client.get("/v1/configs/softmax", params=query).json()
    assert answer["source"] == "exact"
    assert answer["framework"] == f"torch {torch.__version__}"
    assert answer["framework_ms"] > 0 and answer["default_ms"] >= answer["time_ms"]
    assert answer["speedup"] == pytest.approx(answer["framework_ms"] / answer["time_ms"])
    assert answer["compiled"] == f"torch.compile {torch.__version__} inductor"
    assert answer["compiled_ms"] > 0
    assert answer["compiled_speedup"] == pytest.approx(answer["compiled_ms"] / answer["time_ms"])
    print(
        f"softmax 8192x4096 bfloat16: Kato {answer['time_ms']:.4f} ms, default "
        f"{answer['default_ms']:.4f} ms, {answer['framework']} {answer['framework_ms']:.4f} ms, "
        f"speedup {answer['speedup']:.2f}, {answer['compiled']} {answer['compiled_ms']:.4f} ms, "
        f"compiled_speedup {answer['compiled_speedup']:.2f}"
    )


def test_kato_baseline_fills_a_winner_stored_without_its_baselines(tmp_path):
    """``kato baseline`` on this GPU: a winner imported without PyTorch's figures gets the eager
    and the compiled baseline stored beside it (its config and time unchanged), a lookup then
    reports both speedups, and a second run finds nothing to measure."""
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.service.cli import app
    from typer.testing import CliRunner

    url = f"sqlite:///{tmp_path}/kato.db"
    engine = init_db(url)
    sessions = session_factory(engine)
    spec = get_operator("softmax")
    model = normalize_gpu_name(torch.cuda.get_device_name(0))
    config = spec.default_config((4096, 1024), "float16")
    with sessions() as s:
        row = queries.upsert_best_config(
            s, operator="softmax", operator_version=spec.version, shape=[4096, 1024],
            dtype="float16", gpu_model=model, compute_capability="9.0", cuda_version="13.0",
            config=config, time_ms=0.02, job_id=None,
        )  # fmt: skip
    runner = CliRunner()
    result = runner.invoke(app, ["baseline", "--db", url, "--json"])
    assert result.exit_code == 0, result.output
    with sessions() as s:
        stored = queries.best_config_row(s, row.id)
        assert stored.config == config and stored.time_ms == 0.02
        assert stored.framework_ms > 0 and stored.framework.startswith("torch ")
        assert stored.compiled_ms > 0 and stored.compiled.startswith("torch.compile ")
    again = runner.invoke(app, ["baseline", "--db", url, "--json"])
    assert again.exit_code == 0 and again.stdout.strip() == "", again.output
    engine.dispose()
