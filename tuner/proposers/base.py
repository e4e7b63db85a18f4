"""The proposer interface: what a search strategy is asked, and what it is told.

A :class:`tuner.search.Search` owns the loop (budget, validity, nothing measured twice, configs
in flight, writes); a :class:`Proposer` only chooses configs. One proposer per search, built by
name from :data:`tuner.proposers.PROPOSERS` with the search's :class:`ProposerContext`.

Contract (every call comes from the thread that runs the search, one at a time):

- :meth:`Proposer.propose` returns the next config to consider and a ticket for it (an Optuna
  trial where Optuna proposes, else None), or config None when the strategy has nothing left.
  It may propose an invalid config, one measured already or one in flight: the search rejects
  it without measuring and tells the proposer (:meth:`Proposer.discard`). Given ``fallback``
  (a random unmeasured config the search picked after too many proposals in a row that
  brought nothing new) it proposes that one.
- Exactly one of :meth:`Proposer.observe` (measured by this search) and
  :meth:`Proposer.discard` (rejected, answered from another worker's result, or abandoned when
  the search stops) follows every proposal, in the order the search settles them; a proposer
  that learns from :class:`History` alone (the forest, the grid) may ignore both.
- Determinism: given the same seed, space, warm-start configs and results, a proposer proposes
  the same configs. Its random draws come from its own generators and the context's ``rng``,
  which the search shares for its fallback draws (one stream, as the search always drew).
- The study: :attr:`Proposer.study` is the Optuna study that records the proposals of a
  strategy that asks Optuna (TPE, hybrid, random), opened in the context's storage (a stopped
  job resumes with the sampler's history). A strategy that proposes without Optuna (forest,
  grid) has none (``study`` None): Kato's trial rows are its record, and the worker writes the
  job's Optuna study for optuna-dashboard from them when the job ends
  (:func:`tuner.study.record_study`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import optuna
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.space import Config, SearchSpace
from kato.tuner.study import StudyParams


@dataclass
class History:
    """What a proposer knows when asked: ``results`` (config key -> result: measured in this
    job, known from before, or another worker's ``PENDING`` placeholder) and the configs asked
    for and not measured yet (``in_flight``: (key, config), oldest first)."""

    results: Mapping[str, TrialResult]
    in_flight: list[tuple[str, Config]] = field(default_factory=list)

    def with_pending(self) -> Mapping[str, TrialResult]:
        """``results`` with the configs in flight as ``PENDING``: what a model that must not
        propose them again (nor count them as measured) sees."""
        if not self.in_flight:
            return self.results
        view = dict(self.results)
        for key, config in self.in_flight:
            view[key] = TrialResult(config=dict(config), status=TrialStatus.PENDING)
        return view


class SeedQueue:
    """The warm-start configs (valid ones, in order): proposed first, each once, skipping any
    measured meanwhile."""

    def __init__(self, space: SearchSpace, configs: Iterable[Config]) -> None:
        self.space = space
        self._queue = [c for c in configs if space.is_valid(c)]
        self.keys = frozenset(space.key(c) for c in self._queue)

    def next(self, results: Mapping[str, TrialResult]) -> Config | None:
        """The next warm-start config not in ``results`` (None when all are)."""
        while self._queue:
            config = self._queue.pop(0)
            if self.space.key(config) not in results:
                return config
        return None


@dataclass
class ProposerContext:
    """What a search gives its proposer.

    ``rng``: the search's generator, shared (see the module's contract); ``seeds``: the
    warm-start configs; ``encoding``: the study's parameters (:class:`tuner.study.StudyParams`);
    ``storage``/``study_name``: where a proposer that asks Optuna keeps its study (None: in
    memory); ``on_upcoming``: called with the configs the proposer expects to propose next,
    likeliest first (a backend compiles them ahead; None: nobody listens, so none are
    computed); ``ahead``: most configs the search keeps in flight."""

    space: SearchSpace
    seed: int
    rng: random.Random
    seeds: SeedQueue
    encoding: StudyParams
    storage: str | optuna.storages.BaseStorage | None = None
    study_name: str | None = None
    on_upcoming: Callable[[list[Config]], None] | None = None
    ahead: int = 1


class Proposer(ABC):
    """A search strategy (see the module's contract). ``name`` is what settings, the REST API
    and the CLI call it; ``uses_study`` whether its proposals are asked of an Optuna study."""

    name: ClassVar[str]
    uses_study: ClassVar[bool] = False
    #: The Optuna study recording the proposals (None for a strategy that asks no study). A
    #: shared job's search replaces it with a view that tags and retries its calls.
    study: Any = None

    def __init__(self, context: ProposerContext) -> None:
        self.context = context

    @abstractmethod
    def propose(self, history: History, fallback: Config | None) -> tuple[Any, Config | None]:
        """The next config to consider (``fallback`` if given) and its ticket; config None: the
        strategy has none left.

        Raises:
            optuna.exceptions.UpdateFinishedTrialError: another worker closed the asked trial
                (a shared study); the search asks again.
        """

    def observe(self, ticket: Any, value: float) -> None:  # noqa: B027 - optional hook
        """The proposal of ``ticket`` was measured by this search: its objective ``value``
        (:func:`tuner.search.objective_value`)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The search has stopped (for now: it may run again): end any work the strategy
        does in the background."""

    def discard(self, ticket: Any, value: float | None = None) -> None:  # noqa: B027
        """The proposal of ``ticket`` is not measured by this search: told ``value`` (invalid:
        the failed value; measured already, by anyone: its value) or none (a repeat of a config
        in flight, or abandoned)."""
