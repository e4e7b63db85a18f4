"""Target-encoded group features for the trees: per config, the smoothed mean centred log-time
of the measured configs that share its thread-block shape (the ``block_size_*`` values) and
(``TE_WHICH=both``) of those that share everything else (its cell); training rows get
leave-one-out means, prior weight ``TE_M`` (2). A block shape that is fast in other cells then
reads as fast in a cell where it was never measured, a carry-over that splits on
block_size_x / block_size_y cannot make (the conv A100 optimum's 32x4 is the best block shape in
nine of its shared-memory cells; docs/search.md).

Measured (seeds 0-79, budgets 25 / 50 / 100 / 200; default conv A100 0.904 at 100, A4000 0.977)::

    TE_WHICH=both python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:80 \
        --budgets 25,50,100,200 --patch benchmarks/ablations/target_encoding.py

both columns: A100 0.674 / 0.782 / 0.887 / 0.976, A4000 0.771 / 0.873 / 0.942 / 0.998; the
block shape's only (``TE_WHICH=block``): A100 0.661 / 0.774 / 0.880 / 0.948, A4000 0.763 / 0.882
/ 0.950 / 0.997. Not kept: below the default on both spaces at 100 (17-21 A100 runs stuck).
"""

# ruff: noqa: F821
import os

import numpy as np

M = float(os.environ.get("TE_M", "2.0"))
WHICH = os.environ.get("TE_WHICH", "both")  # block | cell | both
_fit = surrogate.ForestProposer._fit_predict


def codes(self):
    if getattr(self, "_te_codes", None) is None:
        base = self.X[:, : len(self.names)]
        blocks = [j for j, n in enumerate(self.names) if n.startswith("block_size")]
        rest = [j for j in range(base.shape[1]) if j not in blocks]
        out = []
        for cols in [blocks] if WHICH == "block" else [rest] if WHICH == "cell" else [blocks, rest]:
            if not cols:
                continue
            _, code = np.unique(base[:, cols], axis=0, return_inverse=True)
            out.append(code.ravel())
        self._te_codes = out
    return self._te_codes


def fit_predict(self, train, y, pool, rng=None):
    cols_train, cols_pool = [], []
    yc = y - y.mean()
    for code in codes(self):
        k = code.max() + 1
        s = np.bincount(code[train], weights=yc, minlength=k)
        n = np.bincount(code[train], minlength=k).astype(float)
        ct = code[train]
        cols_train.append((s[ct] - yc) / (n[ct] - 1 + M))
        cp = code[pool]
        cols_pool.append(s[cp] / (n[cp] + M))
    if not cols_train:
        return _fit(self, train, y, pool, rng)
    X0 = self.X
    try:
        extra = np.zeros((len(X0), len(cols_train)), dtype=np.float32)
        # rows: training rows get LOO values, pool rows their full means (disjoint sets)
        for j, (a, b) in enumerate(zip(cols_train, cols_pool, strict=True)):
            extra[pool, j] = b
            extra[train, j] = a
        self.X = np.ascontiguousarray(np.column_stack([X0, extra]).astype(np.float32))
        return _fit(self, train, y, pool, rng)
    finally:
        self.X = X0


surrogate.ForestProposer._fit_predict = fit_predict
