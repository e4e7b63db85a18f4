"""Ablations of the default search on recorded spaces: many seeds, quickly, with overrides.

``benchmarks/search_quality.py`` is the comparison with Kernel Tuner; this is the bench for
changing Kato's own method. It drives ``tuner.surrogate.ForestProposer`` directly on the replay
backend (no Optuna study, no ``Search`` loop): the proposals are the ones ``Search`` makes with
the default strategy (a forest run asks the proposer for every config, one at a time), so a seed
gives the same fractions as ``kato replay`` and ``search_quality.py`` at about a third of the
cost. One run per seed at the largest budget gives every budget (the proposer never reads it).

Overrides apply to ``tuner.surrogate`` in every worker, once:

- ``--set NAME=VALUE``: a module constant (``N_INITIAL``, ``MOVES``, ``MAX_FEATURES``, ...),
  VALUE a Python literal;
- ``--patch FILE`` (repeatable, applied in order): Python run with ``surrogate`` (the module)
  in its namespace, for a change of code (replace a method, add a move); the patches measured
  so far are in ``benchmarks/ablations``.

Per space it prints the mean fraction of optimum at each budget, how many runs are below
``--stuck`` at the middle budget (runs that never left a poor basin) and the quartiles of the
first measurement above it. The seed noise is large: on convolution A100 at budget 100 the
spread between sets of 80 seeds is about 0.015-0.02, and variants within 0.03 of each other
are not told apart by 80 seeds.

Usage::

    python3 benchmarks/search_ablation.py --spaces convolution_milo/A100 --seeds 40:120
    python3 benchmarks/search_ablation.py --spaces all --seeds 0:30 --set MAX_FEATURES=0.5
    python3 benchmarks/search_ablation.py --spaces A100,gemm --patch my_move.py --out r.json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kato.tuner import surrogate  # noqa: E402
from kato.tuner.backends.replay import ReplayBackend  # noqa: E402
from paths import dataset_files, table_space_files  # noqa: E402

from benchmarks.search_quality import short_name  # noqa: E402
from kato.shared.kt_cache import load_cache  # noqa: E402

BUDGETS = (25, 50, 100, 200)

_BACKENDS: dict[str, ReplayBackend] = {}


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings -> overrides; NAME must be an upper-case constant of
    ``tuner.surrogate`` and VALUE a Python literal.

    Raises:
        ValueError: naming what is wrong.
    """
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name.isupper() or not hasattr(surrogate, name):
            known = ", ".join(n for n in dir(surrogate) if n.isupper() and not n.startswith("_"))
            raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME one of {known}")
        try:
            out[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"--set {item!r}: VALUE must be a Python literal ({exc})") from None
    return out


def apply_overrides(sets: dict[str, Any], patch: str | list[str] | None) -> None:
    """Set the constants, then run the patch files in order (a worker's initializer: once per
    process, so a patch that wraps a method wraps it once)."""
    for name, value in sets.items():
        setattr(surrogate, name, value)
    for path in [patch] if isinstance(patch, str) else patch or []:
        code = compile(Path(path).read_text(), path, "exec")
        exec(code, {"surrogate": surrogate, "__name__": "kato_ablation_patch"})  # noqa: S102


def trace(path: str, seed: int, budget: int) -> list[float]:
    """Fraction of optimum after each measured config (best time in the file / best found so
    far; 0.0 while nothing succeeded), for one seed of the default proposer."""
    if path not in _BACKENDS:
        _BACKENDS[path] = ReplayBackend(load_cache(path))
    backend = _BACKENDS[path]
    space = backend.space()
    optimum = backend.best_time_ms()
    proposer = surrogate.ForestProposer(space, seed=seed)
    results: dict[str, Any] = {}
    best = math.inf
    out: list[float] = []
    while len(results) < budget:
        config = proposer.propose(results)
        if config is None:
            break  # every valid config measured
        result = backend.evaluate(config)
        results[space.key(config)] = result
        if result.time_ms is not None:
            best = min(best, result.time_ms)
        out.append(optimum / best if best < math.inf else 0.0)
    return out


