"""The work one request can cause is bounded: the shape of a JSON body (keys per object, items
per array, nesting) is checked before validation, a 422 lists a few errors and never echoes a
large input, and a large body is decoded off the event loop (``/v1/ping`` stays fast meanwhile).

The fast tests assert on the answers (status, size, what they say); the latency test runs a
real uvicorn on loopback and is marked ``slow``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from kato.service.strict import MAX_ARRAY_ITEMS, MAX_DEPTH, MAX_ERRORS, MAX_OBJECT_KEYS

LOOKUP = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
#: The issue's body: a 649 KB JSON object of 60,000 keys.
SIXTY_THOUSAND_KEYS = json.dumps({f"k{i}": i for i in range(60_000)}).encode()
#: Largest 4xx body any of these requests may get.
SMALL = 4096


def _post(client: TestClient, path: str, body: bytes) -> Any:
    return client.post(path, content=body, headers={"content-type": "application/json"})


def _details(response: Any) -> list[dict[str, Any]]:
    detail = response.json()["detail"]
    assert isinstance(detail, list), detail
    return detail


@pytest.mark.parametrize("path", ["/v1/configs/batch", "/v1/jobs", "/v1/jobs/batch"])
def test_an_object_of_60000_keys_gets_a_small_422_naming_the_limit(
    client: TestClient, path: str
) -> None:
    response = _post(client, path, SIXTY_THOUSAND_KEYS)
    assert response.status_code == 422, response.text[:300]
    assert len(response.content) < SMALL
    [error] = _details(response)
    assert error["type"] == "too_many_keys"
    assert error["loc"] == ["body"]
    assert "60000 keys" in error["msg"] and f"at most {MAX_OBJECT_KEYS}" in error["msg"]


def test_a_nested_object_with_too_many_keys_is_named_by_its_location(client: TestClient) -> None:
    item = {**LOOKUP, **{f"x{i}": 1 for i in range(MAX_OBJECT_KEYS)}}
    body = json.dumps({"lookups": [LOOKUP, item]}).encode()
    [error] = _details(_post(client, "/v1/configs/batch", body))
    assert error["type"] == "too_many_keys" and error["loc"] == ["body", "lookups", 1]


def test_an_array_past_the_limit_gets_a_small_422(client: TestClient) -> None:
    # 300,000 empty jobs (900 KB): validated, each would be 4 "missing" errors (9 s, 1.2M errors).
    body = b'{"jobs": [' + b",".join([b"{}"] * 300_000) + b"]}"
    response = _post(client, "/v1/jobs/batch", body)
    assert response.status_code == 422 and len(response.content) < SMALL
    [error] = _details(response)
    assert error["type"] == "too_many_items" and error["loc"] == ["body", "jobs"]
    assert "300000 items" in error["msg"] and f"at most {MAX_ARRAY_ITEMS}" in error["msg"]


@pytest.mark.parametrize("depth", [MAX_DEPTH, 5_000, 100_000])
def test_nesting_past_the_limit_gets_a_422(client: TestClient, depth: int) -> None:
    # 5,000 and 100,000 levels are past json.loads' own recursion limit (a bare 400 before).
    body = ('{"jobs": ' + "[" * depth + "]" * depth + "}").encode()
    response = _post(client, "/v1/jobs/batch", body)
    assert response.status_code == 422 and len(response.content) < SMALL
    [error] = _details(response)
    assert error["type"] == "too_deep" and f"{MAX_DEPTH} levels" in error["msg"]


def test_many_bad_items_are_listed_up_to_the_cap_with_a_count_of_the_rest(
    client: TestClient,
) -> None:
    # Within every shape limit: 1000 lookups of 50 unknown keys each (50,000 errors before).
    bad = {f"x{i}": 1 for i in range(50)}
    body = json.dumps({"lookups": [bad] * 1000}).encode()
    response = _post(client, "/v1/configs/batch", body)
    assert response.status_code == 422 and len(response.content) < SMALL
    errors = _details(response)
    assert len(errors) == MAX_ERRORS + 1
    assert all(e["loc"][:3] == ["body", "lookups", 0] for e in errors[:-1])
    assert errors[-1]["type"] == "too_many_errors"
    assert "more errors" in errors[-1]["msg"]


def test_a_large_input_is_not_echoed(client: TestClient) -> None:
    body = json.dumps({**JOB, "operator": "s" * 900_000}).encode()
    response = _post(client, "/v1/jobs", body)
    assert response.status_code == 422 and len(response.content) < SMALL
    [error] = _details(response)
    assert error["loc"] == ["body", "operator"] and error["type"] == "string_too_long"
    assert error["input"].startswith("sss") and len(error["input"]) <= 201


def test_a_large_container_input_is_echoed_in_part(client: TestClient) -> None:
    # A list where an object belongs: pydantic echoes the whole list as the error's input.
    body = json.dumps({"lookups": [list(range(9_000))]}).encode()
    response = _post(client, "/v1/configs/batch", body)
    assert response.status_code == 422 and len(response.content) < SMALL
    [error] = _details(response)
    assert error["loc"] == ["body", "lookups", 0]
    assert error["input"][:3] == [0, 1, 2] and len(error["input"]) <= 11


def test_bodies_within_the_limits_are_answered_as_before(client: TestClient) -> None:
    response = client.post("/v1/configs/batch", json={"lookups": [LOOKUP] * 1000})
    assert response.status_code == 200
    assert [r["status"] for r in response.json()["results"]] == [200] * 1000
    response = client.post("/v1/jobs/batch", json={"jobs": [JOB] * 3})
    assert response.status_code == 202 and len(response.json()) == 3
    # A few errors are listed in full, as FastAPI lists them.
    response = client.post("/v1/jobs", json={"shape": [1, 1]})
    assert response.status_code == 422
    assert sorted(e["loc"][-1] for e in _details(response)) == ["dtype", "gpu", "operator"]


# --- latency on a real server -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """The app under uvicorn (``create_app_from_env``) in its own process on a loopback port;
    its base URL."""
    port = _free_port()
    env = {**os.environ, "KATO_DB_URL": str(tmp_path / "kato.db")}
    command = [sys.executable, "-m", "uvicorn", "--factory", "kato.service.app:create_app_from_env"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/v1/ping", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(10)


#: Bodies that took the old code seconds each, sent by several clients at once.
HEAVY = [
    ("/v1/configs/batch", SIXTY_THOUSAND_KEYS),
    ("/v1/jobs/batch", b'{"jobs": [' + b",".join([b"{}"] * 300_000) + b"]}"),
    ("/v1/configs/batch", json.dumps({"lookups": [{f"x{i}": 1 for i in range(50)}] * 1000})),
]


@pytest.mark.slow
def test_heavy_bodies_are_refused_fast_while_ping_stays_fast(server: str) -> None:
    answers: list[tuple[int, int, float]] = []
    pings: list[float] = []
    done = threading.Event()

    def heavy(path: str, body: bytes | str) -> None:
        with httpx.Client(base_url=server, timeout=60) as http:
            for _ in range(3):
                start = time.perf_counter()
                response = http.post(
                    path, content=body, headers={"content-type": "application/json"}
                )
                answers.append(
                    (response.status_code, len(response.content), time.perf_counter() - start)
                )

    def ping() -> None:
        with httpx.Client(base_url=server, timeout=60) as http:
            while not done.is_set():
                start = time.perf_counter()
                assert http.get("/v1/ping").status_code == 200
                pings.append(time.perf_counter() - start)
                time.sleep(0.01)

    pinger = threading.Thread(target=ping)
    pinger.start()
    senders = [threading.Thread(target=heavy, args=item) for item in HEAVY]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    while len(pings) < 20:  # enough pings to judge, however fast the heavy requests were
        time.sleep(0.01)
    done.set()
    pinger.join()

    assert max(pings) < 0.5, sorted(pings)[-5:]
    assert max(a[2] for a in answers) < 2.0, answers
    assert max(a[1] for a in answers) < SMALL
    assert [a[0] for a in answers] == [422] * 9
