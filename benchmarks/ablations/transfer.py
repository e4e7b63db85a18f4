"""Another GPU's log-time as one more feature of the trees (a transfer lead). ``SRC`` names the
other GPU's recorded space (same kernel and parameters). ``SRC_MODE=full``: its measured
log-time for every config (the whole file, more than a database would hold); ``run``: what a
forest fitted on the source's own default run of 100 configs (seed + 1000) predicts, which is
what the database holds after one job there. Configs the source lacks get the median.

Measured (seeds 0-39, conv A4000 from A100; default 0.801 / 0.900 / 0.967 at 25 / 50 / 100)::

    SRC=data/datasets/benchmark_hub/cachefiles/convolution_milo/A100.json.gz \\
    python3 benchmarks/search_ablation.py --spaces convolution_milo/A4000 --seeds 0:40 \\
        --budgets 25,50,100 --patch benchmarks/ablations/transfer.py

``run``: 0.808 / 0.897 / 0.962 (no gain). An earlier session measured ``full``: A4000 from A100
0.890 / 0.988 / 1.000, A100 from A4000 0.674 / 0.770 / 0.882 (default 0.688 / 0.800 / 0.889).
Not built.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import math
import os

import numpy as np
from kato.tuner.backends.replay import ReplayBackend

from kato.shared.kt_cache import load_cache

SRC = os.environ["SRC"]
MODE = os.environ.get("SRC_MODE", "run")
_init = surrogate.ForestProposer.__init__
_fit_predict = surrogate.ForestProposer._fit_predict
_building_source = False


def source_log_times(seed):
    """Config key -> the source's log-time (``full``) or its forest's prediction (``run``)."""
    global _building_source
    backend = ReplayBackend(load_cache(SRC))
    space = backend.space()
    if MODE == "full":
        times = {space.key(c): backend.evaluate(c).time_ms for c in space.valid_configs()}
        return {k: math.log(t) for k, t in times.items() if t}
    _building_source = True
    try:
        proposer = surrogate.ForestProposer(space, seed=seed + 1000)
    finally:
        _building_source = False
    results = {}
    while len(results) < 100:
        config = proposer.propose(results)
        results[space.key(config)] = backend.evaluate(config)
    logs = [math.log(r.time_ms) if r.time_ms else None for r in results.values()]
    worst = max(v for v in logs if v is not None)
    train = np.array([proposer.index[k] for k in results], dtype=np.int64)
    y = np.array([worst if v is None else v for v in logs])
    mu, _, _ = _fit_predict(proposer, train, y, np.arange(len(proposer.configs)))
    return {k: float(mu[i]) for k, i in proposer.index.items()}


def init(self, space, seed=0, **kwargs):
    _init(self, space, seed, **kwargs)
    if _building_source:
        return
    known = source_log_times(seed)
    column = np.array([known.get(space.key(c), np.nan) for c in self.configs])
    column = np.where(np.isnan(column), np.nanmedian(column), column)
    self._with_source = np.column_stack([self.X, column]).astype(np.float32)


def fit_predict(self, train, y, pool, rng=None):
    """The trees see the source column; the design and the neighbourhoods do not."""
    plain = self.X
    self.X = getattr(self, "_with_source", plain)
    try:
        return _fit_predict(self, train, y, pool, rng)
    finally:
        self.X = plain


surrogate.ForestProposer.__init__ = init
surrogate.ForestProposer._fit_predict = fit_predict
