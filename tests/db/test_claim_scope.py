"""Claiming by scope (SQLite and PostgreSQL): a worker claims, and helps with, only the jobs its
backends can answer; every other job stays queued for a worker that can."""

from __future__ import annotations

from kato.db import fleet, queries
from kato.db.queries import JobScope, Problem

V1, V0 = "a1a1a1a1a1a1", "0ld0ld0ld0ld"


def _job(session, operator="softmax", version=V1, shape=(4096, 4096), dtype="float16",
         gpu="H200") -> str:  # fmt: skip
    return queries.create_job(
        session, operator=operator, operator_version=version, shape=list(shape), dtype=dtype,
        gpu_model=gpu, budget_configs=20,
    ).id  # fmt: skip


def _claim_all(session, scope: JobScope | None, worker="w") -> list[str]:
    claimed = []
    while True:
        job = queries.claim_next_job(
            session, gpu_models=["H200", "A100 80GB"], worker_id=worker, lease_seconds=60,
            scope=scope,
        )  # fmt: skip
        if job is None:
            return claimed
        claimed.append(job.id)


def _jobs(session) -> dict[str, str]:
    return {
        "own": _job(session),
        "other_shape": _job(session, shape=(2048, 2048)),
        "other_dtype": _job(session, dtype="float32"),
        "old_version": _job(session, version=V0),
        "other_operator": _job(session, operator="layernorm"),
        "other_gpu": _job(session, gpu="A100 80GB"),
    }


def _own(version: str | None = V1) -> Problem:
    return Problem("softmax", "4096x4096", "float16", "H200", version)


def _names(jobs: dict[str, str], ids: list[str]) -> list[str]:
    by_id = {v: k for k, v in jobs.items()}
    return [by_id[i] for i in ids]


def test_a_problem_with_a_version_claims_only_its_own_job(session):
    jobs = _jobs(session)
    assert _names(jobs, _claim_all(session, JobScope(problems=frozenset({_own()})))) == ["own"]
    assert len(_claim_all(session, None, worker="any")) == 5  # the rest was left queued


def test_a_problem_without_a_version_claims_its_jobs_of_every_version(session):
    jobs = _jobs(session)
    claimed = _claim_all(session, JobScope(problems=frozenset({_own(None)})))
    assert _names(jobs, claimed) == ["own", "old_version"]


def test_operators_and_an_empty_scope(session):
    jobs = _jobs(session)
    assert _claim_all(session, JobScope(problems=frozenset())) == []
    claimed = _claim_all(session, JobScope(operators=frozenset({"layernorm", "gone"})))
    assert _names(jobs, claimed) == ["other_operator"]


def test_a_scope_of_thousands_of_problems(session):
    """A directory of many recordings: row-value IN lists, within SQLite's expression depth
    limit (1000) that one OR per problem would pass."""
    jobs = _jobs(session)
    many = {Problem("softmax", f"{n}x128", "float16", "H200", V1) for n in range(1, 3000)}
    many |= {Problem("relu", f"{n}", "float32", "H200") for n in range(1, 3000)}
    scope = JobScope(problems=frozenset(many | {_own()}))
    assert _names(jobs, _claim_all(session, scope)) == ["own"]


def test_a_worker_helps_only_with_a_running_job_in_its_scope(session):
    jobs = _jobs(session)
    owner = queries.claim_next_job(
        session, gpu_models=["H200"], worker_id="owner", lease_seconds=600
    )
    assert owner.id == jobs["own"]
    fleet.heartbeat_worker(session, worker_id="owner", hostname="h", pid=1, gpu_models=["H200"],
                           backend="pycuda", status="busy", current_job_id=owner.id)  # fmt: skip
    args = {"gpu_models": ["H200"], "worker_id": "helper", "max_workers_per_job": 2,
            "min_configs_per_worker": 1, "stale_seconds": 60}  # fmt: skip
    other = JobScope(problems=frozenset({Problem("softmax", "2048x2048", "float32", "H200")}))
    assert fleet.join_running_job(session, **args, scope=other) is None
    assert fleet.join_running_job(session, **args, scope=JobScope(frozenset({"softmax"}))) == (
        owner.id
    )
