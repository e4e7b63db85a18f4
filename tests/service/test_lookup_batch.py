"""``POST /v1/configs/batch`` answers every lookup exactly as ``GET /v1/configs/{operator}``.

The batch selects from each (operator, version, dtype, GPU) group loaded once
(:func:`service.lookup.pick_best_config`); ``GET`` runs :func:`service.lookup.lookup_best_config`
per lookup. The rows stored here are built so that each rule of the selection decides some
answers (the test checks that it does, so it cannot pass vacuously): distance ties broken by
time and by id, rows of one shape differing only in compute capability (the newest
``updated_at`` wins, whatever the id), configs that do not apply to the shape asked for, a
nearest shape exactly at ``KATO_NEAREST_MAX_DISTANCE``, and ``match=exact``. Besides batch ==
GET item by item, every answer is compared with a brute-force reading of the contract
(:func:`expected`), so a change of the shared nearest-shape order is caught too, not only a
divergence of the two paths.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import queries
from kato.db.models import BestConfig
from kato.kernels import OperatorSpec, get_operator
from kato.service import lookup as service_lookup
from kato.service.app import create_app
from kato.service.settings import Settings
from sqlalchemy import select, update
from sqlalchemy.orm import Session

MAX_DISTANCE = 3.0
SOFTMAX = get_operator("softmax")
LAYERNORM = get_operator("layernorm")
RELU = get_operator("relu")

#: softmax configs: valid for every shape; only for cols % 8 == 0 (float16) and cols up to
#: 16384; the same and small cols only (CACHE=1 shared memory); a config of an older space.
ANY = {"BLOCK_SIZE": 256, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 0, "LANES": 32}
VEC8 = {"BLOCK_SIZE": 128, "VEC": 8, "STRATEGY": 1, "CACHE": 2, "MIN_BLOCKS": 4, "LANES": 32}
SHARED = {"BLOCK_SIZE": 1024, "VEC": 8, "STRATEGY": 0, "CACHE": 1, "MIN_BLOCKS": 2, "LANES": 32}
STALE = {"BLOCK_SIZE": 48, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 0, "LANES": 32}
#: float32 softmax configs: any shape; cols % 4 == 0 only.
ANY32 = {"BLOCK_SIZE": 512, "VEC": 1, "STRATEGY": 1, "CACHE": 0, "MIN_BLOCKS": 0, "LANES": 32}
VEC4 = {"BLOCK_SIZE": 256, "VEC": 4, "STRATEGY": 1, "CACHE": 2, "MIN_BLOCKS": 2, "LANES": 32}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    # The lookup cache off: every GET is answered from the database, like every batch.
    settings = Settings(
        db_url=f"sqlite:///{tmp_path / 'kato.db'}",
        lookup_cache_seconds=0,
        nearest_max_distance=MAX_DISTANCE,
    )
    app = create_app(settings)
    yield app
    app.state.engine.dispose()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def store(
    session: Session,
    spec: OperatorSpec,
    shape: list[int],
    dtype: str,
    config: dict[str, Any],
    time_ms: float,
    *,
    gpu_model: str = "H200",
    compute_capability: str = "9.0",
    updated_at: datetime | None = None,
    operator_version: str | None = None,
) -> BestConfig:
    row = queries.upsert_best_config(
        session,
        operator=spec.name,
        operator_version=operator_version or spec.version,
        shape=shape,
        dtype=dtype,
        gpu_model=gpu_model,
        compute_capability=compute_capability,
        cuda_version="13.0",
        config=config,
        time_ms=time_ms,
        job_id=None,
        default_ms=2 * time_ms,  # beat the default there: served for other shapes too
    )
    if updated_at is not None:
        session.execute(
            update(BestConfig).where(BestConfig.id == row.id).values(updated_at=updated_at)
        )
        session.commit()
    return row


def random_valid_config(
    spec: OperatorSpec, shape: list[int], dtype: str, rng: random.Random
) -> dict[str, Any]:
    """A random config of the spec's space that is valid for ``shape``."""
    for _ in range(10_000):
        config = {name: rng.choice(values) for name, values in spec.params.items()}
        if spec.check(config, shape, dtype) is None:
            return config
    raise AssertionError(f"no valid {spec.name} config found for {shape}")


