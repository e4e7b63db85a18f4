"""The search loop: Optuna proposes configs, a backend measures them, the best median wins.

Contract (what the tests hold the loop to):

- Invalid configs (``space.check`` names a reason) are never measured and never count.
- A config is measured at most once per job: a repeat proposal is answered from the results
  already known (also those recorded before a restart), for free.
- A failed config (compile, launch, verify, timeout) counts as measured, is recorded, and the
  search goes on. Optuna sees it as a bad value so it steers away from it.
- The budget is a number of distinct measured configs and/or seconds of wall time.
- The winner is the config with the lowest median time among the OK results.

The Optuna study can live in any Optuna storage (the service uses the job database), so a job
that stops half-way resumes with the sampler's history intact. Strategies that propose every
config themselves (``forest``, ``grid``) are not asked through Optuna: each config they measure
is added to the study as a finished trial (in batches: :data:`RECORD_BATCH`). The study's
trials hold the configs' real values; the samplers see parameter indices (:mod:`tuner.study`).
"""

from __future__ import annotations

import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import optuna

from tuner.backends.base import TrialResult, TrialStatus
from tuner.space import Config, SearchSpace
from tuner.study import FAILED_VALUE, IndexSampler, StudyParams, add_trials
from tuner.surrogate import ForestProposer
from tuner.write_behind import WriteBehind

log = logging.getLogger(__name__)

Strategy = Literal["forest", "tpe", "hybrid", "random", "grid"]
#: Every selectable strategy; the first is the default.
STRATEGIES: tuple[str, ...] = ("forest", "tpe", "hybrid", "random", "grid")
#: The strategy a job gets when none is named (worker, CLI, API).
DEFAULT_STRATEGY = "forest"

