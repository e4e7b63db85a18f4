"""benchmarks/compile_contention.py with stand-in compiles (a sleep holding a slot): every
config a job's search asks for is compiled and taken once, in both modes; and, as a timing
check under the slow marker, a take waits about one compile by urgency and longer first come,
first served when other jobs' compiles ahead fill the slots."""

from __future__ import annotations

import json

import pytest

from benchmarks import compile_contention


def run(tmp_path, *extra):
    out = tmp_path / "contention.json"
    report = compile_contention.main(
        ["--fake-compile-s", "0.05", "--slots", "8", "--workers", "7", "--budget", "5",
         "--think", "0", "--measure", "0.01", "--out", str(out), *extra]
    )  # fmt: skip
    assert json.loads(out.read_text())["modes"] == report["modes"]
    return report


def test_every_asked_config_is_taken_once_in_both_modes(tmp_path):
    report = run(tmp_path)
    assert [m["mode"] for m in report["modes"]] == ["fifo", "urgency"]
    assert report["nvcc_slots"] == 8 and report["reserved"] == 1
    for mode in report["modes"]:
        assert len(mode["jobs"]) == 3
        for job in mode["jobs"]:
            assert job["asked"] == 5 == len(job["waits_s"]) and job["failed"] == 0
            assert job["ahead"] + job["inline"] == 5
            assert job["space"] > 5
        assert mode["take_wait_s"]["max"] >= mode["take_wait_s"]["mean"] > 0


def test_slots_need_stand_in_compiles(tmp_path):
    with pytest.raises(SystemExit):
        compile_contention.main(["--slots", "4", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow
def test_a_take_waits_less_by_urgency_than_first_come_first_served(tmp_path):
    report = compile_contention.main(
        ["--fake-compile-s", "0.3", "--slots", "16", "--workers", "15", "--budget", "8",
         "--out", str(tmp_path / "c.json")]
    )  # fmt: skip
    fifo, urgency = (m["take_wait_s"]["mean"] for m in report["modes"])
    assert urgency < 0.6 * fifo, (fifo, urgency)
    assert urgency < 2 * 0.3  # about one compile: the reserve is free for it
