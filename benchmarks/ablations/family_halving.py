"""A ``sh`` move: successive halving over the code-path families (combinations of the
two-valued parameters) in the first ``SH_END`` measurements, then an ``ei`` turn.

Between the design and ``SH_END`` the measurements are split into rounds, one per halving
(ceil(log2(families)) + 1 of them). In round k the families still in play are the best
ceil(families / 2^k) by their best measured log-time (``SH_STAT=q``: the ``SH_Q`` quantile),
and a ``sh`` turn goes to the least-measured of those (ties: the better one), where the
forest's expected improvement over its unmeasured configs picks the config. Stateless: the
round and the families in play follow from the results alone. ``SH_EVERY=1`` makes every
turn before ``SH_END`` a ``sh`` turn, whatever ``MOVES`` says.

Measured (seeds 0-79, conv A100 / A4000 at budget 100; default 0.904 / 0.977, 14 A100 runs
below 0.7)::

    SH_END=50 SH_STAT=min \\
    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:80 --budgets 25,50,100 \\
        --patch benchmarks/ablations/family_halving.py \\
        --set 'MOVES=("sh","local","gp","walk","sh","local","sh","flip")'

by the best: 0.888 / 0.965 (17 below 0.7); by the median (``SH_STAT=q SH_Q=0.5``): 0.902 /
0.964 (13 below 0.7, but the optimum found 29 times instead of 37). Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import math
import os

import numpy as np

from benchmarks.ablations._common import expected_improvement

END = int(os.environ.get("SH_END", "50"))
STAT = os.environ.get("SH_STAT", "min")
Q = float(os.environ.get("SH_Q", "0.25"))
EVERY = os.environ.get("SH_EVERY", "0") == "1"
_propose = surrogate.ForestProposer._propose


def families(self):
    """Family index of every valid config, and the number of families."""
    if not hasattr(self, "_fam"):
        if not self._flags:
            self._fam, self._nfam = np.zeros(len(self.configs), dtype=np.int64), 1
        else:
            rows = self.X[:, self._flags]
            _, inv = np.unique(rows, axis=0, return_inverse=True)
            self._fam, self._nfam = inv.ravel().astype(np.int64), int(inv.max()) + 1
    return self._fam, self._nfam


def halving_family(self, train, y, measured):
    """The family the current round's ``sh`` turn goes to, or None."""
    fam, nfam = families(self)
    live = [f for f in range(nfam) if (~measured & (fam == f)).any()]
    if len(live) < 2:
        return None
    start = surrogate.N_INITIAL + self.seeded
    rounds = math.ceil(math.log2(len(live))) + 1
    k = min(rounds - 1, (len(train) - start) * rounds // max(1, END - start))
    ft = fam[train]
    stat = {}
    count = {}
    for f in live:
        yf = y[ft == f]
        count[f] = len(yf)
        if not len(yf):
            stat[f] = -np.inf
        else:
            stat[f] = yf.min() if STAT == "min" else float(np.quantile(yf, Q))
    keep = max(1, math.ceil(len(live) / 2**k))
    ranked = sorted(live, key=lambda f: (stat[f], f))[:keep]
    return min(ranked, key=lambda f: (count[f], stat[f], f))


def propose(self, move, train, y, measured):
    if len(train) >= END or (move != "sh" and not EVERY):
        return _propose(self, "ei" if move == "sh" else move, train, y, measured)
    f = halving_family(self, train, y, measured)
    if f is None:
        return _propose(self, "ei" if move == "sh" else move, train, y, measured)
    fam, _ = families(self)
    pool = np.flatnonzero(~measured & (fam == f))
    if len(pool) > surrogate.POOL_MAX:
        pool = self.rng.choice(pool, surrogate.POOL_MAX, replace=False)
    if len(pool) == 1:
        return int(pool[0])
    return expected_improvement(self, train, y, pool)


surrogate.ForestProposer._propose = propose
