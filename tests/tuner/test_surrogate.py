"""The default strategy's proposer (tuner.surrogate): each move's contract, and the method."""

from __future__ import annotations

import random
import threading
import time

import kato.tuner.surrogate as surrogate
import numpy as np
import pytest
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.search import Budget, Search
from kato.tuner.space import SearchSpace
from kato.tuner.surrogate import ForestProposer

MOVES = ("ei", "local", "gp", "walk", "flip", "ts", "random")


def constrained_space() -> SearchSpace:
    """4 x 4 x 3 x 2 = 96 combinations, 12 of them invalid."""
    return SearchSpace(
        params={"a": (1, 2, 4, 8), "b": (16, 32, 48, 64), "c": ("x", "y", "z"), "d": (0, 1)},
        check=lambda c: "a 8 needs d 0" if c["a"] * (c["d"] + 1) > 8 else None,
    )


def timing(config) -> TrialResult:
    if config["b"] == 48 and config["c"] == "z":
        return TrialResult(config=config, status=TrialStatus.COMPILE_ERROR, error="boom")
    t = 1.0 + abs(config["a"] - 4) + abs(config["b"] - 32) / 16 + (config["c"] != "y")
    return TrialResult(config=config, status=TrialStatus.OK, times_ms=[t + config["d"]])


@pytest.mark.parametrize("move", MOVES)
def test_every_move_proposes_only_valid_unmeasured_configs_until_exhausted(monkeypatch, move):
    """Each move alone, with failures and another worker's PENDING reservations in the history:
    every valid config is proposed exactly once, the reserved ones never, then None."""
    monkeypatch.setattr(surrogate, "MOVES", (move,))
    space = constrained_space()
    valid = {space.key(c) for c in space.valid_configs()}
    assert len(valid) == 84
    proposer = ForestProposer(space, seed=1)
    reserved = [c for c in space.valid_configs() if c["a"] == 4 and c["c"] == "y"]
    results = {space.key(c): TrialResult(config=c, status=TrialStatus.PENDING) for c in reserved}
    proposed = []
    while (config := proposer.propose(results)) is not None:
        key = space.key(config)
        assert space.is_valid(config), config
        assert key not in results, f"{move} proposed a config that has a result: {config}"
        proposed.append(key)
        results[key] = timing(config)
    assert len(proposed) == len(set(proposed)) == len(valid) - len(reserved)
    assert set(proposed) | {space.key(c) for c in reserved} == valid


def test_local_candidates_are_near_the_centres_and_widen_when_exhausted():
    space = constrained_space()
    proposer = ForestProposer(space, seed=0)
    configs = proposer.configs
    centre = configs.index({"a": 4, "b": 32, "c": "y", "d": 0})

    def distance(i: int) -> int:
        return sum(configs[i][p] != configs[centre][p] for p in space.params)

    measured = np.zeros(len(configs), dtype=bool)
    measured[centre] = True
    near = proposer.local_candidates(measured, [centre])
    within = [i for i in range(len(configs)) if 0 < distance(i) <= surrogate.LOCAL_RADIUS]
    assert sorted(near.tolist()) == within
    # Everything within the radius measured: the neighbourhood widens, still unmeasured only.
    measured[within] = True
    wider = proposer.local_candidates(measured, [centre])
    assert len(wider) and not measured[wider].any()
    assert min(distance(int(i)) for i in wider) == surrogate.LOCAL_RADIUS + 1
    measured[:] = True
    assert len(proposer.local_candidates(measured, [centre])) == 0


def switch_space() -> SearchSpace:
    """Two switches (``s``, ``t``), one three-valued parameter that is not a switch (``c``)."""
    return SearchSpace(
        params={"a": (1, 2, 4), "c": ("x", "y", "z"), "s": (0, 1), "t": ("on", "off")},
        check=lambda c: "a 4 needs s 0" if c["a"] == 4 and c["s"] == 1 else None,
    )


