"""The search loop's contract, on synthetic spaces where every answer is known."""

from __future__ import annotations

import optuna
import pytest
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.search import DEFAULT_STRATEGY, STRATEGIES, Budget, Search
from kato.tuner.space import SearchSpace


def make_space() -> SearchSpace:
    # 8 x 4 x 3 = 96 combinations; odd block sizes with vec 4 are "invalid".
    return SearchSpace(
        params={
            "block": (32, 64, 96, 128, 160, 192, 224, 256),
            "vec": (1, 2, 4, 8),
            "mode": ("a", "b", "c"),
        },
        check=lambda c: "vec 8 needs mode a" if c["vec"] == 8 and c["mode"] != "a" else None,
    )


class Counter:
    """An evaluate() that records every call and fails some configs."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, config):
        key = (config["block"], config["vec"], config["mode"])
        self.calls.append(key)
        if config["block"] == 160:
            return TrialResult(config=config, status=TrialStatus.COMPILE_ERROR, error="boom")
        t = (
            abs(config["block"] - 192) / 32
            + abs(config["vec"] - 4)
            + {"a": 1, "b": 0, "c": 2}[config["mode"]]
            + 1.0
        )
        return TrialResult(config=config, status=TrialStatus.OK, times_ms=[t, t + 1, t - 0.5])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_budget_distinct_valid_and_failures_counted(strategy):
    space, evaluate = make_space(), Counter()
    result = Search(space, evaluate, strategy=strategy, seed=3).run(Budget(max_configs=30))
    assert result.measured == 30
    assert len(evaluate.calls) == 30
    assert len(set(evaluate.calls)) == 30, "a config was measured twice"
    for _block, vec, mode in evaluate.calls:
        assert not (vec == 8 and mode != "a"), "an invalid config was measured"
    # The winner is the lowest median among OK results (median of [t, t+1, t-0.5] is t).
    ok = [r for r in result.results.values() if r.ok]
    assert result.best.time_ms == min(r.time_ms for r in ok)
    assert result.best.time_ms == pytest.approx(min(r.times_ms[0] for r in ok))


def test_failed_configs_are_recorded_and_search_goes_on():
    space, evaluate = make_space(), Counter()
    result = Search(space, evaluate, strategy="grid", seed=0).run(Budget(max_configs=80))
    failed = [r for r in result.results.values() if r.status is TrialStatus.COMPILE_ERROR]
    assert failed and all(r.config["block"] == 160 for r in failed)
    assert result.best is not None and result.best.ok


@pytest.mark.parametrize("strategy", ["tpe", "forest"])
def test_exhausting_a_small_space_stops_with_every_valid_config_measured_once(strategy):
    space, evaluate = make_space(), Counter()
    valid = len(space.valid_configs())
    assert valid == 96 - 16
    result = Search(space, evaluate, strategy=strategy, seed=1).run(Budget(max_configs=1000))
    assert result.stopped == "exhausted"
    assert len(evaluate.calls) == valid == len(set(evaluate.calls))
    assert result.best.config == {"block": 192, "vec": 4, "mode": "b"}


@pytest.mark.parametrize("strategy", ["tpe", "forest"])
def test_same_seed_same_proposals(strategy):
    runs = []
    for _ in range(2):
        evaluate = Counter()
        Search(make_space(), evaluate, strategy=strategy, seed=42).run(Budget(max_configs=20))
        runs.append(evaluate.calls)
    assert runs[0] == runs[1]


def test_default_strategy_is_forest_and_first_everywhere():
    from typing import get_args

    from kato.service.schemas import JobCreate, Strategy

    assert DEFAULT_STRATEGY == STRATEGIES[0] == "forest"
    assert Search(make_space(), Counter()).strategy == "forest"
    assert get_args(Strategy) == STRATEGIES
    assert JobCreate.model_fields["strategy"].default == DEFAULT_STRATEGY


@pytest.mark.parametrize("strategy", ["tpe", "forest"])
def test_resume_never_remeasures_and_continues_the_study(tmp_path, strategy):
    """A job stopped half-way resumes from its stored study (TPE) and known results; the forest
    resumes from its known results alone and writes no study."""
    storage = f"sqlite:///{tmp_path}/optuna.db"
    space = make_space()
    first = Counter()
    stop_after = 12
    r1 = Search(
        space,
        first,
        strategy=strategy,
        seed=5,
        storage=storage,
        study_name="job",
        should_stop=lambda: len(first.calls) >= stop_after,
    ).run(Budget(max_configs=40))
    assert r1.stopped == "cancelled" and r1.measured == stop_after
    if strategy == "tpe":  # simulate a crash between ask() and tell(): a RUNNING trial left
        optuna.load_study(study_name="job", storage=storage).ask()
    second = Counter()
    r2 = Search(
        space,
        second,
        strategy=strategy,
        seed=5,
        storage=storage,
        study_name="job",
        known=r1.results,
    ).run(Budget(max_configs=40))
    assert r2.measured == 40
    assert len(second.calls) == 40 - stop_after
    assert not set(first.calls) & set(second.calls), "a finished trial was measured again"
    if strategy == "forest":  # no second copy of its trials: the results are its record
        assert optuna.get_all_study_summaries(storage=storage) == []
        return
    study = optuna.load_study(study_name="job", storage=storage)
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    # Every measured config is a finished trial of the stored study (the sampler's history).
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(done) >= 40


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_configs_are_measured_first(strategy):
    evaluate = Counter()
    seeds = [
        {"block": 192, "vec": 4, "mode": "b"},
        {"block": 64, "vec": 8, "mode": "c"},
        {"block": 32, "vec": 1, "mode": "a"},
    ]
    search = Search(make_space(), evaluate, strategy=strategy, seed=0, seed_configs=seeds)
    search.run(Budget(max_configs=5))
    # the invalid seed (vec 8, mode c) is skipped
    assert evaluate.calls[:2] == [(192, 4, "b"), (32, 1, "a")]


def test_time_budget_stops():
    evaluate = Counter()
    result = Search(make_space(), evaluate, seed=0).run(Budget(max_configs=None, max_seconds=0.2))
    assert result.stopped == "time"


def test_bad_budget_and_strategy():
    with pytest.raises(ValueError, match="max_configs"):
        Budget(max_configs=None, max_seconds=None)
    with pytest.raises(ValueError, match="at least 1"):
        Budget(max_configs=0)
    with pytest.raises(ValueError, match="unknown strategy"):
        Search(make_space(), Counter(), strategy="annealing")


def test_forest_never_depends_on_the_budget():
    """The first N measurements of a run at budget 2N are the run at budget N (what lets
    benchmarks/search_quality.py score every budget from one run)."""
    short, long = Counter(), Counter()
    Search(make_space(), short, seed=7).run(Budget(max_configs=25))
    Search(make_space(), long, seed=7).run(Budget(max_configs=50))
    assert long.calls[:25] == short.calls


def test_forest_skips_configs_other_workers_are_measuring():
    """A PENDING result (another worker's reservation) is never proposed and not learnt from."""
    space = make_space()
    pending = {"block": 192, "vec": 4, "mode": "b"}  # the optimum
    search = Search(space, Counter(), seed=0)
    search.results[space.key(pending)] = TrialResult(config=pending, status=TrialStatus.PENDING)
    evaluate = search.evaluate
    search.run(Budget(max_configs=60))
    assert (192, 4, "b") not in evaluate.calls


def test_forest_finds_the_optimum_of_a_smooth_space_quickly():
    """A separable bowl over 80 valid configs: the model finds the optimum within 30."""
    hits = 0
    for seed in range(5):
        evaluate = Counter()
        result = Search(make_space(), evaluate, seed=seed).run(Budget(max_configs=30))
        hits += result.best.config == {"block": 192, "vec": 4, "mode": "b"}
    assert hits >= 4


class Compiles:
    """Stands in for a backend's compile queue: a config is ready once ``delay`` other
    readiness checks have passed since it was first asked about (its compile "runs" meanwhile);
    ``evaluate`` records the order configs are measured in."""

    def __init__(self, space: SearchSpace, delay: int):
        self.space, self.delay = space, delay
        self.clock = 0
        self.started: dict[str, int] = {}
        self.measured: list[str] = []
        self.inner = Counter()
        self.most_in_flight = 0

    def ready(self, config) -> bool:
        self.clock += 1
        key = self.space.key(config)
        self.started.setdefault(key, self.clock)
        in_flight = len(set(self.started) - set(self.measured))
        self.most_in_flight = max(self.most_in_flight, in_flight)
        return self.clock - self.started[key] >= self.delay

    def evaluate(self, config) -> TrialResult:
        self.measured.append(self.space.key(config))
        return self.inner(config)


@pytest.mark.parametrize("strategy", ["forest", "tpe", "random"])
def test_asking_ahead_measures_the_budget_once_each_and_leaves_no_trial_running(strategy):
    space = make_space()
    compiles = Compiles(space, delay=12)
    search = Search(
        space, compiles.evaluate, strategy=strategy, seed=5, ahead=4, ready=compiles.ready
    )
    result = search.run(Budget(max_configs=40))
    assert result.measured == 40
    assert len(compiles.measured) == 40 == len(set(compiles.measured))
    assert all(space.is_valid(c) for c in (r.config for r in result.results.values()))
    assert compiles.most_in_flight == 4  # asked ahead while nothing was ready, never beyond 4
    if strategy == "forest":  # it proposes without Optuna: no study
        assert search.study is None
        return
    running = search.study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert running == []
    complete = search.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) >= 40


