"""db.queries against a migrated database (SQLite file and PostgreSQL, see conftest.py)."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from kato.db import queries
from kato.db.models import RESERVED, BestConfig, Job, Trial
from kato.service import lookup as service_lookup
from kato.tuner.backends.base import TrialResult, TrialStatus
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker


def make_job(session: Session, gpu_model: str = "H200", **overrides: Any) -> Job:
    fields: dict[str, Any] = {
        "operator": "softmax",
        "operator_version": "abc123",
        "shape": [4096, 4096],
        "dtype": "float16",
        "gpu_model": gpu_model,
        "budget_configs": 50,
    }
    fields.update(overrides)
    return queries.create_job(session, **fields)


def ok_result(*times: float) -> dict[str, Any]:
    return TrialResult(config={}, status=TrialStatus.OK, times_ms=list(times)).to_dict()


def expire_lease(session: Session, job_id: str) -> None:
    job = session.get(Job, job_id)
    assert job is not None
    job.lease_expires_at = datetime.now(UTC) - timedelta(seconds=5)
    session.commit()


# --- jobs ------------------------------------------------------------------------------------


def test_shape_key() -> None:
    assert queries.shape_key([4096, 4096]) == "4096x4096"
    assert queries.shape_key((7,)) == "7"


def test_create_and_get_job(session: Session) -> None:
    job = make_job(session, budget_seconds=60.0, strategy="random", seed=7)
    assert len(job.id) == 32
    session.expunge_all()

    loaded = queries.get_job(session, job.id)
    assert loaded is not None
    assert loaded.status == "queued"
    assert loaded.shape == [4096, 4096]
    assert loaded.shape_key == "4096x4096"
    assert (loaded.budget_configs, loaded.budget_seconds) == (50, 60.0)
    assert (loaded.strategy, loaded.seed) == ("random", 7)
    assert loaded.trials_done == 0 and loaded.best_time_ms is None and loaded.best_config is None
    assert loaded.cancel_requested is False
    assert loaded.created_at.utcoffset() == timedelta(0)  # timezone-aware UTC
    assert abs(loaded.created_at - datetime.now(UTC)) < timedelta(minutes=1)
    assert loaded.started_at is None and loaded.finished_at is None
    assert queries.get_job(session, "nope") is None


def test_create_jobs_in_one_transaction_keeps_their_order(session: Session) -> None:
    fields = {
        "operator": "softmax",
        "operator_version": "abc123",
        "dtype": "float16",
        "gpu_model": "H200",
        "budget_configs": 10,
    }
    jobs = queries.create_jobs(session, [{**fields, "shape": [n, n]} for n in (1, 2, 3)])
    assert [j.shape_key for j in jobs] == ["1x1", "2x2", "3x3"]
    claimed = [
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
        for _ in jobs
    ]
    assert [j.id for j in claimed if j is not None] == [j.id for j in jobs]

    with pytest.raises(TypeError):  # a bad item: nothing of the batch is written
        queries.create_jobs(session, [{**fields, "shape": [4, 4]}, {**fields, "bogus": 1}])
    assert len(queries.list_jobs(session)) == 3


def test_list_jobs_newest_first_and_by_status(session: Session) -> None:
    a, b, c = (make_job(session) for _ in range(3))
    queries.finish_job(session, b.id, status="done")
    assert [j.id for j in queries.list_jobs(session)] == [c.id, b.id, a.id]
    assert [j.id for j in queries.list_jobs(session, status="queued")] == [c.id, a.id]
    assert [j.id for j in queries.list_jobs(session, status="done")] == [b.id]
    assert len(queries.list_jobs(session, limit=2)) == 2


def test_claim_takes_oldest_job_of_a_matching_gpu(session: Session) -> None:
    h100 = make_job(session, gpu_model="H100")
    first = make_job(session)
    second = make_job(session)
    claim = {"worker_id": "w1", "lease_seconds": 60.0}

    job = queries.claim_next_job(session, gpu_models=["H200"], **claim)
    assert job is not None and job.id == first.id
    assert job.status == "running" and job.worker_id == "w1"
    assert job.started_at is not None
    assert job.lease_expires_at is not None
    assert timedelta(seconds=50) < job.lease_expires_at - datetime.now(UTC) < timedelta(seconds=61)

    job = queries.claim_next_job(session, gpu_models=["H200"], **claim)
    assert job is not None and job.id == second.id
    assert queries.claim_next_job(session, gpu_models=["H200"], **claim) is None
    assert queries.claim_next_job(session, gpu_models=[], **claim) is None

    job = queries.claim_next_job(session, gpu_models=["A100", "H100"], **claim)
    assert job is not None and job.id == h100.id


def test_a_claim_scoped_to_job_ids_takes_only_those_jobs(session: Session) -> None:
    """What ``kato tune`` claims: the job it just created, not an older queued one (which
    would be left running under its lease while the command fails)."""
    older = make_job(session)
    mine = make_job(session)
    claim = {"worker_id": "w1", "lease_seconds": 60.0}
    only_mine = queries.JobScope(job_ids=frozenset({mine.id}))
    job = queries.claim_next_job(session, gpu_models=["H200"], scope=only_mine, **claim)
    assert job is not None and job.id == mine.id
    assert queries.get_job(session, older.id).status == "queued"
    assert queries.claim_next_job(session, gpu_models=["H200"], scope=only_mine, **claim) is None
    nothing = queries.JobScope(job_ids=frozenset())
    assert queries.claim_next_job(session, gpu_models=["H200"], scope=nothing, **claim) is None
    assert queries.claim_next_job(session, gpu_models=["H200"], **claim).id == older.id


def test_claim_takes_over_an_expired_lease(session: Session) -> None:
    job = make_job(session)
    claimed = queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1", lease_seconds=60)
    assert claimed is not None
    started_at = claimed.started_at

    # A live lease is respected.
    assert (
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w2", lease_seconds=60)
        is None
    )

    expire_lease(session, job.id)
    retaken = queries.claim_next_job(session, gpu_models=["H200"], worker_id="w2", lease_seconds=60)
    assert retaken is not None and retaken.id == job.id
    assert retaken.worker_id == "w2" and retaken.status == "running"
    assert retaken.started_at == started_at  # the first start is kept
    # The crashed worker, should it come back, learns that the job is no longer its own.
    assert queries.renew_lease(session, job.id, "w1", 60) is False
    assert queries.renew_lease(session, job.id, "w2", 60) is True


def test_expired_job_with_cancel_request_is_cancelled_not_reclaimed(session: Session) -> None:
    """Its worker died (or renews too late) after the cancel: the job ends cancelled, its
    measured trial kept, the reservation its worker held deleted with its unit of budget."""
    job = make_job(session)
    queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1", lease_seconds=60)
    now = datetime.now(UTC)
    session.add_all([
        Trial(job_id=job.id, number=0, config={"B": 1}, config_key="1", status="ok",
              time_ms=1.0, times_ms=[1.0]),
        Trial(job_id=job.id, number=1, config={"B": 2}, config_key="2", status=RESERVED,
              reserved_by="w1", reserved_at=now),
    ])  # fmt: skip
    session.get(Job, job.id).trials_done = 2
    session.commit()
    queries.request_cancel(session, job.id)
    expire_lease(session, job.id)

    assert (
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w2", lease_seconds=60)
        is None
    )
    reloaded = queries.get_job(session, job.id)
    assert reloaded is not None
    assert reloaded.status == "cancelled" and reloaded.finished_at is not None
    assert [(t.config_key, t.status) for t in queries.job_trials(session, job.id)] == [("1", "ok")]
    assert reloaded.trials_done == 1


def test_concurrent_claims_take_each_job_once(factory: sessionmaker[Session]) -> None:
    n_jobs, n_workers = 24, 6
    with factory() as session:
        ids = {make_job(session).id for _ in range(n_jobs)}
    claimed: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(n_workers)

    def worker(name: str) -> None:
        try:
            with factory() as session:
                start.wait()
                while True:
                    job = queries.claim_next_job(
                        session, gpu_models=["H200"], worker_id=name, lease_seconds=60
                    )
                    if job is None:
                        return
                    with lock:
                        claimed.append(job.id)
        except BaseException as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(n_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(claimed) == sorted(ids)  # every job claimed, none twice
    with factory() as session:
        jobs = session.scalars(select(Job)).all()
        assert {j.status for j in jobs} == {"running"}


def test_renew_lease(session: Session) -> None:
    job = make_job(session)
    assert queries.renew_lease(session, job.id, "w1", 60) is False  # queued: nobody's
    queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1", lease_seconds=1)

    assert queries.renew_lease(session, job.id, "w1", 600) is True
    reloaded = queries.get_job(session, job.id)
    assert reloaded is not None and reloaded.lease_expires_at is not None
    assert reloaded.lease_expires_at - datetime.now(UTC) > timedelta(seconds=500)
    assert queries.renew_lease(session, job.id, "other", 60) is False
    assert queries.renew_lease(session, "missing", "w1", 60) is False

    queries.request_cancel(session, job.id)
    assert queries.renew_lease(session, job.id, "w1", 60) is False  # the worker must stop


def test_finish_job(session: Session) -> None:
    job = make_job(session)
    queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1", lease_seconds=60)
    finished = queries.finish_job(session, job.id, status="failed", error="nvcc not found")
    assert finished is not None
    assert finished.status == "failed" and finished.error == "nvcc not found"
    assert finished.finished_at is not None and finished.lease_expires_at is None
    assert queries.renew_lease(session, job.id, "w1", 60) is False
    assert queries.finish_job(session, "missing", status="done") is None
    with pytest.raises(ValueError, match="finish_job needs one of"):
        queries.finish_job(session, job.id, status="running")


def test_cancel_semantics(session: Session) -> None:
    queued = make_job(session)
    running = make_job(session)
    done = make_job(session)
    # Claim order is creation order: take `queued` out of the way first, then put it back.
    queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
    queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
    queries.finish_job(session, done.id, status="done")
    first = session.get(Job, queued.id)
    assert first is not None
    first.status, first.worker_id, first.lease_expires_at = "queued", None, None
    session.commit()

    cancelled = queries.request_cancel(session, queued.id)
    assert cancelled is not None
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None

    flagged = queries.request_cancel(session, running.id)
    assert flagged is not None
    assert flagged.status == "running" and flagged.cancel_requested is True

    unchanged = queries.request_cancel(session, done.id)
    assert unchanged is not None
    assert unchanged.status == "done" and unchanged.cancel_requested is False

    assert queries.request_cancel(session, "missing") is None
    assert (
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="x", lease_seconds=60)
        is None
    )


def test_deleting_a_job_deletes_its_trials(session: Session) -> None:
    job = make_job(session)
    queries.record_trial(
        session, job.id, number=0, config={"B": 1}, config_key="1", result=ok_result(1.0)
    )
    session.delete(job)
    session.commit()
    assert session.scalars(select(Trial)).all() == []


# --- trials ----------------------------------------------------------------------------------


def test_record_trial_counts_and_keeps_the_best(session: Session) -> None:
    job = make_job(session)

    def record(number: int, block: int, result: dict[str, Any]) -> Trial:
        return queries.record_trial(
            session,
            job.id,
            number=number,
            config={"BLOCK": block},
            config_key=str(block),
            result=result,
        )

    record(0, 128, ok_result(2.0, 3.0, 2.5))
    record(1, 256, ok_result(1.0, 1.2, 1.1))
    record(2, 512, ok_result(4.0))  # slower: best unchanged
    failed = TrialResult(config={}, status=TrialStatus.COMPILE_ERROR, error="ptxas: too many")
    record(3, 1024, failed.to_dict())
    record(4, 2048, TrialResult(config={}, status=TrialStatus.INVALID).to_dict())

    reloaded = queries.get_job(session, job.id)
    assert reloaded is not None
    assert reloaded.trials_done == 4  # the invalid config is not counted
    assert reloaded.best_time_ms == pytest.approx(1.1)
    assert reloaded.best_config == {"BLOCK": 256}

    trials = queries.job_trials(session, job.id)
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert trials[0].time_ms == pytest.approx(2.5)
    assert trials[0].times_ms == [2.0, 3.0, 2.5]
    assert trials[3].status == "compile_error" and trials[3].error == "ptxas: too many"
    assert trials[3].time_ms is None


def test_record_trial_is_idempotent(session: Session) -> None:
    job = make_job(session)
    result = TrialResult(
        config={"BLOCK": 256},
        status=TrialStatus.OK,
        times_ms=[1.0, 1.5, 2.0],
        compile_time_s=0.8,
        registers=32,
        shared_static_bytes=1024,
        shared_dynamic_bytes=2048,
        local_bytes=0,
        blocks_per_sm=8,
        occupancy=1.0,
    ).to_dict()
    first = queries.record_trial(
        session, job.id, number=0, config={"BLOCK": 256}, config_key="256", result=result
    )
    again = queries.record_trial(
        session, job.id, number=7, config={"BLOCK": 256}, config_key="256", result=ok_result(0.1)
    )
    assert again.id == first.id and again.number == 0 and again.time_ms == pytest.approx(1.5)
    session.expunge_all()

    (stored,) = queries.job_trials(session, job.id)
    assert (stored.compile_time_s, stored.registers, stored.occupancy) == (0.8, 32, 1.0)
    assert (stored.shared_static_bytes, stored.shared_dynamic_bytes) == (1024, 2048)
    assert (stored.local_bytes, stored.blocks_per_sm, stored.status) == (0, 8, "ok")
    reloaded = queries.get_job(session, job.id)
    assert reloaded is not None
    assert reloaded.trials_done == 1 and reloaded.best_time_ms == pytest.approx(1.5)


def test_record_trial_refreshes_a_loaded_job(session: Session) -> None:
    job = make_job(session)
    queries.record_trial(
        session, job.id, number=0, config={"B": 1}, config_key="1", result=ok_result(1.0)
    )
    assert job.trials_done == 1 and job.best_time_ms == 1.0


# --- best configs ----------------------------------------------------------------------------

KEY = {
    "operator": "softmax",
    "operator_version": "abc123",
    "dtype": "float16",
    "gpu_model": "H200",
}


def upsert(session: Session, shape: list[int], time_ms: float, **overrides: Any) -> BestConfig:
    fields: dict[str, Any] = {
        **KEY,
        "shape": shape,
        "compute_capability": "9.0",
        "cuda_version": "13.0",
        "config": {"BLOCK": int(time_ms * 100)},
        "time_ms": time_ms,
        "job_id": None,
        # A winner twice as fast as the default config on its shape: served for other shapes.
        "default_ms": 2 * time_ms,
    }
    fields.update(overrides)
    return queries.upsert_best_config(session, **fields)


def lookup(session: Session, shape: list[int], **overrides: Any) -> tuple[BestConfig | None, str]:
    return service_lookup.lookup_best_config(session, **{**KEY, **overrides}, shape=shape)


def test_upsert_best_config_keeps_the_faster(session: Session) -> None:
    job = make_job(session)
    row = upsert(session, [1024, 1024], 2.0, job_id=job.id)
    assert row.time_ms == 2.0 and row.job_id == job.id and row.shape_key == "1024x1024"

    kept = upsert(session, [1024, 1024], 3.0)
    assert kept.id == row.id and kept.time_ms == 2.0 and kept.job_id == job.id

    replaced = upsert(session, [1024, 1024], 1.0, config={"BLOCK": 64})
    assert replaced.id == row.id and replaced.time_ms == 1.0 and replaced.config == {"BLOCK": 64}
    assert replaced.job_id is None

    other_cuda = upsert(session, [1024, 1024], 5.0, cuda_version="12.8")
    assert other_cuda.id != row.id
    assert len(session.scalars(select(BestConfig)).all()) == 2


def test_lookup_default_when_nothing_is_stored(session: Session) -> None:
    assert lookup(session, [4096, 4096]) == (None, "default")


def test_lookup_exact_prefers_the_most_recent_toolchain(session: Session) -> None:
    upsert(session, [4096, 4096], 1.0, cuda_version="12.8")
    newer = upsert(session, [4096, 4096], 2.0, cuda_version="13.0")
    upsert(session, [4096, 2048], 0.5)  # a near shape never beats an exact one
    row, source = lookup(session, [4096, 4096])
    assert source == "exact" and row is not None and row.id == newer.id


def test_lookup_nearest_by_log2_distance(session: Session) -> None:
    upsert(session, [1024, 1024], 1.0)  # distance to 4096x2048: 2 + 1 = 3
    near = upsert(session, [4096, 1024], 2.0)  # distance 0 + 1 = 1
    upsert(session, [8192, 8192], 0.5)  # distance 1 + 2 = 3
    upsert(session, [4096], 0.1)  # another rank: never used
    upsert(session, [4096, 2048], 0.1, operator_version="old")  # another kernel version
    upsert(session, [4096, 2048], 0.1, dtype="float32")
    upsert(session, [4096, 2048], 0.1, gpu_model="H100")

    row, source = lookup(session, [4096, 2048])
    assert source == "nearest" and row is not None and row.id == near.id
    assert row.shape == [4096, 1024]


def test_lookup_nearest_ties_go_to_the_fastest(session: Session) -> None:
    upsert(session, [2048, 2048], 3.0)
    fast = upsert(session, [8192, 8192], 1.0)
    row, source = lookup(session, [4096, 4096])
    assert source == "nearest" and row is not None and row.id == fast.id


def test_lookup_skips_configs_rejected_by_accept(session: Session) -> None:
    upsert(session, [4096, 4096], 1.0, config={"VEC": 8})
    usable = upsert(session, [1024, 1024], 2.0, config={"VEC": 1})
    row, source = service_lookup.lookup_best_config(
        session, **KEY, shape=[4096, 4096], accept=lambda c: c["VEC"] == 1
    )
    assert source == "nearest" and row is not None and row.id == usable.id
    assert service_lookup.lookup_best_config(
        session, **KEY, shape=[4096, 4096], accept=lambda c: False
    ) == (None, "default")


def test_an_accept_that_changes_its_config_changes_no_row(session: Session) -> None:
    """``accept`` gets a copy of each candidate's config, as :func:`pick_best_config` gives:
    a check that fills in defaults (say) changes neither the answer nor the stored row."""
    upsert(session, [4096, 4096], 1.0, config={"VEC": 8})
    upsert(session, [1024, 1024], 2.0, config={"VEC": 1})

    def accept(config: dict[str, Any]) -> bool:
        config["VEC"] = 0
        return True

    for shape, source in (([4096, 4096], "exact"), ([2048, 2048], "nearest")):
        row, found = service_lookup.lookup_best_config(session, **KEY, shape=shape, accept=accept)
        assert found == source and row is not None and row.config["VEC"] in (8, 1)
    session.commit()
    session.expire_all()
    assert sorted(r.config["VEC"] for r in session.query(BestConfig)) == [1, 8]


def test_lookup_nearest_within_max_distance_only(session: Session) -> None:
    upsert(session, [1024, 1024], 1.0)  # distance to 4096x2048: 2 + 1 = 3
    far = upsert(session, [65536, 128], 0.5)  # distance 4 + 4 = 8
    assert lookup(session, [4096, 2048], max_distance=3.0)[1] == "nearest"
    assert lookup(session, [4096, 2048], max_distance=2.5) == (None, "default")
    assert lookup(session, [4096, 2048], max_distance=0) == (None, "default")
    row, source = lookup(session, [65536, 256], max_distance=1.0)  # distance 0 + 1
    assert source == "nearest" and row is not None and row.id == far.id
    exact, source = lookup(session, [1024, 1024], max_distance=0)
    assert source == "exact" and exact is not None and exact.time_ms == 1.0


def test_lookup_checks_configs_nearest_first_and_stops_at_the_first_accepted(
    session: Session,
) -> None:
    """``accept`` (a spec check, the costly part of a lookup) runs on candidates in order of
    distance until one passes, not on every stored shape of the operator."""
    for rows in range(1, 41):
        upsert(session, [rows * 1000, 1024], 1.0, config={"rows": rows * 1000})
    checked: list[int] = []

    def accept(config: dict[str, Any]) -> bool:
        checked.append(config["rows"])
        return config["rows"] != 4000  # the nearest is rejected: the next nearest serves

    row, source = service_lookup.lookup_best_config(
        session, **KEY, shape=[4000, 1024], accept=accept, max_distance=4
    )
    assert source == "nearest" and row is not None and row.shape == [5000, 1024]
    assert checked == [4000, 5000]


def group_of(session: Session, **overrides: Any) -> service_lookup.ConfigGroup:
    return service_lookup.load_config_group(session, **{**KEY, **overrides})


def test_pick_best_config_selects_as_lookup_best_config(session: Session) -> None:
    """The batch's selection over a loaded group agrees with the per-lookup query, row for row:
    exact rows by newest update then highest id (here Python's order against the database's
    ORDER BY), nearest by distance, time, id (power-of-two shapes: many exact ties), ``accept``
    and ``max_distance`` honoured, other groups and ranks left out."""
    rng = random.Random(3)
    start = datetime(2025, 1, 1, tzinfo=UTC)
    for rows in (64, 256, 1024, 4096):
        for cols in (32, 128, 512):
            for cc in ("9.0", "9.0a", "10.0")[: rng.randint(1, 3)]:
                row = upsert(
                    session,
                    [rows, cols],
                    rng.choice([1.0, 2.0]),
                    compute_capability=cc,
                    config={"VEC": rng.choice([1, 2, 4, 8, 16]), "cc": cc},
                )
                # Few distinct times, not in id order: ties, and newest != highest id.
                row.updated_at = start + timedelta(hours=rng.randint(0, 3))
                session.commit()
    upsert(session, [4096], 0.1)  # another rank
    upsert(session, [512, 64], 0.1, dtype="float32")  # another group
    upsert(session, [512, 64], 0.1, operator_version="old")

    group = group_of(session)
    assert len(group.rows) == len(session.scalars(select(BestConfig)).all()) - 2
    for _ in range(150):
        shape = [
            2 ** rng.randint(4, 14),
            rng.choice([2 ** rng.randint(3, 11), rng.randint(1, 999)]),
        ]
        cols = shape[1]
        accept = rng.choice([None, lambda c, cols=cols: cols % c["VEC"] == 0])
        max_distance = rng.choice([None, 0.0, 1.0, 2.5, 4.0])
        want, want_source = service_lookup.lookup_best_config(
            session, **KEY, shape=shape, accept=accept, max_distance=max_distance
        )
        got, got_source = service_lookup.pick_best_config(
            group, shape, accept=accept, max_distance=max_distance
        )
        assert got_source == want_source, (shape, max_distance)
        assert (got and got.id) == (want and want.id), (shape, max_distance)


def test_pick_best_config_checks_each_distinct_config_once_in_order(session: Session) -> None:
    """``accept`` runs on candidates nearest first and stops at the first that passes; a config
    already rejected for this lookup (another shape's row with an equal config) is not checked
    again."""
    for rows in range(1, 41):
        upsert(session, [rows * 1000, 1024], 1.0, config={"VEC": 8 if rows % 2 else rows})
    group = group_of(session)
    checked: list[dict[str, Any]] = []

    def accept(config: dict[str, Any]) -> bool:
        checked.append(dict(config))
        return config["VEC"] == 10

    row, source = service_lookup.pick_best_config(
        group, [4000, 1024], accept=accept, max_distance=4
    )
    # Nearest first: 4000 (VEC 4), 3000 and 5000 (VEC 8: checked once), 6000, 2000, 7000, ...
    assert source == "nearest" and row is not None and row.shape == (10000, 1024)
    assert checked == [{"VEC": v} for v in (4, 8, 6, 2, 10)]


def test_pick_best_config_exact_only(session: Session) -> None:
    """``nearest=False`` (``match=exact``): an exact row or nothing, never the nearest."""
    upsert(session, [1024, 1024], 1.0)
    group = group_of(session)
    assert service_lookup.pick_best_config(group, [1024, 2048], nearest=False) == (None, "default")
    assert service_lookup.pick_best_config(group, [1024, 2048])[1] == "nearest"
    row, source = service_lookup.pick_best_config(group, [1024, 1024], nearest=False)
    assert source == "exact" and row is not None and row.shape == (1024, 1024)


def test_load_config_group_gives_read_only_values(session: Session) -> None:
    """Rows are plain values, valid after the session is gone; the config a caller sees (and
    the copy ``accept`` gets) cannot change what the next lookup of the group sees."""
    job = make_job(session)
    stored = upsert(session, [1024, 1024], 1.0, config={"VEC": 4}, job_id=job.id)
    group = group_of(session)
    session.close()
    (row,) = group.rows
    assert (row.id, row.shape, row.shape_key, row.time_ms) == (
        stored.id,
        (1024, 1024),
        "1024x1024",
        1.0,
    )
    assert (row.compute_capability, row.cuda_version, row.job_id) == ("9.0", "13.0", job.id)
    assert row.updated_at == stored.updated_at and row.updated_at.tzinfo is not None
    with pytest.raises(TypeError):
        row.config["VEC"] = 8  # type: ignore[index]

    def meddling(config: dict[str, Any]) -> bool:
        config["VEC"] = 8
        return True

    assert service_lookup.pick_best_config(group, [1024, 1024], accept=meddling)[0] is row
    assert row.config == {"VEC": 4}


def both_lookups(session: Session, shape: list[int], **kwargs: Any) -> tuple[Any, ...]:
    """(id, source) from lookup_best_config and from pick_best_config on the loaded group,
    which must agree."""
    row, source = lookup(session, shape, **kwargs)
    picked, picked_source = service_lookup.pick_best_config(group_of(session), shape, **kwargs)
    assert (picked and picked.id, picked_source) == (row and row.id, source)
    return (row and row.id, source)


@pytest.mark.parametrize(
    ("default_ms", "source"),
    [(None, "default"), (1.0, "default"), (1.05, "default"), (1.0501, "nearest"), (3.0, "nearest")],
)  # fmt: skip
def test_a_neighbour_is_served_only_where_it_beat_the_default_by_more_than_5_percent(
    session: Session, default_ms: float | None, source: str
) -> None:
    near = upsert(session, [4096, 1024], 1.0, default_ms=default_ms)
    expected = near.id if source == "nearest" else None
    assert both_lookups(session, [4096, 2048]) == (expected, source)
    assert both_lookups(session, [4096, 2048], min_gain=None) == (near.id, "nearest")
    assert both_lookups(session, [4096, 1024]) == (near.id, "exact")  # never guarded


def test_the_nearest_valid_neighbour_decides(session: Session) -> None:
    """A neighbour that did not beat its default leaves the default: a farther one that did is
    not served instead (where the default was as good as tuned next door, it is here too)."""
    upsert(session, [4096, 1024], 1.0, default_ms=1.01, config={"BLOCK": 1})  # distance 1
    far = upsert(session, [1024, 1024], 1.0, default_ms=3.0, config={"BLOCK": 2})  # distance 3
    assert both_lookups(session, [4096, 2048]) == (None, "default")
    # Where the nearest is not valid for the shape asked, the next valid one decides.
    accept = lambda config: config["BLOCK"] != 1  # noqa: E731 - rejects the nearest
    assert both_lookups(session, [4096, 2048], accept=accept) == (far.id, "nearest")
    assert service_lookup.beats_default(SimpleNamespace(default_ms=None, time_ms=1.0), None)


def test_upsert_keeps_the_keys_figures_up_to_date(session: Session) -> None:
    first = upsert(session, [1024, 1024], 2.0, default_ms=3.0, framework_ms=2.5,
                   framework="torch 2.12.0")  # fmt: skip
    first_update = first.updated_at
    # A slower winner: the row keeps its config, the figures move to the newer measurement.
    kept = upsert(session, [1024, 1024], 2.2, default_ms=3.1, framework_ms=2.4,
                  framework="torch 2.13.0")  # fmt: skip
    assert kept.id == first.id and kept.time_ms == 2.0
    assert (kept.default_ms, kept.framework_ms, kept.framework) == (3.1, 2.4, "torch 2.13.0")
    assert kept.updated_at > first_update
    # A faster one without a framework time: the stored framework figures stay.
    faster = upsert(session, [1024, 1024], 1.0, default_ms=None, config={"BLOCK": 7})
    assert faster.time_ms == 1.0 and faster.config == {"BLOCK": 7}
    assert (faster.default_ms, faster.framework_ms, faster.framework) == (3.1, 2.4, "torch 2.13.0")
    assert (faster.compiled_ms, faster.compiled) == (None, None)
    # The compiled baseline is the key's too: stored whichever config stays, kept when absent.
    compiled = upsert(session, [1024, 1024], 1.5, compiled_ms=1.8, compiled="torch.compile x")
    assert compiled.config == {"BLOCK": 7} and compiled.framework_ms == 2.4
    assert (compiled.compiled_ms, compiled.compiled) == (1.8, "torch.compile x")
    kept = upsert(session, [1024, 1024], 1.7, default_ms=3.2)
    assert (kept.compiled_ms, kept.compiled) == (1.8, "torch.compile x")
    # A new eager baseline without a compiled one (another torch, the compile failed): the
    # old compiled figure is not left beside it.
    later = upsert(session, [1024, 1024], 1.6, framework_ms=2.3, framework="torch 2.14.0")
    assert (later.framework_ms, later.compiled_ms, later.compiled) == (2.3, None, None)
    both = upsert(session, [1024, 1024], 1.6, framework_ms=2.2, framework="torch 2.14.0",
                  compiled_ms=1.9, compiled="torch.compile 2.14.0 inductor")  # fmt: skip
    assert (both.framework_ms, both.compiled_ms) == (2.2, 1.9)


def test_trial_time_is_a_jobs_successful_measurement_of_one_config(session: Session) -> None:
    job = make_job(session)
    for number, (key, status, time_ms) in enumerate(
        [("a", "ok", 0.5), ("b", "verify_error", None)]
    ):
        queries.record_trial(session, job.id, number=number, config={"k": key}, config_key=key,
                             result={"status": status, "time_ms": time_ms})  # fmt: skip
    assert queries.trial_time(session, job.id, "a") == 0.5
    assert queries.trial_time(session, job.id, "b") is None
    assert queries.trial_time(session, job.id, "c") is None