def test_flip_changes_only_switches_fewest_first_then_the_next_centre():
    space = switch_space()
    proposer = ForestProposer(space, seed=0)
    configs = proposer.configs
    assert [proposer.names[j] for j in proposer._flags] == ["s", "t"]
    best = configs.index({"a": 2, "c": "y", "s": 0, "t": "on"})
    second = configs.index({"a": 4, "c": "x", "s": 0, "t": "off"})
    measured = np.zeros(len(configs), dtype=bool)
    measured[[best, second]] = True
    picks = []
    while (pick := proposer.flip_candidate(measured, [best, second])) is not None:
        picks.append(configs[pick])
        measured[pick] = True
    # The best config's two single flips (either order), its double flip, then the second
    # best's one valid flip ("a 4" with s=1 is invalid); never a change of "a" or "c".
    assert {tuple(sorted(c.items())) for c in picks[:2]} == {
        tuple(sorted({"a": 2, "c": "y", "s": 1, "t": "on"}.items())),
        tuple(sorted({"a": 2, "c": "y", "s": 0, "t": "off"}.items())),
    }
    assert picks[2:] == [
        {"a": 2, "c": "y", "s": 1, "t": "off"},
        {"a": 4, "c": "x", "s": 0, "t": "on"},
    ]
    # A space without two-valued parameters has nothing to flip.
    plain = ForestProposer(SearchSpace(params={"a": (1, 2, 4)}), seed=0)
    assert plain.flip_candidate(np.zeros(3, dtype=bool), [0]) is None


def run(seed: int, budget: int, evaluate) -> list[str]:
    space = constrained_space()
    proposer = ForestProposer(space, seed=seed)
    results: dict = {}
    order = []
    while len(results) < budget:
        config = proposer.propose(results)
        results[space.key(config)] = evaluate(config)
        order.append(space.key(config))
    return order


def test_same_seed_and_history_same_proposals_other_seed_other_proposals():
    assert run(5, 40, timing) == run(5, 40, timing)
    assert run(5, 40, timing) != run(6, 40, timing)


def rugged_space() -> tuple[SearchSpace, dict, object]:
    """A kernel-like landscape: a smooth bowl over ``tile`` and ``mode`` that picks the basin,
    and inside it a rugged, patternless surface over the two block sizes with one needle (the
    optimum), 6% faster than the basin's next best. 16 x 8 x 4 x 3 = 1536 configs, some invalid,
    some failing."""
    params = {
        "bx": tuple(range(16, 272, 16)),
        "by": (1, 2, 3, 4, 6, 8, 12, 16),
        "tile": (1, 2, 3, 4),
        "mode": ("a", "b", "c"),
    }
    rng = random.Random(1234)
    rugged = {(bx, by): rng.uniform(0.06, 0.6) for bx in params["bx"] for by in params["by"]}
    needle = (80, 6)
    rugged[needle] = 0.0
    space = SearchSpace(
        params=params, check=lambda c: "too big" if c["bx"] * c["by"] > 1024 else None
    )

    def evaluate(config):
        if config["tile"] == 4 and config["mode"] == "c":
            return TrialResult(config=config, status=TrialStatus.LAUNCH_ERROR, error="boom")
        t = 1.0 + 0.4 * abs(config["tile"] - 3) + {"a": 0.5, "b": 0.0, "c": 0.8}[config["mode"]]
        t *= 1.0 + rugged[(config["bx"], config["by"])]
        return TrialResult(config=config, status=TrialStatus.OK, times_ms=[t])

    optimum = {"bx": needle[0], "by": needle[1], "tile": 3, "mode": "b"}
    return space, optimum, evaluate


def test_the_default_finds_a_needle_in_a_rugged_basin_within_the_budget():
    """Over 5 seeds at budget 100 (of 1536), the optimum is found in at least 4."""
    space, optimum, evaluate = rugged_space()
    hits = 0
    for seed in range(5):
        result = Search(space, evaluate, seed=seed).run(Budget(max_configs=100))
        assert result.measured == 100
        hits += result.best.config == optimum
    assert hits >= 4


