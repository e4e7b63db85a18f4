"""A ``poll`` move (pattern search's poll step): an unmeasured neighbour of the best config one
value up or down in one parameter (the next valid value), by predicted mean (``POLL_TIE=mean``)
or at random; a ``walk`` when the best has none left. Measured after ``leaf3.py`` (trees with
leaves of 3): the poll was meant to win back conv A4000's one-step misses under those.

Measured (seeds 0-199, conv A100 / A4000 at budget 100; default 0.899 / 0.973; leaves of 3
alone 0.928 / 0.936)::

    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:200 --budgets 25,50,100 \\
        --patch benchmarks/ablations/leaf3.py --patch benchmarks/ablations/poll.py \\
        --set 'MOVES=("ei","local","ei","poll","ei","local","ei","flip")'

poll for the ``walk`` 0.902 / 0.952 (``POLL_TIE=random`` 0.906 / 0.944); for the second ``ei``
0.899 / 0.960; for the second ``local`` 0.892 / 0.960; for the ``flip`` 0.909 / 0.909; as a
ninth turn 0.908 / 0.947. Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

from benchmarks.ablations._common import adjacent

TIE = os.environ.get("POLL_TIE", "mean")
_propose = surrogate.ForestProposer._propose


def propose(self, move, train, y, measured):
    if move != "poll":
        return _propose(self, move, train, y, measured)
    cand = adjacent(self, int(train[np.argsort(y, kind="stable")][0]))
    cand = cand[~measured[cand]] if len(cand) else cand
    if not len(cand):
        return _propose(self, "walk", train, y, measured)
    if TIE == "mean" and len(cand) > 1:
        mu, _, _ = self._fit_predict(train, y, cand)
        return int(cand[int(np.argmin(mu))])
    return int(self.rng.choice(cand))


surrogate.ForestProposer._propose = propose
