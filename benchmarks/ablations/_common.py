"""Helpers shared by the ablation patches (imported normally: they need no injected names)."""

from __future__ import annotations

import numpy as np
from kato.tuner.surrogate import ForestProposer, _expected_improvement


def adjacent(proposer: ForestProposer, centre: int) -> np.ndarray:
    """Valid configs one parameter from ``centre``, at the next valid value up or down."""
    base = proposer.X[:, : len(proposer.names)]
    one_away = proposer.hamming(centre) == 1
    out: list[int] = []
    for j in range(base.shape[1]):
        m = np.flatnonzero(one_away & (base[:, j] != base[centre, j]))
        if not len(m):
            continue
        v = base[m, j]
        up, down = v[v > base[centre, j]], v[v < base[centre, j]]
        if len(up):
            out.extend(m[v == up.min()])
        if len(down):
            out.extend(m[v == down.max()])
    return np.array(out, dtype=np.int64)


def expected_improvement(
    proposer: ForestProposer, train: np.ndarray, y: np.ndarray, pool: np.ndarray
) -> int:
    """The config of ``pool`` with the best expected improvement over the best log-time (the
    same score as the default ``ei`` move, on a pool the caller chose)."""
    mu, sd, _ = proposer._fit_predict(train, y, pool)
    score = _expected_improvement(float(y.min()), mu, sd)
    return int(pool[int(np.argmax(score))])