def test_the_gp_follows_a_trend_past_the_measured_configs_where_the_trees_cannot():
    """Time falls smoothly with two block-size-like parameters and only the slow half of the
    space is measured: the GP predicts the unmeasured fastest config below the best measured
    log-time and its expected improvement picks a config beyond the measured ones; a tree's
    leaf is a mean of measured times, so the forest predicts nothing below the best."""
    space = SearchSpace(params={"a": (1, 2, 4, 8, 16, 32, 64, 128), "b": (1, 2, 4, 8, 16)})
    proposer = ForestProposer(space, seed=0)

    def log_time(c) -> float:
        return -0.4 * np.log2(c["a"]) - 0.3 * np.log2(c["b"])

    slow = [i for i, c in enumerate(proposer.configs) if c["a"] <= 8 and c["b"] <= 4]
    train = np.array(slow)
    y = np.array([log_time(proposer.configs[i]) for i in slow])
    fastest = proposer.index[space.key({"a": 128, "b": 16})]
    pool = np.array([fastest])
    mu, sd = proposer.gp_predict(train, y, pool)
    assert mu[0] < y.min() - 1.0, (mu, y.min())
    assert 0 < sd[0] < 2.0
    forest_mu, _, _ = proposer._fit_predict(train, y, pool)
    assert forest_mu[0] >= y.min() - 1e-9

    results = {
        space.key(c): TrialResult(config=c, status=TrialStatus.OK, times_ms=[np.exp(log_time(c))])
        for c in (proposer.configs[i] for i in slow)
    }
    measured = np.zeros(len(proposer.configs), dtype=bool)
    measured[slow] = True
    pick = proposer.configs[proposer._propose("gp", train, y, measured)]
    assert pick["a"] > 8 and pick["b"] > 4, pick
    assert space.key(pick) not in results


def test_upcoming_names_the_next_design_configs_exactly_and_never_changes_proposals():
    space = constrained_space()
    plain, hinted = ForestProposer(space, seed=4), ForestProposer(space, seed=4, hints=True)
    results: dict = {}
    predicted: list[int] = []
    design_hits = model_hits = model_turns = random_moves = 0
    for step in range(40):
        turn = hinted._turn
        config = plain.propose(results)
        assert hinted.propose(results) == config  # computing upcoming changes nothing
        assert plain.upcoming == []  # only computed when asked for
        i = hinted.index[space.key(config)]
        if step < surrogate.N_INITIAL:
            if predicted:
                assert i == predicted[0]  # the design is known ahead, exactly
                design_hits += 1
        elif surrogate.MOVES[turn % len(surrogate.MOVES)] in ("walk", "flip"):
            # A random move is predicted exactly: the best configs either stay or the config
            # proposed before becomes the best (the two first hints).
            assert i in predicted[:2]
            random_moves += 1
        else:
            model_turns += 1
            model_hits += i in predicted
        predicted = list(hinted.upcoming)
        taken = {hinted.index[k] for k in results} | {i}
        assert not taken & set(predicted)  # never a measured config, nor the one just proposed
        assert all(space.is_valid(hinted.configs[j]) for j in predicted)
        assert len(predicted) <= surrogate.N_UPCOMING
        results[space.key(config)] = timing(config)
    assert design_hits == surrogate.N_INITIAL - 1
    assert random_moves >= 4
    assert model_hits >= model_turns // 4  # the model's next picks are often among them


def rare_space() -> SearchSpace:
    """3 x 16 x 4 = 192 combinations; ``mode`` 2 is valid only with ``x`` 16 and ``y`` 4 or 8:
    2 of the 130 valid configs (a code path that constraints leave a handful of configs)."""
    return SearchSpace(
        params={"mode": (0, 1, 2), "x": tuple(range(1, 17)), "y": (1, 2, 4, 8)},
        check=lambda c: (
            "mode 2 needs x 16, y >= 4"
            if c["mode"] == 2 and (c["x"], c["y"]) not in ((16, 4), (16, 8))
            else None
        ),
    )


