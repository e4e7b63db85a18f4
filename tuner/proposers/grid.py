"""``grid``: every valid config once, in an order shuffled by the seed (Optuna's GridSampler
would also walk the invalid points and stop the study). Proposes without Optuna."""

from __future__ import annotations

from typing import Any

from kato.tuner.proposers.base import History, Proposer
from kato.tuner.space import Config


class GridProposer(Proposer):
    name = "grid"

    _grid: list[Config] | None = None

    def propose(self, history: History, fallback: Config | None) -> tuple[Any, Config | None]:
        if fallback is not None:
            return None, fallback
        if (seeded := self.context.seeds.next(history.results)) is not None:
            return None, seeded
        space, results = self.context.space, history.results
        if self._grid is None:  # shuffled with the search's generator when first needed
            self._grid = list(space.valid_configs())
            self.context.rng.shuffle(self._grid)
            self._grid.reverse()  # pop() from the end walks the shuffled order
        while self._grid:
            point = self._grid.pop()
            if space.key(point) not in results:
                return None, point
        return None, None
