"""Strategies as proposers (:mod:`tuner.proposers`): one registry by name that the search uses,
the proposer contract (observe after a measurement, discard after a rejection), and the Optuna
study only where Optuna proposes."""

from __future__ import annotations

import optuna
import pytest
from kato.service.schemas import JobCreate
from kato.tuner import proposers
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.proposers import DEFAULT_STRATEGY, PROPOSERS, STRATEGIES, Proposer, proposer_class
from kato.tuner.search import Budget, Search
from kato.tuner.space import SearchSpace


def make_space() -> SearchSpace:
    return SearchSpace(
        params={"block": (32, 64, 128, 256), "vec": (1, 2, 4)},
        check=lambda c: "too wide" if c["block"] * c["vec"] > 512 else None,
    )


def evaluate(config) -> TrialResult:
    return TrialResult(config=config, status=TrialStatus.OK, times_ms=[1.0 / config["block"]])


def test_the_registry_holds_every_strategy_by_its_name_each_in_its_own_module():
    assert STRATEGIES == ("forest", "tpe", "hybrid", "random", "grid")
    assert DEFAULT_STRATEGY == STRATEGIES[0] == JobCreate.model_fields["strategy"].default
    assert all(PROPOSERS[name].name == name for name in STRATEGIES)
    modules = {name: PROPOSERS[name].__module__ for name in STRATEGIES}
    assert modules["forest"] == "kato.tuner.proposers.forest"
    assert modules["grid"] == "kato.tuner.proposers.grid"
    assert modules["hybrid"] == "kato.tuner.proposers.hybrid"
    # Only the strategies Optuna proposes for keep a study.
    assert {n for n in STRATEGIES if PROPOSERS[n].uses_study} == {"tpe", "hybrid", "random"}
    with pytest.raises(ValueError, match="unknown strategy 'annealing'"):
        proposer_class("annealing")
    with pytest.raises(ValueError, match="choose one of forest, tpe"):
        Search(make_space(), evaluate, strategy="annealing")


class Listed(Proposer):
    """Proposes a fixed list (an invalid config and a repeat among them), logging what it is
    told."""

    name = "listed"
    order = [
        {"block": 256, "vec": 4},  # invalid: 1024 > 512
        {"block": 32, "vec": 1},
        {"block": 32, "vec": 1},  # a repeat
        {"block": 64, "vec": 2},
        {"block": 128, "vec": 4},
    ]

    def __init__(self, context) -> None:
        super().__init__(context)
        self.todo = list(self.order)
        self.told: list[tuple[str, int, float | None]] = []
        self.asked = 0

    def propose(self, history, fallback):
        self.asked += 1
        ticket = self.asked
        if fallback is not None:
            return ticket, fallback
        return (ticket, self.todo.pop(0)) if self.todo else (ticket, None)

    def observe(self, ticket, value) -> None:
        self.told.append(("observe", ticket, value))

    def discard(self, ticket, value=None) -> None:
        self.told.append(("discard", ticket, value))


def test_the_search_asks_the_registered_proposer_and_tells_it_each_outcome(monkeypatch):
    monkeypatch.setitem(proposers.PROPOSERS, "listed", Listed)
    search = Search(make_space(), evaluate, strategy="listed", seed=0)
    result = search.run(Budget(max_configs=10))
    assert result.stopped == "exhausted"
    assert [r.config for r in result.new] == [Listed.order[i] for i in (1, 3, 4)]
    told = search.proposer.told
    assert [(what, ticket) for what, ticket, _ in told] == [
        ("discard", 1),  # invalid: told the failed value
        ("observe", 2),
        ("discard", 3),  # the repeat: told the known value
        ("observe", 4),
        ("observe", 5),
    ]
    assert told[0][2] == 1e30 and told[2][2] == told[1][2] == 1.0 / 32
    assert search.study is None  # a proposer without Optuna has no study


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_optuna_study_is_kept_only_where_an_optuna_sampler_proposes(tmp_path, strategy):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    search = Search(make_space(), evaluate, strategy=strategy, seed=1, storage=storage,
                    study_name="job")  # fmt: skip
    result = search.run(Budget(max_configs=8))
    assert result.measured == 8
    summaries = optuna.get_all_study_summaries(storage=storage)
    if PROPOSERS[strategy].uses_study:
        (summary,) = summaries
        done = optuna.load_study(study_name="job", storage=storage).get_trials(
            states=(optuna.trial.TrialState.COMPLETE,)
        )
        measured = {tuple(sorted(r.config.items())) for r in result.results.values()}
        assert measured <= {tuple(sorted(t.params.items())) for t in done}
    else:  # its record is the results (a job's trial rows): no second copy
        assert summaries == [] and search.study is None


def test_a_forest_job_an_older_kato_began_resumes_and_its_study_holds_each_config_once(tmp_path):
    """An older Kato added every trial of a forest job to its study as it ran. Such a job,
    interrupted, resumes from its trial rows; the study written when it ends adds only the
    configs it lacks."""
    from datetime import UTC, datetime, timedelta

    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.tuner.backends.replay import ReplayBackend
    from kato.tuner.job_runner import JobRunner
    from kato.tuner.study import FAILED_VALUE, StudyParams, job_attrs, optuna_storage, record_study
    from kato.tuner.worker import Worker
    from paths import RECORDED

    recording = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
    url = f"sqlite:///{tmp_path}/kato.db"
    sessions = session_factory(init_db(url))
    with sessions() as s:
        job = queries.create_job(
            s, operator="softmax", operator_version=get_operator("softmax").version,
            shape=[4096, 4096], dtype="float16", gpu_model="H200", budget_configs=20, seed=4,
        )  # fmt: skip
        job_id = job.id
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="old", lease_seconds=0.01)

    class Crash(Exception):
        pass

    class Crashing(ReplayBackend):
        measured = 0

        def evaluate(self, config):
            self.measured += 1
            if self.measured == 9:
                raise Crash  # the old worker "dies" here
            return super().evaluate(config)

    JobRunner(sessions, url, lambda j: Crashing(recording), worker_id="old").run(job_id)
    with sessions() as s:
        rows = queries.job_trials(s, job_id)
        assert len(rows) == 8
        # The old Kato's study: one finished trial per stored trial, written as it ran.
        old = [(r.config, r.time_ms or FAILED_VALUE, r.created_at, {"kato_worker": "old"})
               for r in rows]  # fmt: skip
        params = StudyParams(ReplayBackend(recording).space().params)
        record_study(optuna_storage(url), f"kato-job-{job_id}", job_attrs(job), params, old)
        # A crashed worker leaves a running job behind: simulate that state.
        current = queries.get_job(s, job_id)
        current.status, current.error, current.finished_at = "running", None, None
        current.worker_id, current.lease_expires_at = "old", datetime.now(UTC) - timedelta(1)
        s.commit()

    resumed = Worker(sessions, url, ["H200"], lambda j: ReplayBackend(recording), worker_id="new")
    assert resumed.run_once().status == "done"
    with sessions() as s:
        rows = queries.job_trials(s, job_id)
    study = optuna.load_study(study_name=f"kato-job-{job_id}", storage=url)
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(rows) == 20 and len(done) == 20  # each config once, none measured twice
    assert sorted(map(str, (t.params for t in done))) == sorted(map(str, (r.config for r in rows)))
    workers = [t.user_attrs.get("kato_worker") for t in done]
    assert workers == ["old"] * 8 + ["new"] * 12
