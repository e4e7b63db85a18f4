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
from kato.service.cli import app
from typer.testing import CliRunner

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
            "kato.service.cli",
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


# --- a user's mistake: one line on stderr, exit 1 (2 for a bad argument), never a traceback ---

#: Nothing listens on port 1 (privileged, unused).
NOWHERE = "http://127.0.0.1:1"
NO_SUCH_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/nope_does_not_exist"
RECORDING = os.path.join(
    REPO, "tests", "data", "recorded", "softmax_H200_4096x4096_float16.json.gz"
)

# (id, argv ({tmp}: a folder of bad files, {db}: a SQLite URL with one imported problem),
#  exit status, phrases that must all appear on one line of the output, environment)
MISTAKES = [
    ("export-to-existing-file", ["export", "{tmp}/existing_file.txt", "--db", "{db}"], 1,
     ["existing_file.txt is a file, not a directory", "pass a directory"], {}),
    ("export-under-a-file", ["export", "{tmp}/file.json/sub", "--db", "{db}"], 1,
     ["file.json is a file, not a directory", "pass a directory"], {}),
    ("lookup-url-nothing-listening",
     ["lookup", "softmax", "--shape", "64x64", "--url", NOWHERE], 1,
     ["cannot reach the Kato service at " + NOWHERE, "kato serve", "--url"], {}),
    ("lookup-url-without-scheme",
     ["lookup", "softmax", "--shape", "64x64", "--url", "127.0.0.1:1"], 1,
     ["--url 127.0.0.1:1: not a service URL"], {}),
    ("token-list-bogus-db", ["token", "list", "--db", "bogus://x"], 1,
     ["cannot open the database bogus://x", "check --db or KATO_DB_URL"], {}),
    ("lookup-bogus-db", ["lookup", "softmax", "--shape", "64x64", "--db", "bogus://x"], 1,
     ["cannot open the database bogus://x", "check --db"], {}),
    ("export-bogus-db", ["export", "{tmp}/out", "--db", "bogus://x"], 1,
     ["cannot open the database bogus://x"], {}),
    ("import-bogus-db", ["import", RECORDING, "--db", "bogus://x"], 1,
     ["cannot open the database bogus://x"], {}),
    ("serve-bogus-db", ["serve", "--no-workers", "--db", "bogus://x"], 1,
     ["cannot open the database bogus://x"], {}),
    ("worker-bogus-db",
     ["worker", "--backend", "replay", "--replay", RECORDING, "--db", "bogus://x",
      "--max-jobs", "0"], 1, ["cannot open the database bogus://x"], {}),
    ("bogus-db-from-environment", ["token", "list"], 1,
     ["cannot open the database bogus://x", "KATO_DB_URL"], {"KATO_DB_URL": "bogus://x"}),
    ("postgres-no-such-database", ["token", "list", "--db", NO_SUCH_PG], 1,
     ["cannot open the database", "nope_does_not_exist"], {}),
    ("db-is-a-text-file", ["token", "list", "--db", "{tmp}/existing_file.txt"], 1,
     ["cannot open the database", "existing_file.txt", "not a database"], {}),
    ("db-url-bad-port", ["token", "list", "--db", "postgresql+psycopg://u@h:abc/db"], 1,
     ["cannot open the database", "'abc'"], {}),
    ("bad-setting-in-environment", ["token", "list", "--db", "{db}"], 1,
     ["invalid settings: KATO_PORT"], {"KATO_PORT": "abc"}),
    ("worker-bad-retry-seconds",
     ["worker", "--backend", "replay", "--replay", RECORDING, "--db", "{db}", "--max-jobs", "0"],
     2, ["KATO_DB_RETRY_SECONDS must be a number of seconds", "'soon'"],
     {"KATO_DB_RETRY_SECONDS": "soon"}),
    ("worker-replay-not-json",
     ["worker", "--backend", "replay", "--replay", "{tmp}/notjson.txt", "--db", "{db}",
      "--max-jobs", "0"], 2, ["notjson.txt: not a Kernel Tuner cache file"], {}),
    ("worker-replay-not-json-with-gpu",
     ["worker", "--backend", "replay", "--replay", "{tmp}/notjson.txt", "--gpu", "H200",
      "--db", "{db}", "--max-jobs", "0"], 2, ["notjson.txt: not a Kernel Tuner cache file"], {}),
    ("worker-replay-not-gzip",
     ["worker", "--backend", "replay", "--replay", "{tmp}/bad.json.gz", "--db", "{db}",
      "--max-jobs", "0"], 2, ["bad.json.gz: not a Kernel Tuner cache file"], {}),
    ("worker-replay-empty-directory",
     ["worker", "--backend", "replay", "--replay", "{tmp}/emptydir", "--db", "{db}",
      "--max-jobs", "0"], 2, ["emptydir: no recordings"], {}),
    ("replay-json-not-an-object", ["replay", "{tmp}/num.json"], 2,
     ["num.json: not a Kernel Tuner cache file"], {}),
    ("replay-not-gzip", ["replay", "{tmp}/bad.json.gz"], 2,
     ["bad.json.gz: not a Kernel Tuner cache file"], {}),
    ("tune-unknown-strategy",
     ["tune", "softmax", "--shape", "64x64", "--strategy", "nope", "--db", "{db}"], 2,
     ["strategy must be one of"], {}),
    ("tune-zero-budget", ["tune", "softmax", "--shape", "64x64", "--budget", "0", "--db", "{db}"],
     2, ["--budget"], {}),
]  # fmt: skip


@pytest.fixture
def mistake_files(tmp_path):
    """Files a user may hand over by mistake, and a database holding one problem to export."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "existing_file.txt").write_text("hello\n")
    (bad / "file.json").write_text("{}")
    (bad / "notjson.txt").write_text('{"a":\n')
    (bad / "num.json").write_text("3\n")
    (bad / "bad.json.gz").write_text("not gzip\n")
    (bad / "emptydir").mkdir()
    db = f"sqlite:///{tmp_path}/kato.db"
    imported = CliRunner().invoke(app, ["import", RECORDING, "--db", db])
    assert imported.exit_code == 0, imported.output
    return bad, db


def _assert_clear_error(result, code: int, phrases: list[str]) -> None:
    """Exit ``code`` through typer (no exception escaped: that would be a traceback), with
    every phrase on one line of the output."""
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    assert escaped is None, f"{type(escaped).__name__}: {escaped}"
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert any(all(p in line for p in phrases) for line in lines), result.output


@pytest.mark.parametrize(
    "argv, code, phrases, env", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES]
)
def test_a_mistake_is_a_one_line_error(mistake_files, monkeypatch, argv, code, phrases, env):
    bad, db = mistake_files
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [a.format(tmp=bad, db=db) for a in argv]
    _assert_clear_error(CliRunner().invoke(app, args), code, phrases)


def test_lookup_url_of_something_else_is_a_clear_error():
    """A --url that answers, but not as Kato (an HTML 404): said so, not a JSONDecodeError."""
    import http.server
    import threading

    class NotKato(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html>not here</html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotKato)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        result = CliRunner().invoke(app, ["lookup", "softmax", "--shape", "64x64", "--url", url])
    finally:
        server.shutdown()
        server.server_close()
    _assert_clear_error(result, 1, [f"{url} did not answer as a Kato service (HTTP 404"])


def test_bogus_db_prints_no_traceback(tmp_path):
    """The real process: one line on stderr, exit status 1, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "kato.service.cli", "token", "list", "--db", "bogus://x"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "cannot open the database bogus://x" in proc.stderr
    assert proc.stdout == ""