def rare_timing(config) -> TrialResult:
    t = 1.0 + abs(config["x"] - 8) / 8 + config["y"] / 8 + (0.1 if config["mode"] == 2 else 1.0)
    return TrialResult(config=config, status=TrialStatus.OK, times_ms=[t])


def test_rare_values_are_the_values_few_valid_configs_hold():
    rare = ForestProposer(rare_space(), seed=0)
    assert len(rare.configs) == 130
    assert rare.rare_values() == [(rare.names.index("mode"), 2.0)]
    assert ForestProposer(constrained_space(), seed=0).rare_values() == []


def test_the_design_measures_every_rare_value():
    """A random design of 15 of 130 configs holds one of the 2 ``mode`` 2 configs about one time
    in five; this one always does, for every seed."""
    space = rare_space()
    for seed in range(20):
        proposer = ForestProposer(space, seed=seed)
        results: dict = {}
        for _ in range(surrogate.N_INITIAL):
            config = proposer.propose(results)
            results[space.key(config)] = rare_timing(config)
        assert any(r.config["mode"] == 2 for r in results.values()), seed


def test_a_seed_with_a_rare_value_does_not_stand_in_for_the_designs_own():
    """Both ``mode`` 2 configs: one a warm-start seed, measured before the proposer; the design
    still measures the other (a seed is another shape's best, not a sample of the value)."""
    space = rare_space()
    seed = {"mode": 2, "x": 16, "y": 8}
    for s in range(5):
        proposer = ForestProposer(space, seed=s, seed_keys=[space.key(seed)])
        results = {space.key(seed): rare_timing(seed)}
        for _ in range(surrogate.N_INITIAL):
            config = proposer.propose(results)
            results[space.key(config)] = rare_timing(config)
        assert space.key({"mode": 2, "x": 16, "y": 4}) in results, s


def test_seeds_do_not_steer_the_designs_pick_of_a_rare_value():
    """The rare value's design config is chosen far from the design's other configs, not from
    the seeds: with a seed measured first (not a holder), the pick is the cold run's."""
    space = rare_space()
    seed = {"mode": 0, "x": 8, "y": 2}
    for s in range(10):
        cold = ForestProposer(space, seed=s).propose({})
        warm = ForestProposer(space, seed=s, seed_keys=[space.key(seed)])
        assert warm.propose({space.key(seed): rare_timing(seed)}) == cold, s
        assert cold["mode"] == 2


def test_upcoming_predicts_a_design_with_rare_values_exactly():
    space = rare_space()
    plain, hinted = ForestProposer(space, seed=3), ForestProposer(space, seed=3, hints=True)
    results: dict = {}
    predicted: list[int] = []
    hits = 0
    for _ in range(surrogate.N_INITIAL):
        config = plain.propose(results)
        assert hinted.propose(results) == config
        i = hinted.index[space.key(config)]
        if predicted:
            assert i == predicted[0]
            hits += 1
        predicted = list(hinted.upcoming)
        results[space.key(config)] = rare_timing(config)
    assert hits == surrogate.N_INITIAL - 1


def test_search_passes_upcoming_configs_on_and_measures_the_same():
    space = constrained_space()
    seen: list[list] = []
    runs = []
    for on_upcoming in (None, seen.append):
        search = Search(space, timing, seed=2, on_upcoming=on_upcoming)
        runs.append(list(search.run(Budget(max_configs=30)).results))
    assert runs[0] == runs[1]
    assert len(seen) >= 20 and all(space.is_valid(c) for batch in seen for c in batch)


