"""Search strategies by name: each a :class:`~tuner.proposers.base.Proposer` in its own module.

Settings, the REST API (``strategy``) and the CLI (``--strategy``) take these names;
:data:`STRATEGIES` lists them, the default first.
"""

from __future__ import annotations

from typing import Literal

from kato.tuner.proposers.base import History, Proposer, ProposerContext, SeedQueue
from kato.tuner.proposers.forest import ForestStrategy
from kato.tuner.proposers.grid import GridProposer
from kato.tuner.proposers.hybrid import HybridProposer
from kato.tuner.proposers.optuna_samplers import RandomProposer, TpeProposer

Strategy = Literal["forest", "tpe", "hybrid", "random", "grid"]
#: Every selectable strategy, by name; the first is the default.
PROPOSERS: dict[str, type[Proposer]] = {
    p.name: p for p in (ForestStrategy, TpeProposer, HybridProposer, RandomProposer, GridProposer)
}
STRATEGIES: tuple[str, ...] = tuple(PROPOSERS)
#: The strategy a job gets when none is named (worker, CLI, API).
DEFAULT_STRATEGY = "forest"


def proposer_class(strategy: str) -> type[Proposer]:
    """The proposer of a strategy name.

    Raises:
        ValueError: for an unknown strategy.
    """
    try:
        return PROPOSERS[strategy]
    except KeyError:
        raise ValueError(
            f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}"
        ) from None


def make_proposer(strategy: str, context: ProposerContext) -> Proposer:
    """The proposer for ``strategy`` (see :func:`proposer_class`), built with ``context``."""
    return proposer_class(strategy)(context)


__all__ = [
    "DEFAULT_STRATEGY",
    "PROPOSERS",
    "STRATEGIES",
    "History",
    "Proposer",
    "ProposerContext",
    "SeedQueue",
    "Strategy",
    "make_proposer",
    "proposer_class",
]
