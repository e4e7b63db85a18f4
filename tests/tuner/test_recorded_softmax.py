"""Softmax measured on the H200 (tests/data/recorded, exported from Kato's own tuning jobs)
replays in CI: the same conformance suite as the live pycuda backend, and the recording agrees
with the spec (every recorded config valid for its shape) and with the committed winners."""

from __future__ import annotations

import json

import pytest
from backend_conformance import BackendConformance
from kato.kernels import get_operator
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.replay_eval import replay_search
from paths import RECORDED, REPO

from kato.shared.kt_cache import load_cache

FILES = sorted(RECORDED.glob("softmax_H200_*.json.gz"))


def test_recordings_present():
    assert len(FILES) == 8, "expected fp32 and fp16 at four shapes"


@pytest.fixture(scope="module")
def backend():
    return ReplayBackend(RECORDED / "softmax_H200_32768x4096_float16.json.gz")


class TestRecordedSoftmaxConformance(BackendConformance):
    @pytest.fixture
    def reference_config(self, backend):
        _, entry = backend.cache.best()
        return {p: entry[p] for p in backend.cache.params}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.split(".")[0])
def test_recording_matches_the_spec_and_the_winners(path):
    cache = load_cache(path)
    spec = get_operator("softmax")
    shape, dtype = tuple(cache.problem_size), cache.extra["dtype"]
    assert cache.extra["kato_operator_version"] == spec.version, "kernel changed: re-record"
    assert cache.params == list(spec.params)
    for entry in cache.entries.values():
        config = {p: entry[p] for p in cache.params}
        assert spec.check(config, shape, dtype) is None, config
    assert ReplayBackend(cache).device().model == "H200"
    winners = json.loads((REPO / "data" / "tuned_h200.json").read_text())["best_configs"]
    (mine,) = [w for w in winners if tuple(w["shape"]) == shape and w["dtype"] == dtype]
    _, best = cache.best()
    assert mine["config"] == {p: best[p] for p in cache.params}
    assert mine["time_ms"] == pytest.approx(best["time"])


def test_search_on_the_recording_finds_its_best():
    """Searching the recorded space (100 measured configs) with a budget of 60 gets within a
    few percent of its best, for every seed."""
    report = replay_search(FILES[0], budget=60, repeats=3, seed=0)
    assert report.min_fraction_of_optimum > 0.9, report.per_seed
