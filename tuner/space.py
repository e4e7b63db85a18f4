"""A search space: named parameters with discrete values and a validity predicate.

A space with a vectorised predicate (``screen``, a user operator's
:meth:`~kernels.user.spec.UserOperatorSpec.screen`) scales past what a config-by-config check
can walk: up to :data:`FILTER_MAX` combinations are filtered whole, in chunks of
:data:`CHUNK` (about a microsecond a combination), and the valid ones are enumerated where
there are at most :data:`ENUMERATE_MAX`. Beyond either, the space is *sampled*: what
:meth:`SearchSpace.valid_configs` gives the search is a pool of :data:`POOL_SIZE` valid configs
drawn uniformly (from the filtered mask, or by rejection sampling through ``screen``), the
same pool in every process (a fixed seed), with the configs the search brings
(:meth:`SearchSpace.include`: warm-start configs and their one-step neighbours, results known
from before) added to it. The default search's proposer adds more to its own copy during a
job: the valid one-step neighbours of the best configs (:meth:`SearchSpace.neighbours`,
:meth:`tuner.surrogate.ForestProposer.grow`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kato.errors import InvalidInput

Config = dict[str, Any]
#: Combinations filtered per call of ``screen`` (bounded memory: a few arrays of this length).
CHUNK = 1 << 18
#: Most combinations filtered whole (a mask of one byte each); a larger product is sampled.
FILTER_MAX = 1 << 26
#: Most valid configs enumerated for the search; more make a sampled space. The default
#: search ranks every config it holds each trial: its overhead grows with them.
ENUMERATE_MAX = 100_000
#: Valid configs in a sampled space's pool: the convolution space's 1.87M valid through a 20k
#: pool cost 0.09-0.16 s a trial of search overhead, a 50k pool 0.2 s (a shared 2-core CPU).
POOL_SIZE = 20_000
#: Random combinations drawn at most when sampling a space too large to filter whole.
MAX_DRAWS = 1 << 23
#: Fewest valid configs rejection sampling must find in :data:`MAX_DRAWS` draws.
MIN_POOL = 200
#: The pool's seed: every worker of a job (and a resumed job) searches the same pool.
POOL_SEED = 0x6B61746F


class SpaceTooSparse(InvalidInput):
    """Rejection sampling found too few valid configs: the restrictions reject nearly every
    combination of a space too large to filter whole."""


@dataclass
class SearchSpace:
    """Discrete parameters in a fixed order plus a predicate naming why a config is invalid.

    ``check(config)`` returns ``None`` for a valid config and a reason otherwise. The order of
    ``params`` is the Kernel Tuner key order (values comma-joined).

    ``enumerate_valid``: optional; returns every valid config in product order, for spaces that
    know their valid configs without walking the product (a recorded space of 20 thousand
    configs out of a product of 10 million: ``check`` over the product takes half a minute).
    It must agree with ``check``.
    """

    params: dict[str, tuple[Any, ...]]
    check: Callable[[Config], str | None] = lambda config: None
    enumerate_valid: Callable[[], list[Config]] | None = field(default=None, repr=False)
    #: Optional: ``check`` for many configs at once (columns: name -> array of values, one
    #: element per config; answers a bool array, true where ``check`` accepts). It must agree
    #: with ``check``; with it the space filters millions of combinations in seconds and
    #: samples larger ones (see the module docstring).
    screen: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = field(
        default=None, repr=False
    )
    _valid: list[Config] | None = field(default=None, repr=False)
    _mask: np.ndarray | None = field(default=None, repr=False)
    _extra: list[Config] = field(default_factory=list, repr=False)

    def key(self, config: Mapping[str, Any]) -> str:
        return ",".join(str(config[name]) for name in self.params)

    def all_configs(self) -> Iterator[Config]:
        names = list(self.params)
        for values in itertools.product(*self.params.values()):
            yield dict(zip(names, values, strict=True))

    def valid_configs(self) -> list[Config]:
        """Every valid config, in product order (computed once); for a :attr:`sampled` space,
        its pool instead (see the module docstring)."""
        if self._valid is None and self.enumerate_valid is not None:
            self._valid = self.enumerate_valid()
        elif self._valid is None and self.screen is not None:
            if self.sampled:
                self._valid = self._pool()
            else:
                assert self._mask is not None
                self._valid = self.configs_at(np.flatnonzero(self._mask))
        elif self._valid is None:
            self._valid = [c for c in self.all_configs() if self.check(c) is None]
        return self._valid

    # --- large spaces (a ``screen``) -------------------------------------------------------

    @property
    def sampled(self) -> bool:
        """Whether :meth:`valid_configs` is a pool drawn from the valid configs rather than all
        of them: a product over :data:`FILTER_MAX`, or more than :data:`ENUMERATE_MAX` valid.
        Filters the whole product on first use where it is at most :data:`FILTER_MAX`."""
        if self.screen is None or self.enumerate_valid is not None:
            return False
        if len(self) > FILTER_MAX:
            return True
        return int(self.filter_mask().sum()) > ENUMERATE_MAX

    def filter_mask(self) -> np.ndarray:
        """For each combination in product order, whether it is valid (``screen`` over the
        whole product in chunks of :data:`CHUNK`; computed once).

        Raises:
            ValueError: the space has no ``screen`` or more than :data:`FILTER_MAX`
                combinations.
        """
        if self._mask is None:
            if self.screen is None or len(self) > FILTER_MAX:
                raise ValueError(
                    f"a space of {len(self)} combinations without a vectorised check, or over "
                    f"{FILTER_MAX}, is not filtered whole"
                )
            total = len(self)
            mask = np.zeros(total, dtype=bool)
            for start in range(0, total, CHUNK):
                flat = np.arange(start, min(total, start + CHUNK), dtype=np.int64)
                mask[start : start + len(flat)] = self._screen_flat(flat)
            self._mask = mask
        return self._mask

    def count_valid(self) -> int | None:
        """The number of valid configs where it is known without enumerating them one by one
        (a ``screen`` and at most :data:`FILTER_MAX` combinations), else None."""
        if self.screen is None or self.enumerate_valid is not None or len(self) > FILTER_MAX:
            return None
        return int(self.filter_mask().sum())

    def sample(self, count: int, seed: int) -> list[Config]:
        """Up to ``count`` distinct valid configs drawn uniformly (fewer where the space has
        fewer), in product order; the same for the same seed.

        Raises:
            SpaceTooSparse: more than :data:`FILTER_MAX` combinations, and fewer than
                :data:`MIN_POOL` valid ones (or ``count``) among :data:`MAX_DRAWS` random
                draws: the message gives the fraction found.
        """
        if self.screen is None:
            raise ValueError("only a space with a vectorised check (screen) is sampled")
        rng = np.random.default_rng(seed)
        if len(self) <= FILTER_MAX:
            valid = np.flatnonzero(self.filter_mask())
            if len(valid) > count:
                valid = np.sort(rng.choice(valid, count, replace=False))
            return self.configs_at(valid)
        found = np.empty(0, dtype=np.int64)
        drawn = 0
        while len(found) < count and drawn < MAX_DRAWS:
            flat = np.unique(rng.integers(0, len(self), CHUNK, dtype=np.int64))
            drawn += CHUNK
            found = np.union1d(found, flat[self._screen_flat(flat)])
        if len(found) < min(count, MIN_POOL):
            fraction = len(found) / drawn
            raise SpaceTooSparse(
                f"the space has {len(self):.3g} combinations, too many to filter whole, and "
                f"only {len(found)} of {drawn} random ones are valid (a fraction of "
                f"{fraction:.2g}): too few to sample from. Narrow tune_params to the values the "
                f"restrictions allow (or split the space), so that at least "
                f"{MIN_POOL / MAX_DRAWS:.1g} of it is valid"
            )
        if len(found) > count:
            found = np.sort(rng.choice(found, count, replace=False))
        return self.configs_at(found)

    def include(self, configs: Iterable[Config], *, neighbours: bool = False) -> None:
        """Add valid ``configs`` (and, with ``neighbours``, every valid config one parameter
        away from each) to a sampled space's pool, so that the search can propose, learn from
        and search around them (warm-start configs, results known from before). Invalid ones
        and configs outside :attr:`params` are skipped. A space that is not sampled holds them
        already: nothing changes."""
        if self.screen is None or not self.sampled:
            return
        wanted: list[Config] = []
        for config in configs:
            if self.check_params(config) is not None or self.check(config) is not None:
                continue
            wanted.append(dict(config))
            if neighbours:
                wanted.extend(self.neighbours([config]))
        pool = self.valid_configs()
        keys = {self.key(c) for c in pool}
        for config in wanted:
            key = self.key(config)
            if key not in keys:
                keys.add(key)
                pool.append(config)
                self._extra.append(config)

    def check_params(self, config: Mapping[str, Any]) -> str | None:
        """Why ``config`` is not a point of :attr:`params`, or None."""
        if set(config) != set(self.params):
            return "other parameters"
        for name, values in self.params.items():
            if config[name] not in values:
                return f"{name}={config[name]!r} is not one of its values"
        return None

    def neighbours(self, configs: Iterable[Config]) -> list[Config]:
        """The valid configs one parameter away from any of ``configs`` (points of
        :attr:`params`), each once, in order: the first config's by parameter and value, then
        the next's. Needs ``screen`` (all are checked in one call of it)."""
        if self.screen is None:
            raise ValueError("only a space with a vectorised check (screen) lists neighbours")
        candidates: dict[str, Config] = {}
        for config in configs:
            for name, values in self.params.items():
                for value in values:
                    if value != config[name]:
                        other = {**config, name: value}
                        candidates.setdefault(self.key(other), other)
        if not candidates:
            return []
        rows = list(candidates.values())
        index = np.array(
            [[self.params[k].index(c[k]) for k in self.params] for c in rows], dtype=np.int64
        )
        keep = np.asarray(self.screen(self._columns(index.T)), dtype=bool)
        return [c for c, ok in zip(rows, keep, strict=True) if ok]

    def _pool(self) -> list[Config]:
        return self.sample(POOL_SIZE, POOL_SEED) + list(self._extra)

    def _dims(self) -> tuple[int, ...]:
        return tuple(len(v) for v in self.params.values())

    def _value_arrays(self) -> list[np.ndarray]:
        """Each parameter's values as an array: of one numpy type where the values share one
        Python type, else of objects (which ``screen`` checks one config at a time)."""
        out = []
        for values in self.params.values():
            kinds = {type(v) for v in values}
            typed = len(kinds) == 1 and kinds <= {int, float, str, bool}
            out.append(np.array(values, dtype=None if typed else object))
        return out

    def _columns(self, indices: Any) -> dict[str, np.ndarray]:
        arrays = self._value_arrays()
        return {name: arrays[j][indices[j]] for j, name in enumerate(self.params)}

    def _screen_flat(self, flat: np.ndarray) -> np.ndarray:
        assert self.screen is not None
        indices = np.unravel_index(flat, self._dims()) if len(flat) else [flat] * len(self.params)
        return np.asarray(self.screen(self._columns(indices)), dtype=bool)

    def configs_at(self, flat: np.ndarray) -> list[Config]:
        """The configs at these positions of the product (``itertools.product`` order, as
        :meth:`filter_mask` indexes it), as Python values."""
        names = list(self.params)
        values = [list(v) for v in self.params.values()]
        if not len(flat):
            return []
        indices = np.unravel_index(flat, self._dims())
        columns = [
            [vals[i] for i in idx.tolist()] for vals, idx in zip(values, indices, strict=True)
        ]
        return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]

    def is_valid(self, config: Config) -> bool:
        return self.check(config) is None

    def __len__(self) -> int:
        return math.prod(len(values) for values in self.params.values())
