"""benchmarks/lookahead_sim.py: the simulated job drives the real Search with asking ahead."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The name ends in the operator's version (it changes with the code): the one committed.
(SPACE,) = (ROOT / "data/spaces/h200").glob("softmax_H200_32768x4096_float16_*.json.gz")


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location(
        "lookahead_sim", ROOT / "benchmarks/lookahead_sim.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def options(**kw) -> argparse.Namespace:
    base = dict(budget=40, compile_workers=4, search_s=0.075, measure_s=0.02, prepare_s=1.0)
    return argparse.Namespace(**{**base, **kw})


def test_asking_ahead_cuts_the_simulated_nvcc_wait_and_still_measures_the_budget(sim):
    one = sim.run(SPACE, 1, seed=3, args=options())
    four = sim.run(SPACE, 4, seed=3, args=options())
    assert 0 < four["nvcc_wait_s"] < one["nvcc_wait_s"]
    assert four["wall_s"] < one["wall_s"]
    assert 0.5 < four["fraction_of_optimum"] <= 1.0 and 0.5 < one["fraction_of_optimum"] <= 1.0


def test_free_compiles_leave_nothing_to_wait_for(sim):
    # Compiles that take no time: the GPU never waits, only the inputs come first.
    args = options(compile_workers=64)
    job = sim.SimulatedJob(sim.ReplayBackend(SPACE), args)
    job.compile_s = dict.fromkeys(job.compile_s, 0.0)
    config = job.space.valid_configs()[0]
    job.evaluate(config)
    assert job.nvcc_wait == 0.0 and job.clock == pytest.approx(1.0 + 0.02)