def seed_rows(session: Session) -> None:
    """42 rows in 6 groups; see the module docstring for what they are built to test."""
    rng = random.Random(7)
    grid = [[rows, cols] for rows in (256, 1024, 4096, 16384) for cols in (128, 512, 2048)]
    # Powers of two: log2 distances are whole numbers, so many lookups tie on distance.
    # Three times only: ties on (distance, time) too, decided by the id.
    configs_cycle = [ANY, VEC8, SHARED, VEC8, ANY, SHARED]
    for i, shape in enumerate(grid):
        store(session, SOFTMAX, shape, "float16", configs_cycle[i % 6], (1.0, 1.5, 2.0)[i % 3])
    for shape in ([333, 1000], [20000, 24], [64, 8000], [7, 96]):  # between the grid points
        store(session, SOFTMAX, shape, "float16", rng.choice([ANY, VEC8, SHARED]), 1.25)

    # One shape, two compute capabilities: the newer row has the *lower* id, so ordering by
    # id instead of by update time answers differently.
    now = datetime(2025, 6, 1, tzinfo=UTC)
    store(session, SOFTMAX, [2048, 1024], "float16", VEC8, 3.0, updated_at=now)
    store(session, SOFTMAX, [2048, 1024], "float16", ANY, 0.5, compute_capability="9.0a")
    session.execute(
        update(BestConfig)
        .where(BestConfig.compute_capability == "9.0a")
        .values(updated_at=now - timedelta(days=1))
    )
    session.commit()
    # The newest row's config is of an older space (valid nowhere): the exact lookup falls to
    # the older row of the same shape, not to a nearest shape.
    store(session, SOFTMAX, [8192, 256], "float16", STALE, 0.1, updated_at=now)
    store(
        session,
        SOFTMAX,
        [8192, 256],
        "float16",
        VEC8,
        2.5,
        compute_capability="9.0a",
        updated_at=now - timedelta(hours=1),
    )
    # Same update time: the higher id wins.
    store(session, SOFTMAX, [512, 4096], "float16", VEC8, 1.0, updated_at=now)
    store(session, SOFTMAX, [512, 4096], "float16", ANY, 1.0, compute_capability="9.0a")
    session.execute(
        update(BestConfig).where(BestConfig.shape_key == "512x4096").values(updated_at=now)
    )
    session.commit()
    # Another kernel version: never served.
    store(session, SOFTMAX, [4096, 512], "float16", ANY, 0.01, operator_version="0ld0ld0ld0ld")

    for i, shape in enumerate(([1024, 1024], [4096, 4096], [256, 64], [64, 256], [16384, 8])):
        store(session, SOFTMAX, shape, "float32", (ANY32, VEC4)[i % 2], 1.0 + (i % 2))
    for i, shape in enumerate(([1024, 1024], [4096, 128], [128, 4096], [2048, 2048])):
        store(session, SOFTMAX, shape, "float16", (VEC8, ANY)[i % 2], 1.0, gpu_model="H100 SXM")
    for shape in ([1024, 1024], [4096, 768], [256, 8192], [32768, 64], [100, 100]):
        config = random_valid_config(LAYERNORM, shape, "float16", rng)
        store(session, LAYERNORM, shape, "float16", config, rng.choice([1.0, 2.0]))
    for n in (1024, 65536, 1 << 20, 1 << 24, 3000):
        config = random_valid_config(RELU, [n], "float32", rng)
        store(session, RELU, [n], "float32", config, rng.choice([1.0, 2.0]))


