"""The REST API end to end on a SQLite file, with the real softmax operator and GPU catalog."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import queries, tokens
from kato.db.ledger import Ledger
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.deps import get_session
from kato.service.settings import Settings
from kato.tuner.backends.base import TrialResult, TrialStatus
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

SOFTMAX = get_operator("softmax")
JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def lookup(client: TestClient, shape: str = "4096,4096", **params: str) -> Any:
    query = {"shape": shape, "dtype": "float16", "gpu": "H200", **params}
    return client.get("/v1/configs/softmax", params=query)


def store_best(session: Session, shape: list[int], time_ms: float, **overrides: Any) -> None:
    fields: dict[str, Any] = {
        "operator": "softmax",
        "operator_version": SOFTMAX.version,
        "shape": shape,
        "dtype": "float16",
        "gpu_model": "H200",
        "compute_capability": "9.0",
        "cuda_version": "13.0",
        "config": {
            "BLOCK_SIZE": 512,
            "VEC": 8,
            "STRATEGY": 0,
            "CACHE": 0,
            "MIN_BLOCKS": 1,
            "LANES": 32,
        },
        "time_ms": time_ms,
        "job_id": None,
        # Twice as fast as the default config there: served for other shapes too.
        "default_ms": 2 * time_ms,
    }
    fields.update(overrides)
    queries.upsert_best_config(session, **fields)


def detail(response: Any) -> str:
    """The error message(s) of a 4xx response as one string, for assertions on the text."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    body = response.json()["detail"]
    return body if isinstance(body, str) else json.dumps(body)


# --- health, operators, GPUs -----------------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "db": "ok"}


