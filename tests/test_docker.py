"""docker/: what can be checked without a Docker engine. The compose file parses and points at
files that exist, the environment it sets is made of real settings, and both entrypoints start
outside Docker: the API answers /healthz, a (replay) worker heartbeats into the database."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from kato.db import fleet
from kato.db.session import init_db, session_factory
from kato.service.settings import Settings
from paths import RECORDED, REPO

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse docker/compose.yaml")

DOCKER = REPO / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_has_a_database_an_api_and_one_worker_per_gpu(compose):
    services = compose["services"]
    assert {"db", "api"} <= set(services)
    workers = {name: s for name, s in services.items() if name.startswith("worker")}
    assert workers
    gpus = []
    for service in workers.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        gpus += device["device_ids"]
        assert service["depends_on"]["db"]["condition"] == "service_healthy"
    assert len(set(gpus)) == len(gpus), "two workers on one GPU"
    for name in ("db", "api"):
        assert services[name]["healthcheck"]["test"]
    assert services["api"]["depends_on"]["db"]["condition"] == "service_healthy"


def test_compose_builds_from_dockerfiles_that_exist(compose):
    builds = [s["build"] for s in compose["services"].values() if "build" in s]
    assert len(builds) >= 2
    for build in builds:
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO
        dockerfile = context / build["dockerfile"]
        assert dockerfile.is_file(), dockerfile
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                source = line.split()[1]
                assert (context / source).exists(), f"{dockerfile.name}: COPY {source}"
        (entry,) = re.findall(r'^ENTRYPOINT \["([^"]+)"\]', dockerfile.read_text(), re.M)
        script = re.search(rf"COPY (\S+) /usr/local/bin/{entry}\n", dockerfile.read_text())
        assert script and os.access(context / script.group(1), os.X_OK)


def test_compose_sets_only_real_settings(compose):
    fields = set(Settings.model_fields)
    envs = [s.get("environment", {}) for s in compose["services"].values()]
    names = {k for env in envs for k in env if k.startswith("KATO_")}
    assert "KATO_DB_URL" in names
    unknown = {n for n in names if n.removeprefix("KATO_").lower() not in fields}
    assert not unknown, f"not Settings fields: {unknown}"
    for env in envs:
        if "KATO_DB_URL" in env:
            assert env["KATO_DB_URL"].startswith("postgresql+psycopg://")
            Settings(**{k.removeprefix("KATO_").lower(): v for k, v in env.items()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def kato_env(tmp_path):
    if shutil.which("kato") is None:
        pytest.skip("the kato command is not installed (pip install -e .)")
    url = f"sqlite:///{tmp_path}/kato.db"
    env = {**os.environ, "KATO_DB_URL": url, "KATO_LEASE_SECONDS": "2"}
    return url, env


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_the_api_entrypoint_starts_and_answers_healthz(kato_env, tmp_path):
    _, env = kato_env
    port = _free_port()
    env.update(KATO_HOST="127.0.0.1", KATO_PORT=str(port))
    log = open(tmp_path / "api.log", "wb")  # noqa: SIM115 - the server writes to it while we wait
    proc = subprocess.Popen(
        ["sh", str(DOCKER / "entrypoint-api.sh")], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, (tmp_path / "api.log").read_text()
                assert time.monotonic() < deadline, "the API did not come up"
                time.sleep(0.3)
        assert r.status_code == 200 and r.json()["db"] == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/workers", timeout=5).json() == []
    finally:
        _stop(proc)


def test_the_worker_entrypoint_starts_and_heartbeats(kato_env, tmp_path):
    url, env = kato_env
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - the worker writes to it
    cmd = ["sh", str(DOCKER / "entrypoint-worker.sh"), "--backend", "replay", "--replay"]
    proc = subprocess.Popen(
        [*cmd, str(RECORDED), "--poll-seconds", "0.2"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    sessions = session_factory(init_db(url))
    try:
        deadline = time.monotonic() + 60
        while True:
            with sessions() as s:
                rows = fleet.list_workers(s)
            if rows and fleet.is_live(rows[0], 2):
                break
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.2)
        assert rows[0].gpu_models == ["H200"] and rows[0].backend == "replay"
    finally:
        _stop(proc)
    with sessions() as s:
        assert fleet.list_workers(s)[0].status == "stopped"  # SIGTERM: a clean stop
