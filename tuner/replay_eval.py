"""Search quality on a recorded space: the fraction of optimum a strategy reaches at a budget.

"Fraction of optimum" = best time in the file / best time the search found (1.0 = found the
optimum), averaged over seeds. What ``kato replay`` and ``benchmarks/search_quality.py`` report.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.backends.replay import ReplayBackend
from tuner.kt_cache import KernelTunerCache, load_cache
from tuner.search import Budget, Search


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay_search(
    cache: KernelTunerCache | str | Path,
    *,
    budget: int,
    repeats: int = 10,
    seed: int = 0,
    strategy: str = "tpe",
    seed_configs: list[dict[str, Any]] | None = None,
) -> ReplayReport:
    """Run ``repeats`` searches (seeds ``seed .. seed+repeats-1``) over a recorded space."""
    path = str(cache) if not isinstance(cache, KernelTunerCache) else "<memory>"
    data = cache if isinstance(cache, KernelTunerCache) else load_cache(cache)
    backend = ReplayBackend(data)
    optimum = backend.best_time_ms()
    per_seed = []
    started = time.perf_counter()
    for s in range(seed, seed + repeats):
        search = Search(
            backend.space(), backend.evaluate, strategy=strategy, seed=s, seed_configs=seed_configs
        )
        result = search.run(Budget(max_configs=budget))
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
    )