def lookups() -> list[dict[str, Any]]:
    """About 200 lookups: stored shapes, power-of-two grid points between them (ties), odd
    column counts (VEC > 1 configs do not apply), random shapes, ``match=exact``, aliases of GPU
    names, text shapes, repeats, and a few that are errors."""
    rng = random.Random(11)
    items: list[dict[str, Any]] = []

    def add(operator: str, shape: Any, dtype: str, gpu: str = "H200", **extra: Any) -> None:
        items.append({"operator": operator, "shape": shape, "dtype": dtype, "gpu": gpu, **extra})

    for rows in (16, 64, 256, 2048, 8192, 65536):
        for cols in (16, 64, 256, 1024, 4096, 16384):
            add("softmax", [rows, cols], "float16")
    for shape in ([256, 512], [2048, 1024], [8192, 256], [512, 4096], [4096, 512], [7, 96]):
        add("softmax", shape, "float16")
        add("softmax", shape, "float16", match="exact")
        add("softmax", [shape[0], shape[1] + 1], "float16")  # odd cols: VEC8 does not apply
        add("softmax", f"{shape[0]}x{shape[1]}", "float16", "NVIDIA H200")
    for _ in range(90):
        shape = [
            rng.randint(1, 1 << 16),
            rng.choice([rng.randint(1, 1 << 15), 8 << rng.randint(0, 11)]),
        ]
        add("softmax", shape, "float16", match=rng.choice(["nearest", "nearest", "exact"]))
    for shape in ([1024, 1024], [2048, 1024], [64, 64], [16384, 16], [1000, 999], [4096, 8192]):
        add("softmax", shape, "float32")
        add("softmax", shape, "float16", "H100")
        add("layernorm", shape, "float16")
    for n in (1024, 2048, 65535, 1 << 22, 1 << 26, 7, 3000):
        add("relu", [n], "float32")
        add("relu", str(n), "float32", match="exact")
    add("softmax", [32, 128], "float16")  # [256, 128] is exactly MAX_DISTANCE away
    add("softmax", [4096, 4096], "bfloat16")  # a group with no rows
    add("gemm", [64, 64], "float16")  # 404
    add("softmax", [64, 64], "float64")  # 422
    add("softmax", [64, 64], "float16", "Voodoo 3")  # 422
    add("softmax", "64x", "float16")  # 422
    items += [dict(item) for item in rng.sample(items, 20)]  # repeats
    rng.shuffle(items)
    return items


def get_answer(client: TestClient, item: dict[str, Any]) -> tuple[int, Any]:
    """What ``GET`` answers for one batch item: (status, result or detail)."""
    shape = item["shape"]
    params = {
        "shape": shape if isinstance(shape, str) else "x".join(str(s) for s in shape),
        "dtype": item["dtype"],
        "gpu": item["gpu"],
        "match": item.get("match", "nearest"),
    }
    response = client.get(f"/v1/configs/{item['operator']}", params=params)
    body = response.json()
    return response.status_code, body if response.status_code == 200 else body["detail"]


def applies(spec: OperatorSpec, config: dict[str, Any], shape: list[int], dtype: str) -> bool:
    try:
        return spec.check(config, shape, dtype) is None
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return False


@dataclass
class Expected:
    source: str
    row: BestConfig | None
    decided_by: set[str]  # which rules had to be applied to tell this answer from another


def expected(rows: list[BestConfig], answer: dict[str, Any], match: str) -> Expected:
    """The contract, read literally over every stored row (no index, no shared code), and
    which of its rules decided the answer (another reading of that rule would answer
    differently)."""
    spec = get_operator(answer["operator"])
    shape, dtype = answer["shape"], answer["dtype"]
    group = [
        r
        for r in rows
        if (r.operator, r.operator_version, r.dtype, r.gpu_model)
        == (spec.name, spec.version, dtype, answer["gpu"])
    ]
    decided: set[str] = set()
    exact = [r for r in group if r.shape == shape]
    exact.sort(key=lambda r: (r.updated_at, r.id), reverse=True)
    usable = [r for r in exact if applies(spec, r.config, shape, dtype)]
    if usable:
        best, others = usable[0], usable[1:]
        if exact[0] is not best:
            decided.add("exact: newest not applicable")
        if any(r.id > best.id for r in others):  # so best is strictly newer
            decided.add("exact: newest update over higher id")
        if any(r.updated_at == best.updated_at for r in others):
            decided.add("exact: same update time, higher id")
        return Expected("exact", best, decided)
    if match == "exact":
        return Expected("default", None, decided)
    near, beyond = [], []
    for r in group:
        if len(r.shape) == len(shape) and r.shape != shape:
            distance = sum(
                abs(math.log2(a) - math.log2(b)) for a, b in zip(r.shape, shape, strict=True)
            )
            if not applies(spec, r.config, shape, dtype):
                if distance <= MAX_DISTANCE:
                    decided.add("nearest: some not applicable")
                continue
            (near if distance <= MAX_DISTANCE else beyond).append((distance, r.time_ms, r.id, r))
    near.sort(key=lambda t: t[:3])
    if not near:
        if beyond:
            decided.add("nearest: limit excluded the only applicable rows")
        return Expected("default", None, decided)
    best = near[0]
    ties = [t for t in near[1:] if t[0] == best[0]]
    if any(t[1] != best[1] for t in ties):
        decided.add("nearest: tie broken by time")
    if any(t[1] == best[1] for t in ties):
        decided.add("nearest: tie broken by id")
    if best[0] == MAX_DISTANCE:
        decided.add("nearest: at the limit")
    return Expected("nearest", best[3], decided)


