"""Optuna's view of Kato's jobs (optuna-dashboard, ``optuna.load_study``): a job's study holds the
real parameter values and names the job; imported jobs get a study too; reading a database never
creates Optuna's tables. SQLite and PostgreSQL (``db_url``)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from fastapi.testclient import TestClient
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.cli import app as cli
from kato.service.settings import Settings
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.search import FAILED_VALUE, Budget, Search
from kato.tuner.worker import Worker
from paths import RECORDED
from sqlalchemy import inspect
from typer.testing import CliRunner

from kato.shared.kt_cache import load_cache

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
SPEC = get_operator("softmax")
OPTUNA_TABLES = {"studies", "trials", "trial_params", "version_info"}


def _sessions(url: str):
    return session_factory(init_db(url))


def _tuned_job(url: str, strategy: str, budget: int = 20) -> str:
    """A softmax job tuned to its end on the replay backend; its id."""
    sessions = _sessions(url)
    with sessions() as s:
        job = queries.create_job(
            s,
            operator="softmax",
            operator_version=SPEC.version,
            shape=[4096, 4096],
            dtype="float16",
            gpu_model="H200",
            budget_configs=budget,
            strategy=strategy,
            seed=3,
        )
    worker = Worker(sessions, url, ["H200"], lambda job: ReplayBackend(RECORDING), poll_seconds=0)
    assert worker.run_once().status == "done"
    return job.id


def _stored(url: str, job_id: str) -> list[tuple[str, float]]:
    """The job's stored trials as (config JSON, objective value), in number order."""
    with _sessions(url)() as s:
        rows = queries.job_trials(s, job_id)
    return [
        (json.dumps(t.config, sort_keys=True), t.time_ms if t.time_ms is not None else FAILED_VALUE)
        for t in rows
    ]


def _study_trials(study: optuna.Study) -> list[tuple[str, float]]:
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    return [(json.dumps(t.params, sort_keys=True), t.value) for t in done]


def _job_attrs(job_id: str, strategy: str, budget: int) -> dict:
    return {
        "job_id": job_id,
        "operator": "softmax",
        "operator_version": SPEC.version,
        "shape": "4096x4096",
        "dtype": "float16",
        "gpu_model": "H200",
        "strategy": strategy,
        "budget_configs": budget,
        "budget_seconds": None,
    }


def _assert_real_values(study: optuna.Study) -> None:
    """Every parameter of every trial is one of the operator's values, over a categorical
    distribution of those values (what optuna-dashboard plots)."""
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert trials
    for t in trials:
        assert set(t.params) == set(SPEC.params)
        for name, value in t.params.items():
            assert value in SPEC.params[name], (name, value)
            dist = t.distributions[name]
            assert isinstance(dist, optuna.distributions.CategoricalDistribution)
            assert set(dist.choices) >= {value} and set(dist.choices) <= set(SPEC.params[name])
    block_sizes = {t.params["BLOCK_SIZE"] for t in trials}
    assert block_sizes <= {32, 64, 128, 256, 512, 1024} and max(block_sizes) >= 64


@pytest.mark.parametrize("strategy", ["forest", "tpe"])
def test_a_tuned_jobs_study_holds_real_values_and_names_the_job(db_url: str, strategy: str):
    job_id = _tuned_job(db_url, strategy)
    study = optuna.load_study(study_name=f"kato-job-{job_id}", storage=db_url)
    _assert_real_values(study)
    assert study.user_attrs == _job_attrs(job_id, strategy, 20)
    assert study.metric_names == ["time_ms"]
    stored, in_study = _stored(db_url, job_id), _study_trials(study)
    assert len(stored) == 20
    if strategy == "forest":  # every measured config is one finished trial, nothing else
        assert sorted(in_study) == sorted(stored)
    else:  # TPE's trials also hold the proposals answered without a measurement
        assert set(stored) <= set(in_study)


def _export(tmp_path: Path, fmt: str) -> tuple[Path, str]:
    source = f"sqlite:///{tmp_path / 'source.db'}"
    job_id = _tuned_job(source, "forest", budget=15)
    out = tmp_path / f"export-{fmt}"
    result = CliRunner().invoke(cli, ["export", str(out), "--format", fmt, "--db", source])
    assert result.exit_code == 0, result.output
    return out, job_id


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_an_imported_job_gets_a_study_once(db_url: str, tmp_path: Path, fmt: str):
    out, job_id = _export(tmp_path, fmt)
    for _ in range(2):  # the second import adds nothing, to the study neither
        result = CliRunner().invoke(cli, ["import", str(out), "--db", db_url])
        assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name=f"kato-job-{job_id}", storage=db_url)
    assert study.user_attrs == _job_attrs(job_id, "forest", 15)
    _assert_real_values(study)
    assert sorted(_study_trials(study)) == sorted(_stored(db_url, job_id))
    assert len(study.trials) == 15


