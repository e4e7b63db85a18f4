"""db.upgrade (what ``kato retune`` queues after an upgrade), on SQLite and PostgreSQL (see
conftest.py): which keys are stale, which are skipped and why, and the jobs queued for them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from kato.db import queries
from kato.db.models import BestConfig, Job
from kato.db.upgrade import (
    DEFAULT_RETUNE_BUDGET,
    SKIP_FAILED,
    SKIP_INVALID,
    SKIP_LIVE_JOB,
    SKIP_UNREGISTERED,
    StaleKey,
    find_stale_keys,
    queue_retune,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session

#: The operators' versions "now"; the rows below carry these or older ones.
CURRENT = {"softmax": "s0ft2", "layernorm": "1n2"}


def best(
    session: Session,
    *,
    operator: str = "softmax",
    version: str,
    shape: tuple[int, ...] = (4096, 4096),
    dtype: str = "float16",
    gpu: str = "H200",
    time_ms: float = 0.05,
    cc: str = "9.0",
    updated: datetime | None = None,
) -> None:
    row = queries.upsert_best_config(
        session,
        operator=operator,
        operator_version=version,
        shape=shape,
        dtype=dtype,
        gpu_model=gpu,
        compute_capability=cc,
        cuda_version="13.0",
        config={"BLOCK_SIZE": 256},
        time_ms=time_ms,
        job_id=None,
    )
    if updated is not None:
        row.updated_at = updated
        session.commit()


def job(session: Session, status: str, **fields: Any) -> str:
    fields = {
        "operator": "softmax",
        "operator_version": CURRENT["softmax"],
        "shape": [4096, 4096],
        "dtype": "float16",
        "gpu_model": "H200",
        "budget_configs": 10,
    } | fields
    created = queries.create_job(session, **fields)
    if status != "queued":
        created.status = status
        session.commit()
    return created.id


def keys_of(stale: list[StaleKey]) -> list[tuple[str, str, str, str, str | None]]:
    return [(k.operator, k.shape_key, k.dtype, k.gpu_model, k.skip) for k in stale]


def test_a_key_tuned_only_at_old_versions_is_stale(session: Session):
    last_year = datetime(2025, 1, 1, tzinfo=UTC)
    best(session, version="old1", time_ms=0.04, updated=last_year)
    best(session, version="old2", time_ms=0.06)  # the newer of the two, listed first
    best(session, version="old2", time_ms=0.03, cc="8.0")  # same key, another CC: its fastest
    best(session, version=CURRENT["softmax"], shape=(2048, 4096))  # up to date: not listed
    best(session, version="old1", shape=(2048, 4096))
    best(session, version="old1", dtype="float32", gpu="A100")

    stale = find_stale_keys(session, CURRENT)
    assert keys_of(stale) == [
        ("softmax", "4096x4096", "float16", "H200", None),
        ("softmax", "4096x4096", "float32", "A100", None),
    ]
    first = stale[0]
    assert first.shape == (4096, 4096) and first.current_version == CURRENT["softmax"]
    assert first.old_versions == ("old2", "old1")
    assert first.old_best_time_ms == pytest.approx(0.03)

    assert find_stale_keys(session, CURRENT, gpu_model="A100")[0].gpu_model == "A100"
    assert find_stale_keys(session, CURRENT, gpu_model="H100 SXM") == []
    assert find_stale_keys(session, CURRENT, operators=["layernorm"]) == []
    assert len(find_stale_keys(session, CURRENT, operators=["softmax", "layernorm"])) == 2


def test_nothing_is_stale_when_every_key_has_a_current_best(session: Session):
    assert find_stale_keys(session, CURRENT) == []
    best(session, version=CURRENT["softmax"])
    best(session, version=CURRENT["layernorm"], operator="layernorm")
    assert find_stale_keys(session, CURRENT) == []


def test_skip_rules(session: Session):
    # Each key below only at an old version; why it is, or is not, queued.
    for shape in [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (64, 64)]:
        best(session, version="old", shape=shape)
    best(session, operator="gone", version="g0ne", shape=(8, 8))
    live = job(session, "queued", shape=[1024, 1024])
    running = job(session, "running", shape=[2048, 2048])
    job(session, "done", shape=[4096, 4096])  # finished without a winner: tune again
    # Queued at the old version: its worker moves it to the current one (nothing measured).
    adopted = job(session, "queued", shape=[8192, 8192], operator_version="old")
    # Running at the old version (a worker of the old code): it stores nothing current.
    job(session, "running", shape=[4096, 4096], operator_version="old")
    # Running at the old version but its worker died, with nothing measured: the next worker
    # resumes it and moves it to the current version.
    abandoned = job(session, "running", shape=[2048, 4096], operator_version="old")
    row = session.get(Job, abandoned)
    row.lease_expires_at = datetime(2026, 1, 1, tzinfo=UTC)
    session.commit()
    best(session, version="old", shape=(2048, 4096))

    def check(operator: str, shape, dtype: str, gpu_model: str) -> str | None:
        return "too small" if list(shape) == [64, 64] else None

    stale = find_stale_keys(session, CURRENT, check=check)
    assert keys_of(stale) == [
        ("gone", "8x8", "float16", "H200", SKIP_UNREGISTERED),
        ("softmax", "64x64", "float16", "H200", f"{SKIP_INVALID}: too small"),
        ("softmax", "1024x1024", "float16", "H200", f"{SKIP_LIVE_JOB}: {live}"),
        ("softmax", "2048x2048", "float16", "H200", f"{SKIP_LIVE_JOB}: {running}"),
        ("softmax", "2048x4096", "float16", "H200", f"{SKIP_LIVE_JOB}: {abandoned}"),
        ("softmax", "4096x4096", "float16", "H200", None),
        ("softmax", "8192x8192", "float16", "H200", f"{SKIP_LIVE_JOB}: {adopted}"),
    ]
    assert stale[0].current_version is None
    # Filtered out, an unregistered operator is not even listed.
    assert [k.operator for k in find_stale_keys(session, CURRENT, operators=["softmax"])] == [
        "softmax"
    ] * 6


def test_a_key_whose_last_current_job_failed_is_skipped_unless_retried(session: Session):
    """Queueing it again would fail it again for the same reason; a later success, or a
    failure at an old version, does not count."""
    for shape in [(1024, 1024), (2048, 2048), (4096, 4096)]:
        best(session, version="old", shape=shape)
    at = {"s": datetime(2026, 1, 1, tzinfo=UTC), "later": datetime(2026, 2, 1, tzinfo=UTC)}

    def ended(status: str, shape: list[int], when: str, **fields: Any) -> str:
        job_id = job(session, status, shape=shape, **fields)
        row = session.get(Job, job_id)
        row.finished_at = at[when]
        session.commit()
        return job_id

    failed = ended("failed", [1024, 1024], "s")
    ended("failed", [2048, 2048], "s")
    ended("done", [2048, 2048], "later")  # the last one succeeded (found no winner): again
    ended("failed", [4096, 4096], "s", operator_version="old")  # the old code's failure
    stale = find_stale_keys(session, CURRENT)
    assert keys_of(stale) == [
        ("softmax", "1024x1024", "float16", "H200", f"{SKIP_FAILED}: {failed}"),
        ("softmax", "2048x2048", "float16", "H200", None),
        ("softmax", "4096x4096", "float16", "H200", None),
    ]
    retried = find_stale_keys(session, CURRENT, retry_failed=True)
    assert [k.skip for k in retried] == [None, None, None]


def test_queue_retune_queues_one_job_per_key_at_the_current_version(session: Session):
    best(session, version="old", shape=(4096, 4096), time_ms=0.02)
    best(session, version="old", shape=(1024, 4096))
    best(session, version="old", operator="layernorm", dtype="float32", gpu="A100")
    best(session, operator="gone", version="g0ne", shape=(8, 8))
    stale = find_stale_keys(session, CURRENT)
    assert queue_retune(session, [k for k in stale if k.skip]) == []
    assert session.scalar(select(func.count()).select_from(Job)) == 0

    ids = queue_retune(session, stale, budget_configs=30)
    assert len(ids) == 3
    jobs = [session.get(Job, i) for i in ids]
    assert [
        (j.operator, j.shape, j.dtype, j.gpu_model, j.operator_version, j.budget_configs, j.status)
        for j in jobs
    ] == [
        ("layernorm", [4096, 4096], "float32", "A100", CURRENT["layernorm"], 30, "queued"),
        ("softmax", [1024, 4096], "float16", "H200", CURRENT["softmax"], 30, "queued"),
        ("softmax", [4096, 4096], "float16", "H200", CURRENT["softmax"], 30, "queued"),
    ]
    assert all(j.token_id is None and j.strategy == "forest" for j in jobs)
    # Claimed in the order listed.
    assert [j.created_at for j in jobs] == sorted(j.created_at for j in jobs)

    # Run again: every key has its job, nothing more is queued.
    again = find_stale_keys(session, CURRENT)
    assert [k.skip for k in again if k.operator != "gone"] == [f"{SKIP_LIVE_JOB}: {i}" for i in ids]
    assert queue_retune(session, again) == []
    assert session.scalar(select(func.count()).select_from(Job)) == 3
    assert DEFAULT_RETUNE_BUDGET == 50
    assert {j.budget_configs for j in session.scalars(select(Job))} == {30}
    assert session.scalar(select(func.count()).select_from(BestConfig)) == 4  # untouched


def test_queue_retune_refuses_a_key_without_a_current_version(session: Session):
    key = StaleKey("gone", (8, 8), "float16", "H200", ("g0ne",), 0.1, current_version=None)
    with pytest.raises(ValueError, match="unregistered"):
        queue_retune(session, [key])
    assert session.scalar(select(func.count()).select_from(Job)) == 0
