"""A learned surrogate that proposes the next config: bagged regression trees, valid configs.

The model (the default strategy's engine, see ``tuner.search``):

- Every valid config is enumerated once and encoded as a feature row: an ordered numeric
  parameter by ``log2`` of its value (by its value where some value is not positive), any other
  parameter by the index of its value. Trees split on these, so only the order matters. Two
  GPU-generic derived features are added: threads per block (the sum of the ``log2`` of the
  ``block_size_*`` parameters, Kernel Tuner's naming) and, per integer parameter, whether the
  value is a power of two.
- The target is ``log(time)``: kernel times span orders of magnitude and what matters is the
  ratio to the best. A failed config (compile, launch, verify, timeout) gets the worst log-time
  seen so far, so the model steers away from its region without one failure dominating the fit.
- The model is a bag of regression trees (bootstrap resamples, random feature subsets): the mean
  over trees predicts, the spread between trees says how unsure the prediction is.

The method: the first configs are a space-filling random design (:data:`N_INITIAL`, after any
warm-start seeds) that measures each rare parameter value once (:data:`RARE_SHARE`). After
that the proposals take turns through a fixed portfolio of moves (:data:`MOVES`), so that
neither a global model nor a local search alone decides the job:

- ``ei`` (global): expected improvement over the best log-time, on the unmeasured valid configs
  (a random subset plus every one-step neighbour of the best few when the space is large).
- ``local`` (model-guided local step): among the unmeasured valid configs within Hamming
  distance :data:`LOCAL_RADIUS` (parameters that differ) of the :data:`N_LOCAL` best configs,
  the one with the best predicted mean. It refines a basin the global model has found; kernel
  landscapes are rugged close to the optimum, where expected improvement alone spreads out.
- ``walk`` (random local step): a random unmeasured valid config within Hamming distance
  :data:`LOCAL_RADIUS` of the best config, without the model. It measures configs the model
  would not pick, which is how a search corrects a wrong belief of the model near the best.
- ``flip`` (switch the code path): the best config with some of its two-valued parameters
  changed and the others kept (fewest changed first; then the second best config, ...; a
  ``walk`` once the :data:`N_LOCAL` best have none left). Two-valued parameters are mostly
  switches between code paths (``use_shmem``, ``read_only``, ``SA``): each path has its own best
  block and tile shapes, and a few early draws of a path with poor shapes teach the model that
  the switch is bad, a belief no other move tests. The best shapes of one path are the best
  guess for another.
- ``gp`` (global, another model): expected improvement from a Gaussian process on the same
  features and log-times (:meth:`ForestProposer.gp_predict`), over the same candidates as
  ``ei``. A tree never predicts below the best measured log-time (a leaf is a mean of measured
  values) and reads an unmeasured value from its ordinal neighbour; a GP with one length scale
  per feature follows a smooth trend past the measured configs, which is how runs on the
  smooth spaces of block sizes and vector widths leave a good basin for a better one.

A neighbourhood with no unmeasured valid config left is widened one parameter at a time (at the
widest it is the whole space).

The models are fitted ahead, off the measuring path: a model move's forest is fitted on the
results the proposer's previous call was given (:data:`FOREST_LAG`), the GP's hyperparameters
on those of two calls before (:data:`GP_LAG`) with the GP then conditioned exactly on every
result. So, with ``background``, the fits a proposal needs start on the proposer's own thread as
soon as the proposal before it is made, and run while that config is measured; a proposal only
looks up predictions (and updates the GP's posterior with the results that came in). The best
configs, the incumbent of expected improvement and what is measured are always the latest.

Contract (``tests/tuner/test_search.py`` and ``tests/tuner/test_surrogate.py`` hold it):

- only valid configs (enumerated from the space; on a sampled space its pool and the rows
  :meth:`ForestProposer.grow` adds) are proposed, and a config with a result in
  ``results`` (measured, failed, or PENDING: another worker is measuring it) is never proposed;
  PENDING results are not learnt from; failures are imputed as above;
- reproducible: the same seed and the same sequence of results give the same proposals (a
  resumed job's new proposer starts its turns afresh from the known results), with or without
  ``background`` and however long the caller takes between calls: each model's random draws come
  from a generator seeded by the seed and the call it is fitted for, and a model not fitted
  ahead is fitted when needed, the same model;
- warm-start configs measured before the proposer (``seed_keys``) do not shorten
  its own space-filling design, nor stand in for its config with a rare value;
- None is returned only when every valid config has a result;
- :attr:`ForestProposer.upcoming` (with ``hints``) names likely next proposals, for compiling
  ahead, without consuming the random state: the proposals are the same with or without it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.space import Config, SearchSpace

#: Configs drawn as a space-filling random design before the model is fitted. 15 rather than 10:
#: with kernel spaces of 5-7 tuned parameters, 10 points let a few unlucky draws decide which
#: region the model believes in (a small measured gain, not a cure: docs/search.md, "Constants").
N_INITIAL = 15
#: A parameter value held by fewer valid configs than this fraction of a uniform share (valid
#: configs / the parameter's values) is rare: the design measures one config with it, rarest
#: first, for at most half the design (:meth:`ForestProposer.rare_values`). Constraints leave
#: some code paths only a handful of valid configs (layernorm 8192x32768 float32: CACHE=2, the
#: register cache, in 3 of 363, and the fastest); a random design misses them, and the trees
#: then read such a value from its ordinal neighbour (CACHE=1, 4x slower there). Spaces without
#: a rare value run exactly as before (measured: docs/search.md, "Constants").
RARE_SHARE = 0.25
#: Trees in the bag.
N_TREES = 24
#: Above this many unmeasured valid configs, acquisition is evaluated on a random subset of this
#: size plus the neighbours of the best configs.
POOL_MAX = 3000
#: Best configs whose one-step neighbours are always scored.
N_INCUMBENTS = 5
#: Fraction of the features each tree split may consider.
MAX_FEATURES = 0.8
#: The moves after the space-filling design, taken in turn (see the module docstring); also
#: "ts" (Thompson: the minimum of one tree's prediction) and "random" (space-filling).
#: ``flip`` every 8th turn and ``gp`` for the second of the four ``ei`` turns are the measured
#: best of their variants (docs/search.md, "Constants").
MOVES: tuple[str, ...] = ("ei", "local", "gp", "walk", "ei", "local", "ei", "flip")
#: Hamming radius of the local neighbourhoods, and how many of the best configs ``local`` uses.
LOCAL_RADIUS = 2
N_LOCAL = 3
#: Configs named as likely next proposals after each proposal (:attr:`ForestProposer.upcoming`),
#: for the backend to compile ahead of the rest: about one per compile process of a GPU host.
N_UPCOMING = 16
#: The ``gp`` move's training set: every result up to this many, else the best half of this many
#: and a random draw of the rest (a GP fit costs the cube of its points: 0.1-0.3 s at 128 on
#: one core, with the kernel's length scales fitted each time).
GP_MAX = 128
#: A model move's model is fitted on the results an earlier call of
#: :meth:`ForestProposer.propose` was given: the forest's on those of the call before
#: (``FOREST_LAG``: all but the results that came in since, usually the last one), the GP's
#: length scales and noise on those of ``GP_LAG`` calls before (the GP is then conditioned on
#: every result, exactly). So the fits for the next proposal start, on a thread, as soon as one is
#: made, and run while it is measured (:meth:`ForestProposer._prefetch`); the best configs, the
#: incumbent of expected improvement and what is measured are always the latest. 0 fits on the
#: call's own results (the proposals wait for their fits). Measured: docs/search.md, "Search
#: overhead per trial".
FOREST_LAG = 1
GP_LAG = 2
#: A model fitted ahead predicts every config unmeasured when it is fitted, up to this many
#: (above, a random draw of this many and the neighbourhoods of the best configs): a proposal
#: then only looks its predictions up.
COVER_MAX = 20000
#: On a sampled space (:mod:`tuner.space`: a pool of valid configs drawn from a larger space),
#: the valid configs one parameter away from each of this many best configs join the rows as
#: the job finds them (:meth:`ForestProposer.grow`), so that the local moves reach past the pool.
N_GROW = N_LOCAL
#: Most rows :meth:`ForestProposer.grow` adds around the best configs in one job (a config
#: has up to a few dozen valid neighbours; the pool is 20 000): the models rank every row,
#: so the overhead per trial grows with them. 0 keeps the pool fixed.
GROW_MAX = 4096
#: Add the threads-per-block feature (block_size_* parameters) and the power-of-two flags.
DERIVED = True
POW2 = True


def _is_log(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)


def _feature_maps(params: Mapping[str, Sequence[Any]]) -> dict[str, dict[Any, float]]:
    """For each parameter with more than one value: value -> feature."""
    maps: dict[str, dict[Any, float]] = {}
    for name, values in params.items():
        vals = list(dict.fromkeys(values))
        if len(vals) < 2:
            continue
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
        if numeric and all(v > 0 for v in vals):
            maps[name] = {v: math.log2(v) for v in vals}
        elif numeric:
            maps[name] = {v: float(v) for v in vals}
        else:
            maps[name] = {v: float(i) for i, v in enumerate(vals)}
    return maps


class ForestProposer:
    """Proposes unmeasured valid configs of ``space`` from the results measured so far.

    Args:
        space: the search space (its valid configs are enumerated once, here).
        seed: makes the proposals reproducible for the same history.
        batch: ``ei`` proposals made from one model fit (1, the default: refit before every
            proposal; more queues the next best ones, cheaper but less informed).
        seed_keys: the keys of the configs measured on purpose before this proposer (warm
            start). The space-filling design still gets its own :data:`N_INITIAL` configs, so
            that seeds from a source whose best region is a poor one here do not confine the
            model to that region; and a rare value only a seed holds still gets a design config
            of its own (a seed is another shape's best, not a sample of the value).
        hints: fill :attr:`upcoming` after each proposal (a little work per proposal, for a
            caller that compiles ahead; off, it stays empty).
        background: fit the models the next proposals need on a thread of the proposer's own
            while the caller measures (:data:`FOREST_LAG`); off, each is fitted when needed.
            The proposals are the same either way.
    """

    def __init__(
        self,
        space: SearchSpace,
        seed: int = 0,
        *,
        batch: int = 1,
        seed_keys: Collection[str] = (),
        hints: bool = False,
        background: bool = False,
    ):
        self.space = space
        # A copy: a sampled space's pool may grow later (SearchSpace.include); these rows stay.
        self.configs: list[Config] = list(space.valid_configs())
        self.index: dict[str, int] = {space.key(c): i for i, c in enumerate(self.configs)}
        maps = _feature_maps(space.params)
        self._maps = maps
        self.names = list(maps)
        self._flags = [j for j, name in enumerate(self.names) if len(maps[name]) == 2]
        self._logscale = [_is_log(space.params[name]) for name in self.names]
        n = len(self.configs)
        # Kernel Tuner's convention names the thread-block dimensions block_size_x/y/z: their
        # product (threads per block) drives occupancy, and trees cannot add features themselves.
        blocks = [j for j, name in enumerate(self.names) if name.startswith("block_size")]
        derived = DERIVED and len(blocks) >= 2 and all(self._logscale[j] for j in blocks)
        self._blocks = blocks if derived else []
        #: Per integer parameter with other values too, value -> whether a power of two.
        self._pow2: list[tuple[str, dict[Any, float]]] = []
        if POW2:
            # Powers of two (and multiples of the warp size) often behave differently from
            # their neighbours on a GPU: a flag per integer parameter with other values too.
            for name in self.names:
                vals = [v for v in maps[name] if isinstance(v, int) and not isinstance(v, bool)]
                flags = {v: float(v > 0 and v & (v - 1) == 0) for v in vals}
                mixed = 0 < sum(flags.values()) < len(vals)
                if len(vals) == len(maps[name]) and mixed and max(vals) > 2:
                    self._pow2.append((name, flags))
        X = self._encode(self.configs)
        self.X = X
        span = X.max(axis=0) - X.min(axis=0) if n else np.ones(X.shape[1])
        self._scale = np.where(span > 0, span, 1.0).astype(np.float32)
        self._low = X.min(axis=0) if n else np.zeros(X.shape[1], dtype=np.float32)
        # The features scaled to [0, 1] (the GP's inputs: its length-scale bounds then mean the
        # same in every space).
        self._unit = (X - self._low) / self._scale if n else X
        #: Rows enumerated from the space; :meth:`grow` appends others after them.
        self._base_rows = n
        self._grows = space.sampled
        #: Keys of the configs whose neighbours joined the rows; rows added around them; keys
        #: of results that are no valid config of the space.
        self._expanded: set[str] = set()
        self._grown = 0
        self._foreign: set[str] = set()
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.background = background
        self._calls = 0
        #: What each of the last calls of :meth:`propose` was given, by call number.
        self._snapshots: dict[int, _Snapshot] = {}
        #: Models being fitted ahead on the thread: (kind, source call) -> the fit.
        self._fits: dict[tuple[str, int], Future[_ForestModel | _GpModel]] = {}
        self._pool_executor: ThreadPoolExecutor | None = None
        self.batch = max(1, batch)
        self.seeded = len(seed_keys)
        self._queue: list[int] = []
        self._turn = 0
        self._rare: list[tuple[int, float]] | None = None
        self._seeds = np.zeros(len(self.configs), dtype=bool)
        self._seeds[[self.index[k] for k in seed_keys if k in self.index]] = True
        #: Indices of the configs this proposer expects to propose next, likeliest first (set by
        #: :meth:`propose`; empty after a move that does not use the model). A hint for
        #: compiling ahead; computing it never changes the proposals.
        self.upcoming: list[int] = []
        self.hints = hints
        # The latest fit's rankings (hints only): unmeasured configs by expected improvement,
        # and near the best configs by predicted mean.
        self._by_score: np.ndarray = np.empty(0, dtype=np.int64)
        self._by_mean: np.ndarray = np.empty(0, dtype=np.int64)

    def _encode(self, configs: Sequence[Config]) -> np.ndarray:
        """The feature rows of ``configs`` (see the module docstring), float32."""
        X = np.zeros((len(configs), max(1, len(self.names))), dtype=np.float32)
        for j, name in enumerate(self.names):
            m = self._maps[name]
            X[:, j] = [m[c[name]] for c in configs]
        extra = []
        if self._blocks:
            extra.append(X[:, self._blocks].sum(axis=1))
        for name, flags in self._pow2:
            extra.append(np.array([flags[c[name]] for c in configs], dtype=np.float32))
        if extra:
            X = np.column_stack([X, *extra]).astype(np.float32)
        return X

    # -- a sampled space's rows grow ---------------------------------------------------------

    def grow(self, results: Mapping[str, TrialResult]) -> int:
        """On a sampled space, add rows for what the pool lacks: every valid config of
        ``results`` (another worker's measurement or reservation of a config this proposer's
        pool lacks: learnt from, never proposed), then, once the space-filling design is
        measured, the valid one-step neighbours of each of the :data:`N_GROW` best configs not
        grown around yet (at most :data:`GROW_MAX` rows in all), so that ``local``, ``walk``
        and ``ei`` search past the pool around the best. (Around the design's random configs
        they would only skew its draws.)

        Rows are only appended (an index stays the config it was) and what is added depends on
        ``results`` alone, in their order (no random draw): workers sharing a job add the same
        rows for the same results, and a resumed job's proposer grows around the best of the
        results it resumes from. Returns how many were added; on a space that is not sampled
        (every valid config a row already) none, at no cost."""
        if not self._grows:
            return 0
        added: dict[str, Config] = {}
        for key, result in results.items():
            if key in self.index or key in self._foreign:
                continue
            config = result.config
            if (
                config
                and self.space.key(config) == key
                and self.space.check_params(config) is None
                and self.space.is_valid(config)
            ):
                added[key] = dict(config)
            else:
                self._foreign.add(key)
        centres: list[Config] = []
        timed = [
            (t, key)
            for key, r in results.items()
            if (t := r.time_ms) is not None and math.isfinite(t)
            if key in self.index or key in added
        ]
        if self._grown < GROW_MAX and len(timed) >= N_INITIAL + self.seeded:
            timed.sort(key=lambda pair: pair[0])  # stable: ties in the results' order
            for _, key in timed[:N_GROW]:
                if key not in self._expanded:
                    self._expanded.add(key)
                    i = self.index.get(key)
                    centres.append(self.configs[i] if i is not None else added[key])
        if centres:
            for config in self.space.neighbours(centres):
                key = self.space.key(config)
                if key not in self.index and key not in added:
                    if self._grown >= GROW_MAX:
                        break
                    added[key] = config
                    self._grown += 1
        if added:
            self._append(list(added.values()))
        return len(added)

    def _append(self, configs: list[Config]) -> None:
        """New rows after the others. The arrays are replaced, not resized: a model fitted on
        the thread meanwhile reads the old rows from either."""
        start = len(self.configs)
        rows = self._encode(configs)
        self.configs.extend(configs)
        for i, config in enumerate(configs, start):
            self.index[self.space.key(config)] = i
        self.X = np.concatenate([self.X, rows])
        self._unit = np.concatenate([self._unit, (rows - self._low) / self._scale])
        self._seeds = np.concatenate([self._seeds, np.zeros(len(configs), dtype=bool)])

    # -- model -------------------------------------------------------------------------------

    def _training_set(
        self, results: Mapping[str, TrialResult]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Indices of measured configs, their log-times (failures imputed), the measured mask."""
        measured = np.zeros(len(self.configs), dtype=bool)
        idx: list[int] = []
        ys: list[float | None] = []
        for key, result in results.items():
            i = self.index.get(key)
            if i is None:
                continue
            measured[i] = True
            if result.status == TrialStatus.PENDING:
                continue  # another worker is measuring it: not proposed, not learnt from
            t = result.time_ms
            idx.append(i)
            ys.append(math.log(t) if t is not None and t > 0 and math.isfinite(t) else None)
        ok = [y for y in ys if y is not None]
        worst = max(ok) if ok else 0.0
        y = np.array([worst if v is None else v for v in ys], dtype=np.float64)
        return np.array(idx, dtype=np.int64), y, measured

    def _fit_predict(
        self,
        train: np.ndarray,
        y: np.ndarray,
        pool: np.ndarray,
        rng: np.random.Generator | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mean and spread over the trees of the predicted log-time of ``pool``, and each
        tree's prediction; the bootstrap samples and the trees' seeds are drawn from ``rng``
        (the proposer's by default), so the same generator state gives the same trees."""
        from sklearn.tree import DecisionTreeRegressor

        rng = self.rng if rng is None else rng
        Xt, Xp = self.X[train], self.X[pool]
        n = len(train)
        preds = np.empty((N_TREES, len(pool)))
        with _fitting():
            for t in range(N_TREES):
                boot = rng.integers(0, n, n)
                tree = DecisionTreeRegressor(
                    max_features=MAX_FEATURES,
                    min_samples_leaf=1,
                    random_state=int(rng.integers(2**31)),
                )
                # The rows are float32 and C-contiguous already: skip sklearn's input checks (a
                # third of a fit's time on ~100 rows; the same trees and predictions).
                tree.fit(Xt[boot], y[boot], check_input=False)
                preds[t] = tree.predict(Xp, check_input=False)
        return preds.mean(axis=0), preds.std(axis=0), preds

    def gp_predict(
        self,
        train: np.ndarray,
        y: np.ndarray,
        pool: np.ndarray,
        rng: np.random.Generator | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the predicted log-time of ``pool`` from a Gaussian
        process fitted to (at most :data:`GP_MAX` of) the measured configs (:class:`_GpModel`;
        a draw of the rest beyond them from ``rng``, the proposer's by default)."""
        measured = np.zeros(len(self.configs), dtype=bool)
        measured[train] = True
        snap = _Snapshot(train, y, measured)
        model = _GpModel(self, snap, self.rng if rng is None else rng, np.empty(0, np.int64))
        return model.posterior(pool, snap)

    # -- candidates --------------------------------------------------------------------------

    def hamming(self, i: int, rows: int | None = None) -> np.ndarray:
        """For every valid config (the first ``rows``: those a snapshot knew), how many
        parameters differ from config ``i``."""
        base = self.X[:rows, : len(self.names)]
        return (base != base[i]).sum(axis=1)

    def neighbours(self, i: int, rows: int | None = None) -> np.ndarray:
        """Valid configs (the first ``rows``) that differ from config ``i`` in exactly one
        parameter."""
        return np.flatnonzero(self.hamming(i, rows) == 1)

    def _pool(self, measured: np.ndarray, train: np.ndarray, y: np.ndarray) -> np.ndarray:
        free = np.flatnonzero(~measured)
        if len(free) <= POOL_MAX:
            return free
        sample = self.rng.choice(free, POOL_MAX, replace=False)
        near = [self.neighbours(int(i)) for i in train[np.argsort(y)[:N_INCUMBENTS]]]
        near_free = np.concatenate(near)
        near_free = near_free[~measured[near_free]]
        return np.unique(np.concatenate([sample, near_free]))

    def _space_filling(self, measured: np.ndarray, count: int) -> list[int]:
        """``count`` unmeasured configs, each the farthest (scaled L1) from those chosen so far
        among a few random candidates."""
        free = np.flatnonzero(~measured)
        chosen = list(np.flatnonzero(measured))
        out: list[int] = []
        for _ in range(min(count, len(free))):
            cand = self.rng.choice(free, min(len(free), 16), replace=False)
            cand = np.array([c for c in cand if c not in out] or [cand[0]])
            pick = self._farthest(cand, np.array(chosen, dtype=np.int64))
            out.append(pick)
            chosen.append(pick)
        return out

    def rare_values(self) -> list[tuple[int, float]]:
        """The rare parameter values (see :data:`RARE_SHARE`) as (feature column, value), rarest
        first, at most half the design's size; the same for every call (no random state)."""
        if self._rare is None:
            # The space's own rows: those grown around the best configs are no sample of it.
            base = self.X[: self._base_rows, : len(self.names)]
            rare: list[tuple[int, int, float]] = []
            for j in range(base.shape[1]):
                values, counts = np.unique(base[:, j], return_counts=True)
                limit = RARE_SHARE * len(base) / len(values)
                held = zip(values, counts, strict=True)
                rare += [(int(c), j, float(v)) for v, c in held if c < limit]
            self._rare = [(j, v) for _, j, v in sorted(rare)][: N_INITIAL // 2]
        return self._rare

    def _design_pick(self, measured: np.ndarray) -> int:
        """The next config of the space-filling design: for the first rare value no measured
        config but a warm-start seed holds, the farthest of a few random configs holding it;
        with every rare value measured, :meth:`_space_filling`'s pick."""
        base = self.X[:, : len(self.names)]
        for j, v in self.rare_values():
            holders = base[:, j] == v
            if (holders & measured & ~self._seeds).any():
                continue
            free = np.flatnonzero(holders & ~measured)
            if len(free):
                # Far from the design's other configs, not from the seeds: farthest from another
                # shape's best is a poor config of the rare value more often than a random one.
                cand = self.rng.choice(free, min(len(free), 16), replace=False)
                return self._farthest(cand, np.flatnonzero(measured & ~self._seeds))
        return self._space_filling(measured, 1)[0]

    def _farthest(self, cand: np.ndarray, chosen: np.ndarray) -> int:
        """The candidate farthest (scaled L1) from the configs ``chosen`` (the first candidate
        if none is)."""
        if not len(chosen):
            return int(cand[0])
        d = np.abs(
            self.X[cand][:, None, :] / self._scale - self.X[chosen][None, :, :] / self._scale
        ).sum(axis=2)
        return int(cand[int(d.min(axis=1).argmax())])

    # -- proposing ---------------------------------------------------------------------------

    def local_candidates(self, measured: np.ndarray, centres: Sequence[int]) -> np.ndarray:
        """Unmeasured valid configs within Hamming distance :data:`LOCAL_RADIUS` (parameters
        that differ) of any of ``centres``; the radius grows until there is one (at the widest,
        every unmeasured valid config). The configs are the first ``len(measured)`` rows."""
        dist = np.full(len(measured), len(self.names) + 1)
        for c in centres:
            dist = np.minimum(dist, self.hamming(c, len(measured)))
        for radius in range(LOCAL_RADIUS, len(self.names) + 1):
            near = np.flatnonzero((dist <= radius) & ~measured)
            if len(near):
                return near
        return np.flatnonzero(~measured)

    def flip_candidate(self, measured: np.ndarray, centres: Sequence[int]) -> int | None:
        """An unmeasured valid config equal to the first of ``centres`` that has one, except
        in two-valued parameters, with as few of them changed as possible (ties at random);
        None if no centre has one (or the space has no two-valued parameter)."""
        if not self._flags:
            return None
        base = self.X[:, : len(self.names)]
        others = [j for j in range(len(self.names)) if j not in self._flags]
        for c in centres:
            same = (base[:, others] == base[c, others]).all(axis=1) & ~measured
            cand = np.flatnonzero(same)
            if len(cand):
                changed = (base[cand][:, self._flags] != base[c, self._flags]).sum(axis=1)
                return int(self.rng.choice(cand[changed == changed.min()]))
        return None

    def propose(self, results: Mapping[str, TrialResult]) -> Config | None:
        """The next config to measure given ``results`` (config key -> result with ``time_ms``,
        None for a failure); None when every valid config has been measured."""
        self.grow(results)
        train, y, measured = self._training_set(results)
        call = self._calls
        self._calls += 1
        self._snapshots[call] = _Snapshot(train, y, measured)
        for old in [c for c in self._snapshots if c < call - max(FOREST_LAG, GP_LAG)]:
            del self._snapshots[old]
        ok = int(np.sum([r.time_ms is not None for r in results.values()]))
        pick = self._next(ok, train, y, measured)
        if pick is not None and self.background:
            self._prefetch(call, ok)
        return None if pick is None else self.configs[pick]

    def _next(self, ok: int, train: np.ndarray, y: np.ndarray, measured: np.ndarray) -> int | None:
        """:meth:`propose`'s pick, by index, given how many results are OK."""
        self.upcoming = []
        while self._queue:
            i = self._queue.pop(0)
            if not measured[i]:
                if self.hints:
                    self.upcoming = [j for j in self._queue if not measured[j]][:N_UPCOMING]
                return i
        if measured.all():
            return None
        if ok < N_INITIAL + self.seeded or len(train) < N_INITIAL + self.seeded:
            pick = self._design_pick(measured)
            if self.hints:
                left = N_INITIAL + self.seeded - ok - 1
                self.upcoming = self._design_ahead(measured, pick, min(left, N_UPCOMING))
            return pick
        move = MOVES[self._turn % len(MOVES)]
        self._turn += 1
        pick = self._propose(move, train, y, measured)
        if self.hints:
            self.upcoming = self._likely_next(pick, train, y, measured)
        return pick

    def _design_ahead(self, measured: np.ndarray, pick: int, count: int) -> list[int]:
        """The next ``count`` configs of the space-filling design, as :meth:`propose` will draw
        them once ``pick`` is measured (on a copy of the random state: nothing is consumed)."""
        if count <= 0:
            return []
        ahead = measured.copy()
        ahead[pick] = True
        out: list[int] = []
        with self._rng_restored():
            for _ in range(count):
                if ahead.all():
                    break
                nxt = self._design_pick(ahead)
                out.append(nxt)
                ahead[nxt] = True
        return out

    @contextlib.contextmanager
    def _rng_restored(self) -> Iterator[None]:
        """Draws made inside leave the random state as it was (hints consume nothing)."""
        state = self.rng.bit_generator.state
        try:
            yield
        finally:
            self.rng.bit_generator.state = state

    def _propose(self, move: str, train: np.ndarray, y: np.ndarray, measured: np.ndarray) -> int:
        """The index of the config ``move`` proposes (unmeasured and valid). A model move's
        model comes from an earlier call's results (:meth:`_model`); the best configs, the
        incumbent of expected improvement and what is measured are the latest."""
        if move == "random":
            return self._space_filling(measured, 1)[0]
        ranked = train[np.argsort(y, kind="stable")]
        if move == "flip":
            pick = self.flip_candidate(measured, [int(i) for i in ranked[:N_LOCAL]])
            if pick is not None:
                return pick
            move = "walk"
        if move == "walk":
            return int(self.rng.choice(self.local_candidates(measured, [int(ranked[0])])))
        current = _Snapshot(train, y, measured)
        if move == "local":
            pool = self.local_candidates(measured, [int(i) for i in ranked[:N_LOCAL]])
            mu, _, _ = self._model("forest", current).predict(pool)
            order = np.argsort(mu, kind="stable")
            if self.hints:
                self._by_mean = pool[order[: 2 * N_UPCOMING]]
            return int(pool[int(order[0])])
        pool = self._pool(measured, train, y)
        if move == "gp":
            mu, sd = self._model("gp", current).posterior(pool, current)
            score = _expected_improvement(float(y.min()), mu, sd)
        else:
            mu, sd, preds = self._model("forest", current).predict(pool)
            if move == "ts":
                score = -preds[int(self.rng.integers(len(preds)))]
            else:
                score = _expected_improvement(float(y.min()), mu, sd)
        ranking = np.argsort(-score, kind="stable")
        picks = [int(pool[k]) for k in ranking[: self.batch]]
        self._queue = picks[1:]
        if self.hints:
            self._by_score = pool[ranking[: 2 * N_UPCOMING]]
            near = self.local_candidates(measured, [int(i) for i in ranked[:N_LOCAL]])
            by_mean = pool[np.argsort(mu, kind="stable")]
            self._by_mean = by_mean[np.isin(by_mean, near)][: 2 * N_UPCOMING]
        return picks[0]

    # -- models fitted ahead -----------------------------------------------------------------

    def _source(self, kind: str, current: _Snapshot) -> tuple[int, _Snapshot]:
        """The results a ``kind`` model of the call in progress is fitted on, and the number of
        the call that was given them: the forest's from the call before, the GP's from
        :data:`GP_LAG` calls before (the nearest later one where the proposer has made fewer
        calls), the call's own where none before has at least two training results."""
        call = max(self._calls - 1, 0)
        for lag in range(FOREST_LAG if kind == "forest" else GP_LAG, 0, -1):
            snap = self._snapshots.get(call - lag)
            if snap is not None and len(snap.train) >= 2:
                return call - lag, snap
        return call, current

    def _model(self, kind: str, current: _Snapshot) -> Any:
        """The ``kind`` model of the call in progress: fitted ahead on the thread when
        :meth:`_prefetch` foresaw it, else here; the same model either way."""
        source, snap = self._source(kind, current)
        pending = self._fits.pop((kind, source), None)
        if pending is not None:
            return pending.result()
        return self._build(kind, source, snap)

    def _build(self, kind: str, source: int, snap: _Snapshot) -> _ForestModel | _GpModel:
        """A ``kind`` model fitted on ``snap`` (the results call ``source`` was given), with
        its predictions for every config unmeasured then (:data:`COVER_MAX`) made ahead. Its
        random draws come from a generator of its own, seeded by the proposer's seed and
        ``source``: the same model whichever thread fits it, and whenever."""
        rng = np.random.default_rng((self.seed, source, 0 if kind == "forest" else 1))
        cover = self._cover(snap, rng)
        if kind == "forest":
            return _ForestModel(self, snap, rng, cover)
        return _GpModel(self, snap, rng, cover)

    def _cover(self, snap: _Snapshot, rng: np.random.Generator) -> np.ndarray:
        """The configs a model predicts when it is fitted: every config unmeasured in ``snap``,
        or above :data:`COVER_MAX` of them a random draw of that many and the neighbourhoods of
        the best configs then (a config needed later that is not covered is predicted then).
        Only the rows ``snap`` knew: rows grown since are predicted when needed."""
        free = np.flatnonzero(~snap.measured)
        if len(free) <= COVER_MAX:
            return free
        rows = len(snap.measured)
        ranked = snap.train[np.argsort(snap.y, kind="stable")]
        near = self.local_candidates(snap.measured, [int(i) for i in ranked[:N_LOCAL]])
        incumbents = [self.neighbours(int(i), rows) for i in ranked[:N_INCUMBENTS]]
        sample = rng.choice(free, COVER_MAX, replace=False)
        both = np.unique(np.concatenate([sample, near, *incumbents]))
        return both[~snap.measured[both]]

    def _prefetch(self, call: int, ok: int) -> None:
        """After call ``call``: start fitting, on the thread, the models the next calls are
        expected to need (a forest for a model move :data:`FOREST_LAG` calls on, a GP for a
        ``gp`` move :data:`GP_LAG` calls on, and any nearer one not started yet), and drop the
        fits no later call can use. Only a guess: a model not started ahead is fitted when it
        is needed, the same model."""
        design = max(N_INITIAL + self.seeded - ok - 1, 0)  # design calls expected next
        for j in range(1, max(FOREST_LAG, GP_LAG) + 1):
            if j <= design:
                continue
            move = MOVES[(self._turn + j - design - 1) % len(MOVES)]
            kind, lag = ("gp", GP_LAG) if move == "gp" else ("forest", FOREST_LAG)
            if move not in ("ei", "local", "ts", "gp") or j > lag:
                continue
            source = call + j - lag
            snap = self._snapshots.get(source)
            if (kind, source) in self._fits or snap is None or len(snap.train) < 2:
                continue
            self._fits[(kind, source)] = self._executor().submit(self._build, kind, source, snap)
        for key in [k for k in self._fits if k[1] < call + 1 - max(FOREST_LAG, GP_LAG)]:
            self._fits.pop(key).cancel()

    def close(self) -> None:
        """Drop the fits started ahead and end the fitting thread without waiting for the one
        running (it ends on its own). A search that stops (budget, cancelled, interrupted)
        calls it, so that its fits do not run on into the next job's compiles; proposing
        again afterwards fits each model when it is needed (the same models), and a later
        prefetch starts another thread."""
        fits, self._fits = self._fits, {}
        for fit in fits.values():
            fit.cancel()
        executor, self._pool_executor = self._pool_executor, None
        if executor is not None:
            _shutdown(executor)

    def _executor(self) -> ThreadPoolExecutor:
        """The one thread this proposer fits its models on, made when first needed and shut
        down when the proposer is collected."""
        if self._pool_executor is None:
            self._pool_executor = ThreadPoolExecutor(1, thread_name_prefix="kato-fit")
            weakref.finalize(self, _shutdown, self._pool_executor)
        return self._pool_executor

    def _likely_next(
        self, pick: int, train: np.ndarray, y: np.ndarray, measured: np.ndarray
    ) -> list[int]:
        """Configs the next proposals are likely to be, once ``pick`` is measured, likeliest
        first (nothing is consumed: the random state is restored).

        The next move is known (the turns are fixed). A ``walk`` or ``flip`` is a random draw
        that depends only on the random state and the best configs, so it is predicted exactly
        for the two likely outcomes of ``pick``: it does not change the best configs, or it
        becomes the best. A model move is predicted from the latest fit: the best by expected
        improvement (``ei``) and by predicted mean near the best (``local``), the next move's
        kind first, alternating with the other (a model move follows every other turn).
        """
        ahead = measured.copy()
        ahead[pick] = True
        nxt = MOVES[self._turn % len(MOVES)]
        exact: list[int] = []
        if nxt in ("walk", "flip"):
            ranked = [int(i) for i in train[np.argsort(y, kind="stable")]]
            for centres in (ranked[:N_LOCAL], [pick, *ranked[: N_LOCAL - 1]]):
                with self._rng_restored():  # the same draw the next proposal will make
                    p = self.flip_candidate(ahead, centres) if nxt == "flip" else None
                    if p is None:
                        p = int(self.rng.choice(self.local_candidates(ahead, centres[:1])))
                exact.append(p)
        first, second = self._by_score, self._by_mean
        if nxt == "local":
            first, second = second, first
        merged = exact + [
            int(i) for pair in itertools.zip_longest(first, second) for i in pair if i is not None
        ]
        out = [i for i in dict.fromkeys(merged) if not ahead[i]]
        return out[:N_UPCOMING]


@dataclass(frozen=True)
class _Snapshot:
    """What one call of :meth:`ForestProposer.propose` was given: the training set (config
    indices, log-times with failures imputed) and which configs had a result (or a
    reservation). Never changed once made: a model fitted on it may run on another thread."""

    train: np.ndarray
    y: np.ndarray
    measured: np.ndarray


class _Cover:
    """Where a model's predictions made ahead are: config index -> column (-1: none)."""

    def __init__(self, n_configs: int, cover: np.ndarray) -> None:
        self.cover = cover
        self.column = np.full(n_configs, -1, dtype=np.int64)
        self.column[cover] = np.arange(len(cover))

    def split(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The columns of ``idx`` and the mask of those that have none (a row added after the
        cover was made has none)."""
        inside = idx < len(self.column)
        cols = np.full(len(idx), -1, dtype=np.int64)
        cols[inside] = self.column[idx[inside]]
        return cols, cols < 0


class _ForestModel:
    """The bag of trees fitted on a snapshot (:meth:`ForestProposer._fit_predict`), with every
    tree's prediction for its cover made when it is fitted. A config outside the cover is
    predicted when asked by the same trees, fitted again from the same generator state (a row
    grown since the fit, :meth:`ForestProposer.grow`, is outside it)."""

    def __init__(
        self,
        proposer: ForestProposer,
        snap: _Snapshot,
        rng: np.random.Generator,
        cover: np.ndarray,
    ) -> None:
        self._proposer, self._snap = proposer, snap
        self._state = rng.bit_generator.state
        self._cover = _Cover(len(snap.measured), cover)
        _, _, self._preds = proposer._fit_predict(snap.train, snap.y, cover, rng=rng)

    def predict(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mean and spread over the trees of the predicted log-time of ``idx``, and each tree's
        prediction (the same numbers whether made ahead or now)."""
        cols, missing = self._cover.split(idx)
        preds = np.empty((self._preds.shape[0], len(idx)))
        preds[:, ~missing] = self._preds[:, cols[~missing]]
        if missing.any():
            rng = np.random.default_rng()
            rng.bit_generator.state = self._state
            snap = self._snap
            _, _, extra = self._proposer._fit_predict(snap.train, snap.y, idx[missing], rng=rng)
            preds[:, missing] = extra
        return preds.mean(axis=0), preds.std(axis=0), preds


class _GpModel:
    """A Gaussian process on the features scaled to [0, 1] and the log-times of a snapshot (at
    most :data:`GP_MAX` of them: the best half of that many and a random draw of the rest).

    The kernel: a constant times a Matern 5/2 with one length scale per feature (the scaled
    features make the bounds mean the same in every space), plus white noise for the timing
    noise and for configs that differ only in what the features do not see. The
    hyperparameters are fitted by maximum likelihood (L-BFGS, as scikit-learn's fit does) from
    one fixed start, so the same data give the same model; the log-times are normalised by the
    snapshot's mean and spread (scikit-learn's ``normalize_y``).

    :meth:`posterior` conditions the process, with those hyperparameters, on every result
    the snapshot lacks as well: exactly, by a block update of the snapshot's posterior (made
    ahead for the cover), not a refit. Only the hyperparameters lag."""

    def __init__(
        self,
        proposer: ForestProposer,
        snap: _Snapshot,
        rng: np.random.Generator,
        cover: np.ndarray,
    ) -> None:
        train, y = snap.train, snap.y
        if len(train) > GP_MAX:
            order = np.argsort(y, kind="stable")
            keep = GP_MAX // 2
            rest = rng.choice(order[keep:], GP_MAX - keep, replace=False)
            chosen = np.concatenate([order[:keep], rest])
            train, y = train[chosen], y[chosen]
        self._proposer = proposer
        #: Configs whose results the snapshot held (those beyond GP_MAX included): a result
        #: of one of them is not new.
        self._known = np.zeros(len(snap.measured), dtype=bool)
        self._known[snap.train] = True
        self._mean = float(y.mean())
        spread = float(y.std())
        self._scale = spread if spread > 10 * np.finfo(float).eps else 1.0
        self._Xs = self._unit[train]
        self._cover = _Cover(len(snap.measured), cover)
        # One BLAS thread: the matrices are at most GP_MAX square, where threads cost more
        # than they give, and a GPU host's cores are busy compiling ahead (a fit took 2-6 s
        # with two contended OpenBLAS threads, 0.3 s with one; the same numbers).
        with _one_blas_thread(), _fitting():
            self._fit((y - self._mean) / self._scale)
            self._ahead = self._prior(self._unit[cover])

    @property
    def _unit(self) -> np.ndarray:
        """The proposer's scaled features, read when used: rows may have grown since."""
        return self._proposer._unit

    def _fit(self, yn: np.ndarray) -> None:
        """The hyperparameters, as ``GaussianProcessRegressor.fit`` with its L-BFGS optimiser
        finds them (the same start, bounds and objective), without its warnings: a length
        scale at its bound is a feature the data say does not matter, expected here, and
        silencing a warning is not thread-safe (the fit may run on the proposer's thread)."""
        from scipy.optimize import minimize
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

        kernel = ConstantKernel(1.0, (1e-3, 1e3)) * Matern(
            length_scale=np.full(self._Xs.shape[1], 0.5), length_scale_bounds=(1e-2, 1e2), nu=2.5
        ) + WhiteKernel(1e-3, (1e-6, 1e-1))
        start = GaussianProcessRegressor(kernel, optimizer=None).fit(self._Xs, yn)

        def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
            lml, grad = start.log_marginal_likelihood(theta, eval_gradient=True, clone_kernel=False)
            return -lml, -grad

        theta = start.kernel_.theta
        found = minimize(objective, theta, method="L-BFGS-B", jac=True, bounds=start.kernel_.bounds)
        gp = GaussianProcessRegressor(start.kernel_.clone_with_theta(found.x), optimizer=None)
        gp.fit(self._Xs, yn)
        self._kernel, self._L, self._alpha = gp.kernel_, gp.L_, gp.alpha_
        self._jitter = gp.alpha  # added to the training points' variance, as fit does

    def _prior(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The snapshot's posterior at the rows ``X`` (normalised units): mean, variance (the
        noise included, as scikit-learn's predicted standard deviation has it), and
        ``L^-1 k(train, X)``, which a later result's update needs."""
        from scipy.linalg import solve_triangular

        K = self._kernel(X, self._Xs)
        mu = K @ self._alpha
        V = solve_triangular(self._L, K.T, lower=True, check_finite=False)
        var = self._kernel.diag(X) - np.einsum("ij,ij->j", V, V)
        return mu, var, V

    def _at(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_prior` at the configs ``idx``: the cover's from the fit, the rest now."""
        cols, missing = self._cover.split(idx)
        mu0, var0, V0 = self._ahead
        mu, var = np.empty(len(idx)), np.empty(len(idx))
        V = np.empty((self._Xs.shape[0], len(idx)))
        hit = ~missing
        mu[hit], var[hit], V[:, hit] = mu0[cols[hit]], var0[cols[hit]], V0[:, cols[hit]]
        if missing.any():
            mu[missing], var[missing], V[:, missing] = self._prior(self._unit[idx[missing]])
        return mu, var, V

    def posterior(self, idx: np.ndarray, current: _Snapshot) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the log-time of the configs ``idx`` given the
        snapshot's results and every result of ``current`` it lacked (exact for the fitted
        hyperparameters)."""
        mu, var, V = self._at(idx)
        known = self._known
        fresh = np.ones(len(current.train), dtype=bool)
        inside = current.train < len(known)
        fresh[inside] = ~known[current.train[inside]]
        if fresh.any():
            new = current.train[fresh]
            yz = (current.y[fresh] - self._mean) / self._scale
            mz, _, Vz = self._at(new)
            Xz = self._unit[new]
            # Covariances given the snapshot: new results with each other (their noise and
            # the fit's jitter on the diagonal) and with the configs asked about.
            czz = self._kernel(Xz) - np.einsum("ki,kj->ij", Vz, Vz)
            czz[np.diag_indices_from(czz)] += self._jitter
            cxz = self._kernel(self._unit[idx], Xz) - np.einsum("kp,kj->pj", V, Vz)
            gain = np.linalg.solve(czz, cxz.T).T  # cxz czz^-1, one row per config
            mu = mu + gain @ (yz - mz)
            var = var - np.einsum("pj,pj->p", gain, cxz)
        sd = np.sqrt(np.maximum(var, 0.0))
        return mu * self._scale + self._mean, sd * self._scale


def _shutdown(executor: ThreadPoolExecutor) -> None:
    """A collected proposer's thread: the fits not started are dropped, the one running ends."""
    executor.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def _fitting() -> Iterator[None]:
    """scikit-learn without its per-call checks of estimator parameters and input finiteness:
    the proposer's are fixed and valid, its features and log-times finite, and the checks were
    a third of a tree fit's time on ~100 rows (the same models either way)."""
    import sklearn

    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):
        yield


_blas: Any = None
#: The BLAS limit of :func:`_one_blas_thread`, shared by the threads inside it (the limit is
#: process-wide): made by the first to enter, undone by the last to leave.
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter: Any = None


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """BLAS limited to one thread (threadpoolctl), through one controller made once: making
    one per call looks up the loaded libraries again, 1.4 ms. The limit is process-wide and
    a fit may run on the proposer's thread while another runs on the caller's (or another
    proposer's): nested per-thread limits would each restore what they saw on entry, and
    one leaving after another that entered before it would leave BLAS at one thread for the
    rest of the process. So it is counted: set once, restored when the last user leaves."""
    global _blas, _blas_users, _blas_limiter
    with _blas_lock:
        if _blas is None:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController()
        if _blas_users == 0:
            _blas_limiter = _blas.limit(limits=1)
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None


def import_models() -> None:
    """Import the libraries the proposer fits its models with (scikit-learn, SciPy: about 2 s
    the first time in a process), so that a worker pays for them when it starts, not inside
    its first job's search."""
    import scipy.special  # noqa: F401
    import sklearn.gaussian_process  # noqa: F401
    import sklearn.tree  # noqa: F401
    import threadpoolctl  # noqa: F401


def _expected_improvement(best: float, mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """Expected improvement below ``best`` of Gaussian predictions (mean ``mu``, spread ``sd``)."""
    sd = np.maximum(sd, 1e-9)
    z = (best - mu) / sd
    return sd * (z * _norm_cdf(z) + _norm_pdf(z))


def _norm_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(z)