def test_openapi_and_docs(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["info"]["title"] == "Kato"
    assert "/v1/jobs/{job_id}/trials" in schema["paths"]
    assert client.get("/docs").status_code == 200


def test_operators(client: TestClient) -> None:
    listed = client.get("/v1/operators").json()
    softmax = next(op for op in listed if op["name"] == "softmax")
    assert softmax["rank"] == 2
    assert set(softmax["dtypes"]) == {"float32", "float16", "bfloat16"}
    assert softmax["version"] == SOFTMAX.version
    assert softmax["params"]["BLOCK_SIZE"] == list(SOFTMAX.params["BLOCK_SIZE"])
    assert client.get("/v1/operators/softmax").json() == softmax

    response = client.get("/v1/operators/gemm")
    assert response.status_code == 404
    assert "unknown operator 'gemm'; known operators: " in detail(response)
    assert "softmax" in detail(response)


def test_gpus(client: TestClient) -> None:
    listed = client.get("/v1/gpus").json()
    h200 = next(gpu for gpu in listed if gpu["name"] == "H200")
    assert h200["compute_capability"] == "9.0"
    assert h200["memory_bytes"] > 100 * 10**9 and h200["sm_count"] == 132
    assert client.get("/v1/gpus/NVIDIA H200").json()["name"] == "H200"
    response = client.get("/v1/gpus/RTX 9999")
    assert response.status_code == 404 and "unknown GPU model 'RTX 9999'" in detail(response)


# --- config lookups --------------------------------------------------------------------------


def test_config_default_then_exact_then_nearest(client: TestClient, session: Session) -> None:
    response = lookup(client)
    assert response.status_code == 200
    body = response.json()
    assert body["source"] == "default"
    assert body["config"] == SOFTMAX.default_config([4096, 4096], "float16")
    assert body["tuned_shape"] is None and body["time_ms"] is None
    assert (body["gpu"], body["compute_capability"], body["operator_version"]) == (
        "H200",
        "9.0",
        SOFTMAX.version,
    )

    store_best(session, [4096, 4096], 0.05)
    body = lookup(client, "4096x4096").json()
    assert body["source"] == "exact"
    assert body["config"]["BLOCK_SIZE"] == 512 and body["time_ms"] == 0.05
    assert body["tuned_shape"] == [4096, 4096] and body["cuda_version"] == "13.0"

    body = lookup(client, "8192x2048").json()
    assert body["source"] == "nearest"
    assert body["shape"] == [8192, 2048] and body["tuned_shape"] == [4096, 4096]

    # Aliases resolve to the canonical model; other GPU models and dtypes have nothing tuned.
    assert lookup(client, gpu="NVIDIA H200").json()["source"] == "exact"
    assert lookup(client, gpu="H100").json()["source"] == "default"
    assert lookup(client, dtype="bfloat16").json()["source"] == "default"


def test_lookups_report_the_figures_beside_the_winner(client: TestClient, session: Session) -> None:
    """framework_ms, framework, default_ms and speedup, measured on tuned_shape: a nearest
    answer carries its neighbour's; a default answer none; a winner never timed against the
    framework has a null speedup."""
    store_best(session, [4096, 4096], 0.05, default_ms=0.08, framework_ms=0.06,
               framework="torch 2.13.0+cu130")  # fmt: skip
    exact = lookup(client, "4096x4096").json()
    assert (exact["framework_ms"], exact["framework"], exact["default_ms"]) == (
        0.06, "torch 2.13.0+cu130", 0.08,
    )  # fmt: skip
    assert exact["speedup"] == pytest.approx(0.06 / 0.05)
    near = lookup(client, "8192x4096").json()
    assert near["source"] == "nearest" and near["tuned_shape"] == [4096, 4096]
    assert {k: near[k] for k in ("time_ms", "framework_ms", "speedup", "default_ms")} == {
        k: exact[k] for k in ("time_ms", "framework_ms", "speedup", "default_ms")
    }
    batch = client.post(
        "/v1/configs/batch",
        json={"lookups": [{"operator": "softmax", "shape": s, "dtype": "float16", "gpu": "H200"}
                          for s in ("4096x4096", "8192x4096", "64x64")]},
    ).json()["results"]  # fmt: skip
    assert [r["result"] for r in batch[:2]] == [exact, near]
    default = batch[2]["result"]
    assert default["source"] == "default"
    assert [default[k] for k in ("framework_ms", "framework", "speedup", "default_ms")] == [
        None
    ] * 4
    store_best(session, [1024, 1024], 0.01, dtype="float32", default_ms=None)
    untimed = lookup(client, "1024x1024", dtype="float32").json()
    assert (untimed["framework_ms"], untimed["speedup"]) == (None, None)


def test_lookups_report_the_compiled_baseline_beside_the_winner(
    client: TestClient, session: Session
) -> None:
    """compiled_ms, compiled and compiled_speedup (the op compiled by torch.compile), in GET
    and batch answers alike; a winner without them answers nulls beside its eager figures."""
    store_best(session, [4096, 4096], 0.05, framework_ms=0.06, framework="torch 2.14.1",
               compiled_ms=0.04, compiled="torch.compile 2.14.1 inductor")  # fmt: skip
    exact = lookup(client, "4096x4096").json()
    assert (exact["compiled_ms"], exact["compiled"]) == (0.04, "torch.compile 2.14.1 inductor")
    assert exact["compiled_speedup"] == pytest.approx(0.04 / 0.05)
    assert exact["speedup"] == pytest.approx(0.06 / 0.05)
    batch = client.post(
        "/v1/configs/batch",
        json={"lookups": [{"operator": "softmax", "shape": "4096x4096", "dtype": "float16",
                           "gpu": "H200"}]},
    ).json()["results"]  # fmt: skip
    assert batch[0]["result"] == exact
    store_best(session, [2048, 2048], 0.01, framework_ms=0.02, framework="torch 2.14.1")
    eager_only = lookup(client, "2048x2048").json()
    assert eager_only["source"] == "exact", eager_only
    assert eager_only["speedup"] == pytest.approx(2.0)
    assert [eager_only[k] for k in ("compiled_ms", "compiled", "compiled_speedup")] == [None] * 3


def test_a_neighbour_that_did_not_beat_its_default_is_not_served(
    client: TestClient, session: Session
) -> None:
    store_best(session, [4096, 4096], 0.05, default_ms=0.051)  # 2% faster than the default
    body = lookup(client, "8192x4096").json()
    assert body["source"] == "default"
    assert body["config"] == SOFTMAX.default_config([8192, 4096], "float16")
    store_best(session, [2048, 2048], 0.05, default_ms=None)  # default never measured
    assert lookup(client, "2048x4096").json()["source"] == "default"


def test_the_guard_is_a_setting(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'k.db'}", nearest_min_gain=0)
    app = create_app(settings)
    try:
        with app.state.session_factory() as session:
            store_best(session, [4096, 4096], 0.05, default_ms=None)
        with TestClient(app) as client:
            assert lookup(client, "8192x4096").json()["source"] == "nearest"
    finally:
        app.state.engine.dispose()
    with pytest.raises(ValueError):
        Settings(nearest_min_gain=-1)


def test_nearest_config_too_far_away_is_not_served(client: TestClient, session: Session) -> None:
    store_best(session, [4096, 4096], 0.05)
    body = lookup(client, "65536x1024").json()  # distance 4 + 2 = 6 > the default 4
    assert body["source"] == "default" and body["tuned_shape"] is None
    assert body["config"] == SOFTMAX.default_config([65536, 1024], "float16")
    body = lookup(client, "16384x2048").json()  # distance 2 + 1 = 3
    assert body["source"] == "nearest" and body["tuned_shape"] == [4096, 4096]


def test_config_ignores_other_kernel_versions(client: TestClient, session: Session) -> None:
    store_best(session, [4096, 4096], 0.05, operator_version="0ld0ld0ld0ld")
    assert lookup(client).json()["source"] == "default"


def test_nearest_config_invalid_for_the_shape_is_not_served(
    client: TestClient, session: Session
) -> None:
    # The row in registers: 16 vectors a thread hold 4096 columns, 4100 would need 17.
    cached = {"BLOCK_SIZE": 512, "VEC": 8, "STRATEGY": 0, "CACHE": 2, "MIN_BLOCKS": 0, "LANES": 32}
    store_best(session, [4096, 4096], 0.05, config=cached)
    body = lookup(client, "4096x4100").json()
    assert body["source"] == "default"
    assert SOFTMAX.check(body["config"], [4096, 4100], "float16") is None


@pytest.mark.parametrize(
    ("params", "status", "message"),
    [
        ({"shape": "4096"}, 422, "takes a shape of rank 2"),
        ({"shape": "0x4096"}, 422, "shape must be positive integers without sign or leading zeros"),
        ({"shape": "-5,4096"}, 422, "got '-5,4096'"),
        (
            {"shape": "4096xabc"},
            422,
            "shape must be positive integers without sign or leading zeros, joined by 'x' or ','",
        ),
        ({"shape": ""}, 422, "shape must be positive integers"),
        ({"shape": "9" * 5000}, 422, "at most 200 characters"),
        ({"shape": "1x2x3x4x5x6x7x8x9"}, 422, "at most 8 are supported"),
        ({"dtype": "float64"}, 422, "does not support dtype 'float64'"),
        ({"gpu": "RTX 9999"}, 422, "unknown GPU model 'RTX 9999'"),
        ({"shape": "1048576x1048576"}, 422, "of device memory; H200 has"),
        ({"shape": "2147483647x2147483647"}, 422, "softmax takes up to"),
    ],
)
def test_config_bad_requests(
    client: TestClient, params: dict[str, str], status: int, message: str
) -> None:
    query = {"shape": "4096,4096", "dtype": "float16", "gpu": "H200", **params}
    response = client.get("/v1/configs/softmax", params=query)
    assert response.status_code == status
    assert message in detail(response)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "x" * 32])
