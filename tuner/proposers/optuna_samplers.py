"""Strategies whose configs an Optuna sampler proposes (``tpe``, ``random``): asked of the job's
study, which records every proposal (the sampler's history, resumed with the job)."""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from kato.tuner.proposers.base import History, Proposer, ProposerContext
from kato.tuner.space import Config
from kato.tuner.study import IndexSampler


class OptunaProposer(Proposer):
    """Proposes what the study's sampler asks (seeds and fallbacks enqueued first). The study's
    trials hold real values, the sampler sees indices (:mod:`tuner.study`); a study an older
    Kato stored with indices is resumed on them."""

    uses_study = True

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.encoding = context.encoding
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = self.make_sampler(context.seed)
        self.study = optuna.create_study(
            storage=context.storage,
            study_name=context.study_name,
            sampler=IndexSampler(sampler, self.encoding),
            direction="minimize",
            load_if_exists=context.study_name is not None,
        )
        stored = self.encoding.stored_in(self.study)
        if stored.indices:  # a job begun by an older Kato: resumed on the indices it stored
            self.encoding, self.study.sampler = stored, sampler

    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        """The sampler (it samples parameter indices)."""
        raise NotImplementedError

    def local_proposal(self, history: History) -> Config | None:
        """A config to enqueue instead of the sampler's own (None: the sampler proposes)."""
        return None

    def propose(self, history: History, fallback: Config | None) -> tuple[Any, Config | None]:
        if fallback is not None:
            self.study.enqueue_trial(self.encoding.params(fallback))
        if (seeded := self.context.seeds.next(history.results)) is not None:
            self.study.enqueue_trial(self.encoding.params(seeded))
        elif (local := self.local_proposal(history)) is not None:
            self.study.enqueue_trial(self.encoding.params(local))
        trial = self.study.ask()
        return trial, self.encoding.suggest(trial)

    def observe(self, ticket: Any, value: float) -> None:
        self.study.tell(ticket, value)  # the sampler reads it next

    def discard(self, ticket: Any, value: float | None = None) -> None:
        if value is None:
            self.study.tell(ticket, state=optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(ticket, value)


class TpeProposer(OptunaProposer):
    """``tpe``: Optuna's multivariate TPE, after 10 start-up trials."""

    name = "tpe"

    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10)


class RandomProposer(OptunaProposer):
    """``random``: Optuna's random sampler."""

    name = "random"

    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.RandomSampler(seed=seed)