def test_models_fitted_ahead_on_a_thread_give_the_proposals_of_models_fitted_when_needed(
    monkeypatch,
):
    """The fits for the next proposal start on the proposer's thread as soon as one is made
    (``background``); the proposals are those of fitting each model when it is needed, with
    every move taking its turns (``gp`` among them) and failures in the history."""
    threads: list[str] = []
    fit = ForestProposer._fit_predict

    def recorded(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(ForestProposer, "_fit_predict", recorded)
    space = constrained_space()
    orders = []
    for background in (False, True):
        threads.clear()
        proposer = ForestProposer(space, seed=3, background=background)
        results: dict = {}
        for _ in range(60):
            config = proposer.propose(results)
            time.sleep(0.002)  # the measurement, while the thread fits
            results[space.key(config)] = timing(config)
        orders.append(list(results))
        on_thread = sum(name.startswith("kato-fit") for name in threads)
        assert on_thread == (len(threads) if background else 0) and len(threads) >= 20
    assert orders[0] == orders[1]


def test_a_model_move_learns_from_the_results_of_an_earlier_call(monkeypatch):
    """The forest of a proposal is fitted on the results the call before was given (all but
    the last one here, measured between the two calls), the GP's hyperparameters on those of
    two calls before; the model's incumbent is the latest best."""
    space = constrained_space()
    fitted: list[tuple[int, int]] = []
    fit = ForestProposer._fit_predict

    def recorded(self, train, y, pool, rng=None):
        fitted.append((len(results), len(train)))
        return fit(self, train, y, pool, rng)

    monkeypatch.setattr(ForestProposer, "_fit_predict", recorded)
    monkeypatch.setattr(surrogate, "MOVES", ("ei", "local"))
    proposer = ForestProposer(space, seed=0)
    results: dict = {}
    for _ in range(surrogate.N_INITIAL + 10):
        config = proposer.propose(results)
        results[space.key(config)] = timing(config)
    # One fit per model turn, on one result fewer than the call holds.
    assert len(fitted) == proposer._turn >= 5
    assert all(known - trained == 1 for known, trained in fitted)

    seen: list[int] = []
    gp_init = surrogate._GpModel.__init__

    def gp_recorded(self, proposer, snap, rng, cover):
        seen.append(len(snap.train))
        gp_init(self, proposer, snap, rng, cover)

    monkeypatch.setattr(surrogate._GpModel, "__init__", gp_recorded)
    monkeypatch.setattr(surrogate, "MOVES", ("gp",))
    proposer = ForestProposer(space, seed=0)
    results = {}
    sizes = []
    for _ in range(surrogate.N_INITIAL + 8):
        turn, known = proposer._turn, len(results)
        config = proposer.propose(results)
        if proposer._turn > turn:  # a gp turn: its model from two calls before
            sizes.append(known - 2)
        results[space.key(config)] = timing(config)
    assert seen == sizes and len(sizes) >= 5


def test_the_gp_is_conditioned_exactly_on_the_results_its_fit_lacked():
    """The GP's posterior given its snapshot's results and later ones, by the block update, is
    scikit-learn's for the same kernel on all of them (no refit of the hyperparameters)."""
    from sklearn.gaussian_process import GaussianProcessRegressor

    space = SearchSpace(params={"a": (1, 2, 4, 8, 16, 32, 64, 128), "b": (1, 2, 4, 8, 16)})
    proposer = ForestProposer(space, seed=0)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(proposer.configs))
    train, pool = order[:24], order[24:]
    y = np.array([np.log(1 + c["a"] % 7 + 0.5 * c["b"]) for c in proposer.configs])[train]
    measured = np.zeros(len(proposer.configs), dtype=bool)
    measured[train[:18]] = True
    snap = surrogate._Snapshot(train[:18], y[:18], measured)
    # Predictions ahead for part of the pool only: the rest are made when asked, the same way.
    model = surrogate._GpModel(proposer, snap, np.random.default_rng(0), pool[:5])
    measured = measured.copy()
    measured[train] = True
    mu, sd = model.posterior(pool, surrogate._Snapshot(train, y, measured))
    direct = GaussianProcessRegressor(model._kernel, optimizer=None)
    direct.fit(proposer._unit[train], (y - model._mean) / model._scale)
    mu2, sd2 = direct.predict(proposer._unit[pool], return_std=True)
    assert np.allclose(mu, mu2 * model._scale + model._mean, atol=1e-9)
    assert np.allclose(sd, sd2 * model._scale, atol=1e-9)
    # The snapshot's results alone: the model says what a fit on them says.
    alone, _ = model.posterior(pool, snap)
    refit, _ = proposer.gp_predict(train[:18], y[:18], pool)
    assert np.allclose(alone, refit, atol=1e-9) and not np.allclose(alone, mu, atol=1e-3)


