"""The ``kato`` command line on a machine without a GPU: serve answers and queues, lookup
answers, GPU commands fail with a clear message."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from service.cli import app

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_gpu(monkeypatch):
    """Hide any GPU: this test is about the machine without one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_serve_without_gpu_answers_and_queues(tmp_path, no_gpu):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    created = CliRunner().invoke(
        app, ["token", "create", "cli-test", "--db", f"sqlite:///{tmp_path}/kato.db"]
    )
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip()
    assert secret.startswith("kato_") and "\n" not in secret
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--port",
            str(port),
            "--db",
            f"sqlite:///{tmp_path}/kato.db",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "kato serve did not come up in 60 s"
                time.sleep(0.3)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        body = {"operator": "softmax", "shape": [1024, 1024], "dtype": "float32", "gpu": "H200"}
        refused = httpx.post(f"{base}/v1/jobs", json=body)
        assert refused.status_code == 401 and "kato token create" in refused.json()["detail"]
        job = httpx.post(
            f"{base}/v1/jobs", json=body, headers={"Authorization": f"Bearer {secret}"}
        ).json()
        time.sleep(1.0)
        assert httpx.get(f"{base}/v1/jobs/{job['id']}").json()["status"] == "queued"
        cfg = httpx.get(
            f"{base}/v1/configs/softmax",
            params={"shape": "1024x1024", "dtype": "float32", "gpu": "H200"},
        ).json()
        assert cfg["source"] == "default"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "no CUDA device visible" in out


def test_lookup_from_the_database(tmp_path):
    db = f"sqlite:///{tmp_path}/kato.db"
    out = CliRunner().invoke(
        app,
        [
            "lookup",
            "softmax",
            "--shape",
            "4096x4096",
            "--dtype",
            "float16",
            "--gpu",
            "NVIDIA H200",
            "--db",
            db,
        ],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["source"] == "default" and data["gpu"] == "H200"
    assert data["config"]["VEC"] == 8


def test_lookup_bad_input_is_a_clear_error(tmp_path):
    out = CliRunner().invoke(
        app,
        [
            "lookup",
            "softmax",
            "--shape",
            "4096",
            "--dtype",
            "float16",
            "--db",
            f"sqlite:///{tmp_path}/kato.db",
        ],
    )
    assert out.exit_code == 1
    assert "rank 2" in out.output


def test_tune_without_a_gpu_says_so(tmp_path, no_gpu):
    out = CliRunner().invoke(
        app, ["tune", "softmax", "--shape", "64x64", "--db", f"sqlite:///{tmp_path}/kato.db"]
    )
    assert out.exit_code == 2
    assert "no usable CUDA device" in out.output