def test_a_ready_config_is_measured_before_an_older_one_still_compiling():
    space = make_space()
    slow: set[str] = set()
    order: list[str] = []

    def ready(config) -> bool:
        key = space.key(config)
        if not order and not slow:
            slow.add(key)  # the first config asked for compiles "forever"
        return key not in slow or len(order) >= 5

    def evaluate(config):
        order.append(space.key(config))
        return Counter()(config)

    Search(space, evaluate, seed=1, ahead=3, ready=ready).run(Budget(max_configs=12))
    (first,) = slow
    assert first in order and order.index(first) >= 5  # measured once it was ready
    assert order[0] != first


def test_ahead_1_or_no_readiness_gives_the_sequential_search():
    space = make_space()
    runs = []
    for kwargs in ({}, {"ahead": 4}, {"ahead": 1, "ready": lambda c: False}):
        evaluate = Counter()
        Search(space, evaluate, seed=7, **kwargs).run(Budget(max_configs=30))
        runs.append(evaluate.calls)
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("strategy", ["tpe", "forest"])
def test_a_stop_with_configs_in_flight_measures_none_of_them_and_leaves_no_trial_open(strategy):
    space = make_space()
    evaluate = Counter()
    stops = iter([False] * 6 + [True] * 100)
    search = Search(
        space,
        evaluate,
        strategy=strategy,
        seed=2,
        ahead=4,
        ready=lambda c: False,  # nothing ever compiles: the search asks 4 ahead
        should_stop=lambda: next(stops),
    )
    result = search.run(Budget(max_configs=30))
    assert result.stopped == "cancelled"
    assert len(evaluate.calls) == result.measured
    if strategy == "forest":  # it proposes without Optuna: no study
        assert search.study is None
        return
    states = [t.state for t in search.study.get_trials()]
    assert optuna.trial.TrialState.RUNNING not in states
    complete = states.count(optuna.trial.TrialState.COMPLETE)
    # Each measured config is one finished trial (the invalid proposals are too, told a
    # failed value).
    assert complete >= result.measured
    # Configs asked from Optuna and never measured are failed trials; the forest's own
    # proposals get a trial only once measured.
    failed = states.count(optuna.trial.TrialState.FAIL)
    assert failed >= 1 if strategy == "tpe" else failed == 0


