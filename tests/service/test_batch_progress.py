"""A batch's progress as one view (GET /v1/jobs/batch/{id}, ``kato jobs --batch``) and a job's
GPU busy time (GET /v1/jobs/{id}, ``kato jobs``): issue 35."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kato.db import queries, tokens
from kato.db.models import Job, utcnow
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.cli import app as cli
from kato.service.settings import Settings
from sqlalchemy import update
from typer.testing import CliRunner


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'kato.db'}"
    init_db(url)
    return url


@pytest.fixture
def client(db: str):
    app = create_app(Settings(db_url=db))
    with app.state.session_factory() as session:
        secret = tokens.create_token(session, "batch", max_queued_jobs=100)[1]
    with TestClient(app, headers={"Authorization": f"Bearer {secret}"}) as c:
        yield c
    app.state.engine.dispose()


def submit_batch(client: TestClient) -> list[dict]:
    shapes = [[64, 1024], [128, 1024], [256, 1024]]
    body = {
        "jobs": [
            {"operator": "softmax", "shape": s, "dtype": "float16", "gpu": "H200", "budget": 10}
            for s in shapes
        ]
    }
    response = client.post("/v1/jobs/batch", json=body)
    assert response.status_code == 202, response.text
    return response.json()


def set_progress(db: str, ids: list[str]) -> None:
    """Job 0 done in 10 s with 4 s of GPU; job 1 running, 5 of 10 after 10 s; job 2 queued."""
    sessions = session_factory(init_db(db))
    now = utcnow()
    with sessions() as s:
        s.execute(
            update(Job)
            .where(Job.id == ids[0])
            .values(
                status="done",
                trials_done=10,
                best_time_ms=0.5,
                started_at=now - timedelta(seconds=20),
                finished_at=now - timedelta(seconds=10),
            )  # fmt: skip
        )
        s.execute(
            update(Job)
            .where(Job.id == ids[1])
            .values(
                status="running",
                trials_done=5,
                best_time_ms=0.75,
                started_at=now - timedelta(seconds=10),
            )  # fmt: skip
        )
        s.commit()
        queries.add_gpu_busy(s, ids[0], 4.0)


def test_a_batch_shares_one_id_and_its_progress_is_one_view(client: TestClient, db: str) -> None:
    jobs = submit_batch(client)
    (batch_id,) = {j["batch_id"] for j in jobs}
    assert batch_id
    ids = [j["id"] for j in jobs]
    fresh = client.get(f"/v1/jobs/batch/{batch_id}").json()
    assert (fresh["trials_done"], fresh["budget"], fresh["jobs"]) == (0, 30, 3)
    assert fresh["status_counts"] == {"queued": 3} and fresh["elapsed_s"] is None
    assert fresh["eta_s"] is None and fresh["gpu_busy_fraction"] is None

    set_progress(db, ids)
    view = client.get(f"/v1/jobs/batch/{batch_id}").json()
    assert view["status_counts"] == {"done": 1, "running": 1, "queued": 1}
    assert (view["trials_done"], view["budget"]) == (15, 30)
    assert [k["job_id"] for k in view["keys"]] == ids  # in the order submitted
    assert [k["best_time_ms"] for k in view["keys"]] == [0.5, 0.75, None]
    assert [k["trials_done"] for k in view["keys"]] == [10, 5, 0]
    # From the first start (20 s ago) to now; the 15 trials left at that rate.
    assert 20 <= view["elapsed_s"] < 30
    assert view["eta_s"] == pytest.approx(view["elapsed_s"], rel=1e-6)
    assert view["gpu_busy_s"] == 4.0 and view["gpu_busy_fraction"] is None  # not ended

    job = client.get(f"/v1/jobs/{ids[0]}").json()
    assert job["gpu_busy_s"] == 4.0 and job["gpu_busy_fraction"] == pytest.approx(0.4, rel=1e-3)
    assert job["batch_id"] == batch_id
    assert client.get(f"/v1/jobs/{ids[2]}").json()["gpu_busy_s"] is None


def test_an_unknown_batch_is_a_404(client: TestClient) -> None:
    for bad in ("0" * 32, "not-an-id", "x" * 300):
        response = client.get(f"/v1/jobs/batch/{bad}")
        assert response.status_code == 404 and "not found" in response.json()["detail"]


def test_a_single_job_has_no_batch(client: TestClient) -> None:
    body = {"operator": "softmax", "shape": [64, 64], "dtype": "float16", "gpu": "H200"}
    job = client.post("/v1/jobs", json=body).json()
    assert job["batch_id"] is None


def test_kato_jobs_shows_a_batch_and_the_gpu_busy_fraction(client: TestClient, db: str) -> None:
    jobs = submit_batch(client)
    ids, batch_id = [j["id"] for j in jobs], jobs[0]["batch_id"]
    set_progress(db, ids)
    shown = CliRunner().invoke(cli, ["jobs", "--batch", batch_id, "--db", db])
    assert shown.exit_code == 0, shown.output
    assert f"batch {batch_id}: 15/30 configs" in shown.stdout
    assert "1 done, 1 queued, 1 running" in shown.stdout
    assert "10/10" in shown.stdout and "0.7500" in shown.stdout and "40%" in shown.stdout
    as_json = CliRunner().invoke(cli, ["jobs", "--batch", batch_id, "--json", "--db", db])
    assert json.loads(as_json.stdout)["trials_done"] == 15
    listed = CliRunner().invoke(cli, ["jobs", "--db", db])
    assert "GPU busy" in listed.stdout and "40%" in listed.stdout
    missing = CliRunner().invoke(cli, ["jobs", "--batch", "f" * 32, "--db", db])
    assert missing.exit_code == 1 and "no batch" in missing.output
    assert get_operator("softmax").version == jobs[0]["operator_version"]
