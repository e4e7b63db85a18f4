"""A ``cover`` move, as in combinatorial testing: among the unmeasured valid configs within
``COVER_RADIUS`` parameters of the best, the one with the most parameter-value pairs that no
measured config has; ties at random (``COVER_TIE=random``) or by predicted mean (``mean``).

Measured (seeds 0-199, conv A100 / A4000 at budget 100; default 0.899 / 0.973)::

    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:200 --budgets 25,50,100 \\
        --patch benchmarks/ablations/coverage.py \\
        --set 'MOVES=("ei","local","ei","cover","ei","local","ei","flip")'

0.900 / 0.963; ``COVER_TIE=mean`` 0.881 / 0.964. Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import itertools
import os

import numpy as np

TIE = os.environ.get("COVER_TIE", "random")
RADIUS = int(os.environ.get("COVER_RADIUS", "2"))
_propose = surrogate.ForestProposer._propose


def pair_codes(self):
    """For every valid config, one integer per parameter pair naming the pair's two values."""
    if not hasattr(self, "_pair_codes"):
        base = self.X[:, : len(self.names)]
        cols = [np.unique(base[:, j], return_inverse=True)[1] for j in range(base.shape[1])]
        pairs = [
            cols[a] * 1000 + cols[b] + (a * 64 + b) * 10**7
            for a, b in itertools.combinations(range(len(cols)), 2)
        ]
        empty = np.zeros((len(base), 0), dtype=np.int64)
        self._pair_codes = np.stack(pairs, axis=1) if pairs else empty
    return self._pair_codes


def propose(self, move, train, y, measured):
    if move != "cover":
        return _propose(self, move, train, y, measured)
    codes = pair_codes(self)
    seen = np.unique(codes[np.flatnonzero(measured)])
    dist = self.hamming(int(train[np.argsort(y, kind="stable")][0]))
    cand = np.flatnonzero(~measured)
    for radius in range(RADIUS, len(self.names) + 1):
        near = np.flatnonzero((dist <= radius) & ~measured)
        if len(near):
            cand = near
            break
    novel = (~np.isin(codes[cand], seen)).sum(axis=1)
    top = cand[novel == novel.max()]
    if TIE == "mean" and len(top) > 1:
        mu, _, _ = self._fit_predict(train, y, top)
        return int(top[int(np.argmin(mu))])
    return int(self.rng.choice(top))


surrogate.ForestProposer._propose = propose
