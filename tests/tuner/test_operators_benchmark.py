"""benchmarks/operators.py's CPU side: the awkward case set (issue 31) and the figures each
row reports. The GPU run itself is the lead's (the report's command)."""

from __future__ import annotations

import json
import math

import pytest
from kato.kernels import get_operator
from kato.tuner.trial_cost import launch_lower_bound_s

from benchmarks import operators
from benchmarks.torch_ops import modules
from kato.shared.gpus import get_gpu

H200 = get_gpu("H200")
#: float32 FFMA peak of the H200 (132 SMs x 128 lanes x 2 FLOPs x 1.98 GHz), for matmul's bound.
FP32_PEAK = 132 * 128 * 2 * 1.98e9


def test_every_awkward_case_is_a_valid_problem_with_a_pytorch_equivalent():
    torch_ops = modules()
    for operator, shape, dtype, why in operators.AWKWARD_CASES:
        spec = get_operator(operator)
        assert tuple(spec.validate(shape, dtype)) == tuple(shape)
        config = spec.default_config(shape, dtype)
        assert spec.check(config, shape, dtype) is None, (operator, shape, config)
        assert operator in torch_ops and why


def test_the_awkward_set_covers_the_issues_kinds_of_shape():
    shapes = {(o, s) for o, s, _, _ in operators.AWKWARD_CASES}
    assert {"softmax", "layernorm", "rmsnorm", "reduce_sum", "reduce_sum_all", "relu"} <= {
        o for o, _ in shapes
    }
    assert {"transpose", "cross_entropy", "matmul"} <= {o for o, _ in shapes}
    assert ("softmax", (2048, 50257)) in shapes  # a vocabulary: odd, prime
    assert ("reduce_sum", (4, 16777216)) in shapes  # few long rows
    assert ("softmax", (8, 4194301)) in shapes and ("softmax", (64, 1048573)) in shapes
    assert ("reduce_sum", (1, 67108863)) in shapes
    assert any(s[-1] == 7 and s[0] >= 2**20 for _, s in shapes)  # many short rows
    assert any(o == "reduce_sum_all" and s[0] == 2**26 + 1 for o, s in shapes)
    assert ("matmul", (1000, 1001, 999)) in shapes and ("matmul", (4095, 4097, 1003)) in shapes
    for _, shape in shapes:  # every case has a length that is no multiple of a vector
        assert any(d % 8 for d in shape), shape


