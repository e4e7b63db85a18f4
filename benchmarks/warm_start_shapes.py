"""Warm start from other shapes on the same GPU, measured on recorded spaces.

A job's warm start (``tuner/warm_start.py``) first measures the fastest configs that other jobs
of the same operator, operator version and dtype measured at other shapes on the same GPU model
(every job), and on other GPU models (only jobs of at most ``OTHER_GPU_MAX_BUDGET`` configs: that
half is measured by ``search_quality.py --warm-start`` on the two convolution files). This script
measures the same-GPU half, the one every job gets.

For every recorded space with siblings (same operator, version, dtype and GPU, other shapes;
Kato's recorded spaces carry those in the file), Kato's default strategy runs at each budget with
and without seeds, same seeds. The seeds are ranked by ``rank_seed_configs``, as a job ranks the
database's sources (nearest shape first, each sibling's best, then each one's second best, ...;
``seed_limit`` of the budget), from what the database would hold:

- ``--source job`` (default): each sibling's own default-strategy run of ``--source-budget``
  configs with the same seed number, i.e. what one earlier job on that shape left behind;
- ``--source file``: each sibling's whole recorded file, a brute-forced neighbour (the most a
  source can know).

Per target and budget it prints the mean fraction of optimum without and with the seeds and the
difference with its 95% Welch interval (``benchmarks/verdicts.compare``: ``above`` where the seeds
help beyond the seed noise, ``below`` where they hurt), then a count over the targets.

Usage::

    python3 benchmarks/warm_start_shapes.py --seeds 40 --out data/benchmarks/warm_start_shapes.json
    python3 benchmarks/warm_start_shapes.py FILE.json.gz ... --no-recorded --source file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kato.tuner.backends.replay import ReplayBackend  # noqa: E402
from kato.tuner.search import DEFAULT_STRATEGY  # noqa: E402
from kato.tuner.warm_start import (  # noqa: E402
    SEEDS_PER_SOURCE,
    Source,
    cache_source,
    rank_seed_configs,
    seed_limit,
    shape_distance,
)
from paths import space_files  # noqa: E402

from benchmarks.search_quality import _cache, _table, fraction, kato_run, short_name  # noqa: E402
from benchmarks.verdicts import compare  # noqa: E402

BUDGETS = (10, 25, 50, 100)
#: Configs of the earlier job each sibling source stands for (``--source job``).
SOURCE_BUDGET = 100


def space_key(path: str) -> tuple[str, str, str, str] | None:
    """(operator, operator version, dtype, GPU) of a Kato-recorded file; None for other files
    (Kernel Tuner's own cache files do not say their dtype or operator version)."""
    cache = _cache(path)
    extra = cache.extra or {}
    if not {"kato_operator", "kato_operator_version", "dtype"} <= extra.keys():
        return None
    return (
        extra["kato_operator"],
        extra["kato_operator_version"],
        extra["dtype"],
        cache.device_name,
    )


def sibling_groups(paths: list[str]) -> dict[str, list[str]]:
    """Each target with siblings -> its siblings (same key, another problem size)."""
    by_key: dict[tuple, list[str]] = defaultdict(list)
    for p in paths:
        if (key := space_key(p)) is not None:
            by_key[key].append(p)
    out: dict[str, list[str]] = {}
    for members in by_key.values():
        for p in members:
            shape = list(_cache(p).problem_size)
            others = [q for q in members if list(_cache(q).problem_size) != shape]
            if others:
                out[p] = others
    return out


def run(path: str, seed: int, budget: int, seeds: list[dict] | None = None) -> list[tuple]:
    """One default-strategy search on the replay backend: (config, time or None) in order."""
    return kato_run(path, DEFAULT_STRATEGY, seed, budget, seeds)


def sources_for(
    target: str, siblings: list[str], seed: int, mode: str, budget: int
) -> list[Source]:
    """The database's view of the siblings for a job on ``target`` (see the module doc)."""
    shape = list(_cache(target).problem_size)
    out = []
    for sib in siblings:
        cache = _cache(sib)
        distance = shape_distance(list(cache.problem_size), shape)
        if mode == "file":
            source = cache_source(cache, name=short_name(sib), distance=distance)
            source.other_gpu = False  # a sibling shape on the same GPU
        else:
            trials = [(c, t) for c, t in run(sib, seed, budget) if t is not None]
            source = Source(name=short_name(sib), distance=distance, trials=trials)
        out.append(source)
    return out


def task(
    target: str,
    siblings: list[str],
    seed: int,
    budgets: tuple[int, ...],
    mode: str,
    source_budget: int,
    per_source: int = SEEDS_PER_SOURCE,
) -> dict[str, Any]:
    """Cold and warm fractions of one target and seed at every budget."""
    optimum = float(_cache(target).best()[1][_cache(target).time_field])
    cold = [t for _, t in run(target, seed, max(budgets))]
    space = ReplayBackend(_cache(target)).space()
    sources = sources_for(target, siblings, seed, mode, source_budget)
    warm, n_seeds, seed_fraction = {}, {}, {}
    for b in budgets:
        seeds = rank_seed_configs(
            sources, limit=seed_limit(b), accept=space.is_valid, per_source=per_source
        )
        times = [t for _, t in run(target, seed, b, seeds)]
        warm[b] = fraction(optimum, times)
        n_seeds[b] = len(seeds)
        seed_fraction[b] = fraction(optimum, times[: len(seeds)])
    return {
        "target": target,
        "seed": seed,
        "cold": {b: fraction(optimum, cold[:b]) for b in budgets},
        "warm": warm,
        "seeds": n_seeds,
        "seeds_alone": seed_fraction,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="more recorded spaces (Kato's Kernel Tuner files)")
    ap.add_argument("--no-recorded", action="store_true", help="only the files given")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--seeds", type=int, default=10, help="seeds per target and budget")
    ap.add_argument("--source", choices=("job", "file"), default="job")
    ap.add_argument("--source-budget", type=int, default=SOURCE_BUDGET)
    ap.add_argument(
        "--per-source",
        type=int,
        default=SEEDS_PER_SOURCE,
        help="seeds taken from each sibling at most (default: what a job takes)",
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    paths = [] if args.no_recorded else [str(p) for p in space_files()]
    paths += [str(Path(f).resolve()) for f in args.files]
    groups = sibling_groups(paths)
    if not groups:
        ap.error("no recorded space has a sibling (same operator, version, dtype, GPU)")
    if args.seeds < 2:
        ap.error("--seeds must be at least 2 (the intervals need a spread)")

    started = time.time()
    jobs = [
        (t, sibs, s, budgets, args.source, args.source_budget, args.per_source)
        for t, sibs in groups.items()
        for s in range(args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        done = list(pool.map(task, *zip(*jobs, strict=True)))

    by_target: dict[str, list[dict]] = defaultdict(list)
    for r in done:
        by_target[r["target"]].append(r)
    report: dict[str, Any] = {
        "strategy": DEFAULT_STRATEGY,
        "source": args.source,
        "source_budget": args.source_budget if args.source == "job" else None,
        "per_source": args.per_source,
        "budgets": list(budgets),
        "seeds": args.seeds,
        "metric": "mean over seeds of (best time in file / best time found)",
        "targets": {},
    }
    rows, verdicts = [], Counter()
    for target, runs in sorted(by_target.items()):
        entry: dict[str, Any] = {"siblings": [short_name(s) for s in groups[target]]}
        for b in budgets:
            cold = [r["cold"][b] for r in runs]
            warm = [r["warm"][b] for r in runs]
            c = compare(warm, cold)
            verdicts[(b, c.verdict)] += 1
            entry[str(b)] = {
                "seed_configs": runs[0]["seeds"][b],
                "cold_mean": statistics.fmean(cold),
                "warm_mean": statistics.fmean(warm),
                "seeds_alone_mean": statistics.fmean(r["seeds_alone"][b] for r in runs),
                "warm_minus_cold": c.as_dict(),
                "cold_per_seed": [round(x, 4) for x in cold],
                "warm_per_seed": [round(x, 4) for x in warm],
            }
            rows.append(
                [
                    short_name(target).split("/")[-1],
                    str(b),
                    str(runs[0]["seeds"][b]),
                    f"{statistics.fmean(r['seeds_alone'][b] for r in runs):.3f}",
                    f"{statistics.fmean(cold):.3f}",
                    f"{statistics.fmean(warm):.3f}",
                    f"{c.difference:+.4f} [{c.low:+.4f}, {c.high:+.4f}]",
                    "helps"
                    if c.verdict == "above"
                    else "hurts"
                    if c.verdict == "below"
                    else "level",
                ]
            )
        report["targets"][short_name(target)] = entry
    report["summary"] = {
        str(b): {v: verdicts[(b, v)] for v in ("above", "level", "below")} for b in budgets
    }
    report["seconds"] = round(time.time() - started, 1)
    _table(
        f"warm start from other shapes on the same GPU ({DEFAULT_STRATEGY}, {args.seeds} seeds,"
        f" source: {args.source}, at most {args.per_source} per sibling)",
        [
            "target",
            "budget",
            "seeds",
            "seeds alone",
            "without",
            "with",
            "with - without [95%]",
            "verdict",
        ],
        rows,
    )
    for b in budgets:
        s = report["summary"][str(b)]
        print(
            f"budget {b}: seeds help on {s['above']}, level on {s['level']}, hurt on"
            f" {s['below']} of {len(by_target)} targets"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