def _job(args: tuple[str, int, int]) -> tuple[str, int, list[float]]:
    path, seed, budget = args
    return path, seed, trace(path, seed, budget)


def at(curve: list[float], budget: int) -> float:
    """The fraction reached within ``budget`` measurements (the last one for a smaller space)."""
    return curve[min(budget, len(curve)) - 1] if curve else 0.0


def summarise(curves: list[list[float]], budgets: list[int], stuck: float) -> dict[str, Any]:
    middle = budgets[len(budgets) // 2] if len(budgets) > 1 else budgets[0]
    first = sorted(next((i + 1 for i, f in enumerate(c) if f > stuck), math.inf) for c in curves)
    quart = [first[min(len(first) - 1, (len(first) * q) // 4)] for q in (1, 2, 3)]
    return {
        "mean": {str(b): statistics.fmean(at(c, b) for c in curves) for b in budgets},
        "stuck_budget": middle,
        "stuck_runs": sum(at(c, middle) <= stuck for c in curves),
        "first_above_stuck_quartiles": [q if q != math.inf else None for q in quart],
    }


def select(spec: str) -> list[str]:
    files = [str(p) for p in [*dataset_files(), *table_space_files()]]
    if spec == "all":
        return files
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    chosen = [f for f in files if any(w in short_name(f) for w in wanted)]
    if not chosen:
        names = ", ".join(short_name(f) for f in files)
        raise SystemExit(f"--spaces {spec!r} matches none of: {names}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spaces", default="all", help="'all' or comma-separated name parts")
    ap.add_argument("--seeds", default="0:20", help="FIRST:END (END excluded)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument(
        "--patch",
        action="append",
        default=[],
        help="Python file run with `surrogate` in its namespace (repeatable, in order)",
    )
    ap.add_argument("--stuck", type=float, default=0.7, help="fraction counted as 'stuck'")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", help="write the summaries and every curve as JSON here")
    args = ap.parse_args(argv)
    try:
        sets = parse_sets(args.sets)
    except ValueError as exc:
        ap.error(str(exc))
    for path in args.patch:
        if not Path(path).is_file():
            ap.error(f"--patch {path}: no such file")
    first, _, end = args.seeds.partition(":")
    seeds = range(int(first), int(end) if end else int(first) + 1)
    budgets = sorted(int(b) for b in args.budgets.split(","))
    files = select(args.spaces)
    jobs = [(f, s, budgets[-1]) for f in files for s in seeds]
    curves: dict[str, list[list[float]]] = {f: [] for f in files}
    with ProcessPoolExecutor(
        args.workers, initializer=apply_overrides, initargs=(sets, args.patch)
    ) as pool:
        for path, _, curve in pool.map(_job, jobs):
            curves[path].append(curve)
    report = {f: summarise(c, budgets, args.stuck) for f, c in curves.items()}
    head = " ".join(f"{b:>6}" for b in budgets)
    print(f"{'space':52s} {head}  stuck@{report[files[0]]['stuck_budget']}  first>stuck q1/q2/q3")
    for f in files:
        r = report[f]
        row = " ".join(f"{r['mean'][str(b)]:6.3f}" for b in budgets)
        quart = "/".join("-" if q is None else str(q) for q in r["first_above_stuck_quartiles"])
        print(f"{short_name(f):52s} {row}  {r['stuck_runs']:>3}/{len(seeds):<4} {quart}")
    means = {str(b): statistics.fmean(r["mean"][str(b)] for r in report.values()) for b in budgets}
    print(f"{'mean over spaces':52s} " + " ".join(f"{means[str(b)]:6.3f}" for b in budgets))
    if args.out:
        doc = {
            "seeds": [seeds.start, seeds.stop],
            "budgets": budgets,
            "sets": {k: repr(v) for k, v in sets.items()},
            "patch": args.patch,
            "spaces": {short_name(f): {**report[f], "curves": curves[f]} for f in files},
        }
        Path(args.out).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