#: Strategies that propose every config themselves: their configs are not asked from Optuna
#: (an enqueue, an ask, a suggestion per parameter and a tell, each a database write); each
#: measured one is added to the study as a finished trial, in batches of :data:`RECORD_BATCH`
#: (the costs: docs/search.md, "Constants").
SELF_PROPOSING: tuple[str, ...] = ("forest", "grid")
#: After this many proposals in a row that bring nothing new (invalid or already measured), the
#: loop measures a random unmeasured valid config instead, so small or heavily constrained
#: spaces never stall the search.
MAX_UNPRODUCTIVE_PROPOSALS = 32
#: A self-proposing strategy's measured configs go to the study in batches (one transaction
#: each: an Optuna ``add_trial`` commits alone), written
#: once this many wait or the oldest has waited :data:`RECORD_SECONDS`, and when a run ends. A
#: process that dies loses at most the unwritten ones from the study; the job's trial rows, which
#: a resume reads, are written per result.
RECORD_BATCH = 16
RECORD_SECONDS = 2.0


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
    write-behind) or making them inline (the study, ``on_result``); ``evaluate``: the
    ``evaluate`` callable (a worker's includes its reservation of the config); ``total``: the
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


def make_sampler(strategy: str, seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for a strategy name (it samples parameter indices: a study holds real
    values through :class:`tuner.study.IndexSampler`).

    Raises:
        ValueError: for an unknown strategy.
    """
    if strategy in ("tpe", "hybrid"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10)
    if strategy in ("random", "forest"):
        # "forest" proposes every config itself (enqueued); the sampler only carries them.
        return optuna.samplers.RandomSampler(seed=seed)
    if strategy == "grid":
        # The grid's order comes from Search (every valid config, shuffled by the seed, enqueued
        # one by one); Optuna's GridSampler would also walk the invalid points and stop the study.
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


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
        strategy: one of STRATEGIES; "forest" (the default) is a bagged-tree surrogate over
            the valid configs whose proposals alternate expected improvement with model-guided
            and random local steps around the best configs and with flips of the best configs'
            two-valued switches (tuner.surrogate), "tpe" Optuna's TPE,
            "hybrid" TPE plus local search, "random", "grid" (every valid config, shuffled).
        seed: makes the proposals reproducible.
        storage: Optuna storage (URL or object); None keeps the study in memory.
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
        write_behind: ``on_result`` and the study's record of a self-proposing strategy's
            result run on a background thread, in order, while the next config is measured
            (:mod:`tuner.write_behind`); :meth:`run` returns once they are done. Only for a
            backend that measures out of this process; ``on_result`` must then be callable from
            another thread and must not touch the search.
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
    ):
        self.space = space
        self.evaluate = evaluate
        self.strategy = strategy
        self.encoding = StudyParams(space.params)
        self.results: dict[str, TrialResult] = dict(known or {})
        self.on_result = on_result
        self.should_stop = should_stop
        self.on_upcoming = on_upcoming
        self._rng = random.Random(seed)
        self._grid: list[Config] | None = None
        self._forest: ForestProposer | None = None
        self._seed = seed
        self.local_after = 15
        if ahead < 1:
            raise ValueError("ahead must be at least 1")
        self.ahead = ahead
        self.ready = ready
        self.wait_ready = wait_ready
        self._writes = WriteBehind(write_behind)
        #: Configs asked for and not measured yet: (Optuna trial, config, key), oldest first.
        self._inflight: list[tuple[optuna.Trial | None, Config, str]] = []
        self._self_proposing = strategy in SELF_PROPOSING
        self._drained = False
        #: Where the loop's time went for each config the last :meth:`run` measured.
        self.timings: list[TrialTiming] = []
        #: Finished trials of a self-proposing strategy not handed to the writes yet, and when
        #: the oldest was measured.
        self._unrecorded: list[optuna.trial.FrozenTrial] = []
        self._unrecorded_since = 0.0
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = make_sampler(strategy, seed)
        self.study = optuna.create_study(
            storage=storage,
            study_name=study_name,
            sampler=IndexSampler(sampler, self.encoding),
            direction="minimize",
            load_if_exists=study_name is not None,
        )
        stored = self.encoding.stored_in(self.study)
        if stored.indices:  # a job begun by an older Kato: resumed on the indices it stored
            self.encoding, self.study.sampler = stored, sampler
        self._fail_orphaned_trials()
        self._seed_queue = [c for c in seed_configs or [] if space.is_valid(c)]
        self._seed_keys = frozenset(space.key(c) for c in self._seed_queue)

    def _next_seed_config(self) -> Config | None:
        """The next warm-start config not measured yet (None when all are)."""
        while self._seed_queue:
            config = self._seed_queue.pop(0)
            if self.space.key(config) not in self.results:
                return config
        return None

    def _fail_orphaned_trials(self) -> None:
        """Trials asked but never told (the process died mid-measurement) are marked failed;
        their configs, if measured and recorded, are answered from ``known``."""
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)

    def _random_unmeasured(self) -> Config | None:
        candidates = [
            c for c in self.space.valid_configs() if self.space.key(c) not in self.results
        ]
        return self._rng.choice(candidates) if candidates else None

    def _neighbours(self, config: Config) -> list[Config]:
        """Configs one step away: one ordered parameter moved to an adjacent value, or one
        categorical parameter changed."""
        out = []
        for name, vals in self.encoding.values.items():
            i = vals.index(config[name])
            steps = (i - 1, i + 1) if self.encoding.ordered[name] else range(len(vals))
            for j in steps:
                if 0 <= j < len(vals) and j != i:
                    out.append({**config, name: vals[j]})
        return out

    def _local_proposal(self) -> Config | None:
        """Hybrid strategy: half of the proposals after the start-up phase explore the
        neighbourhood of one of the three best configs so far (a greedy local search riding on
        TPE's global model); the rest come from TPE."""
        ok = sorted(
            (r for r in self.results.values() if r.time_ms is not None), key=lambda r: r.time_ms
        )  # type: ignore[arg-type,return-value]
        if len(self.results) < self.local_after or self._rng.random() < 0.5:
            return None
        for rank, incumbent in enumerate(ok[:3]):
            if rank and self._rng.random() < 0.5:
                continue
            fresh = [
                c
                for c in self._neighbours(incumbent.config)
                if self.space.is_valid(c) and self.space.key(c) not in self.results
            ]
            if fresh:
                return self._rng.choice(fresh)
        return None

    def _next_grid_point(self) -> Config | None:
        if self._grid is None:
            self._grid = list(self.space.valid_configs())
            self._rng.shuffle(self._grid)
            self._grid.reverse()  # pop() from the end walks the shuffled order
        while self._grid:
            point = self._grid.pop()
            if self.space.key(point) not in self.results:
                return point
        return None

    def _proposal_view(self) -> Mapping[str, TrialResult]:
        """The results as a proposer sees them: configs in flight count as pending."""
        if not self._inflight:
            return self.results
        view = dict(self.results)
        for _, config, key in self._inflight:
            view[key] = TrialResult(config=dict(config), status=TrialStatus.PENDING)
        return view

    def _own_proposal(self) -> Config | None:
        """Strategies that propose every config themselves (:data:`SELF_PROPOSING`): the next
        config, warm-start seeds first; None when the strategy has none left."""
        if (seeded := self._next_seed_config()) is not None:
            return seeded
        if self.strategy != "forest":
            return self._next_grid_point()
        if self._forest is None:
            self._forest = ForestProposer(
                self.space,
                self._seed,
                seed_keys=self._seed_keys,
                hints=self.on_upcoming is not None,
            )
        point = self._forest.propose(self._proposal_view())
        if point is None:
            return None
        upcoming = [self._forest.configs[i] for i in self._forest.upcoming]
        if self.ahead > 1:
            upcoming.insert(0, point)  # it may wait in flight: compile it first
        if self.on_upcoming is not None and upcoming:
            self.on_upcoming(upcoming)
        return point

    def _enqueue_next(self) -> None:
        """Sampler strategies: enqueue the config the next ``ask`` returns, if not the
        sampler's own (a warm-start seed, a hybrid local step)."""
        if (seeded := self._next_seed_config()) is not None:
            self.study.enqueue_trial(self.encoding.params(seeded))
        elif self.strategy == "hybrid" and (local := self._local_proposal()) is not None:
            self.study.enqueue_trial(self.encoding.params(local))

    def _ask(self, fallback: Config | None) -> tuple[optuna.Trial | None, Config | None]:
        """The next config to consider (``fallback`` if given) and its Optuna trial: None for a
        self-proposing strategy, whose configs get a trial once measured. Config None: the
        strategy has none left.

        Raises:
            optuna.exceptions.UpdateFinishedTrialError: another worker closed the asked trial.
        """
        if self._self_proposing:
            return None, fallback or self._own_proposal()
        if fallback is not None:
            self.study.enqueue_trial(self.encoding.params(fallback))
        self._enqueue_next()
        trial = self.study.ask()
        return trial, self.encoding.suggest(trial)

    def _rejected(self, trial: optuna.Trial | None, config: Config, key: str) -> bool:
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

    def _close(self, trial: optuna.Trial | None, value: float | None = None) -> None:
        """Finish an asked trial whose config is not measured by it: told ``value``, or failed
        without one (no-op without a trial: self-proposed configs have none)."""
        if trial is None:
            return
        if value is None:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(trial, value)

    def _record(self, config: Config, value: float) -> None:
        """A measured config of a self-proposing strategy, as a finished trial of the study
        (the study keeps every job's history whatever its strategy): stamped now, written with
        the next batch (:data:`RECORD_BATCH`)."""
        if not self._unrecorded:
            self._unrecorded_since = time.monotonic()
        self._unrecorded.append(
            optuna.trial.create_trial(
                params=self.encoding.params(config),
                distributions=self.encoding.distributions,
                value=value,
            )
        )
        waited = time.monotonic() - self._unrecorded_since
        if len(self._unrecorded) >= RECORD_BATCH or waited >= RECORD_SECONDS:
            self._submit_records()

    def _submit_records(self) -> None:
        """Hand the unwritten finished trials to the writes (one batch)."""
        if self._unrecorded:
            batch, self._unrecorded = self._unrecorded, []
            self._writes.submit(self._write_records, batch)

    def _write_records(self, trials: list[optuna.trial.FrozenTrial]) -> None:
        """One batch of finished trials into the study (one transaction in a database)."""
        add_trials(self.study, trials)

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

    def _next_to_measure(self) -> tuple[optuna.Trial | None, Config, str]:
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

    def run(self, budget: Budget) -> SearchResult:
        """Measure until ``budget`` is used, the strategy has nothing left, or ``should_stop``;
        every result is recorded (``on_result``, the study) when it returns or raises."""
        self.timings = []
        try:
            try:
                outcome = self._run(budget)
            finally:
                self._submit_records()  # whatever ended the run: the study gets them all
        except Exception as stop:
            # A stop (budget used, job cancelled) or a failure: a failed write outranks it, so
            # that a job never ends as if a result it lost had been stored.
            self._abandon_inflight_quietly()
            try:
                self._writes.close(raise_errors=True)
            except Exception as write_error:
                raise write_error from stop
            raise
        except BaseException:
            self._abandon_inflight_quietly()
            self._writes.close()  # interrupted: failed writes are logged, the interrupt raised
            raise
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
            t0 = clock()
            try:
                # The last result's records, while the next one compiles and measures.
                self._writes.release()
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
            self.results[key] = result
            new.append(result)
            if trial is not None:
                self.study.tell(trial, objective_value(result))  # the sampler reads it next
            else:
                self._record(config, objective_value(result))
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
