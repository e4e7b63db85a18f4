"""benchmarks/search_ablation.py: its fast runs are the default search's runs; overrides apply."""

from __future__ import annotations

import itertools

import pytest
from kato.tuner import surrogate
from kato.tuner.replay_eval import replay_search
from paths import RECORDED

from benchmarks import search_ablation

SPACE = str(RECORDED / "softmax_H200_4096x4096_float16.json.gz")


def test_a_trace_reaches_what_the_default_search_reaches_for_the_same_seed():
    """Driving the proposer directly must not change a run: the ablation bench is only worth
    having if its figures are the ones ``kato replay`` and search_quality.py report."""
    report = replay_search(SPACE, budget=40, repeats=3, seed=5)
    for run in report.per_seed:
        curve = search_ablation.trace(SPACE, run["seed"], 40)
        assert len(curve) == run["measured"]
        assert search_ablation.at(curve, 40) == pytest.approx(run["fraction_of_optimum"])
        assert all(b >= a for a, b in itertools.pairwise(curve))


def test_summaries_count_runs_left_in_a_poor_basin():
    curves = [[0.5, 0.6, 0.9, 1.0], [0.5, 0.5, 0.6, 0.6], [0.8, 0.8, 0.8, 0.8]]
    s = search_ablation.summarise(curves, [2, 4], stuck=0.7)
    assert s["mean"] == {"2": pytest.approx(0.6333333), "4": pytest.approx(0.8)}
    assert s["stuck_budget"] == 4 and s["stuck_runs"] == 1
    assert s["first_above_stuck_quartiles"] == [1, 3, None]


def test_overrides_set_constants_and_run_a_patch(tmp_path, monkeypatch):
    monkeypatch.setattr(surrogate, "N_INITIAL", surrogate.N_INITIAL)
    monkeypatch.setattr(surrogate, "N_TREES", surrogate.N_TREES)
    patch = tmp_path / "patch.py"
    patch.write_text("surrogate.N_TREES = surrogate.N_TREES + 1\n")
    trees = surrogate.N_TREES
    sets = search_ablation.parse_sets(["N_INITIAL=7", "MOVES=('ei', 'walk')"])
    assert sets == {"N_INITIAL": 7, "MOVES": ("ei", "walk")}
    monkeypatch.setattr(surrogate, "MOVES", surrogate.MOVES)
    search_ablation.apply_overrides(sets, str(patch))
    assert surrogate.N_INITIAL == 7 and surrogate.MOVES == ("ei", "walk")
    assert trees + 1 == surrogate.N_TREES


@pytest.mark.parametrize("item", ["NOPE=1", "N_INITIAL", "n_initial=3", "N_INITIAL=abs(3)"])
def test_a_bad_override_is_refused_with_what_to_fix(item):
    with pytest.raises(ValueError, match="--set"):
        search_ablation.parse_sets([item])


ABLATIONS = search_ablation.REPO / "benchmarks" / "ablations"
MOVES = ("ei", "local", "ei", "{}", "ei", "local", "ei", "flip")


@pytest.mark.parametrize(
    ("patches", "move", "env", "changes"),
    [
        (["subspace.py"], "sub", {}, True),
        (["coverage.py"], "cover", {}, True),
        (["cuda_design.py"], None, {}, False),  # the space has no block_size_* parameters
        (["leaf3.py"], None, {}, True),
        (["leaf3.py", "poll.py"], "poll", {}, True),
        (["oob_leaf.py"], None, {}, True),
        (["certified_restart.py"], "poll", {}, True),
        (["transfer.py"], None, {"SRC": SPACE, "SRC_MODE": "full"}, True),
        (["bore.py"], "bore", {}, True),
        (["additive.py"], "add", {}, True),
        (["additive.py"], "add", {"TWOF": "1"}, True),
        (["onehot.py"], None, {}, True),
    ],
)
def test_the_recorded_ablation_patches_still_apply(patches, move, env, changes, monkeypatch):
    """The patches in benchmarks/ablations are how docs/search.md's figures are
    reproduced: each must still apply to the proposer and give a valid run."""
    for name in ("__init__", "_propose", "_fit_predict", "_space_filling"):
        monkeypatch.setattr(surrogate.ForestProposer, name, getattr(surrogate.ForestProposer, name))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if move:  # the same turns without the patch: an unknown move is an ``ei`` turn there
        monkeypatch.setattr(surrogate, "MOVES", tuple(m.format(move) for m in MOVES))
    unpatched = [search_ablation.trace(SPACE, seed, 40) for seed in (1, 2)]
    search_ablation.apply_overrides({}, [str(ABLATIONS / p) for p in patches])
    runs = [search_ablation.trace(SPACE, seed, 40) for seed in (1, 2)]
    for curve in runs:
        assert len(curve) == 40 and 0.0 < curve[-1] <= 1.0
        assert all(b >= a for a, b in itertools.pairwise(curve))
    assert (runs != unpatched) == changes
