"""Many concurrent requests against a real server (uvicorn on loopback, not TestClient): no
request waits on the database pool while holding a connection another one needs.

Before the fix, about 64 concurrent requests deadlocked: a request held a pooled connection
from its token check (``require_writer``) while it waited for a thread to run its route, and
the 40 threads waited for connections (QueuePool 5 + 10) for the pool's 30 s timeout, then
answered 500. Each burst here must answer every request, without a 5xx, within a bound far
below that timeout, with ``/healthz`` answering meanwhile, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio.to_thread
import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from kato.db import tokens
from kato.service.app import create_app
from kato.service.settings import Settings
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
POSTGRES_URL = os.environ.get(
    "KATO_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A SQLite file, or a fresh PostgreSQL schema (as ``tests/db/conftest.py`` makes them)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'kato.db'}"
        return
    admin = create_engine(
        POSTGRES_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    schema = f"kato_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as exc:
        admin.dispose()
        pytest.skip(f"no PostgreSQL server at {POSTGRES_URL}: {exc.orig}")
    url = make_url(POSTGRES_URL).update_query_dict(
        {"options": f"-csearch_path={schema}", "application_name": schema}
    )
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            # A failed run can leave transactions open on the schema (the deadlock this file
            # is about): end them, or DROP SCHEMA waits on their locks for ever.
            connection.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": schema},
            )
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextlib.contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """``app`` behind uvicorn on a free loopback port, in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Keep-alive longer than a burst: a connection the server drops as idle while the client
    # reuses it would be a client-side race, not an answer of the server.
    config = uvicorn.Config(
        app, log_level="warning", timeout_keep_alive=120, timeout_graceful_shutdown=2, backlog=1024
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        app.state.engine.dispose()


@dataclass
class Answers:
    """Status codes (or the client error's name) and latencies, per kind of request."""

    statuses: dict[str, Counter[int | str]] = field(default_factory=dict)
    latencies: dict[str, list[float]] = field(default_factory=dict)

    def record(self, kind: str, status: int | str, seconds: float) -> None:
        self.statuses.setdefault(kind, Counter())[status] += 1
        self.latencies.setdefault(kind, []).append(seconds)

    def slowest(self, kind: str) -> float:
        return max(self.latencies.get(kind, [float("inf")]))


async def _timed(
    answers: Answers, kind: str, send: asyncio.Future | object
) -> httpx.Response | None:
    t0 = time.perf_counter()
    try:
        response = await send  # type: ignore[misc]
    except httpx.HTTPError as exc:  # a timeout is the failure this test is about
        answers.record(kind, type(exc).__name__, time.perf_counter() - t0)
        return None
    answers.record(kind, response.status_code, time.perf_counter() - t0)
    return response


async def _burst(base_url: str, secret: str, clients: int, bound_s: float) -> Answers:
    """``clients`` concurrent clients, each: submit a job, then read its status; meanwhile one
    client asks ``/healthz`` every 50 ms. No request may take longer than ``bound_s``."""
    answers = Answers()
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=bound_s, limits=limits) as client:
        done = asyncio.Event()

        async def health() -> None:
            while not done.is_set():
                await _timed(answers, "healthz", client.get("/healthz"))
                await asyncio.sleep(0.05)

        async def one() -> None:
            response = await _timed(
                answers, "submit", client.post("/v1/jobs", json=JOB, headers=headers)
            )
            if response is not None and response.status_code == 202:
                await _timed(answers, "status", client.get(f"/v1/jobs/{response.json()['id']}"))

        watcher = asyncio.create_task(health())
        await asyncio.gather(*(one() for _ in range(clients)))
        done.set()
        await watcher
    return answers


def _check_burst(db_url: str, clients: int, bound_s: float, **settings: object) -> None:
    app = create_app(Settings(db_url=db_url, max_queued_jobs=100_000, **settings))
    with app.state.session_factory() as session:
        secret = tokens.create_token(session, "load")[1]
    with served(app) as base_url:
        answers = asyncio.run(_burst(base_url, secret, clients, bound_s))
    assert answers.statuses["submit"] == {202: clients}, answers.statuses
    assert answers.statuses["status"] == {200: clients}, answers.statuses
    assert set(answers.statuses["healthz"]) == {200}, answers.statuses
    assert answers.slowest("submit") < bound_s and answers.slowest("status") < bound_s
    assert answers.slowest("healthz") < bound_s


def test_64_concurrent_requests_with_few_threads_all_answer(db_url: str) -> None:
    """Four API threads for 64 concurrent clients (submit, then status): a request waiting
    for a thread holds no connection, so the small pool sized from the threads never runs dry.
    Before the fix this deadlocked for the pool's 30 s timeout; the bound here is 10 s."""
    _check_burst(db_url, clients=64, bound_s=10.0, api_threads=4)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [40, 8])
def test_256_concurrent_requests_all_answer(db_url: str, threads: int) -> None:
    """256 concurrent clients with the default 40 API threads, and with 8 (on 2 busy cores a
    burst takes about 10 s: submissions queue on the database's write lock)."""
    _check_burst(db_url, clients=256, bound_s=20.0, api_threads=threads)


def test_the_api_thread_limit_is_set_at_startup(tmp_path: Path) -> None:
    """``api_threads`` is AnyIO's default thread limit in the server's event loop (sync routes,
    sync dependencies and ``run_in_threadpool`` all draw on it), and the database pool holds a
    connection for each of them plus headroom."""
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}", api_threads=7)
    app = create_app(settings)

    @app.get("/test-thread-limit")
    async def thread_limit() -> dict[str, float]:
        return {"tokens": anyio.to_thread.current_default_thread_limiter().total_tokens}

    with served(app) as base_url:
        answer = httpx.get(f"{base_url}/test-thread-limit", timeout=10)
    assert answer.json() == {"tokens": 7}
    pool = app.state.engine.pool
    assert pool.size() == settings.api_db_connections > 7