@pytest.mark.parametrize(
    "shape", ["1x1", "1x2147483647", "2147483647x1", "3x5", "65536x65536", "1,2,3", "0", "1e3x4"]
)
def test_no_config_lookup_makes_a_500(client: TestClient, shape: str, dtype: str) -> None:
    for gpu in ("H200", "T4", "nvidia h200", "\x00", "x" * 64):
        query = {"shape": shape, "dtype": dtype, "gpu": gpu}
        response = client.get("/v1/configs/softmax", params=query)
        assert response.status_code in (200, 422), (query, response.text)


def test_config_unknown_operator_or_missing_params(client: TestClient) -> None:
    response = client.get("/v1/configs/gemm", params={"shape": "4", "dtype": "x", "gpu": "H200"})
    assert response.status_code == 404 and "known operators: " in detail(response)
    response = client.get("/v1/configs/softmax", params={"dtype": "float16", "gpu": "H200"})
    assert response.status_code == 422 and "Field required" in detail(response)


# --- jobs ------------------------------------------------------------------------------------


def test_job_submit_get_trials_and_cancel(client: TestClient, session: Session) -> None:
    response = client.post("/v1/jobs", json={**JOB, "shape": "4096x4096", "gpu": "NVIDIA H200"})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and job["gpu"] == "H200"
    assert job["shape"] == [4096, 4096] and job["operator_version"] == SOFTMAX.version
    assert job["budget"] == 100 and job["strategy"] == "forest" and job["seed"] == 0
    assert job["trials_done"] == 0 and job["best_time_ms"] is None
    assert job["created_at"].endswith(("Z", "+00:00"))
    # No worker advertises an H200: the submit answer, the job and the list all say so.
    assert job["note"].startswith("no live worker advertises GPU model H200")

    fetched = client.get(f"/v1/jobs/{job['id']}").json()
    assert fetched == job
    assert client.get(f"/v1/jobs/{job['id']}/trials").json() == []
    assert client.get("/v1/jobs", params={"status": "queued"}).json() == [job]
    assert client.get("/v1/jobs", params={"status": "done"}).json() == []

    # A worker claims it and records trials.
    claimed = queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
    assert claimed is not None and claimed.id == job["id"]
    config = SOFTMAX.default_config([4096, 4096], "float16")
    result = TrialResult(config=config, status=TrialStatus.OK, times_ms=[0.2, 0.1, 0.3])
    queries.record_trial(
        session, job["id"], number=0, config=config, config_key="k0", result=result.to_dict()
    )
    failed = TrialResult(config=config, status=TrialStatus.COMPILE_ERROR, error="ptxas error")
    queries.record_trial(
        session, job["id"], number=1, config=config, config_key="k1", result=failed.to_dict()
    )

    running = client.get(f"/v1/jobs/{job['id']}").json()
    assert running["status"] == "running" and running["started_at"] is not None
    assert running["trials_done"] == 2
    assert running["best_time_ms"] == pytest.approx(0.2) and running["best_config"] == config
    trials = client.get(f"/v1/jobs/{job['id']}/trials").json()
    assert [t["number"] for t in trials] == [0, 1]
    assert trials[0]["times_ms"] == [0.2, 0.1, 0.3] and trials[0]["time_ms"] == pytest.approx(0.2)
    assert trials[1]["status"] == "compile_error" and trials[1]["error"] == "ptxas error"
    assert trials[0]["reserved_by"] is None  # stored without a reservation
    # A config being measured: its worker is named, it has no result (nor error) yet.
    measuring = Ledger(client.app.state.session_factory, "w").job(job["id"])
    assert measuring.reserve({**config, "BLOCK_SIZE": 512}, "k2") == "reserved"
    reserved = client.get(f"/v1/jobs/{job['id']}/trials").json()[2]
    assert [reserved[k] for k in ("status", "reserved_by", "error")] == ["running", "w", None]

    cancelled = client.delete(f"/v1/jobs/{job['id']}")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "running" and cancelled.json()["cancel_requested"]


