"""Security and limits: API tokens on the write routes (and optionally reads), body size,
batch length, shape size, budgets, and the per-token queue quota."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import queries, tokens
from kato.db.models import ApiToken, Job
from kato.service.app import create_app
from kato.service.cli import app as cli
from kato.service.settings import Settings
from sqlalchemy import select
from typer.testing import CliRunner

JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def make_token(app: FastAPI, name: str = "t", **kw: Any) -> tuple[str, str]:
    """(id, secret) of a new token."""
    with app.state.session_factory() as session:
        token, secret = tokens.create_token(session, name, **kw)
        return token.id, secret


@pytest.fixture
def make_client(tmp_path: Path) -> Iterator[Any]:
    """Build an app with extra settings and a client on it (closed at the end)."""
    opened: list[tuple[FastAPI, TestClient]] = []

    def make(**settings: Any) -> tuple[FastAPI, TestClient]:
        db = tmp_path / f"k{len(opened)}.db"
        app = create_app(Settings(db_url=f"sqlite:///{db}", **settings))
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        opened.append((app, client))
        return app, client

    yield make
    for app, client in opened:
        client.__exit__(None, None, None)
        app.state.engine.dispose()


# --- tokens in the database ------------------------------------------------------------------


def test_token_is_stored_hashed(app: FastAPI) -> None:
    token_id, secret = make_token(app, "ci", max_queued_jobs=3)
    assert secret.startswith("kato_") and len(secret) > 40
    with app.state.session_factory() as session:
        row = session.get(ApiToken, token_id)
        assert row is not None and row.name == "ci" and row.max_queued_jobs == 3
        assert row.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
        assert secret not in str(
            session.execute(select(ApiToken.__table__)).all()
        )  # no column holds the secret
        assert tokens.verify_token(session, secret).ok
        assert not tokens.verify_token(session, secret + "x").ok
        assert not tokens.verify_token(session, "").ok
        assert tokens.revoke_token(session, token_id) is not None
        assert tokens.verify_token(session, secret).revoked
        assert tokens.revoke_token(session, "nope") is None
        with pytest.raises(ValueError):
            tokens.create_token(session, "  ")
        with pytest.raises(ValueError):
            tokens.create_token(session, "x", max_queued_jobs=0)


# --- 401 / 403 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/jobs", JOB),
        ("POST", "/v1/jobs/batch", {"jobs": [JOB]}),
        ("DELETE", "/v1/jobs/0123456789abcdef", None),
    ],
)
def test_writes_need_a_token(
    anonymous: TestClient, app: FastAPI, method: str, path: str, body: Any
) -> None:
    response = anonymous.request(method, path, json=body)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert "needs an API token" in response.json()["detail"]
    assert "kato token create" in response.json()["detail"]

    for header in ("Bearer kato_wrong", "Bearer ", "Basic dXNlcjpwdw==", "kato_x"):
        response = anonymous.request(method, path, json=body, headers={"Authorization": header})
        assert response.status_code == 401, (header, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")

    token_id, secret = make_token(app)
    with app.state.session_factory() as session:
        tokens.revoke_token(session, token_id)
    response = anonymous.request(method, path, json=body, headers=bearer(secret))
    assert response.status_code == 403
    assert f"API token {token_id} ('t') was revoked on" in response.json()["detail"]
    assert anonymous.get("/v1/jobs").json() == []


def test_reads_are_open_by_default(anonymous: TestClient) -> None:
    assert anonymous.get("/v1/jobs").status_code == 200
    assert anonymous.get("/v1/operators").status_code == 200
    params = {"shape": "4096x4096", "dtype": "float16", "gpu": "H200"}
    assert anonymous.get("/v1/configs/softmax", params=params).status_code == 200


def test_reads_can_be_closed(make_client: Any) -> None:
    app, client = make_client(auth_reads=True)
    _, secret = make_token(app)
    params = {"shape": "4096x4096", "dtype": "float16", "gpu": "H200"}
    for path in (
        "/v1/jobs",
        "/v1/operators",
        "/v1/gpus/H200",
        "/v1/configs/softmax",
        "/v1/workers",
    ):
        response = client.get(path, params=params)
        assert response.status_code == 401 and "for reads too" in response.json()["detail"]
        assert response.headers["www-authenticate"] == "Bearer"
        assert client.get(path, params=params, headers=bearer(secret)).status_code == 200
    assert client.get("/healthz").status_code == 200 and client.get("/v1/ping").status_code == 200
    schema = client.get("/openapi.json", headers=bearer(secret)).json()
    assert "401" in schema["paths"]["/v1/configs/{operator}"]["get"]["responses"]


def test_auth_can_be_turned_off(make_client: Any) -> None:
    app, client = make_client(auth_required=False)
    job = client.post("/v1/jobs", json=JOB)
    assert job.status_code == 202
    assert client.delete(f"/v1/jobs/{job.json()['id']}").status_code == 200
    # A presented token is still checked and recorded.
    token_id, secret = make_token(app)
    assert client.post("/v1/jobs", json=JOB, headers=bearer("kato_bad")).status_code == 401
    job = client.post("/v1/jobs", json=JOB, headers=bearer(secret)).json()
    with app.state.session_factory() as session:
        assert queries.get_job(session, job["id"]).token_id == token_id


def test_jobs_record_their_token_and_last_use(app: FastAPI, anonymous: TestClient) -> None:
    token_id, secret = make_token(app)
    single = anonymous.post("/v1/jobs", json=JOB, headers=bearer(secret)).json()
    batch = anonymous.post("/v1/jobs/batch", json={"jobs": [JOB] * 2}, headers=bearer(secret))
    with app.state.session_factory() as session:
        owners = session.scalars(select(Job.token_id)).all()
        assert owners == [token_id] * 3
        assert session.get(ApiToken, token_id).last_used_at is not None
    assert single["id"] not in [j["id"] for j in batch.json()]


def test_cancel_only_own_or_unowned_jobs(app: FastAPI, anonymous: TestClient) -> None:
    _, alice = make_token(app, "alice")
    _, bob = make_token(app, "bob")
    job = anonymous.post("/v1/jobs", json=JOB, headers=bearer(alice)).json()
    response = anonymous.delete(f"/v1/jobs/{job['id']}", headers=bearer(bob))
    assert response.status_code == 403 and "another API token" in response.json()["detail"]
    assert anonymous.delete(f"/v1/jobs/{job['id']}", headers=bearer(alice)).status_code == 200
    # A job queued without a token (the CLI) may be cancelled by any live token.
    with app.state.session_factory() as session:
        spec_version = anonymous.get("/v1/operators/softmax").json()["version"]
        cli_job = queries.create_job(
            session,
            operator="softmax",
            operator_version=spec_version,
            shape=[64, 64],
            dtype="float32",
            gpu_model="H200",
            budget_configs=5,
        )
    response = anonymous.delete(f"/v1/jobs/{cli_job.id}", headers=bearer(bob))
    assert response.status_code == 200 and response.json()["status"] == "cancelled"


# --- queue quota -----------------------------------------------------------------------------


def test_queued_jobs_per_token(app: FastAPI, anonymous: TestClient) -> None:
    _, secret = make_token(app, "small", max_queued_jobs=2)
    headers = bearer(secret)
    first = anonymous.post("/v1/jobs", json=JOB, headers=headers).json()
    assert anonymous.post("/v1/jobs", json=JOB, headers=headers).status_code == 202
    response = anonymous.post("/v1/jobs", json=JOB, headers=headers)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "60"
    assert "has 2 queued or running job(s) and may have at most 2" in response.json()["detail"]
    # A batch that does not fit is refused whole.
    anonymous.delete(f"/v1/jobs/{first['id']}", headers=headers)
    response = anonymous.post("/v1/jobs/batch", json={"jobs": [JOB] * 2}, headers=headers)
    assert response.status_code == 429 and "submitting 2 more" in response.json()["detail"]
    response = anonymous.post("/v1/jobs/batch", json={"jobs": [JOB]}, headers=headers)
    assert response.status_code == 202
    # Running jobs count; finished ones do not.
    with app.state.session_factory() as session:
        claimed = queries.claim_next_job(
            session, gpu_models=["H200"], worker_id="w", lease_seconds=60
        )
        assert claimed is not None
        assert anonymous.post("/v1/jobs", json=JOB, headers=headers).status_code == 429
        queries.finish_job(session, claimed.id, status="done")
    assert anonymous.post("/v1/jobs", json=JOB, headers=headers).status_code == 202
    # Another token has its own quota.
    _, other = make_token(app, "other")
    assert anonymous.post("/v1/jobs", json=JOB, headers=bearer(other)).status_code == 202


def test_service_default_quota(make_client: Any) -> None:
    app, client = make_client(max_queued_jobs=1, queue_retry_after_seconds=5)
    _, secret = make_token(app)
    assert client.post("/v1/jobs", json=JOB, headers=bearer(secret)).status_code == 202
    response = client.post("/v1/jobs", json=JOB, headers=bearer(secret))
    assert response.status_code == 429 and response.headers["retry-after"] == "5"


# --- sizes -----------------------------------------------------------------------------------


def test_body_size_limit(make_client: Any) -> None:
    app, client = make_client(max_body_bytes=4096)
    _, secret = make_token(app)
    big = {"jobs": [JOB] * 100}  # ~8 KB
    response = client.post("/v1/jobs/batch", json=big, headers=bearer(secret))
    assert response.status_code == 413
    assert "larger than 4096 bytes (KATO_MAX_BODY_BYTES)" in response.json()["detail"]

    # A body without Content-Length (streamed) is cut off as it passes the limit.
    def chunks() -> Iterator[bytes]:
        yield b'{"jobs": ['
        for _ in range(1000):
            yield b'{"operator": "softmax", "shape": [1, 1], "dtype": "float16", "gpu": "H200"},'
        yield b"]}"

    response = client.post(
        "/v1/jobs/batch",
        content=chunks(),
        headers={**bearer(secret), "content-type": "application/json"},
    )
    assert response.status_code == 413, response.text
    assert client.post("/v1/jobs", json=JOB, headers=bearer(secret)).status_code == 202
    assert len(client.get("/v1/jobs").json()) == 1


def test_shape_must_fit_the_gpu(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={**JOB, "shape": [400_000, 200_000], "gpu": "T4"})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "shape 400000x200000 in float16 needs 320.0 GB of device memory; T4 has 16.0 GB"
    )


def test_budget_limits_come_from_settings(make_client: Any) -> None:
    app, client = make_client(max_budget_configs=50, default_budget_configs=10)
    _, secret = make_token(app)
    response = client.post("/v1/jobs", json={**JOB, "budget": 51}, headers=bearer(secret))
    assert response.status_code == 422
    assert response.json()["detail"] == "budget must be at most 50 configs, got 51"
    job = client.post("/v1/jobs", json=JOB, headers=bearer(secret)).json()
    assert job["budget"] == 10


# --- the CLI ---------------------------------------------------------------------------------


def test_token_cli(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/kato.db"
    runner = CliRunner()
    created = runner.invoke(cli, ["token", "create", "fleet", "--max-queued", "7", "--db", db])
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip()
    listed = runner.invoke(cli, ["token", "list", "--json", "--db", db])
    assert listed.exit_code == 0 and secret not in listed.output
    row = json.loads(listed.stdout.splitlines()[0])
    assert row["name"] == "fleet" and row["max_queued_jobs"] == 7 and row["revoked_at"] is None
    assert runner.invoke(cli, ["token", "list", "--db", db]).exit_code == 0
    revoked = runner.invoke(cli, ["token", "revoke", row["id"], "--db", db])
    assert revoked.exit_code == 0 and "revoked" in revoked.output
    assert runner.invoke(cli, ["token", "revoke", "nope", "--db", db]).exit_code == 2
    bad = runner.invoke(cli, ["token", "create", "x", "--max-queued", "0", "--db", db])
    assert bad.exit_code == 2