def test_a_search_proposes_the_same_whatever_its_measurements_take():
    """A search of the default strategy fits ahead on a thread while measuring: how long each
    measurement takes (so how far each fit got) never changes what is proposed."""
    space, _, evaluate = rugged_space()
    delays = random.Random(7)

    def slow(config):
        time.sleep(delays.choice((0.0, 0.001, 0.004)))
        return evaluate(config)

    runs = [
        list(Search(space, measure, seed=11).run(Budget(max_configs=45)).results)
        for measure in (evaluate, slow)
    ]
    assert runs[0] == runs[1]


def test_overlapping_blas_limits_restore_the_process_limit_whoever_leaves_last():
    """A GP fit limits BLAS to one thread, process-wide; one on the proposer's thread and one on
    the caller's may overlap, the first in leaving first. BLAS is then as it was before either
    entered (each limit restoring what it saw on entry left it at one thread for the rest of
    the process). The interleaving is made here on one thread: OpenBLAS's reported count is
    only reliable from the thread that set it."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads() -> list[int]:
        info = threadpoolctl.threadpool_info()
        return [i["num_threads"] for i in info if i["user_api"] == "blas"]

    before = blas_threads()
    if not before or max(before) < 2:
        pytest.skip("BLAS runs one thread here already")
    first, second = surrogate._one_blas_thread(), surrogate._one_blas_thread()
    first.__enter__()
    second.__enter__()
    assert blas_threads() == [1] * len(before)
    first.__exit__(None, None, None)
    assert blas_threads() == [1] * len(before)  # the second is still fitting
    second.__exit__(None, None, None)
    assert blas_threads() == before


def test_a_search_that_stops_ends_its_fitting_thread_and_can_run_on():
    """The forest's fits ran on after its search stopped (budget used, job cancelled or
    interrupted), on a thread kept until the proposer was collected, into the next job's
    compiles. A run now closes the proposer: fits not started are dropped, the thread ends;
    a later run fits again, and proposes what one uninterrupted run would."""
    space = constrained_space()

    def kato_fit_threads() -> int:
        return sum(t.name.startswith("kato-fit") and t.is_alive() for t in threading.enumerate())

    before = kato_fit_threads()
    search = Search(space, timing, seed=5)
    search.run(Budget(max_configs=30))
    model = search.proposer._model
    assert model is not None and model._pool_executor is None and not model._fits
    deadline = time.monotonic() + 30
    while kato_fit_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kato_fit_threads() == before
    resumed = list(search.run(Budget(max_configs=45)).results)
    whole = list(Search(space, timing, seed=5).run(Budget(max_configs=45)).results)
    assert resumed == whole


# --- a sampled space: the rows grow around the best configs ---------------------------------


def sampled_space(monkeypatch) -> SearchSpace:
    """12 x 12 x 8 x 2 = 2304 combinations, 1536 valid, searched through a pool of 150."""
    from kato.tuner import space as space_module

    monkeypatch.setattr(space_module, "ENUMERATE_MAX", 500)
    monkeypatch.setattr(space_module, "POOL_SIZE", 150)
    space = SearchSpace(
        params={"a": tuple(range(12)), "b": tuple(range(12)), "c": tuple(range(8)), "d": (0, 1)},
        check=lambda c: "a + b divisible by 3" if (c["a"] + c["b"]) % 3 == 0 else None,
        screen=lambda cols: (cols["a"] + cols["b"]) % 3 != 0,
    )
    assert space.sampled and len(space.valid_configs()) == 150
    return space


def sampled_timing(config) -> TrialResult:
    """One smooth basin, its best (a=7, b=9, c=5, d=1) outside the pool."""
    t = 1 + 0.1 * (abs(config["a"] - 7) + abs(config["b"] - 9) + abs(config["c"] - 5))
    return TrialResult(config=config, status=TrialStatus.OK, times_ms=[t + 0.2 * (1 - config["d"])])


def grown_run(space, seed: int, budget: int, background: bool = False):
    proposer = ForestProposer(space, seed=seed, background=background)
    results: dict = {}
    for _ in range(budget):
        config = proposer.propose(results)
        assert space.is_valid(config) and space.key(config) not in results
        results[space.key(config)] = sampled_timing(config)
    proposer.close()
    return proposer, results


def test_on_a_sampled_space_the_search_reaches_past_the_pool_to_the_best(monkeypatch):
    space = sampled_space(monkeypatch)
    pool = {space.key(c) for c in space.valid_configs()}
    best = {"a": 7, "b": 9, "c": 5, "d": 1}
    assert space.key(best) not in pool
    in_pool = min(sampled_timing(c).time_ms for c in space.valid_configs())
    proposer, results = grown_run(space, seed=0, budget=60)
    assert space.key(best) in results  # found by steps from the best configs
    outside = [k for k in results if k not in pool]
    assert len(outside) > 10 and min(r.time_ms for r in results.values()) < in_pool
    # The rows: the pool, then only valid one-step neighbours of measured configs.
    rows = proposer.configs
    assert [space.key(c) for c in rows[:150]] == [space.key(c) for c in space.valid_configs()]
    measured = [r.config for r in results.values()]
    for config in rows[150:]:
        assert space.is_valid(config)
        assert any(sum(config[k] != m[k] for k in config) == 1 for m in measured)
    # A fixed pool (GROW_MAX 0) never leaves it.
    monkeypatch.setattr(surrogate, "GROW_MAX", 0)
    proposer, results = grown_run(space, seed=0, budget=60)
    assert len(proposer.configs) == 150 and set(results) <= pool


def test_grown_rows_are_the_same_with_models_fitted_ahead_and_bounded(monkeypatch):
    space = sampled_space(monkeypatch)
    now, results_now = grown_run(space, seed=2, budget=45)
    ahead, results_ahead = grown_run(space, seed=2, budget=45, background=True)
    assert list(results_now) == list(results_ahead)
    assert [space.key(c) for c in now.configs] == [space.key(c) for c in ahead.configs]
    monkeypatch.setattr(surrogate, "GROW_MAX", 20)
    bounded, _ = grown_run(space, seed=2, budget=45)
    assert 150 < len(bounded.configs) <= 150 + 20


def test_another_workers_results_outside_the_pool_become_rows_never_proposed(monkeypatch):
    space = sampled_space(monkeypatch)
    pool = {space.key(c) for c in space.valid_configs()}
    theirs = next(
        c for c in ({"a": a, "b": b, "c": 5, "d": 1} for a in range(12) for b in range(12))
        if space.is_valid(c) and space.key(c) not in pool
    )  # fmt: skip
    invalid = {"a": 0, "b": 3, "c": 0, "d": 0}
    proposer = ForestProposer(space, seed=1)
    results = {
        space.key(theirs): TrialResult(config=theirs, status=TrialStatus.PENDING),
        space.key(invalid): sampled_timing(invalid),
    }
    for _ in range(30):
        config = proposer.propose(results)
        assert space.key(config) not in results
        results[space.key(config)] = sampled_timing(config)
    assert space.key(theirs) in proposer.index and space.key(invalid) not in proposer.index
