"""benchmarks/matmul_sweep.py without a GPU: the configs a case selects (``--where``,
``--list``) and the best row per value of a parameter (``--best-by``)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import matmul_sweep

ISSUE_CASE = ("matmul_tn", (768, 3072, 8192), "bfloat16")


def test_where_selects_the_stream_k_configs():
    configs = matmul_sweep.select(*ISSUE_CASE, where={"STREAM_K": {1}})
    assert len(configs) == 54 and all(c["STREAM_K"] == 1 for c in configs)
    both = matmul_sweep.select(*ISSUE_CASE, where={"STREAM_K": {0, 1}, "PERSISTENT": {1}})
    assert {c["STREAM_K"] for c in both} == {0, 1} and all(c["PERSISTENT"] for c in both)


def test_where_refuses_a_name_the_operator_lacks():
    with pytest.raises(SystemExit, match="STREAMK"):
        matmul_sweep.select(*ISSUE_CASE, where={"STREAMK": {1}})


def test_list_prints_the_configs_without_a_gpu(monkeypatch, capsys):
    argv = ["matmul_sweep.py", "--out", "/dev/null", "--list", "--dtypes", "bfloat16"]
    argv += ["--case", "matmul_tn:768x3072x8192", "--where", "STREAM_K=1"]
    monkeypatch.setattr(sys, "argv", argv)
    matmul_sweep.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "matmul_tn 768x3072x8192 bfloat16: 54 configs"
    assert len(lines) == 55 and all(line.endswith("STREAM_K=1") for line in lines[1:])


def test_best_by_takes_the_fastest_measured_row_per_value():
    rows = [
        {"config": {"STREAM_K": 0}, "time_ms": 2.0},
        {"config": {"STREAM_K": 1}, "time_ms": None},  # failed: not a time
        {"config": {"STREAM_K": 1}, "time_ms": 1.5},
        {"config": {"STREAM_K": 0}, "time_ms": 1.8},
    ]
    best = matmul_sweep.best_by({"rows": rows}, "STREAM_K")
    assert {value: row["time_ms"] for value, row in best.items()} == {0: 1.8, 1: 1.5}