@pytest.mark.parametrize("case", operators.AWKWARD_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_each_awkward_launch_is_between_0_05_and_5_ms_on_the_h200(case):
    """Long enough to time, short enough that 16 cases tune at budget 20 in minutes: bytes at
    the H200's peak bandwidth for memory-bound operators, FLOPs at float32 FFMA peak for matmul
    (floors; the real launch is slower, so the 0.045 ms floor is the 0.05 ms target)."""
    operator, shape, dtype, _ = case
    spec = get_operator(operator)
    if operator == "matmul":
        ms = 1e3 * spec.flops(shape, dtype) / FP32_PEAK
        assert 0.02 <= ms <= 5.0, ms
    else:
        ms = 1e3 * launch_lower_bound_s(spec, shape, dtype, H200)
        assert 0.045 <= ms <= 5.0, ms


def test_awkward_selectors_pick_within_the_awkward_set():
    every = operators.cases(None, awkward=True)
    assert every == [(o, tuple(s), d) for o, s, d, _ in operators.AWKWARD_CASES]
    picked = operators.cases(["reduce_sum", "matmul:1000x1001x999"], awkward=True)
    assert [c[0] for c in picked] == ["reduce_sum"] * 3 + ["matmul"]
    assert picked[-1] == ("matmul", (1000, 1001, 999), "float32")
    assert ("reduce_sum", (4, 16777216), "float32") not in operators.cases(None)
    with pytest.raises(SystemExit):
        operators.cases(["no_such_op"], awkward=True)


def test_a_memory_bound_row_reports_the_share_of_copy_bandwidth():
    row = operators.make_row(
        "reduce_sum",
        (4, 16777216),
        "float32",
        bytes_moved=268435472,
        flops=0,
        kato_ms=0.0625,
        torch_ms=0.125,
        copy_gbs=4295.0,
    )
    assert row["speedup"] == 2.0
    assert row["kato_gbs"] == pytest.approx(268435472 / 0.0625 / 1e6)
    assert row["kato_pct_copy"] == pytest.approx(100 * row["kato_gbs"] / 4295.0)
    assert row["torch_pct_copy"] == pytest.approx(row["kato_pct_copy"] / 2)
    assert row["pct_cublas"] is None and row["kato_tflops"] is None


def test_a_matmul_row_reports_the_share_of_cublas_not_of_copy():
    flops = 2 * 4095 * 4097 * 1003
    row = operators.make_row(
        "matmul",
        (4095, 4097, 1003),
        "float32",
        bytes_moved=10**8,
        flops=flops,
        kato_ms=1.0,
        torch_ms=0.8,
        copy_gbs=4295.0,
    )
    assert row["pct_cublas"] == pytest.approx(80.0)
    assert row["kato_tflops"] == pytest.approx(flops / 1e9)
    assert row["kato_pct_copy"] is None and row["torch_pct_copy"] is None


def test_a_failed_config_has_no_kato_figures():
    row = operators.make_row(
        "matmul", (8, 8, 8), "float32", bytes_moved=768, flops=1024, kato_ms=None,
        torch_ms=0.01, copy_gbs=4000.0,
    )  # fmt: skip
    assert row["speedup"] is None and row["pct_cublas"] is None and row["kato_gbs"] is None
    assert not math.isnan(row["torch_gbs"])


def test_a_full_selector_off_the_set_is_a_case_of_its_own():
    picked = operators.cases(["transpose:8191x8193:float32", "transpose:8192x8192:float32"])
    assert picked == [
        ("transpose", (8191, 8193), "float32"),
        ("transpose", (8192, 8192), "float32"),
    ]
    assert operators.cases(["transpose:8191x8193"]) == []  # no dtype: only the set's cases
    with pytest.raises(SystemExit, match="rank"):
        operators.cases(["transpose:8191:float32"])
    with pytest.raises(SystemExit):
        operators.cases(["transpose:8191xabc:float32"])


def test_where_filters_parse_to_integer_sets():
    assert operators.parse_where(["HINTS=0,1,2", "TILE=64"]) == {"HINTS": {0, 1, 2}, "TILE": {64}}
    assert operators.parse_where(None) == {}
    for bad in ("HINTS", "HINTS=", "=1", "HINTS=a"):
        with pytest.raises(SystemExit, match="PARAM=V1,V2"):
            operators.parse_where([bad])


def test_a_sweep_takes_the_valid_configs_that_match_hints_side_by_side():
    """Issue 31's cache-hint comparison: the configs that pass check() and take the listed
    values, those differing only in HINTS (the last parameter) one after another."""
    spec = get_operator("transpose")
    where = operators.parse_where(
        ["TILE=64", "VEC=1,2,4", "RPT=4,8", "SMEM=1,2", "MIN_BLOCKS=0,4", "HINTS=0,1,2", "SKEW=0"]
    )
    configs = operators.sweep_configs(spec, (8191, 8193), "float32", where)
    assert len(configs) == 54  # 72 combinations; MIN_BLOCKS=4 rules out 18 (threads or registers)
    assert all(spec.check(c, (8191, 8193), "float32") is None for c in configs)
    assert all(c[k] in where[k] for c in configs for k in where)
    for i in range(0, len(configs), 3):
        triple = configs[i : i + 3]
        assert [c["HINTS"] for c in triple] == [0, 1, 2]
        assert len({tuple(v for k, v in c.items() if k != "HINTS") for c in triple}) == 1
    # The skewed tiles' comparison (SKEW, the last parameter): twins one after the other, every
    # SKEW=1 config valid wherever its SKEW=0 twin is at the odd shape.
    where = operators.parse_where(
        ["TILE=64", "VEC=1,2,4", "RPT=4,8", "SMEM=1", "MIN_BLOCKS=0,4", "HINTS=2", "SKEW=0,1"]
    )
    configs = operators.sweep_configs(spec, (8191, 8193), "float32", where)
    assert len(configs) == 18  # 24 combinations; MIN_BLOCKS=4 rules out 6
    for i in range(0, len(configs), 2):
        pair = configs[i : i + 2]
        assert [c["SKEW"] for c in pair] == [0, 1]
        assert pair[0] == {**pair[1], "SKEW": 0}
    with pytest.raises(SystemExit, match="no parameter NOPE"):
        operators.sweep_configs(spec, (64, 64), "float32", {"NOPE": {1}})
    with pytest.raises(SystemExit, match="no valid"):
        operators.sweep_configs(spec, (64, 64), "float32", {"TILE": {16}, "VEC": {4}, "RPT": {4}})


def test_sweep_configs_draws_from_the_spec_candidates():
    """matmul lists its candidates (its whole product is 24 million configs): the sweep takes
    the valid ones with the listed values, in the spec's order, as matmul_sweep.py does."""
    from benchmarks import matmul_sweep

    spec = get_operator("matmul_tn")
    case = ((768, 3072, 8192), "bfloat16")
    where = {"STREAM_K": {1}, "EPILOGUE": {0}}
    configs = operators.sweep_configs(spec, *case, where)
    assert len(configs) == 29 and all(c["STREAM_K"] == 1 and not c["EPILOGUE"] for c in configs)
    assert configs == matmul_sweep.select("matmul_tn", *case, where, engine="any")


def test_best_by_takes_the_fastest_timed_row_per_value(capsys):
    def row(hints, ms, vec=1):
        r = operators.make_row(
            "transpose", (8191, 8193), "float32", bytes_moved=2 * 8191 * 8193 * 4, flops=0,
            kato_ms=ms, torch_ms=0.55, copy_gbs=3029.0,
        )  # fmt: skip
        r.update(source="sweep", config={"VEC": vec, "HINTS": hints}, error="boom")
        return r

    rows = [row(0, 0.25), row(1, 0.21), row(0, 0.24, vec=4), row(1, None), row(2, None)]
    best = operators.best_by(rows, "HINTS")
    assert list(best) == [0, 1]  # HINTS=2 never timed
    assert best[0]["kato_ms"] == 0.24 and best[0]["config"]["VEC"] == 4
    assert best[1]["kato_ms"] == 0.21
    operators.print_row(best[1], prefix="HINTS=1")
    operators.print_row(rows[-1])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("HINTS=1: VEC=1 HINTS=1") and "0.2100" in lines[0]
    assert "FAILED boom" in lines[1] and lines[1].endswith("VEC=1 HINTS=2")


def test_a_sweep_writes_every_row_and_the_best_per_value(tmp_path, monkeypatch, capsys):
    """The ``--where`` run end to end with the device parts stood in: one row per matching
    config (a failed one too), the JSON's best per HINTS value per case, the summary table."""
    import sys
    import types

    from kato.tuner.backends import pycuda
    from kato.tuner.backends.base import DeviceInfo, TrialResult, TrialStatus

    import benchmarks.torch_ops

    class FakeBackend:
        def __init__(self, spec, shape, dtype, repeats):
            self.shape = tuple(shape)

        def precompile(self, configs):
            self.compiled = len(configs)

        def evaluate(self, config):
            if config["VEC"] == 4 and config["HINTS"] == 2:
                return TrialResult(dict(config), TrialStatus.VERIFY_ERROR, error="mismatch")
            ms = 0.25 - 0.01 * config["HINTS"] - 0.001 * config["VEC"]
            return TrialResult(dict(config), TrialStatus.OK, times_ms=[ms], registers=30)

        def close(self):
            pass

    device = DeviceInfo("NVIDIA H100 80GB HBM3", "H100-SXM", (9, 0), "13.0")
    monkeypatch.setattr(pycuda, "PyCudaBackend", FakeBackend)
    monkeypatch.setattr(pycuda, "describe_device", lambda index: device)
    monkeypatch.setattr(operators, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(operators, "torch_time_ms", lambda fn: 0.55)
    torch_transpose = types.SimpleNamespace(CASES=[], make=lambda shape, dtype: None)
    monkeypatch.setattr(benchmarks.torch_ops, "modules", lambda: {"transpose": torch_transpose})
    out = tmp_path / "sweep.json"
    argv = ["operators.py", "--out", str(out), "--case", "transpose:8191x8193:float32"]
    argv += ["--where", "TILE=64", "--where", "VEC=1,4", "--where", "RPT=4"]
    argv += ["--where", "SMEM=2", "--where", "MIN_BLOCKS=0", "--where", "HINTS=0,1,2"]
    argv += ["--where", "SKEW=0"]
    monkeypatch.setattr(sys, "argv", argv)
    operators.main()
    report = json.loads(out.read_text())
    assert report["copy_gbs"] == 3000.0 and report["where"]["HINTS"] == [0, 1, 2]
    assert [(r["config"]["VEC"], r["config"]["HINTS"]) for r in report["rows"]] == [
        (v, h) for v in (1, 4) for h in (0, 1, 2)
    ]
    failed = [r for r in report["rows"] if r["kato_ms"] is None]
    assert [(r["status"], r["error"]) for r in failed] == [("verify_error", "mismatch")]
    best = {(b["param"], b["value"]): b for b in report["best_by"]}
    assert set(best) == {("VEC", 1), ("VEC", 4), ("HINTS", 0), ("HINTS", 1), ("HINTS", 2)}
    assert best[("HINTS", 2)]["config"]["VEC"] == 1  # VEC=4 HINTS=2 failed
    assert best[("HINTS", 1)]["kato_ms"] == pytest.approx(0.236)
    assert best[("HINTS", 1)]["kato_pct_copy"] == pytest.approx(
        100 * 2 * 8191 * 8193 * 4 / 0.236 / 1e6 / 3000.0
    )
    text = capsys.readouterr().out
    assert "best per value of VEC, HINTS" in text and "HINTS=1: TILE=64 VEC=4" in text
