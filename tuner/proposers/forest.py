"""``forest`` (the default): a bagged-tree surrogate over the valid configs
(:class:`tuner.surrogate.ForestProposer`), proposing without Optuna."""

from __future__ import annotations

from typing import Any

from kato.tuner.proposers.base import History, Proposer
from kato.tuner.space import Config
from kato.tuner.surrogate import ForestProposer


class ForestStrategy(Proposer):
    """Warm-start configs first, then the surrogate's proposals over the results with the
    configs in flight as pending; after each, the configs it expects to propose next go to
    ``on_upcoming`` (with the proposal itself first when the search keeps several in flight:
    it may wait there, so it is compiled first)."""

    name = "forest"

    _model: ForestProposer | None = None

    def propose(self, history: History, fallback: Config | None) -> tuple[Any, Config | None]:
        if fallback is not None:
            return None, fallback
        if (seeded := self.context.seeds.next(history.results)) is not None:
            return None, seeded
        context = self.context
        if self._model is None:
            self._model = ForestProposer(
                context.space,
                context.seed,
                seed_keys=context.seeds.keys,
                hints=context.on_upcoming is not None,
                background=True,
            )
        point = self._model.propose(history.with_pending())
        if point is None:
            return None, None
        upcoming = [self._model.configs[i] for i in self._model.upcoming]
        if context.ahead > 1:
            upcoming.insert(0, point)
        if context.on_upcoming is not None and upcoming:
            context.on_upcoming(upcoming)
        return None, point

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
