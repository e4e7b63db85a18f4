"""In which order a batch's jobs should run so that the warm start helps most (issue 35).

A job's warm start seeds it with the winners of already-tuned shapes of the same operator,
dtype and GPU (``tuner/warm_start.py``), so the order of a batch decides what each job can start
from. This replays every group of whole spaces Kato recorded on the H200 (``data/spaces``; a
group: one operator, operator version and dtype, at least two shapes) as one batch, job after
job, each job measuring what the worker measures (``tuner.job_runner.first_configs``: the
operator's default config, then the seeds ranked from the jobs before it, then Kato's default
search), and counts the configs each job measures until its best is within ``--target`` (0.98)
of its space's optimum (the budget + 1 where it never gets there). Orders compared:

- ``given``: as submitted (here: by name, i.e. by shape);
- ``nearest``: the order :func:`warm_order` gives a batch: first the shape nearest all the
  others (least summed log2 distance), then always the untuned shape nearest to a tuned one.

Prints a table per group and the totals, writes JSON (``--out``). No GPU: recorded times.

    python3 benchmarks/batch_order.py --budget 50 --seeds 5 --out data/benchmarks/batch_order.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kato.kernels import get_operator  # noqa: E402
from kato.tuner.backends.replay import ReplayBackend  # noqa: E402
from kato.tuner.search import Budget, Search  # noqa: E402
from kato.tuner.warm_start import (  # noqa: E402
    SEEDS_PER_SOURCE,
    Source,
    rank_seed_configs,
    seed_limit,
    shape_distance,
)

from kato.shared.kt_cache import KernelTunerCache, load_cache  # noqa: E402

SPACES = ROOT / "data" / "spaces"


def warm_order(shapes: list[tuple[int, ...]]) -> list[int]:
    """Indices of ``shapes`` in the order that gives each job the nearest tuned neighbour: the
    most central shape first (least summed distance to the others, ties by position), then
    repeatedly the untuned shape nearest to any tuned one."""
    if not shapes:
        return []
    first = min(
        range(len(shapes)), key=lambda i: (sum(shape_distance(shapes[i], s) for s in shapes), i)
    )
    order, left = [first], set(range(len(shapes))) - {first}
    while left:
        nxt = min(left, key=lambda i: (min(shape_distance(shapes[i], shapes[j]) for j in order), i))
        order.append(nxt)
        left.remove(nxt)
    return order


def groups(root: Path) -> dict[str, list[KernelTunerCache]]:
    found: dict[str, list[KernelTunerCache]] = defaultdict(list)
    for path in sorted(root.glob("**/*.json.gz")):
        cache = load_cache(path)
        key = "{}/{}/{}".format(
            cache.extra["kato_operator"], cache.extra["kato_operator_version"], cache.extra["dtype"]
        )
        found[key].append(cache)
    return {k: v for k, v in found.items() if len(v) >= 2}


def run_batch(
    caches: list[KernelTunerCache], order: list[int], budget: int, seed: int, target: float
) -> list[int]:
    """Configs each job (in ``caches`` order) measured to reach ``target`` of its optimum."""
    tuned: list[Source] = []
    needed = [0] * len(caches)
    for index in order:
        cache = caches[index]
        shape = tuple(int(s) for s in cache.problem_size)
        backend = ReplayBackend(cache)
        space = backend.space()
        optimum = backend.best_time_ms()
        spec = get_operator(cache.extra["kato_operator"])
        first = [spec.default_config(list(shape), cache.extra["dtype"])]
        sources = [
            Source(name=s.name, distance=shape_distance(shape, tuple(s.name)), trials=s.trials)
            for s in tuned
        ]
        first += rank_seed_configs(
            sources, limit=seed_limit(budget), accept=space.is_valid, per_source=SEEDS_PER_SOURCE
        )
        trials: list[tuple[dict[str, Any], float]] = []
        reached: list[int] = []

        def measured(result: Any, count: int, trials=trials, reached=reached, best=optimum) -> None:
            if result.time_ms is not None:
                trials.append((dict(result.config), result.time_ms))
                if not reached and best / result.time_ms >= target:
                    reached.append(count)

        Search(space, backend.evaluate, seed=seed, seed_configs=first, on_result=measured).run(
            Budget(max_configs=budget)
        )
        needed[index] = reached[0] if reached else budget + 1
        # A source is named by its shape here, so that the next jobs can measure distances.
        tuned.append(Source(name=shape, distance=0.0, trials=trials))  # type: ignore[arg-type]
    return needed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spaces", type=Path, default=SPACES)
    parser.add_argument("--budget", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"budget": args.budget, "target": args.target, "groups": {}}
    totals = {"given": [], "nearest": []}
    print(f"{'group':48s} {'shapes':>6s} {'given':>8s} {'nearest':>8s}  (configs to target)")
    for name, caches in groups(args.spaces).items():
        shapes = [tuple(int(s) for s in c.problem_size) for c in caches]
        orders = {"given": list(range(len(caches))), "nearest": warm_order(shapes)}
        result = {}
        for label, order in orders.items():
            runs = [
                sum(run_batch(caches, order, args.budget, seed, args.target))
                for seed in range(args.seeds)
            ]
            result[label] = statistics.fmean(runs)
            totals[label].append(result[label])
        report["groups"][name] = {"shapes": shapes, "orders": orders, **result}
        print(f"{name:48s} {len(caches):6d} {result['given']:8.1f} {result['nearest']:8.1f}")
    report["total"] = {k: sum(v) for k, v in totals.items()}
    print(
        f"{'total':48s} {'':6s} {report['total']['given']:8.1f} {report['total']['nearest']:8.1f}"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=list) + "\n")
    return report


if __name__ == "__main__":
    main()
