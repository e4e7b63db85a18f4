"""A batch of tuning jobs on the replay backend: the scheduling, not the speed (issue 35).

Every recorded space at its operator's current version (the H200 spaces of ``data/spaces`` and
``tests/data/recorded``: 30 or more keys over several operators, two dtypes) is submitted as one
batch (``POST /v1/jobs/batch``) and tuned by two replay workers sharing a SQLite file, each
free to help with the other's running job. Then: every key tuned once (one job, done, one
winner stored), every budget exact (that many distinct configs measured, no reservation
left), and each winner the best of its job's trials.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kato.db import queries, tokens
from kato.db.models import RESERVED, BestConfig
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.settings import Settings
from kato.tuner.factories import Recording, ReplayBackends, find_recordings
from kato.tuner.worker import Worker
from paths import RECORDED, SPACES


def current_recordings() -> list[Recording]:
    """The H200 recordings whose operator version is the registered one (a recording of an
    older version answers only jobs of that version; a batch submits the current one), one per
    problem (``data/spaces`` first)."""
    kept: dict[tuple[object, ...], Recording] = {}
    for r in find_recordings(SPACES) + find_recordings(RECORDED):
        current = r.problem.operator_version == get_operator(r.problem.operator).version
        if r.problem.gpu_model == "H200" and current:
            kept.setdefault(r.key, r)
    return list(kept.values())


def submit_batch(db_url: str, recordings: list[Recording], budget: int) -> list[str]:
    app = create_app(Settings(db_url=db_url))
    try:
        with app.state.session_factory() as session:
            secret = tokens.create_token(session, "batch", max_queued_jobs=1000)[1]
        jobs = [
            {
                "operator": r.problem.operator,
                "shape": list(r.problem.shape),
                "dtype": r.problem.dtype,
                "gpu": "H200",
                "budget": budget,
                "seed": i,
            }
            for i, r in enumerate(recordings)
        ]
        with TestClient(app, headers={"Authorization": f"Bearer {secret}"}) as client:
            response = client.post("/v1/jobs/batch", json={"jobs": jobs})
        assert response.status_code == 202, response.text
        return [job["id"] for job in response.json()]
    finally:
        app.state.engine.dispose()


def run_workers(db_url: str, recordings: list[Recording], n_jobs: int, workers: int = 2) -> None:
    """``workers`` replay workers (threads, an engine each) until every job has ended."""
    pool = [
        Worker(
            session_factory(init_db(db_url)),
            db_url,
            ["H200"],
            ReplayBackends(recordings),
            worker_id=f"batch-{i}",
            poll_seconds=0.02,
            max_workers_per_job=workers,
            min_configs_per_worker=2,
            lease_seconds=30,
        )
        for i in range(workers)
    ]
    errors: list[BaseException] = []

    def work(worker: Worker) -> None:
        try:
            worker.run_forever()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in pool]
    for t in threads:
        t.start()
    sessions = session_factory(init_db(db_url))
    try:
        stop = threading.Event()
        while not stop.wait(0.1):
            with sessions() as s:
                jobs = queries.list_jobs(s, limit=n_jobs + 10)
            if all(j.status not in ("queued", "running") for j in jobs) or errors:
                break
            if not any(t.is_alive() for t in threads):
                break
    finally:
        for w in pool:
            w.stop()
        for t in threads:
            t.join(30)
    assert not errors, errors


def check_batch(db_url: str, job_ids: list[str], recordings: list[Recording], budget: int) -> None:
    sessions = session_factory(init_db(db_url))
    with sessions() as s:
        jobs = [queries.get_job(s, job_id) for job_id in job_ids]
        keys = Counter((j.operator, j.shape_key, j.dtype, j.gpu_model) for j in jobs)
        assert len(keys) == len(recordings) and set(keys.values()) == {1}  # each key once
        for job in jobs:
            trials = queries.job_trials(s, job.id)
            assert job.status == "done", (job.operator, job.shape_key, job.status, job.error)
            assert job.trials_done == budget
            assert len(trials) == budget and len({t.config_key for t in trials}) == budget
            assert not [t for t in trials if t.status == RESERVED]
            assert sorted(t.number for t in trials) == list(range(budget))
            best = min((t.time_ms for t in trials if t.time_ms is not None), default=None)
            assert best is not None and job.best_time_ms == best
        winners = s.query(BestConfig).all()
        stored = Counter((w.operator, w.shape_key, w.dtype, w.gpu_model) for w in winners)
        assert stored == keys  # one winner per key
        by_key = {(j.operator, j.shape_key, j.dtype): j for j in jobs}
        for w in winners:
            assert w.time_ms == by_key[(w.operator, w.shape_key, w.dtype)].best_time_ms


def batch(tmp_path: Path, budget: int) -> None:
    recordings = current_recordings()
    operators = {r.problem.operator for r in recordings}
    assert len(recordings) >= 30 and len(operators) >= 4, [str(r.problem) for r in recordings]
    assert {r.problem.dtype for r in recordings} >= {"float16", "float32"}
    db_url = f"sqlite:///{tmp_path / 'kato.db'}"
    init_db(db_url)
    job_ids = submit_batch(db_url, recordings, budget)
    run_workers(db_url, recordings, len(job_ids))
    check_batch(db_url, job_ids, recordings, budget)


def test_a_batch_on_replay_tunes_every_key_once_to_its_exact_budget(tmp_path):
    batch(tmp_path, budget=6)


@pytest.mark.slow
def test_the_issue_35_batch_at_budget_50_tunes_every_key_once_to_its_exact_budget(tmp_path):
    batch(tmp_path, budget=50)