def test_cancel_a_queued_job(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=JOB).json()
    response = client.delete(f"/v1/jobs/{job['id']}")
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled" and response.json()["finished_at"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs/0123456789abcdef"),
        ("GET", "/v1/jobs/0123456789abcdef/trials"),
        ("DELETE", "/v1/jobs/0123456789abcdef"),
    ],
)
def test_unknown_job_is_404(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 404
    assert detail(response) == "job '0123456789abcdef' not found"
    for odd in ("%00", "x" * 500, "..%2F..", "DROP TABLE kato_jobs"):
        response = client.request(method, path.replace("0123456789abcdef", odd))
        assert response.status_code == 404, (odd, response.text)


def test_batch(client: TestClient) -> None:
    jobs = [
        JOB,
        {**JOB, "shape": "8192,1024", "dtype": "bfloat16", "budget": 10, "seed": 3},
        {**JOB, "gpu": "A100 80GB", "strategy": "random", "budget_seconds": 600},
    ]
    response = client.post("/v1/jobs/batch", json={"jobs": jobs})
    assert response.status_code == 202, response.text
    created = response.json()
    assert [j["shape"] for j in created] == [[4096, 4096], [8192, 1024], [4096, 4096]]
    assert [j["budget"] for j in created] == [100, 10, 100]
    assert created[2]["gpu"] == "A100 80GB" and created[2]["budget_seconds"] == 600
    assert len(client.get("/v1/jobs").json()) == 3


def test_batch_with_one_bad_job_writes_nothing(client: TestClient) -> None:
    jobs = [JOB, {**JOB, "dtype": "float64"}, JOB]
    response = client.post("/v1/jobs/batch", json={"jobs": jobs})
    assert response.status_code == 422
    assert detail(response).startswith("jobs[1]: operator 'softmax' does not support dtype")

    response = client.post("/v1/jobs/batch", json={"jobs": [JOB, {**JOB, "shape": [0, 1]}]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "jobs", 1, "shape", 0]

    assert client.get("/v1/jobs").json() == []


def test_batch_limits(tmp_path: Any) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'small.db'}", max_batch=2)
    app = create_app(settings)
    with app.state.session_factory() as session:
        secret = tokens.create_token(session, "t")[1]
    with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
        response = client.post("/v1/jobs/batch", json={"jobs": [JOB] * 3})
        assert response.status_code == 422
        assert detail(response) == "a batch holds at most 2 jobs (KATO_MAX_BATCH), got 3"
        response = client.post("/v1/jobs/batch", json={"jobs": []})
        assert response.status_code == 422 and "at least 1 item" in detail(response)
        assert client.get("/v1/jobs").json() == []


# --- bad job requests: always a 4xx with a message, never a 500 -------------------------------

BAD_JOBS: list[tuple[dict[str, Any], str]] = [
    ({"operator": "gemm"}, "unknown operator 'gemm'; known operators: "),
    ({"dtype": "float64"}, "does not support dtype 'float64'"),
    ({"dtype": "int32"}, "does not support dtype 'int32'"),
    ({"gpu": "RTX 9999"}, "unknown GPU model 'RTX 9999'"),
    ({"shape": [4096]}, "takes a shape of rank 2"),
    ({"shape": [4096, 4096, 2]}, "takes a shape of rank 2"),
    ({"shape": [0, 4096]}, "Input should be greater than or equal to 1"),
    ({"shape": [-1, 4096]}, "Input should be greater than or equal to 1"),
    ({"shape": "0x4096"}, "shape must be positive integers without sign or leading zeros"),
    (
        {"shape": "4096 by 4096"},
        "shape must be positive integers without sign or leading zeros, joined by 'x' or ','",
    ),
    ({"shape": []}, "should have at least 1 item"),
    ({"shape": [1] * 9}, "should have at most 8 items"),
    ({"shape": [1e30, 4096]}, "Input should be a valid integer"),
    ({"shape": [10**40, 4096]}, "Input should be less than or equal to 2147483647"),
    ({"shape": [2.5, 4096]}, "Input should be a valid integer"),
    ({"shape": [[1, 2], 3]}, "Input should be a valid integer"),
    ({"shape": [2**20, 2**20]}, "of device memory; H200 has"),
    ({"shape": [2**31 - 1, 2**31 - 1]}, "softmax takes up to"),
    (
        {"shape": [400_000, 200_000], "gpu": "T4"},
        "shape 400000x200000 in float16 needs 320.0 GB of device memory; T4 has 16.0 GB",
    ),
    ({"budget": 0}, "Input should be greater than or equal to 1"),
    ({"budget": -5}, "Input should be greater than or equal to 1"),
    ({"budget": 5001}, "budget must be at most 5000 configs, got 5001"),
    ({"budget": 10**20}, "Input should be less than or equal to 2147483647"),
    ({"budget_seconds": 0}, "budget_seconds must be at least 1, got 0"),
    ({"budget_seconds": 5e-324}, "budget_seconds must be at least 1, got 4.94066e-324"),
    ({"budget_seconds": 1e9}, "budget_seconds must be at most 86400, got 1e+09"),
    ({"strategy": "annealing"}, "Input should be 'forest', 'tpe', 'hybrid', 'random' or 'grid'"),
    ({"seed": -1}, "seed must be from 0 to 2147483647, got -1"),
    ({"gpu": ""}, "String should have at least 1 character"),
    ({"operator": "x" * 65}, "String should have at most 64 characters"),
    ({"budjet": 10}, "Extra inputs are not permitted"),
    ({"operator": None}, "Input should be a valid string"),
]


@pytest.mark.parametrize(("change", "message"), BAD_JOBS, ids=[m for _, m in BAD_JOBS])
def test_bad_job_is_rejected_with_a_message(
    client: TestClient, change: dict[str, Any], message: str
) -> None:
    response = client.post("/v1/jobs", json={**JOB, **change})
    assert response.status_code == 422
    assert message in detail(response)
    assert client.get("/v1/jobs").json() == []


@pytest.mark.parametrize("field", ["operator", "shape", "dtype", "gpu"])
def test_missing_field(client: TestClient, field: str) -> None:
    body = {k: v for k, v in JOB.items() if k != field}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", field] and error["msg"] == "Field required"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"operator": "softmax", ', "JSON decode error"),
        ("not json", "JSON decode error"),
        ("[1, 2, 3]", "Input should be a valid dictionary"),
        ('"softmax"', "Input should be a valid dictionary"),
        ("", "Field required"),
        # Python's json module accepts these literals: they must not come back as a 500 when the
        # error message echoes the input.
        (
            '{"operator": "softmax", "shape": [NaN, 1], "dtype": "float16", "gpu": "H200"}',
            "finite number",
        ),
        (
            '{"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200",'
            ' "budget_seconds": Infinity}',
            "finite number",
        ),
        (
            '{"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200",'
            ' "budget_seconds": NaN}',
            "finite number",
        ),
    ],
)
def test_malformed_body(client: TestClient, raw: str, message: str) -> None:
    response = client.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert message in detail(response)