def test_batch_answers_every_lookup_as_get_does(app: FastAPI, client: TestClient) -> None:
    with app.state.session_factory() as session:
        seed_rows(session)
        rows = list(session.scalars(select(BestConfig)))
    assert 40 <= len(rows) <= 60
    items = lookups()
    assert len(items) >= 200

    response = client.post("/v1/configs/batch", json={"lookups": items})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == len(items)

    sources: Counter[str] = Counter()
    decided: Counter[str] = Counter()
    for item, result in zip(items, results, strict=True):
        status, body = get_answer(client, item)
        assert result["status"] == status, (item, result, body)
        if status != 200:
            assert result["detail"] == body, item
            sources[str(status)] += 1
            continue
        assert result["result"] == body, item  # value equality on the JSON, field by field

        want = expected(rows, body, item.get("match", "nearest"))
        assert body["source"] == want.source, (item, body)
        if want.row is not None:
            got = (body["tuned_shape"], body["compute_capability"], body["time_ms"])
            assert got == (want.row.shape, want.row.compute_capability, want.row.time_ms), item
            assert body["config"] == want.row.config, item
        sources[want.source] += 1
        decided.update(want.decided_by)

    # The data exercised each rule (else the equalities above would prove little).
    assert sources["exact"] >= 10 and sources["nearest"] >= 40 and sources["default"] >= 20
    assert {"404", "422"} <= set(sources), sources
    for rule in (
        "exact: newest not applicable",
        "exact: newest update over higher id",
        "exact: same update time, higher id",
        "nearest: some not applicable",
        "nearest: tie broken by time",
        "nearest: tie broken by id",
        "nearest: at the limit",
        "nearest: limit excluded the only applicable rows",
    ):
        assert decided[rule] >= 1, (rule, decided)


def test_batch_reads_each_group_once_and_answers_repeats_once(
    app: FastAPI, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group with more than LOAD_AFTER distinct lookups is read once for the whole batch (its
    first LOAD_AFTER answered as GET answers them), a group with fewer is never read whole, and
    a repeated item, or one in error, is not worked out again."""
    with app.state.session_factory() as session:
        seed_rows(session)
    item = {"operator": "softmax", "shape": [3000, 777], "dtype": "float16", "gpu": "H200"}
    items = (
        [item] * 300
        + [{**item, "shape": [rows, 1000]} for rows in range(1, 101)]
        + [{**item, "dtype": "float32"}] * 5
        + [{**item, "operator": "layernorm"}, {**item, "gpu": "H100"}]
        + [{**item, "dtype": "float64"}] * 50
    )
    calls: dict[str, list[Any]] = {"pick": [], "load": [], "lookup": []}

    def counting(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name].append(kwargs.get("dtype") or kwargs.get("shape"))
            return real(*args, **kwargs)

        return wrapper

    for name, attr in [
        ("pick", "pick_best_config"),
        ("load", "load_config_group"),
        ("lookup", "lookup_best_config"),
    ]:
        monkeypatch.setattr(service_lookup, attr, counting(name, getattr(service_lookup, attr)))
    response = client.post("/v1/configs/batch", json={"lookups": items})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["status"] for r in results] == [200] * 407 + [422] * 50
    assert len({str(r["result"]) for r in results[:300]}) == 1
    first = service_lookup.Lookups.LOAD_AFTER
    assert calls["load"] == ["float16"]  # softmax float16 H200: 101 distinct lookups
    # Before it is loaded: its first lookups, and the groups of one lookup each.
    assert len(calls["lookup"]) == first + 3
    assert len(calls["pick"]) == 101 - first