def test_a_foreign_cache_imported_gets_a_study_of_its_trials(db_url: str):
    args = ["import", str(RECORDING), "--operator", "softmax", "--shape", "4096x4096"]
    args += ["--dtype", "float16", "--gpu", "H200", "--db", db_url]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (study,) = optuna.get_all_study_summaries(storage=db_url)
    job_id = study.study_name.removeprefix("kato-job-")
    loaded = optuna.load_study(study_name=study.study_name, storage=db_url)
    assert loaded.user_attrs["job_id"] == job_id and loaded.user_attrs["operator"] == "softmax"
    assert loaded.user_attrs["gpu_model"] == "H200" and loaded.user_attrs["shape"] == "4096x4096"
    _assert_real_values(loaded)
    stored = _stored(db_url, job_id)
    assert len(stored) == len(load_cache(RECORDING).entries)
    assert sorted(_study_trials(loaded)) == sorted(stored)


def _tables(url: str) -> set[str]:
    engine = init_db(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_reading_a_database_creates_no_optuna_tables(db_url: str, tmp_path: Path):
    """Lookups, job listings, exports and the service's start read Kato's tables only; a job
    submitted is not a tuning run either."""
    with _sessions(db_url)() as s:  # a result to read, stored as a tuning run would
        queries.upsert_best_config(s, operator="softmax", operator_version=SPEC.version,
                                   shape=[4096, 4096], dtype="float16", gpu_model="H200",
                                   compute_capability="9.0", cuda_version="13.0",
                                   config=SPEC.default_config([4096, 4096], "float16"),
                                   time_ms=0.1, job_id=None)  # fmt: skip
    settings = Settings(db_url=db_url, auth_required=False)
    with TestClient(create_app(settings)) as client:
        found = client.get("/v1/configs/softmax?shape=4096x4096&dtype=float16&gpu=H200")
        assert found.json()["source"] == "exact"
        job = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
        submitted = client.post("/v1/jobs", json=job)
        assert submitted.is_success, submitted.text
        assert client.get(f"/v1/jobs/{submitted.json()['id']}").is_success
    runner = CliRunner()
    for args in (
        ["lookup", "softmax", "--shape", "4096x4096", "--dtype", "float16", "--gpu", "H200"],
        ["export", str(tmp_path / "out")],
        ["token", "list"],
        ["retune", "--dry-run"],
    ):
        result = runner.invoke(cli, [*args, "--db", db_url])
        assert result.exit_code == 0, (args, result.output)
    tables = _tables(db_url)
    assert "kato_jobs" in tables and not tables & OPTUNA_TABLES


def test_a_job_stored_before_real_values_resumes_on_its_indices(tmp_path: Path):
    """A study whose trials hold parameter indices (Kato before its studies held the real
    values) is resumed as it was stored, not failed over an incompatible distribution."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    backend = ReplayBackend(RECORDING)
    space = backend.space()
    names = [n for n, values in space.params.items() if len(values) > 1]
    old = {n: optuna.distributions.IntDistribution(0, len(space.params[n]) - 1) for n in names}
    study = optuna.create_study(storage=storage, study_name="job")
    measured = {}
    for config in space.valid_configs()[:5]:
        result = backend.evaluate(config)
        measured[space.key(config)] = result
        index = {n: sorted(space.params[n]).index(config[n]) for n in names}
        trial = optuna.trial.create_trial(params=index, distributions=old, value=result.time_ms)
        study.add_trial(trial)
    for budget, strategy in ((12, "tpe"), (18, "forest")):
        search = Search(
            space, backend.evaluate, strategy=strategy, seed=1, storage=storage,
            study_name="job", known=measured,
        )  # fmt: skip
        result = search.run(Budget(max_configs=budget))
        assert result.measured == budget
        measured = result.results
    trials = optuna.load_study(study_name="job", storage=storage).get_trials()
    assert all(t.distributions == old for t in trials if t.params)