def test_huge_integer_literal_is_a_client_error(client: TestClient) -> None:
    # Longer than Python's int-parsing limit (4300 digits): rejected while parsing the body.
    raw = (
        '{"operator": "softmax", "shape": ['
        + "9" * 5000
        + ', 1], "dtype": "float16", "gpu": "H200"}'
    )
    response = client.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500


HOSTILE = [None, "", "x" * 10_000, -1, 0, 1.5, 1e308, -1e308, 10**40, True, [], {}, [[]], "NaN"]


@pytest.mark.parametrize(
    "field", ["operator", "shape", "dtype", "gpu", "budget", "budget_seconds", "strategy", "seed"]
)
def test_no_value_makes_a_500(client: TestClient, field: str) -> None:
    for value in HOSTILE:
        for path, body in (
            ("/v1/jobs", {**JOB, field: value}),
            ("/v1/jobs/batch", {"jobs": [{**JOB, field: value}]}),
        ):
            response = client.post(path, json=body)
            assert response.status_code < 500, (field, value, response.text)


@pytest.mark.parametrize(
    ("query", "message"),
    [("status=bogus", "Input should be 'queued'"), ("limit=0", "greater than or equal to 1")],
)
def test_bad_job_list_filters(client: TestClient, query: str, message: str) -> None:
    response = client.get(f"/v1/jobs?{query}")
    assert response.status_code == 422 and message in detail(response)


