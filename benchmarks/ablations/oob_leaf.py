"""The leaf size of the trees chosen at every fit, among ``CV_MSL`` (default 1,3), by the
out-of-bag error of the forest on the faster ``CV_FAST`` (default half) of the measured configs:
model selection from the run's own data, as a GP picks its length scales.

Measured (seeds 0-199, conv A100 / A4000 at budget 100; default 0.899 / 0.973; leaves of 3
throughout 0.928 / 0.936)::

    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:200 --budgets 25,50,100 \\
        --patch benchmarks/ablations/oob_leaf.py

0.902 / 0.962. Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

CHOICES = tuple(int(x) for x in os.environ.get("CV_MSL", "1,3").split(","))
FAST = float(os.environ.get("CV_FAST", "0.5"))


def forest(self, Xt, y, leaf, rng):
    """The bag of trees with leaves of ``leaf`` samples, and its mean absolute out-of-bag
    error on the fast configs."""
    from sklearn.tree import DecisionTreeRegressor

    n = len(y)
    trees = []
    total, count = np.zeros(n), np.zeros(n)
    for _ in range(surrogate.N_TREES):
        boot = rng.integers(0, n, n)
        tree = DecisionTreeRegressor(
            max_features=surrogate.MAX_FEATURES,
            min_samples_leaf=leaf,
            random_state=int(rng.integers(2**31)),
        )
        tree.fit(Xt[boot], y[boot], check_input=False)
        out = np.ones(n, dtype=bool)
        out[boot] = False
        if out.any():
            total[out] += tree.predict(Xt[out], check_input=False)
            count[out] += 1
        trees.append(tree)
    fast = (y <= np.quantile(y, FAST)) & (count > 0)
    if not fast.any():
        return trees, np.inf
    return trees, float(np.mean(np.abs(total[fast] / count[fast] - y[fast])))


def fit_predict(self, train, y, pool, rng=None):
    rng = self.rng if rng is None else rng
    Xt, Xp = self.X[train], self.X[pool]
    best_trees, best_error = None, np.inf
    for leaf in CHOICES:
        trees, error = forest(self, Xt, y, leaf, rng)
        if best_trees is None or error < best_error:
            best_trees, best_error = trees, error
    preds = np.array([t.predict(Xp, check_input=False) for t in best_trees])
    return preds.mean(axis=0), preds.std(axis=0), preds


surrogate.ForestProposer._fit_predict = fit_predict
