"""benchmarks/verdicts.py: Welch intervals and above / level / below verdicts from a report."""

from __future__ import annotations

import json

import pytest
from paths import REPO

from benchmarks import verdicts
from benchmarks.verdicts import compare, report_verdicts, space_verdicts

COMMITTED = REPO / "data" / "benchmarks" / "search_quality.json"


def test_a_clear_gap_is_above_and_its_mirror_below():
    kato = [0.90, 0.91, 0.92, 0.93]
    other = [0.50, 0.52, 0.51, 0.49]
    c = compare(kato, other)
    assert c.difference == pytest.approx(0.41)
    assert 0 < c.low < 0.41 < c.high and c.verdict == "above"
    mirror = compare(other, kato)
    assert mirror.verdict == "below"
    assert (mirror.low, mirror.high) == pytest.approx((-c.high, -c.low))


@pytest.mark.parametrize(
    ("kato", "other"),
    [
        ([0.90, 0.95, 1.00, 0.85, 0.99], [0.88, 0.97, 0.93, 0.80]),  # overlapping spreads
        ([1.0] * 6, [0.90, 0.95, 1.00, 0.85]),  # one side constant
        ([0.70, 1.00, 0.93, 1.00, 0.65, 1.00], [0.83, 0.84, 0.82, 0.83, 0.84]),
    ],
)
@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")  # scipy, on the constant side
def test_the_interval_is_welchs(kato, other):
    """The same interval as scipy's Welch t-test (unequal variances), a constant side too."""
    from scipy.stats import ttest_ind

    c = compare(kato, other)
    ci = ttest_ind(kato, other, equal_var=False).confidence_interval(verdicts.CONFIDENCE)
    assert (c.low, c.high) == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert c.verdict == ("above" if ci.low > 0 else "below" if ci.high < 0 else "level")


def test_a_small_gap_within_the_noise_is_level():
    c = compare([0.90, 0.95, 1.00, 0.85, 0.99], [0.88, 0.97, 0.93, 0.80])
    assert c.low < 0 < c.high and c.verdict == "level"


def test_two_constant_sides():
    assert compare([1.0] * 5, [1.0] * 3).verdict == "level"
    c = compare([1.0] * 5, [0.9] * 3)
    assert c.verdict == "above" and c.low == c.high == pytest.approx(0.1)


def test_fewer_than_two_runs_is_an_error():
    with pytest.raises(ValueError, match="at least two runs"):
        compare([1.0], [0.9, 0.8])


def _methods(**per_seed: list[float]) -> dict:
    return {label: {"100": {"per_seed": runs}} for label, runs in per_seed.items()}


def test_the_verdict_against_every_strategy():
    kato = [0.95, 0.96, 0.97, 0.96]
    low = [0.60, 0.62, 0.61, 0.63]
    methods = _methods(**{"kato:forest": kato, "kt:a": low, "kt:b": [0.70, 0.72, 0.71, 0.69]})
    v = space_verdicts(methods, "100")
    assert v["against_every"] == "above" and v["best_strategy"] == "b"
    assert v["below"] == [] and v["kato_mean"] == pytest.approx(0.96)

    # One strategy clearly better: below, whichever has the best mean.
    methods["kt:c"] = {"100": {"per_seed": [0.99, 0.995, 0.99, 0.995]}}
    v = space_verdicts(methods, "100")
    assert v["against_every"] == "below" and v["below"] == ["c"] and v["best_strategy"] == "c"

    # Level with one and above the rest: level.
    methods["kt:c"] = {"100": {"per_seed": [0.90, 1.0, 0.95, 0.99]}}
    v = space_verdicts(methods, "100")
    assert v["against_every"] == "level" and v["below"] == []
    assert set(v["per_strategy"]) == {"a", "b", "c"}


def test_a_report_without_kernel_tuner_strategies_is_refused():
    with pytest.raises(ValueError, match="no Kernel Tuner strategy"):
        space_verdicts(_methods(**{"kato:forest": [1.0, 0.9]}), "100")


def test_the_committed_table_at_budget_100():
    """What the README and the closing note claim from Table 1 (40 seeds): at budget 100 Kato's
    default is below no Kernel Tuner strategy on the fifteen spaces (batchnorm_stats
    32x256x56x56 float16 was, 0.986 against bayes_opt's 0.999, before the search's ``gp``
    move), above every one on twelve of them (ten before Kernel Tuner's bayes_opt was fixed by
    the seed), convolution A4000 and gemm among them."""
    report = json.loads(COMMITTED.read_text())
    got = report_verdicts(report, ["100"])
    assert len(got) == 15
    below = {name: v["100"]["below"] for name, v in got.items() if v["100"]["below"]}
    assert below == {}
    above = [name for name, v in got.items() if v["100"]["against_every"] == "above"]
    assert len(above) == 12
    for name in ("convolution_milo/A4000", "gemm_kerneltuner/RTX_3090"):
        assert name in above


def test_cli_writes_the_verdicts_and_refuses_a_bad_report(tmp_path, capsys):
    runs = {"kato:forest": [1.0, 0.99, 1.0], "kt:a": [0.5, 0.6, 0.55]}
    report = {
        "budgets": [100],
        "kato_default": "forest",
        "files": {"s": {"methods": _methods(**runs)}},
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "v.json"
    assert verdicts.main([str(path), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["s"]["100"]["against_every"] == "above"
    assert "above every strategy on 1" in capsys.readouterr().out

    path.write_text("{}")
    assert verdicts.main([str(path)]) == 2
    assert "cannot compare" in capsys.readouterr().err
