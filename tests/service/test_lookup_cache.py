"""The in-memory lookup cache: answers from memory, dropped when a winner is stored."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from fastapi.testclient import TestClient
from kato.db import queries
from kato.db.models import BestConfig
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.lookup_cache import LookupCache
from kato.service.settings import Settings
from sqlalchemy import select

PARAMS = {"shape": "4096x4096", "dtype": "float16", "gpu": "H200"}


def store(app, time_ms: float, block: int, shape: tuple[int, int] = (4096, 4096)) -> None:
    spec = get_operator("softmax")
    config = {**spec.default_config(list(shape), "float16"), "BLOCK_SIZE": block}
    with app.state.session_factory() as session:
        queries.upsert_best_config(
            session,
            operator="softmax",
            operator_version=spec.version,
            shape=list(shape),
            dtype="float16",
            gpu_model="H200",
            compute_capability="9.0",
            cuda_version="13.0",
            config=config,
            time_ms=time_ms,
            job_id=None,
        )


def wait_for(client: TestClient, source: str, block: int | None = None) -> dict:
    deadline = time.monotonic() + 10
    while True:
        body = client.get("/v1/configs/softmax", params=PARAMS).json()
        if body["source"] == source and (block is None or body["config"]["BLOCK_SIZE"] == block):
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def test_a_new_winner_replaces_the_cached_answer(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path}/k.db", lookup_cache_check_seconds=0.1)
    app = create_app(settings)
    with TestClient(app) as client:
        assert wait_for(client, "default")
        cache = app.state.lookup_cache
        hits = cache.hits
        # An answer read while the watcher drops the cache (its first fingerprint, at start)
        # is not kept, so the first repeat may miss; one of a few must be a hit.
        for _ in range(20):
            client.get("/v1/configs/softmax", params=PARAMS)
            if cache.hits > hits:
                break
            time.sleep(0.05)
        assert cache.hits == hits + 1 and len(cache) >= 1
        store(app, 0.05, 256)
        assert wait_for(client, "exact", 256)["time_ms"] == 0.05
        store(app, 0.04, 512)  # a faster one replaces it
        assert wait_for(client, "exact", 512)["time_ms"] == 0.04
        # Errors are not cached.
        bad = {**PARAMS, "gpu": "RTX 9999"}
        assert client.get("/v1/configs/softmax", params=bad).status_code == 422
        assert client.get("/v1/configs/softmax", params=bad).status_code == 422
    app.state.engine.dispose()


def test_cache_off(tmp_path: Path) -> None:
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path}/k.db", lookup_cache_seconds=0))
    with TestClient(app) as client:
        assert client.get("/v1/configs/softmax", params=PARAMS).json()["source"] == "default"
        store(app, 0.05, 256)
        assert client.get("/v1/configs/softmax", params=PARAMS).json()["source"] == "exact"
        assert len(app.state.lookup_cache) == 0
    app.state.engine.dispose()


def test_cache_is_bounded_and_expires() -> None:
    cache = LookupCache(ttl=0.05, max_entries=3)
    for k in range(5):
        cache.put(k, b"x")
    assert len(cache) == 3 and cache.get(0) is None and cache.get(4) == b"x"
    time.sleep(0.06)
    assert cache.get(4) is None
    assert cache.set_version(1) and not cache.set_version(1)


def test_an_answer_read_before_a_drop_is_not_kept() -> None:
    """A lookup that read the database before a new winner was seen must not store its (old)
    answer after the drop: it would be served for the whole ttl."""
    cache = LookupCache(ttl=60)
    generation = cache.generation  # the route reads it before asking the database
    cache.set_version("a new winner")  # the watcher drops every answer meanwhile
    cache.put("key", b"old answer", generation)
    assert cache.get("key") is None
    cache.put("key", b"new answer", cache.generation)
    assert cache.get("key") == b"new answer"
    generation = cache.generation
    cache.clear()
    cache.put("key2", b"old", generation)
    assert cache.get("key2") is None


def test_a_replaced_winner_is_seen_when_another_row_is_dated_later(tmp_path: Path) -> None:
    """The fingerprint must change on a replacement even when the newest ``updated_at`` belongs
    to another row (an imported file's dates, a worker host whose clock runs behind)."""
    settings = Settings(db_url=f"sqlite:///{tmp_path}/k.db", lookup_cache_check_seconds=0.1)
    app = create_app(settings)
    with TestClient(app) as client:
        store(app, 0.05, 256)
        store(app, 0.01, 256, shape=(8192, 1024))
        with app.state.session_factory() as session:
            row = session.scalars(
                select(BestConfig).where(BestConfig.shape_key == "8192x1024")
            ).one()
            row.updated_at = datetime(2100, 1, 1)  # dated after every later write
            session.commit()
        assert wait_for(client, "exact", 256)["time_ms"] == 0.05
        time.sleep(0.5)  # the watcher has seen the row dated 2100 (5 polls)
        hits = app.state.lookup_cache.hits
        assert wait_for(client, "exact", 256) and wait_for(client, "exact", 256)
        assert app.state.lookup_cache.hits > hits  # the old winner is served from memory
        store(app, 0.04, 512)  # a faster one replaces it; the newest updated_at stays 2100
        assert wait_for(client, "exact", 512)["time_ms"] == 0.04
    app.state.engine.dispose()
