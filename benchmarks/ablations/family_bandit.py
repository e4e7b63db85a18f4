"""A ``fam`` move: a bandit over the code-path families (the combinations of the two-valued
parameters, as for ``flip``), then expected improvement inside the chosen family.

Per family with a measured config, a robust statistic of its measured log-times (``FAM_STAT``:
``min``, or ``q`` the ``FAM_Q`` quantile) minus an optimism bonus ``FAM_BETA`` x the spread of
every measured log-time (the interquartile range / 1.349) / sqrt(the family's count): the
family with the lowest score (a family never measured first) gets the turn, and the forest's
expected improvement over its unmeasured configs picks the config (``FAM_PICK=mean``: the best
predicted mean instead). Spaces with fewer than two families take an ``ei`` turn.

Measured (seeds 0-79, conv A100 / A4000 at budget 100; default 0.904 / 0.977, 14 A100 runs
below 0.7)::

    FAM_STAT=q FAM_Q=0.25 FAM_BETA=1 \\
    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:80 --budgets 25,50,100 \\
        --patch benchmarks/ablations/family_bandit.py \\
        --set 'MOVES=("ei","local","gp","walk","ei","local","fam","flip")'

lower quartile, bonus 1: 0.882 / 0.966 (17 below 0.7); median, bonus 0.5 (``FAM_Q=0.5
FAM_BETA=0.5``): 0.907 / 0.966 (15 below 0.7; 0.794 vs 0.764 at 50). Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

from benchmarks.ablations._common import expected_improvement

STAT = os.environ.get("FAM_STAT", "q")
Q = float(os.environ.get("FAM_Q", "0.25"))
BETA = float(os.environ.get("FAM_BETA", "1.0"))
PICK = os.environ.get("FAM_PICK", "ei")
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


def family_scores(self, train, y, measured):
    """The bandit's score per family (lower first; inf for a family with nothing left)."""
    fam, nfam = families(self)
    q75, q25 = np.quantile(y, [0.75, 0.25])
    spread = max((q75 - q25) / 1.349, 1e-6)
    ft = fam[train]
    score = np.full(nfam, np.inf)
    for f in range(nfam):
        if not (~measured & (fam == f)).any():
            continue
        yf = y[ft == f]
        if not len(yf):
            score[f] = -np.inf
            continue
        stat = yf.min() if STAT == "min" else np.quantile(yf, Q)
        score[f] = stat - BETA * spread / np.sqrt(len(yf))
    return score


def propose(self, move, train, y, measured):
    if move != "fam":
        return _propose(self, move, train, y, measured)
    fam, nfam = families(self)
    if nfam < 2:
        return _propose(self, "ei", train, y, measured)
    score = family_scores(self, train, y, measured)
    best = np.flatnonzero(score == score.min())
    f = int(self.rng.choice(best))
    pool = np.flatnonzero(~measured & (fam == f))
    if len(pool) > surrogate.POOL_MAX:
        pool = self.rng.choice(pool, surrogate.POOL_MAX, replace=False)
    if len(pool) == 1:
        return int(pool[0])
    if PICK == "mean":
        mu, _, _ = self._fit_predict(train, y, pool)
        return int(pool[int(np.argmin(mu))])
    if PICK == "random":
        return int(self.rng.choice(pool))
    return expected_improvement(self, train, y, pool)


surrogate.ForestProposer._propose = propose
