"""A ``bore`` move (BORE: Bayesian optimisation by density-ratio estimation, Tiao et al. 2021):
bagged classification trees of "among the fastest ``BORE_GAMMA`` of the measured configs" on the
same features; the unmeasured config with the highest mean predicted probability (ties at
random). A classifier is not pulled by how slow the slow configs are, which is where the
regression trees' spread comes from.

Measured (seeds 0-199, conv A100 / A4000 at budget 100; default 0.899 / 0.973)::

    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:200 --budgets 25,50,100 \\
        --patch benchmarks/ablations/bore.py \\
        --set 'MOVES=("ei","local","bore","walk","ei","local","bore","flip")'

0.892 / 0.964 (86 A100 runs below 0.7 at budget 50). Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

GAMMA = float(os.environ.get("BORE_GAMMA", "0.2"))
MIN_POSITIVE = int(os.environ.get("BORE_MINPOS", "3"))
_propose = surrogate.ForestProposer._propose


def propose(self, move, train, y, measured):
    if move != "bore":
        return _propose(self, move, train, y, measured)
    from sklearn.tree import DecisionTreeClassifier

    pool = self._pool(measured, train, y)
    label = np.zeros(len(y), dtype=np.int64)
    label[np.argsort(y, kind="stable")[: max(MIN_POSITIVE, round(GAMMA * len(y)))]] = 1
    Xt, Xp = self.X[train], self.X[pool]
    prob = np.zeros(len(pool))
    for _ in range(surrogate.N_TREES):
        boot = self.rng.integers(0, len(train), len(train))
        if label[boot].min() == label[boot].max():
            continue  # a resample with one class only says nothing
        tree = DecisionTreeClassifier(
            max_features=surrogate.MAX_FEATURES, random_state=int(self.rng.integers(2**31))
        )
        tree.fit(Xt[boot], label[boot])
        prob += tree.predict_proba(Xp)[:, list(tree.classes_).index(1)]
    return int(pool[int(self.rng.choice(np.flatnonzero(prob == prob.max())))])


surrogate.ForestProposer._propose = propose
