"""A ``sub`` move: the best config with a random half of its parameters kept; among the
unmeasured valid configs that share those and differ from it in at least ``SUB_MINDIST``
parameters, the one with the best expected improvement (``SUB_MODE=ei``), predicted mean
(``mean``) or a random one (``random``). Meant to carry a block shape that wins in one cell into
the others.

Measured (seeds 0-199, conv A100 / A4000 at budget 100; default 0.899 / 0.973)::

    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:200 --budgets 25,50,100 \\
        --patch benchmarks/ablations/subspace.py \\
        --set 'MOVES=("ei","local","sub","walk","ei","local","ei","flip")'

0.907 / 0.965; ``SUB_MODE=mean`` 0.888 / 0.968, ``random`` 0.870 / 0.966; for the ``walk``
instead of the second ``ei`` 0.894 / 0.967. Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

from benchmarks.ablations._common import expected_improvement

MODE = os.environ.get("SUB_MODE", "ei")
KEEP = float(os.environ.get("SUB_KEEP", "0.5"))
MINDIST = int(os.environ.get("SUB_MINDIST", "2"))
CENTRES = int(os.environ.get("SUB_CENTRES", "1"))  # the centre: a random one of the best N
_propose = surrogate.ForestProposer._propose


def propose(self, move, train, y, measured):
    if move != "sub":
        return _propose(self, move, train, y, measured)
    ranked = train[np.argsort(y, kind="stable")]
    centre = int(ranked[int(self.rng.integers(min(CENTRES, len(ranked))))])
    base = self.X[:, : len(self.names)]
    n_params = len(self.names)
    far_enough = self.hamming(centre) >= MINDIST
    cand = np.empty(0, dtype=np.int64)
    for _ in range(30):  # a few draws of the kept subset until one leaves a candidate
        keep = self.rng.random(n_params) < KEEP
        if not 1 <= keep.sum() <= n_params - 2:
            continue
        same = (base[:, keep] == base[centre, keep]).all(axis=1)
        cand = np.flatnonzero(same & ~measured & far_enough)
        if len(cand):
            break
    if not len(cand):
        return _propose(self, "ei", train, y, measured)
    if MODE == "random":
        return int(self.rng.choice(cand))
    if MODE == "mean":
        mu, _, _ = self._fit_predict(train, y, cand)
        return int(cand[int(np.argmin(mu))])
    return expected_improvement(self, train, y, cand)


surrogate.ForestProposer._propose = propose
