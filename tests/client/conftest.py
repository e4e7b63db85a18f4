"""Client fixtures: the service on a real loopback port (uvicorn in a thread) over a fresh SQLite
file seeded with a few best configs, and a port where nothing listens."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from client_seed import SEEDED
from fastapi import FastAPI, Request
from kato.db import queries
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_best(app: FastAPI, rows=SEEDED, gpu: str = "H200", operator: str = "softmax") -> None:
    """Store best configs of ``operator`` the way a worker would."""
    version = get_operator(operator).version
    with app.state.session_factory() as session:
        for shape, dtype, config, time_ms in rows:
            queries.upsert_best_config(
                session,
                operator=operator,
                operator_version=version,
                shape=list(shape),
                dtype=dtype,
                gpu_model=gpu,
                compute_capability="9.0",
                cuda_version="13.0",
                config=config,
                time_ms=time_ms,
                job_id=None,
                default_ms=2 * time_ms,  # beat the default there: served for other shapes too
            )


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    requests: Counter  # "METHOD path" -> count, as the server saw them
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """Shut the server down; its port refuses connections afterwards."""
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "uvicorn did not stop"

    def set_best(
        self, shape, dtype, config, time_ms, drop_cache: bool = True, operator: str = "softmax"
    ) -> None:
        """Store a winner; ``drop_cache=False`` leaves the service's answer cache as it is, as
        between a worker's write and the API's watcher noticing it (this server has no
        lifespan, so its watcher never runs)."""
        seed_best(self.app, [(shape, dtype, config, time_ms)], operator=operator)
        cache = getattr(self.app.state, "lookup_cache", None)
        if cache is not None and drop_cache:  # the service's own short-lived answer cache
            cache.clear()


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[LiveServer]:
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}"))
    seed_best(app)
    seen: Counter = Counter()

    @app.middleware("http")
    async def count(request: Request, call_next):
        seen[f"{request.method} {request.url.path}"] += 1
        return await call_next(request)

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    live = LiveServer(f"http://127.0.0.1:{port}", app, seen, server, thread)
    yield live
    live.stop()
    app.state.engine.dispose()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"
