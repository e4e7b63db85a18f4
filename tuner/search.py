"""The search loop: Optuna proposes configs, a backend measures them, the best median wins.

Contract (what the tests hold the loop to):

- Invalid configs (``space.check`` names a reason) are never measured and never count.
- A config is measured at most once per job: a repeat proposal is answered from the results
  already known (also those recorded before a restart), for free.
- A failed config (compile, launch, verify, timeout) counts as measured, is recorded, and the
  search goes on. Optuna sees it as a bad value so it steers away from it.
- The budget is a number of distinct measured configs and/or seconds of wall time.
- The winner is the config with the lowest median time among the OK results.

Each strategy is a :class:`tuner.proposers.Proposer` in its own module, chosen by name
(:data:`tuner.proposers.PROPOSERS`). A strategy an Optuna sampler proposes for (``tpe``,
``hybrid``, ``random``) asks the job's Optuna study, which can live in any Optuna storage (the
service uses the job database), so a job that stops half-way resumes with the sampler's history
intact; its trials hold the configs' real values, the samplers see parameter indices
(:mod:`tuner.study`). A strategy that proposes without Optuna (``forest``, ``grid``) keeps no
study: its record is the results (a job's trial rows).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.proposers import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    History,
    Proposer,
    ProposerContext,
    SeedQueue,
    Strategy,
    make_proposer,
)
from kato.tuner.space import Config, SearchSpace
from kato.tuner.study import FAILED_VALUE, StudyParams
from kato.tuner.write_behind import WriteBehind

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STRATEGY",
    "FAILED_VALUE",
    "STRATEGIES",
    "Budget",
    "Search",
    "SearchResult",
    "Strategy",
    "TrialTiming",
    "best_of",
    "objective_value",
]

#: After this many proposals in a row that bring nothing new (invalid or already measured), the
#: loop measures a random unmeasured valid config instead, so small or heavily constrained
#: spaces never stall the search.
MAX_UNPRODUCTIVE_PROPOSALS = 32


@dataclass(frozen=True)
class Budget:
    """How much a search may measure: distinct configs and/or wall-clock seconds (None = no
    limit on that axis; at least one must be set)."""

    max_configs: int | None = 100
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_configs is None and self.max_seconds is None:
            raise ValueError("a budget needs max_configs or max_seconds")
        if self.max_configs is not None and self.max_configs < 1:
            raise ValueError("max_configs must be at least 1")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError("max_seconds must be positive")


@dataclass
class TrialTiming:
    """Where the search loop's wall time went for one measured config, in seconds: from the end
    of the previous measurement (or the start of the run) to the end of this one.

    ``propose``: asking the strategy for configs (model fits and acquisition, Optuna's ask),
    rejected proposals included; ``stop_check``: ``should_stop`` (a worker reads the other
    workers' results there); ``writes``: waiting for the previous result's records (the
    write-behind) or making them inline (the proposer's study, ``on_result``); ``evaluate``: the
    ``evaluate`` callable (a worker's includes its reservation of the config and, with
    ``evaluate_releases``, the wait for the previous records); ``total``: the
    whole span, so ``total`` minus the others is the loop's own bookkeeping."""

    propose: float = 0.0
    stop_check: float = 0.0
    writes: float = 0.0
    evaluate: float = 0.0
    total: float = 0.0

    @property
    def overhead(self) -> float:
        """Everything but ``evaluate``."""
        return self.total - self.evaluate


@dataclass
class SearchResult:
    """Outcome of :meth:`Search.run`. ``results`` maps config key -> result for every config
    measured in this job (resumed ones included); ``new`` lists the ones measured in this run,
    ``timings`` where the loop's time went for each of them (in the same order)."""

    best: TrialResult | None
    results: dict[str, TrialResult]
    new: list[TrialResult] = field(default_factory=list)
    stopped: str = "budget"  # budget | time | exhausted | cancelled
    timings: list[TrialTiming] = field(default_factory=list)

    @property
    def measured(self) -> int:
        return len(self.results)


def objective_value(result: TrialResult) -> float:
    t = result.time_ms
    return t if t is not None and math.isfinite(t) else FAILED_VALUE


def best_of(results: Mapping[str, TrialResult]) -> TrialResult | None:
    """The OK result with the lowest median time (None if none succeeded)."""
    ok = [r for r in results.values() if r.time_ms is not None]
    return min(ok, key=lambda r: r.time_ms) if ok else None  # type: ignore[arg-type,return-value]


class Search:
    """One search over ``space`` measuring with ``evaluate``.

    Args:
        space: parameters and validity.
        evaluate: measures one valid config; must not raise for a faulty config.
        strategy: one of STRATEGIES (:mod:`tuner.proposers`); "forest" (the default) is a
            bagged-tree surrogate over the valid configs whose proposals alternate expected
            improvement with model-guided and random local steps around the best configs and
            with flips of the best configs' two-valued switches (tuner.surrogate), "tpe"
            Optuna's TPE, "hybrid" TPE plus local search, "random", "grid" (every valid
            config, shuffled).
        seed: makes the proposals reproducible.
        storage: Optuna storage (URL or object) of the study of a strategy that asks Optuna;
            None keeps it in memory. Unused by a strategy that proposes without Optuna.
        study_name: required with a persistent storage to resume a job.
        known: results measured earlier for this job (key -> result); never re-measured.
        seed_configs: configs to measure first (warm start), in order; invalid ones skipped.
        on_result: called after each new measurement with (result, measured_so_far).
        on_upcoming: called with the configs the search expects to propose next, likeliest
            first, after each proposal that has them (the default strategy names them; a
            backend compiles them ahead: ``PyCudaBackend.hint``). Never changes the search.
        should_stop: polled before each measurement; True ends the search ("cancelled").
        ahead: most configs asked for and not measured yet (1: ask, measure, ask, ...). Above
            1, when no config asked for is ``ready`` (its compile is still running), the search
            asks for another one, with those in flight as pending, instead of waiting, and
            measures the first that is ready: the GPU waits on the compiler only when all of
            them compile. Each extra proposal is made without the results still in flight.
        ready: whether measuring a config now would not wait (its compile is done; a backend's
            ``is_compiled``). None: always (no proposal is ever made ahead).
        wait_ready: blocks until one of the configs given is ``ready`` (a backend's
            ``wait_compiled``); with ``ahead`` configs in flight and none ready, the search
            waits with it and measures the first ready, rather than the oldest.
        write_behind: ``on_result`` runs on a background thread, in order, while the next
            config is measured
            (:mod:`tuner.write_behind`); :meth:`run` returns once they are done. Only for a
            backend that measures out of this process; ``on_result`` must then be callable from
            another thread and must not touch the search.
        evaluate_releases: ``evaluate`` starts the earlier results' writes itself
            (:meth:`release_writes`) once its own database work before the measurement is done
            (a worker's reservation of the config), so that the two do not contend for the
            database; the loop starts them before ``evaluate`` otherwise, and after it where
            ``evaluate`` did not.
    """

    def __init__(
        self,
        space: SearchSpace,
        evaluate: Callable[[Config], TrialResult],
        *,
        strategy: str = DEFAULT_STRATEGY,
        seed: int = 0,
        storage: str | optuna.storages.BaseStorage | None = None,
        study_name: str | None = None,
        known: Mapping[str, TrialResult] | None = None,
        seed_configs: list[Config] | None = None,
        on_result: Callable[[TrialResult, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_upcoming: Callable[[list[Config]], None] | None = None,
        ahead: int = 1,
        ready: Callable[[Config], bool] | None = None,
        wait_ready: Callable[[list[Config]], None] | None = None,
        write_behind: bool = False,
        evaluate_releases: bool = False,
    ):
        self.space = space
        self.evaluate = evaluate
        self.strategy = strategy
        self.results: dict[str, TrialResult] = dict(known or {})
        # A sampled space's pool (tuner.space) must hold what this search starts from: the
        # warm-start configs with their one-step neighbours (to search around them) and the
        # configs measured before (to learn from them).
        space.include(seed_configs or [], neighbours=True)
        space.include(r.config for r in self.results.values() if r.config)
        self.on_result = on_result
        self.should_stop = should_stop
        self.on_upcoming = on_upcoming
        # One generator for the search's fallback draws and the proposer's own (see
        # tuner.proposers.base): the proposals stay what they were given the seed.
        self._rng = random.Random(seed)
        if ahead < 1:
            raise ValueError("ahead must be at least 1")
        self.ahead = ahead
        self.ready = ready
        self.wait_ready = wait_ready
        self._writes = WriteBehind(write_behind)
        self._evaluate_releases = evaluate_releases
        self._released = False  # the earlier results' writes were started for this trial
        #: Configs asked for and not measured yet: (ticket, config, key), oldest first.
        self._inflight: list[tuple[Any, Config, str]] = []
        self._drained = False
        #: Where the loop's time went for each config the last :meth:`run` measured.
        self.timings: list[TrialTiming] = []
        context = ProposerContext(
            space=space,
            seed=seed,
            rng=self._rng,
            seeds=SeedQueue(space, seed_configs or []),
            encoding=StudyParams(space.params),
            storage=storage,
            study_name=study_name,
            on_upcoming=on_upcoming,
            ahead=ahead,
        )
        #: The strategy (:mod:`tuner.proposers`).
        self.proposer: Proposer = make_proposer(strategy, context)
        self._fail_orphaned_trials()

    @property
    def study(self) -> Any:
        """The Optuna study of a strategy that asks Optuna; None for one that does not."""
        return self.proposer.study

    @study.setter
    def study(self, study: Any) -> None:
        self.proposer.study = study

    def _fail_orphaned_trials(self) -> None:
        """Trials asked but never told (the process died mid-measurement) are marked failed;
        their configs, if measured and recorded, are answered from ``known``."""
        if self.study is None:
            return
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)

    def _random_unmeasured(self) -> Config | None:
        candidates = [
            c for c in self.space.valid_configs() if self.space.key(c) not in self.results
        ]
        return self._rng.choice(candidates) if candidates else None

    def _ask(self, fallback: Config | None) -> tuple[Any, Config | None]:
        """The proposer's next config (``fallback`` if given) and its ticket; config None: the
        strategy has none left."""
        in_flight = [(key, config) for _, config, key in self._inflight]
        return self.proposer.propose(History(self.results, in_flight), fallback)

    def _rejected(self, trial: Any, config: Config, key: str) -> bool:
        """Whether ``config`` brings nothing new (invalid, measured, or in flight); its trial is
        then closed: told the failed or known value, or failed."""
        if not self.space.is_valid(config):
            self._close(trial, FAILED_VALUE)
        elif key in self.results:
            self._close(trial, objective_value(self.results[key]))
        elif any(key == k for _, _, k in self._inflight):
            self._close(trial)
        else:
            return False
        return True

    def _close(self, trial: Any, value: float | None = None) -> None:
        """A proposal not measured by this search: the proposer is told (``value`` where one is
        known; :meth:`tuner.proposers.Proposer.discard`)."""
        self.proposer.discard(trial, value)

    def _wants_another(self, budget: Budget) -> bool:
        """Ask for another config before measuring? Always with none in flight; with some, only
        while none of them is ready, up to ``ahead`` and the config budget."""
        if not self._inflight:
            return True
        if self._drained or len(self._inflight) >= self.ahead or self.ready is None:
            return False
        if budget.max_configs is not None and (
            len(self.results) + len(self._inflight) >= budget.max_configs
        ):
            return False
        return not any(self.ready(config) for _, config, _ in self._inflight)

    def _next_to_measure(self) -> tuple[Any, Config, str]:
        """The first config in flight that is ready (else, after ``wait_ready``, the first
        ready then, else the oldest), out of the list."""
        if self.ready is None or len(self._inflight) < 2:
            return self._inflight.pop(0)
        ready = self.ready

        def first_ready() -> int | None:
            return next((i for i, (_, c, _) in enumerate(self._inflight) if ready(c)), None)

        first = first_ready()
        if first is None and self.wait_ready is not None:
            self.wait_ready([c for _, c, _ in self._inflight])
            first = first_ready()
        return self._inflight.pop(first or 0)

    def _abandon_inflight(self) -> None:
        """The search stops with configs asked for and not measured: close their trials."""
        for trial, _, _ in self._inflight:
            self._close(trial)
        self._inflight.clear()

    def _abandon_inflight_quietly(self) -> None:
        """On an exception from anywhere in the loop (a sync, an ask, a tell): close the trials
        asked and not measured, so none stays RUNNING in the study while this worker lives
        (a resume fails only a dead worker's); a failure to close them is logged, not raised
        over the exception that ended the run."""
        try:
            self._abandon_inflight()
        except Exception:
            log.exception("closing the trials in flight failed")
            self._inflight.clear()

    def release_writes(self) -> None:
        """Start the earlier results' writes (``on_result``) on the write-behind thread, after
        waiting for those started before; once per measured config, later calls are no-ops.
        Called by ``evaluate`` where the search was made with ``evaluate_releases``, from the
        search's thread. Raises the first failure of the writes started before."""
        if self._released:
            return
        self._released = True
        self._writes.release()

    def _close_proposer(self) -> None:
        """The strategy's background work ends with the run (the forest's model fits)."""
        close = getattr(self.proposer, "close", None)
        try:
            if close is not None:
                close()
        except Exception:
            log.exception("closing the strategy failed")

    def run(self, budget: Budget) -> SearchResult:
        """Measure until ``budget`` is used, the strategy has nothing left, or ``should_stop``;
        every result is recorded (``on_result``, the study) when it returns or raises."""
        self.timings = []
        try:
            outcome = self._run(budget)
        except Exception as stop:
            self._close_proposer()
            # A stop (budget used, job cancelled) or a failure: a failed write outranks it, so
            # that a job never ends as if a result it lost had been stored.
            self._abandon_inflight_quietly()
            try:
                self._writes.close(raise_errors=True)
            except Exception as write_error:
                raise write_error from stop
            raise
        except BaseException:
            self._close_proposer()
            self._abandon_inflight_quietly()
            self._writes.close()  # interrupted: failed writes are logged, the interrupt raised
            raise
        self._close_proposer()
        t0 = time.perf_counter()
        self._writes.close(raise_errors=True)
        if self.timings:  # the last result's records are written on the path
            waited = time.perf_counter() - t0
            self.timings[-1].writes += waited
            self.timings[-1].total += waited
        outcome.timings = list(self.timings)
        return outcome

    def _run(self, budget: Budget) -> SearchResult:
        start = time.monotonic()
        self._drained = False  # the strategy had nothing left to propose in this run
        new: list[TrialResult] = []
        unproductive = 0
        stopped = "budget"
        clock = time.perf_counter
        timing, since = TrialTiming(), clock()
        while True:
            if budget.max_configs is not None and len(self.results) >= budget.max_configs:
                stopped = "budget"
                break
            if budget.max_seconds is not None and time.monotonic() - start >= budget.max_seconds:
                stopped = "time"
                break
            if self.should_stop is not None:
                t0 = clock()
                stop = self.should_stop()
                timing.stop_check += clock() - t0
                if stop:
                    stopped = "cancelled"
                    break
            if self._wants_another(budget):
                t0 = clock()
                try:
                    asked, unproductive = self._ask_one(unproductive)
                finally:
                    timing.propose += clock() - t0
                if asked == "exhausted":
                    stopped = "exhausted"
                    break
                if asked != "asked":
                    continue
                if self._wants_another(budget):
                    continue
            self._released = False
            if not self._evaluate_releases:
                t0 = clock()
                try:
                    # The last result's records, while the next one compiles and measures.
                    self.release_writes()
                except BaseException:
                    self._abandon_inflight()
                    raise
                timing.writes += clock() - t0
            trial, config, key = self._next_to_measure()
            known = self.results.get(key)
            if known is not None and known.status != TrialStatus.PENDING:
                self._close(trial, objective_value(known))  # another worker measured it
                continue
            t0 = clock()
            try:
                result = self.evaluate(config)
            except BaseException:
                self._inflight.insert(0, (trial, config, key))
                self._abandon_inflight()
                raise
            t1 = clock()
            timing.evaluate += t1 - t0
            if not self._released:  # evaluate answered without a release of its own
                try:
                    self.release_writes()
                except BaseException:
                    self._abandon_inflight()
                    raise
            self.results[key] = result
            new.append(result)
            self.proposer.observe(trial, objective_value(result))
            if self.on_result is not None:
                self._writes.submit(self.on_result, result, len(self.results))
            now = clock()
            timing.writes += now - t1
            timing.total = now - since
            self.timings.append(timing)
            timing, since = TrialTiming(), now
        self._abandon_inflight()
        return SearchResult(
            best=best_of(self.results), results=self.results, new=new, stopped=stopped
        )

    def _ask_one(self, unproductive: int) -> tuple[str, int]:
        """Ask the strategy for one config and put it in flight, given how many proposals in a
        row brought nothing new; returns what happened and that count after it. ``asked``;
        ``retry``: nothing new (or its trial was closed by another worker); ``drained``: the
        strategy has none left, configs are in flight; ``exhausted``: none left at all."""
        fallback = None
        if unproductive >= MAX_UNPRODUCTIVE_PROPOSALS:
            fallback = self._random_unmeasured()
            if fallback is None and not self._inflight:
                return "exhausted", unproductive
            unproductive = 0
        try:
            trial, config = self._ask(fallback)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker sharing the study closed this trial between the ask and the
            # suggest (it took it for an orphan): ask again; nothing was measured.
            return "retry", unproductive + 1
        if config is None:
            if not self._inflight:
                return "exhausted", unproductive
            self._drained = True  # nothing left to ask for: measure the rest
            return "drained", unproductive
        key = self.space.key(config)
        if self._rejected(trial, config, key):
            return "retry", unproductive + 1
        self._inflight.append((trial, config, key))
        return "asked", 0