def test_app_reuses_a_given_engine(app: FastAPI, settings: Settings) -> None:
    other = create_app(settings, engine=app.state.engine)
    assert other.state.engine is app.state.engine
    assert other.state.session_factory.kw["bind"] is app.state.engine


def test_settings_from_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KATO_DB_URL", str(tmp_path / "env" / "kato.db"))
    monkeypatch.setenv("KATO_MAX_BATCH", "7")
    monkeypatch.setenv("KATO_LEASE_SECONDS", "12.5")
    monkeypatch.setenv("KATO_LOOKAHEAD", "2")
    settings = Settings()
    assert settings.db_url == f"sqlite:///{tmp_path}/env/kato.db"
    assert (settings.max_batch, settings.lease_seconds, settings.port) == (7, 12.5, 8000)
    assert settings.lookahead == 2
    with pytest.raises(ValueError, match="lookahead"):
        Settings(lookahead=0)
    with pytest.raises(ValueError, match="exceeds max_budget_configs"):
        Settings(default_budget_configs=10, max_budget_configs=5)


def test_healthz_with_the_database_down_names_no_host_or_user(app: FastAPI) -> None:
    """An anonymous caller learns that the database is unreachable, not where it is or who
    connects to it (the driver's message says both)."""

    class DownSession:
        def execute(self, *args: Any, **kwargs: Any) -> None:
            cause = ConnectionError('connection to "db.internal:5432" as "secret_user" failed')
            raise OperationalError("SELECT 1", {}, cause)

    app.dependency_overrides[get_session] = lambda: DownSession()
    with TestClient(app, raise_server_exceptions=False) as anonymous_client:
        response = anonymous_client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "error", "db": "unreachable (ConnectionError)"}
    assert "secret_user" not in response.text and "db.internal" not in response.text


def test_lookup_batch_answers_each_lookup_on_its_own(client: TestClient) -> None:
    """One bad lookup (a shape out of range included) is that lookup's 4xx in the answer;
    the batch's other lookups are answered, as GET would answer them."""
    good = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
    lookups = [
        good,
        {**good, "operator": "gemm"},
        {**good, "dtype": "float64"},
        {**good, "shape": [2**31, 4]},
        {**good, "shape": "1024x1024"},
        {**good, "shape": [1] * 9},
        {**good, "shape": []},
    ]
    response = client.post("/v1/configs/batch", json={"lookups": lookups})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["status"] for r in results] == [200, 404, 422, 422, 200, 422, 422]
    assert results[0]["result"]["source"] == "default"
    assert (
        results[3]["detail"] == "every dimension must be between 1 and 2147483647, got 2147483648"
    )
    assert results[4]["result"]["shape"] == [1024, 1024]
    assert results[5]["detail"] == "shape has 9 dimensions; at most 8 are supported"
    assert results[6]["detail"] == "shape must have at least one dimension"
    too_many = client.post("/v1/configs/batch", json={"lookups": [good] * 1001})
    assert too_many.status_code == 422