def test_ahead_must_be_positive():
    with pytest.raises(ValueError, match="ahead"):
        Search(make_space(), Counter(), ahead=0)


def test_with_nothing_ready_the_search_waits_for_the_first_ready_not_the_oldest():
    space = make_space()
    done: set[str] = set()
    waits: list[list[str]] = []
    measured: list[str] = []

    def wait_ready(configs):
        keys = [space.key(c) for c in configs]
        waits.append((len(measured), keys))
        done.add(keys[-1])  # the newest one finishes first

    def evaluate(config):
        measured.append(space.key(config))
        done.add(space.key(config))
        return Counter()(config)

    Search(
        space,
        evaluate,
        seed=4,
        ahead=3,
        ready=lambda c: space.key(c) in done,
        wait_ready=wait_ready,
    ).run(Budget(max_configs=20))
    assert len(measured) == 20 == len(set(measured))
    assert len(waits) >= 10 and all(len(keys) >= 2 for _, keys in waits)
    assert max(len(keys) for _, keys in waits) == 3
    for at, keys in waits:  # after each wait, the config that finished is measured next
        assert measured[at] == keys[-1] != keys[0]  # not the oldest


@pytest.mark.parametrize("strategy", ["forest", "grid"])
def test_a_small_space_asked_ahead_is_measured_whole_then_exhausted(strategy):
    space = SearchSpace(params={"block": (32, 64, 128), "vec": (1, 2)})
    measured: list[str] = []

    def evaluate(config):
        measured.append(space.key(config))
        t = config["block"] / 32 + config["vec"]
        return TrialResult(config=config, status=TrialStatus.OK, times_ms=[t])

    search = Search(space, evaluate, strategy=strategy, seed=1, ahead=4, ready=lambda c: False)
    result = search.run(Budget(max_configs=50))
    assert result.stopped == "exhausted"
    assert sorted(measured) == sorted(space.key(c) for c in space.valid_configs())
    assert search.study is None  # both propose without Optuna: nothing left open anywhere


def test_an_error_in_the_loop_leaves_no_trial_of_the_configs_in_flight_open():
    """A failure outside a measurement (here: the sync of a shared job, run by should_stop)
    must close the trials asked ahead, not leave them RUNNING while the worker lives."""
    space = make_space()
    calls = iter(range(100))

    def should_stop() -> bool:
        if next(calls) == 6:
            raise RuntimeError("database hiccup")
        return False

    search = Search(space, Counter(), strategy="tpe", seed=2, ahead=4, ready=lambda c: False,
                    should_stop=should_stop)  # fmt: skip
    with pytest.raises(RuntimeError, match="hiccup"):
        search.run(Budget(max_configs=30))
    states = [t.state for t in search.study.get_trials()]
    assert optuna.trial.TrialState.RUNNING not in states
    assert optuna.trial.TrialState.FAIL in states  # the configs asked ahead, never measured
