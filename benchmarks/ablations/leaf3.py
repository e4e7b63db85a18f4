"""Tree leaves of at least ``MSL`` samples (default 3; the default search uses 1): smoother
predictions.

Measured (seeds 0-199, conv A100 / A4000 at budget 100; default 0.899 / 0.973)::

    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:200 --budgets 25,50,100 \\
        --patch benchmarks/ablations/leaf3.py

0.928 / 0.936: A4000 runs end at ``block_size_y`` 2 instead of 1 (31 of 200) and in a 0.81
basin (33, default 21). Not kept (earlier sessions: conv A100 +0.027 over 270 seeds, conv A4000
below 0.95, batchnorm_stats 0.996 -> 0.992).
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

MSL = int(os.environ.get("MSL", "3"))


def fit_predict(self, train, y, pool, rng=None):
    """``ForestProposer._fit_predict`` with ``min_samples_leaf=MSL``."""
    from sklearn.tree import DecisionTreeRegressor

    rng = self.rng if rng is None else rng

    Xt, Xp = self.X[train], self.X[pool]
    n = len(train)
    preds = np.empty((surrogate.N_TREES, len(pool)))
    for t in range(surrogate.N_TREES):
        boot = rng.integers(0, n, n)
        tree = DecisionTreeRegressor(
            max_features=surrogate.MAX_FEATURES,
            min_samples_leaf=MSL,
            random_state=int(rng.integers(2**31)),
        )
        tree.fit(Xt[boot], y[boot], check_input=False)
        preds[t] = tree.predict(Xp, check_input=False)
    return preds.mean(axis=0), preds.std(axis=0), preds


surrogate.ForestProposer._fit_predict = fit_predict
