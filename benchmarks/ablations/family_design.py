"""A design stratified over the code-path families (combinations of the two-valued
parameters): each design config goes to the family furthest below its target, the target a
family's share of the valid configs times the design's size but at least ``FD_MIN``, and is
the farthest (scaled L1) of a few random unmeasured configs of that family from the design so
far. Rare values (``RARE_SHARE``) are still measured first, as in the default design.
``FD_EXTRA`` more measurements after the design are taken the same way (a longer design).

Measured (seeds 0-79, conv A100 / A4000 at budget 100; default 0.904 / 0.977, 14 A100 runs
below 0.7)::

    FD_MIN=2 \\
    python3 benchmarks/search_ablation.py --spaces convolution --seeds 0:80 --budgets 25,50,100 \\
        --patch benchmarks/ablations/family_design.py

0.888 / 0.971 (18 below 0.7; at 50 0.800 vs 0.764); ``FD_MIN=3 FD_EXTRA=10`` (25 configs):
0.897 / 0.970 (at 25 0.623 / 0.728 vs 0.668 / 0.779). Not kept.
"""
# ruff: noqa: F821  (``surrogate`` is injected by benchmarks/search_ablation.py)

import os

import numpy as np

MIN = int(os.environ.get("FD_MIN", "2"))
EXTRA = int(os.environ.get("FD_EXTRA", "0"))
_design_pick = surrogate.ForestProposer._design_pick
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


def stratified_pick(self, measured, total):
    fam, nfam = families(self)
    size = np.bincount(fam, minlength=nfam).astype(float)
    own = measured & ~self._seeds
    have = np.bincount(fam[own], minlength=nfam).astype(float)
    target = np.maximum(np.minimum(MIN, size), size / size.sum() * total)
    left = np.array([(~measured & (fam == f)).any() for f in range(nfam)])
    deficit = np.where(left, target - have, -np.inf)
    f = int(self.rng.choice(np.flatnonzero(deficit == deficit.max())))
    free = np.flatnonzero(~measured & (fam == f))
    cand = self.rng.choice(free, min(len(free), 16), replace=False)
    return self._farthest(cand, np.flatnonzero(measured))


def design_pick(self, measured):
    fam, nfam = families(self)
    base = self.X[:, : len(self.names)]
    for j, v in self.rare_values():
        holders = base[:, j] == v
        if not (holders & measured & ~self._seeds).any() and (holders & ~measured).any():
            return _design_pick(self, measured)
    if nfam < 2:
        return _design_pick(self, measured)
    return stratified_pick(self, measured, surrogate.N_INITIAL + EXTRA)


def propose(self, move, train, y, measured):
    fam, nfam = families(self)
    if nfam >= 2 and EXTRA and len(train) < surrogate.N_INITIAL + self.seeded + EXTRA:
        return stratified_pick(self, measured, surrogate.N_INITIAL + EXTRA)
    return _propose(self, move, train, y, measured)


surrogate.ForestProposer._design_pick = design_pick
surrogate.ForestProposer._propose = propose
