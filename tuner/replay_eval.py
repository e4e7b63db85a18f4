"""Search quality on a recorded space: the fraction of optimum a strategy reaches at a budget.

"Fraction of optimum" = best time in the file / best time the search found (1.0 = found the
optimum), averaged over seeds. What ``kato replay`` and ``benchmarks/search_quality.py`` report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.search import DEFAULT_STRATEGY, Budget, Search
from kato.tuner.warm_start import SEEDS_PER_SOURCE, cache_source, rank_seed_configs, seed_limit

from kato.shared.kt_cache import KernelTunerCache, load_cache


@dataclass
class ReplayReport:
    file: str
    kernel: str
    device: str
    strategy: str
    budget: int
    repeats: int
    seed: int
    optimum_ms: float
    mean_fraction_of_optimum: float
    min_fraction_of_optimum: float
    per_seed: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    warm_start: str | None = None
    seed_configs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay_search(
    cache: KernelTunerCache | str | Path,
    *,
    budget: int,
    repeats: int = 10,
    seed: int = 0,
    strategy: str = DEFAULT_STRATEGY,
    seed_configs: list[dict[str, Any]] | None = None,
    warm_start: KernelTunerCache | str | Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Run ``repeats`` searches (seeds ``seed .. seed+repeats-1``) over a recorded space.

    ``warm_start``: another recorded space of the same kernel (e.g. another GPU); its
    measurements are ranked as a job's warm start from the database ranks them
    (:func:`warm_start_seeds`) and measured first, after any ``seed_configs``.

    ``on_progress``: called with ``(done, repeats * budget)`` after every measured config, in
    the calling thread; a search that ends short of its budget (a space smaller than it) counts
    the rest as done when it ends, so ``done`` ends at the total.
    """
    path = str(cache) if not isinstance(cache, KernelTunerCache) else "<memory>"
    data = cache if isinstance(cache, KernelTunerCache) else load_cache(cache)
    backend = ReplayBackend(data)
    optimum = backend.best_time_ms()
    seeds = list(seed_configs or [])
    if warm_start is not None:
        seeds += warm_start_seeds(backend, warm_start, budget)
    per_seed = []
    started = time.perf_counter()
    total = repeats * budget
    for index, s in enumerate(range(seed, seed + repeats)):
        before = index * budget

        def measured(_result: Any, count: int, before: int = before) -> None:
            if on_progress is not None:
                on_progress(before + min(count, budget), total)

        search = Search(
            backend.space(),
            backend.evaluate,
            strategy=strategy,
            seed=s,
            seed_configs=seeds,
            on_result=measured,
        )
        result = search.run(Budget(max_configs=budget))
        if on_progress is not None and result.measured < budget:
            on_progress(before + budget, total)
        best = result.best.time_ms if result.best else None
        per_seed.append(
            {
                "seed": s,
                "best_time_ms": best,
                "fraction_of_optimum": optimum / best if best else 0.0,
                "measured": result.measured,
                "best_config": result.best.config if result.best else None,
            }
        )
    fractions = [p["fraction_of_optimum"] for p in per_seed]
    return ReplayReport(
        file=path,
        kernel=data.kernel_name,
        device=data.device_name,
        strategy=strategy,
        budget=budget,
        repeats=repeats,
        seed=seed,
        optimum_ms=optimum,
        mean_fraction_of_optimum=statistics.fmean(fractions),
        min_fraction_of_optimum=min(fractions),
        per_seed=per_seed,
        seconds=time.perf_counter() - started,
        warm_start=None if warm_start is None else str(warm_start),
        seed_configs=seeds,
    )


def warm_start_seeds(
    backend: ReplayBackend, source: KernelTunerCache | str | Path, budget: int
) -> list[dict[str, Any]]:
    """The configs a job over ``backend``'s space would measure first if the database held
    ``source``'s measurements (another GPU, same shape): ranked by
    :func:`tuner.warm_start.rank_seed_configs`, at most :func:`tuner.warm_start.seed_limit`."""
    other = source if isinstance(source, KernelTunerCache) else load_cache(source)
    return rank_seed_configs(
        [cache_source(other)],
        limit=seed_limit(budget),
        accept=backend.space().is_valid,
        per_source=SEEDS_PER_SOURCE,
    )
