"""Search quality on brute-forced spaces: Kato vs Kernel Tuner, same files, same budgets.

For every Kernel Tuner cache file under data/datasets and data/spaces/h200 (the spaces Kato
brute-forced on the H200; ``tests/paths.py``; the later ones in data/spaces/h200-holdout are
given on the command line) and any given on the command line, each method
searches the recorded space at each budget (distinct measured configs, failures included) with
several seeds; the score is the mean fraction of optimum (best time in the file / best time
found; 1.0 = found the optimum).

- Kato: its strategies on the replay backend (``tuner.search.Search``). Kato's strategies never
  look at the budget, so the first N measurements of a run at the largest budget *are* the run at
  budget N: one run per seed gives every budget.
- Kernel Tuner (``pip install -e '.[bench]'``, kernel-tuner 1.5.0): its strategies in simulation
  mode on the same file (``tune_kernel(..., simulation_mode=True, cache=file)``), its space
  restricted to the configurations present in the file (a restriction that accepts only keys in
  the cache), so both sides search the same space. Kernel Tuner counts a function evaluation the
  first time a legal config is served from the cache (failed configs included; configs outside
  the restrictions are not counted and cost nothing, as in Kato), so ``max_fevals=N`` is N
  distinct measured configs; the script checks that count on every run and scores only the first
  N distinct configs in evaluation order. One run per (budget, seed): some strategies adapt to
  ``max_fevals``.
- Warm start (``--warm-start``): for files that have a sibling (same kernel and parameters,
  another GPU), Kato's default strategy at small budgets with and without seeds ranked from the
  sibling's measurements by ``tuner.warm_start`` (the code a job's warm start from the database
  uses).

Usage::

    python3 benchmarks/search_quality.py --out data/benchmarks/search_quality.json
    python3 benchmarks/search_quality.py FILE.json.gz --budgets 25,100 --seeds 3 --strategies mls
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kato.tuner.backends.replay import ReplayBackend  # noqa: E402
from kato.tuner.search import DEFAULT_STRATEGY, Budget, Search  # noqa: E402
from kato.tuner.warm_start import (  # noqa: E402
    SEEDS_PER_SOURCE,
    cache_source,
    rank_seed_configs,
    seed_limit,
)
from paths import dataset_files, table_space_files  # noqa: E402

from benchmarks.verdicts import print_table, report_verdicts  # noqa: E402
from kato.shared.kt_cache import KernelTunerCache, load_cache  # noqa: E402

BUDGETS = (25, 50, 100, 200)
WARM_BUDGETS = (10, 25, 50)
KATO_STRATEGIES = (DEFAULT_STRATEGY, "random")
KT_STRATEGIES = (
    "genetic_algorithm",
    "dual_annealing",
    "simulated_annealing",
    "basinhopping",
    "greedy_ils",
    "mls",
    "firefly_algorithm",
    "pso",
    "diff_evo",
    "random_sample",
    # Kernel Tuner's Gaussian-process Bayesian optimisation (Willemsen et al. 2021): 0.4-5.6 s
    # of CPU per seed, its four budgets together, on these spaces (gemm's 17956 configs the most).
    "bayes_opt",
)

# -- per-process caches (each worker loads a file once) ----------------------------------------

_CACHES: dict[str, KernelTunerCache] = {}
_PLAIN: dict[str, str] = {}


@functools.cache
def _tmp_dir() -> str:
    """A scratch directory for plain copies of the cache files, made on first use (importing
    this module, as benchmarks/search_ablation.py does, makes none)."""
    return tempfile.mkdtemp(prefix="kato-sq-")


def _cache(path: str) -> KernelTunerCache:
    if path not in _CACHES:
        _CACHES[path] = load_cache(path)
    return _CACHES[path]


def short_name(path: str | Path) -> str:
    p = Path(path)
    return f"{p.parent.name}/{p.name.removesuffix('.gz').removesuffix('.json')}"


# -- Kato --------------------------------------------------------------------------------------


def kato_run(
    path: str, strategy: str, seed: int, budget: int, seeds: list[dict] | None = None
) -> list[tuple[dict, float | None]]:
    """(config, time or None = failed) of one Kato search, in measurement order."""
    backend = ReplayBackend(_cache(path))
    search = Search(
        backend.space(), backend.evaluate, strategy=strategy, seed=seed, seed_configs=seeds
    )
    search.run(Budget(max_configs=budget))
    return [(r.config, r.time_ms) for r in search.results.values()]


def kato_trace(
    path: str, strategy: str, seed: int, budget: int, seeds: list[dict] | None = None
) -> list[float | None]:
    """Times (None = failed) of one Kato search, in measurement order."""
    return [t for _, t in kato_run(path, strategy, seed, budget, seeds)]


def fraction(optimum: float, times: list[float | None]) -> float:
    ok = [t for t in times if t is not None]
    return optimum / min(ok) if ok else 0.0


# -- Kernel Tuner ------------------------------------------------------------------------------


def _fresh_neighbours(space: Any) -> Any:
    """A copy of a memoised ``Searchspace`` that shares its enumerated configs but none of the
    neighbour caches a run fills.

    Strategies draw neighbours through those caches (``get_random_neighbor`` pops "partial"
    neighbours, configs expanded earlier, before it draws from the full list), so a run handed
    the memoised object itself would start from every earlier run's explored neighbourhoods.
    That happened here until this copy: simulated annealing at budget 100 on the A4000
    convolution space scored 0.980 over 40 seeds run in one process, and 0.875 / 0.856 / 0.870
    for seeds 5-7 in fresh processes (0.996 / 0.996 / 0.987 after other seeds).
    """
    fresh = copy.copy(space)
    for name, value in vars(space).items():
        if "neighbor" not in name.lower() or not isinstance(value, dict):
            continue
        if name.endswith("neighbors_index"):
            setattr(fresh, name, {})
        else:  # {method: {} or defaultdict(list)}, one per neighbour method
            setattr(fresh, name, {m: _empty_like(v) for m, v in value.items()})
    return fresh


def _empty_like(value: Any) -> Any:
    if isinstance(value, defaultdict):
        return defaultdict(value.default_factory)
    return type(value)()


def _kt_setup(path: str) -> str:
    """A plain-JSON copy of the file (Kernel Tuner reads only ``.json``), once per process, and
    Kernel Tuner's cache reading and search-space construction memoised per file (they cost
    seconds and do not change between runs)."""
    if path in _PLAIN:
        return _PLAIN[path]
    import kernel_tuner.interface as kti
    import kernel_tuner.util as ktu

    if not getattr(ktu, "_kato_memo", False):
        read_cache, space_cls = ktu.read_cache, kti.Searchspace
        read_memo: dict[str, Any] = {}
        space_memo: dict[int, Any] = {}

        def cached_read(cachefile, open_cache=True):
            if cachefile not in read_memo:
                read_memo[cachefile] = read_cache(cachefile, open_cache=False)
            data = read_memo[cachefile]
            return {**data, "cache": dict(data["cache"])}

        def cached_space(tune_params, restrictions, max_threads, **kwargs):
            key = id(restrictions)
            if key not in space_memo:
                recorded = _FROM_FILE.get(key)
                if recorded is None:
                    space = space_cls(tune_params, restrictions, max_threads, **kwargs)
                else:  # a large product: the file's configs, without checking the product
                    names = kwargs.get("block_size_names", ["block_size_x", "block_size_y"])
                    space = space_cls(None, None, None, block_size_names=names, from_cache=recorded)
                space_memo[key] = (restrictions, space)
            return _fresh_neighbours(space_memo[key][1])

        ktu.read_cache, kti.Searchspace, ktu._kato_memo = cached_read, cached_space, True
    cache = _cache(path)
    # Pool workers forked after a first use share the directory: the pid keeps copies apart.
    plain = os.path.join(
        _tmp_dir(), f"{os.getpid()}-{len(_PLAIN)}-{Path(path).name.removesuffix('.gz')}"
    )
    if not plain.endswith(".json"):
        plain += ".json"
    with open(plain, "w") as f:
        json.dump(cache.to_json(), f)
    _PLAIN[path] = plain
    keys = frozenset(cache.entries)
    names = cache.params

    def in_file(p: dict[str, Any]) -> bool:
        return ",".join(str(p[n]) for n in names) in keys

    _RESTRICT[path] = in_file
    backend = ReplayBackend(cache)
    if len(backend.space()) > KT_PRODUCT_MAX:
        configs = backend.space().valid_configs()
        entries = {cache.key(c): dict(c) for c in configs}
        _FROM_FILE[id(in_file)] = {"tune_params": cache.tune_params, "cache": entries}
    return plain


_RESTRICT: dict[str, Any] = {}
#: Above this many combinations of ``tune_params``, Kernel Tuner's space is built from the
#: file's configs (its ``Searchspace(from_cache=...)``) instead of by checking the restriction
#: on every combination: the same configs, without the check (a recorded space of 20 thousand
#: configs over a product of 12 million did not finish building in 15 minutes). Below it the
#: restriction path is kept: its order of the configs decides which ones a seeded strategy
#: draws, and the committed results were produced that way.
KT_PRODUCT_MAX = 2**20
_FROM_FILE: dict[int, dict[str, Any]] = {}


#: Wall-clock seconds one Kernel Tuner run may take (``--kt-run-seconds``). Some strategies
#: never finish on a sparse space: greedy_ils restarts its hill climb from random points whose
#: neighbours are mostly outside the space, which costs no evaluation, so ``max_fevals`` is never
#: reached (on 20 thousand configs of a 12-million product it ran 13 minutes and grew to 15 GB).
#: Kernel Tuner's own ``time_limit`` cannot bound this: in simulation mode it counts the
#: recorded compile and benchmark times, not the wall clock.
KT_RUN_SECONDS = 120.0
_DEADLINE: list[float] = []  # [monotonic deadline] of the run in progress, if any
_STOPPED: list[bool] = [False]  # whether the run in progress hit the deadline


def _install_deadline() -> None:
    """Make Kernel Tuner's budget check (called before every evaluation, valid or not) also
    stop the run at :data:`_DEADLINE`, through its own StopCriterionReached, so the strategy
    returns what it measured."""
    import kernel_tuner.util as ktu

    if getattr(ktu.TuningBudget, "_kato_deadline", False):
        return
    check = ktu.TuningBudget.raise_exception_if_done

    def check_with_deadline(self):
        if _DEADLINE and time.monotonic() > _DEADLINE[0]:
            _STOPPED[0] = True
            raise ktu.StopCriterionReached("the benchmark's wall-clock limit per run")
        check(self)

    ktu.TuningBudget.raise_exception_if_done = check_with_deadline
    ktu.TuningBudget._kato_deadline = True


def _seed_bayes_opt(seed: int) -> None:
    """Kernel Tuner's ``bayes_opt`` draws its Latin hypercube design from a generator of its
    own (``LatinHypercube(d)``, fresh entropy each run), so the seeds above did not fix it:
    give that generator the run's seed. The rest of a run is still not fixed: its default
    method (multi-ultrafast) refits its GP or not by comparing the wall-clock times of its
    predictions and evaluations, so a busy machine can change which configs follow."""
    from kernel_tuner.strategies import bayes_opt
    from scipy.stats.qmc import LatinHypercube

    bayes_opt.LatinHypercube = functools.partial(LatinHypercube, rng=seed)


def _kt_once(path: str, strategy: str, seed: int, max_fevals: int) -> list[str]:
    """One Kernel Tuner run in simulation mode; the config keys it evaluated, in order (cut at
    :data:`KT_RUN_SECONDS` of wall clock; :data:`_STOPPED` says whether it was)."""
    import kernel_tuner
    import numpy as np

    _install_deadline()
    _DEADLINE[:] = [time.monotonic() + KT_RUN_SECONDS]
    _STOPPED[0] = False
    plain = _kt_setup(path)
    cache = _cache(path)
    # The strategy's module first: an import inside the run could draw from the generators
    # seeded next, so a process's first run of a strategy would differ from its later ones.
    importlib.import_module(f"kernel_tuner.strategies.{strategy}")
    if strategy == "bayes_opt":
        _seed_bayes_opt(seed)
    random.seed(seed)
    np.random.seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results, _ = kernel_tuner.tune_kernel(
            cache.kernel_name,
            f"__global__ void {cache.kernel_name}() {{}}",
            cache.problem_size,
            [],
            cache.tune_params,
            restrictions=_RESTRICT[path],
            cache=plain,
            simulation_mode=True,
            strategy=strategy,
            strategy_options={"max_fevals": max_fevals},
            quiet=True,
            verbose=False,
            lang="CUDA",
        )
    _DEADLINE.clear()
    return [cache.key(r) for r in results]


def kt_run(path: str, strategy: str, seed: int, budget: int) -> dict[str, Any]:
    """Kernel Tuner's ``strategy`` scored on its first ``budget`` distinct measured configs.

    Some strategies stop before ``max_fevals`` distinct configs: they hand ``max_fevals`` to a
    SciPy optimiser that counts every call, repeats and configs outside the space included
    (dual_annealing, basinhopping, ...). Such a run is repeated with ``max_fevals`` doubled (up
    to 16x) until it measures ``budget`` distinct configs or stops measuring more, so every
    method is scored on the same number of distinct measured configs where it can reach it.
    A run cut by :data:`KT_RUN_SECONDS` is scored on what it measured (``timed_out``).
    """
    cache = _cache(path)
    optimum = float(cache.best()[1][cache.time_field])
    max_fevals, distinct = budget, 0
    while True:
        keys = list(dict.fromkeys(_kt_once(path, strategy, seed, max_fevals)))
        if len(keys) >= budget or len(keys) <= distinct or max_fevals >= 16 * budget:
            break
        if _STOPPED[0]:
            break
        distinct, max_fevals = len(keys), max_fevals * 2
    times = []
    for key in keys[:budget]:
        t = cache.entries[key].get(cache.time_field)
        times.append(float(t) if isinstance(t, int | float) else None)
    return {
        "fraction": fraction(optimum, times),
        "distinct": min(budget, len(keys)),
        "max_fevals": max_fevals,
        "timed_out": _STOPPED[0],
    }


# -- tasks -------------------------------------------------------------------------------------


def task(kind: str, path: str, method: str, seed: int, budgets: tuple[int, ...]) -> dict[str, Any]:
    """One unit of work for the pool (see :func:`main`)."""
    started = time.process_time()
    cache = _cache(path)
    optimum = float(cache.best()[1][cache.time_field])
    out: dict[str, Any] = {"kind": kind, "path": path, "method": method, "seed": seed}
    if kind in ("kato", "cold"):
        times = kato_trace(path, method, seed, max(budgets))
        out["fractions"] = {b: fraction(optimum, times[:b]) for b in budgets}
        out["distinct"] = {b: min(b, len(times)) for b in budgets}
    elif kind == "kt":
        runs = {b: kt_run(path, method, seed, b) for b in budgets}
        out["fractions"] = {b: r["fraction"] for b, r in runs.items()}
        out["distinct"] = {b: r["distinct"] for b, r in runs.items()}
        out["max_fevals"] = {b: r["max_fevals"] for b, r in runs.items()}
        out["timed_out"] = {b: r["timed_out"] for b, r in runs.items()}
    elif kind == "warm":
        source = _cache(method)
        space = ReplayBackend(cache).space()
        out["fractions"], out["seeds"] = {}, {}
        for b in budgets:
            seeds = rank_seed_configs(
                [cache_source(source)],
                limit=seed_limit(b),
                accept=space.is_valid,
                per_source=SEEDS_PER_SOURCE,
            )
            times = kato_trace(path, DEFAULT_STRATEGY, seed, b, seeds)
            out["fractions"][b] = fraction(optimum, times)
            out["seeds"][b] = len(seeds)
    out["cpu_s"] = time.process_time() - started
    return out


def siblings(paths: list[str]) -> list[tuple[str, str]]:
    """(target, source) pairs: same kernel name and parameters, another device."""
    info = {p: _cache(p) for p in paths}
    pairs = []
    for a in paths:
        for b in paths:
            ca, cb = info[a], info[b]
            if (
                a != b
                and ca.kernel_name == cb.kernel_name
                and ca.tune_params == cb.tune_params
                and ca.device_name != cb.device_name
            ):
                pairs.append((a, b))
    return pairs


def _cell(result: dict[str, Any], budget: int) -> str:
    """A table cell: the mean, marked ``*`` where a run measured fewer configs than the budget
    and ``+`` where a Kernel Tuner run was cut at the wall-clock limit."""
    short = any(d < budget for d in result["distinct_measured"])
    cut = any(result.get("kt_timed_out", []))
    return f"{result['mean']:.3f}" + ("*" if short else "") + ("+" if cut else "")


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="right" if h != header[0] else "left")
        for row in rows:
            table.add_row(*row)
        # Piped output (a log, tee) is not cut at 80 columns.
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    except ImportError:  # plain text
        print(title)
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global KT_RUN_SECONDS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="more Kernel Tuner cache files (.json or .json.gz)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--seeds", type=int, default=10, help="seeds per method, file and budget")
    ap.add_argument("--kato", default=",".join(KATO_STRATEGIES), help="Kato strategies")
    ap.add_argument(
        "--strategies",
        default=",".join(KT_STRATEGIES),
        help="Kernel Tuner strategies ('' for none)",
    )
    ap.add_argument("--warm-start", action="store_true", help="also measure the warm start")
    ap.add_argument("--warm-budgets", default=",".join(map(str, WARM_BUDGETS)))
    ap.add_argument(
        "--no-datasets",
        action="store_true",
        help="only the files given (not the datasets nor data/spaces)",
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument(
        "--kt-run-seconds",
        type=float,
        default=KT_RUN_SECONDS,
        help="wall-clock limit of one Kernel Tuner run (scored on what it measured by then)",
    )
    args = ap.parse_args(argv)
    KT_RUN_SECONDS = args.kt_run_seconds  # forked pool workers inherit it

    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    warm_budgets = tuple(int(b) for b in args.warm_budgets.split(",") if b)
    kato = [s for s in args.kato.split(",") if s]
    kt = [s for s in args.strategies.split(",") if s]
    paths = [] if args.no_datasets else [str(p) for p in [*dataset_files(), *table_space_files()]]
    paths += [str(Path(f).resolve()) for f in args.files]
    if not paths:
        ap.error("no cache files: none under the datasets folder and none given")
    if kt:
        try:
            import kernel_tuner  # noqa: F401
        except ImportError:
            ap.error(
                "Kernel Tuner is not installed: pip install -e '.[bench]' (or --strategies '')"
            )

    jobs: list[tuple] = []
    for p in paths:
        for s in range(args.seeds):
            jobs += [("kato", p, m, s, budgets) for m in kato]
            jobs += [("kt", p, m, s, budgets) for m in kt]
    pairs = siblings(paths) if args.warm_start else []
    for target, source in pairs:
        for s in range(args.seeds):
            jobs.append(("warm", target, source, s, warm_budgets))
            jobs.append(("cold", target, DEFAULT_STRATEGY, s, warm_budgets))

    started = time.time()
    done: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {pool.submit(task, *j): j for j in jobs}
        for n, fut in enumerate(as_completed(futures), 1):
            try:
                done.append(fut.result())
            except Exception as exc:  # stop now, not after every other job has run
                for other in futures:
                    other.cancel()
                kind, path, method, seed, _ = futures[fut]
                raise SystemExit(
                    f"{kind} {method} on {short_name(path)}, seed {seed}, failed: {exc!r}"
                    " (leave the strategy out with --strategies)"
                ) from exc
            if n % 50 == 0 or n == len(futures):
                print(f"{n}/{len(futures)} runs, {time.time() - started:.0f} s", file=sys.stderr)

    if args.out:  # the raw runs first: nothing is lost if the summary below fails
        args.out.parent.mkdir(parents=True, exist_ok=True)
        raw = args.out.with_name(args.out.stem + ".runs.json")
        raw.write_text(json.dumps(done, default=str) + "\n")
    report: dict[str, Any] = {
        "budgets": list(budgets),
        "seeds": args.seeds,
        "metric": "mean over seeds of (best time in file / best time found)",
        "budget_unit": "distinct measured configs (failures included)",
        "kato_default": DEFAULT_STRATEGY,
        "files": {},
        "warm_start": {},
    }
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for r in done:
        grouped[(r["kind"], r["path"], r["method"])].append(r)
    for p in paths:
        cache = _cache(p)
        entry: dict[str, Any] = {
            "path": p,
            "kernel": cache.kernel_name,
            "device": cache.device_name,
            "configs": len(cache.entries),
            "optimum_ms": float(cache.best()[1][cache.time_field]),
            "methods": {},
        }
        for kind, names in (("kato", kato), ("kt", kt)):
            for m in names:
                runs = sorted(grouped[(kind, p, m)], key=lambda r: r["seed"])
                label = f"kato:{m}" if kind == "kato" else f"kt:{m}"
                entry["methods"][label] = {
                    str(b): {
                        "mean": statistics.fmean(r["fractions"][b] for r in runs),
                        "min": min(r["fractions"][b] for r in runs),
                        "per_seed": [round(r["fractions"][b], 4) for r in runs],
                        "distinct_measured": [r["distinct"][b] for r in runs],
                        **(
                            {
                                "kt_max_fevals": [r["max_fevals"][b] for r in runs],
                                "kt_timed_out": [r["timed_out"][b] for r in runs],
                            }
                            if kind == "kt"
                            else {}
                        ),
                    }
                    for b in budgets
                }
                entry["methods"][label]["cpu_s_per_seed"] = statistics.fmean(
                    r["cpu_s"] for r in runs
                )
        report["files"][short_name(p)] = entry
    for target, source in pairs:
        cold = grouped[("cold", target, DEFAULT_STRATEGY)]
        warm = grouped[("warm", target, source)]
        report["warm_start"][short_name(target)] = {
            "source": short_name(source),
            "strategy": DEFAULT_STRATEGY,
            **{
                str(b): {
                    "cold_mean": statistics.fmean(r["fractions"][b] for r in cold),
                    "warm_mean": statistics.fmean(r["fractions"][b] for r in warm),
                    "seed_configs": warm[0]["seeds"][b],
                }
                for b in warm_budgets
            },
        }
    report["seconds"] = round(time.time() - started, 1)
    if kt and DEFAULT_STRATEGY in kato and args.seeds >= 2:
        report["verdicts"] = report_verdicts(report)

    for name, entry in report["files"].items():
        rows = []
        for label, per_budget in entry["methods"].items():
            rows.append([label] + [_cell(per_budget[str(b)], b) for b in budgets])
        _table(
            f"{name} ({entry['device']}, {entry['configs']} configs): mean fraction of optimum"
            " (* some runs measured fewer configs than the budget, + some were cut at the"
            " wall-clock limit per run; see distinct_measured, kt_timed_out in the JSON)",
            ["method"] + [f"budget {b}" for b in budgets],
            rows,
        )
    if report["warm_start"]:
        rows = []
        for name, w in report["warm_start"].items():
            for b in warm_budgets:
                cell = w[str(b)]
                rows.append(
                    [
                        f"{name} <- {w['source']}",
                        str(b),
                        str(cell["seed_configs"]),
                        f"{cell['cold_mean']:.3f}",
                        f"{cell['warm_mean']:.3f}",
                    ]
                )
        _table(
            f"warm start ({DEFAULT_STRATEGY}, {args.seeds} seeds)",
            ["target <- source", "budget", "seeds", "without", "with"],
            rows,
        )
    if "verdicts" in report:
        print_table(report["verdicts"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
