"""Search overhead per trial in the worker: real jobs on recorded spaces, replayed.

Each case is one tuning job run as ``kato worker --backend replay`` runs it: a fresh SQLite
file database, the job queued and claimed, :class:`tuner.job_runner.JobRunner` with the replay
backend (in this process), the default strategy, budget 100. Each measurement takes
``--measure-ms`` (the replay backend sleeps, as ``kato serve``'s replay delay does): a GPU's
time per config, during which the worker's other threads (the fits of the next proposal's
models, the previous result's records) run; 0 gives the worker's whole CPU cost per trial, as
if the GPU measured in no time. What is left of the job's wall time is the worker's own: the
search, the database, the loop.

Per measured config the search loop's wall time (:class:`tuner.search.TrialTiming`) is split
into

- ``propose``: the strategy's proposals (model fits, acquisition; Optuna's ask for a sampler),
- ``db``: the database on the path: reserving the config (``evaluate`` minus the backend's own
  time), reading the other workers' results (``should_stop``), waiting for the previous
  result's records (trial row, study) or writing them inline,
- ``measure``: the backend's ``evaluate`` (a dictionary look-up on replay),
- ``rest``: the loop itself (what the other three leave of the span);

and ``overhead`` = everything but ``measure``. Mean and p95 over a job's trials, then over the
cases. The job's wall time (claim to done) is set against the sum of its spans and of its
measurements: the difference is the job's setup and end (backend, study, warm start, winner).
CPU time per trial: the process's (every thread) and the search's thread's alone (the work on
the measuring path, without its waits: on a loaded host the steadier figure).

    python3 benchmarks/search_overhead.py --measure-ms 20 --out data/benchmarks/search_overhead.json
    python3 benchmarks/search_overhead.py data/spaces/h200/softmax_*.json.gz --seeds 3

Results: docs/search.md (Search overhead per trial).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kato.db import queries  # noqa: E402 - after the path insert
from kato.db.session import init_db, session_factory  # noqa: E402
from kato.kernels import get_operator  # noqa: E402
from kato.tuner import job_runner as job_runner_module  # noqa: E402
from kato.tuner.backends.base import Backend  # noqa: E402
from kato.tuner.factories import ReplayBackends, find_recordings  # noqa: E402
from kato.tuner.job_runner import DEFAULT_LOOKAHEAD, JobRunner  # noqa: E402
from kato.tuner.search import SearchResult, TrialTiming  # noqa: E402

#: The recorded H200 spaces (``h200_session.sh spaces``).
DEFAULT_SPACES = (REPO / "data" / "spaces" / "h200",)
PARTS = ("propose", "db", "measure", "rest", "overhead")


class _TimedBackend(Backend):
    """A backend whose ``evaluate`` adds its own seconds to ``spent`` (the rest passes through).
    A :class:`~tuner.backends.base.Backend` measuring where the one it wraps does, so that the
    job's search writes its results behind, as the worker's does (a wrapper that is no
    ``Backend`` would have them written inline, on the path)."""

    def __init__(self, inner: Any, spent: list[float]):
        self._inner, self._spent = inner, spent
        self.measures_out_of_process = inner.measures_out_of_process

    def device(self) -> Any:
        return self._inner.device()

    def space(self) -> Any:
        return self._inner.space()

    def evaluate(self, config: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return self._inner.evaluate(config)
        finally:
            self._spent.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def recorded_searches() -> Iterator[list[SearchResult]]:
    """While inside, every worker search's outcome (with its per-trial timings) is appended to
    the list yielded: :class:`tuner.job_runner.SharedSearch` is wrapped, nothing else changes."""
    searches: list[SearchResult] = []
    base = job_runner_module.SharedSearch

    class Recorded(base):  # type: ignore[misc,valid-type]
        def run(self, budget: Any) -> SearchResult:
            outcome = super().run(budget)
            searches.append(outcome)
            return outcome

    job_runner_module.SharedSearch = Recorded  # type: ignore[misc]
    try:
        yield searches
    finally:
        job_runner_module.SharedSearch = base  # type: ignore[misc]


def per_trial(
    searches: Sequence[SearchResult], measured: Sequence[float]
) -> list[dict[str, float]]:
    """Each measured config's split (:func:`split`), given the backend's own seconds for each."""
    timings = [t for result in searches for t in result.timings]
    if len(timings) != len(measured):
        raise RuntimeError(f"{len(timings)} timed trials, {len(measured)} measurements")
    return [split(t, m) for t, m in zip(timings, measured, strict=True)]


def run_job(
    path: Path,
    *,
    budget: int,
    seed: int,
    workdir: Path,
    lookahead: int = DEFAULT_LOOKAHEAD,
    measure_s: float = 0.0,
) -> dict[str, Any]:
    """One job on the recording ``path`` in a fresh SQLite database under ``workdir``, each
    measurement taking ``measure_s``: the per-trial split (seconds), the job's wall time, the
    winner against the space's optimum."""
    recording = find_recordings(path)[0]
    problem = recording.problem
    url = f"sqlite:///{workdir / f'kato-{seed}.db'}"
    sessions = session_factory(init_db(url))
    factory = ReplayBackends([recording], delay_s=measure_s)
    measured: list[float] = []
    backends: list[Any] = []

    def make(job: Any) -> Any:
        backend = factory(job)
        backends.append(backend)
        return _TimedBackend(backend, measured)

    make.scope = factory.scope  # type: ignore[attr-defined]
    make.runs_current_code = False  # type: ignore[attr-defined]
    version = problem.operator_version or get_operator(problem.operator).version
    with sessions() as s:
        job = queries.create_job(
            s,
            operator=problem.operator,
            operator_version=version,
            shape=list(problem.shape),
            dtype=problem.dtype,
            gpu_model=problem.gpu_model,
            budget_configs=budget,
            seed=seed,
        )
        job_id = job.id
    runner = JobRunner(
        sessions, url, make, worker_id=f"bench-{seed}", lookahead=lookahead, sync_seconds=0.5
    )
    with recorded_searches() as searches:
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        with sessions() as s:
            claimed = queries.claim_next_job(
                s, gpu_models=[problem.gpu_model], worker_id=runner.worker_id, lease_seconds=60
            )
        assert claimed is not None and claimed.id == job_id
        outcome = runner.run(job_id)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        main_cpu = time.thread_time() - m0
    if outcome.status != "done":
        raise RuntimeError(f"{path.name}: the job ended {outcome.status}: {outcome.error}")
    trials = per_trial(searches, measured)
    if len(trials) != outcome.measured:
        raise RuntimeError(f"{path.name}: {len(trials)} timed trials, {outcome.measured} recorded")
    optimum = backends[0].best_time_ms()
    return {
        "file": path.name,
        "job_id": job_id,
        "db_url": url,
        "seed": seed,
        "budget": budget,
        "measured": outcome.measured,
        "wall_s": wall,
        "cpu_s": cpu,
        "main_thread_cpu_s": main_cpu,
        "spans_s": sum(t["overhead"] + t["measure"] for t in trials),
        "measure_s": sum(measured),
        "fraction_of_optimum": optimum / outcome.best_time_ms if outcome.best_time_ms else 0.0,
        "trials": trials,
    }


def split(timing: TrialTiming, measure: float) -> dict[str, float]:
    """One trial's seconds by part (see the module docstring)."""
    db = timing.stop_check + timing.writes + max(timing.evaluate - measure, 0.0)
    rest = max(timing.total - timing.propose - db - measure, 0.0)
    return {
        "propose": timing.propose,
        "db": db,
        "measure": measure,
        "rest": rest,
        "overhead": timing.total - measure,
    }


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def parts_ms(trials: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean and p95 in milliseconds of each part over ``trials``."""
    out = {}
    for part in PARTS:
        values = [1000 * t[part] for t in trials]
        out[part] = {"mean_ms": statistics.fmean(values), "p95_ms": p95(values)}
    return out


def summarise(job: dict[str, Any]) -> dict[str, Any]:
    """Mean and p95 in milliseconds per part over the job's trials."""
    out: dict[str, Any] = dict(parts_ms(job["trials"]))
    n = max(job["measured"], 1)
    out["wall_per_trial_ms"] = 1000 * job["wall_s"] / n
    out["cpu_per_trial_ms"] = 1000 * job["cpu_s"] / n
    out["main_thread_cpu_per_trial_ms"] = 1000 * job["main_thread_cpu_s"] / n
    out["setup_and_end_s"] = job["wall_s"] - job["spans_s"]
    return out


def table(cases: list[dict[str, Any]]) -> str:
    """A markdown table: one row per case (mean / p95 ms per trial), and the mean of the rows."""
    head = (
        "| space | seed | propose | db | rest | overhead | wall / trial | setup + end s |"
        " CPU / trial | fraction of optimum |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(summary: dict[str, Any], part: str) -> str:
        return f"{summary[part]['mean_ms']:.1f} / {summary[part]['p95_ms']:.1f}"

    for case in cases:
        s = case["summary"]
        name = case["file"].split(".json")[0]
        lines.append(
            f"| {name} | {case['seed']} | {cell(s, 'propose')} | {cell(s, 'db')} | "
            f"{cell(s, 'rest')} | {cell(s, 'overhead')} | {s['wall_per_trial_ms']:.1f} | "
            f"{s['setup_and_end_s']:.2f} | {s['cpu_per_trial_ms']:.1f} | "
            f"{case['fraction_of_optimum']:.3f} |"
        )
    overall = overall_summary(cases)
    lines.append(
        "| **all** | | "
        + " | ".join(
            f"{overall[p]['mean_ms']:.1f} / {overall[p]['p95_ms']:.1f}"
            for p in ("propose", "db", "rest", "overhead")
        )
        + f" | {overall['wall_per_trial_ms']:.1f} | | {overall['cpu_per_trial_ms']:.1f} | "
        + f"{overall['fraction_of_optimum']:.3f} |"
    )
    return "\n".join(lines)


def overall_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Every case's trials pooled: mean and p95 per part; the mean wall time per trial."""
    out: dict[str, Any] = {}
    for part in PARTS:
        values = [1000 * t[part] for c in cases for t in c["trials"]]
        out[part] = {"mean_ms": statistics.fmean(values), "p95_ms": p95(values)}
    for key in ("wall_per_trial_ms", "cpu_per_trial_ms", "main_thread_cpu_per_trial_ms"):
        out[key] = statistics.fmean(c["summary"][key] for c in cases)
    out["fraction_of_optimum"] = statistics.fmean(c["fraction_of_optimum"] for c in cases)
    return out


def recording_paths(paths: Sequence[Path]) -> list[Path]:
    return [r.path for p in paths for r in find_recordings(p)]


def _commit() -> str | None:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="recordings or directories of them")
    parser.add_argument("--budget", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1, help="jobs per space (seeds 0, 1, ...)")
    parser.add_argument("--lookahead", type=int, default=DEFAULT_LOOKAHEAD)
    parser.add_argument(
        "--measure-ms",
        type=float,
        default=0.0,
        help="milliseconds each measurement takes (a GPU's time per config; 0: none)",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--keep-trials", action="store_true", help="per-trial rows in the JSON")
    args = parser.parse_args(argv)
    files = recording_paths(args.paths or DEFAULT_SPACES)
    cases = []
    with tempfile.TemporaryDirectory(prefix="kato-overhead-") as tmp:
        for path in files:
            for seed in range(args.seeds):
                workdir = Path(tmp) / f"{path.name}-{seed}"
                workdir.mkdir()
                case = run_job(
                    path,
                    budget=args.budget,
                    seed=seed,
                    workdir=workdir,
                    lookahead=args.lookahead,
                    measure_s=args.measure_ms / 1000,
                )
                case["summary"] = summarise(case)
                s = case["summary"]
                print(
                    f"{path.name} seed {seed}: overhead {s['overhead']['mean_ms']:.1f} ms mean "
                    f"({s['overhead']['p95_ms']:.1f} p95), propose "
                    f"{s['propose']['mean_ms']:.1f}, db {s['db']['mean_ms']:.1f}, CPU "
                    f"{s['cpu_per_trial_ms']:.1f} ms per trial "
                    f"({s['main_thread_cpu_per_trial_ms']:.1f} on the search's thread)",
                    flush=True,
                )
                cases.append(case)
    print(table(cases))
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end")
    if args.out is not None:
        report = {
            "commit": _commit(),
            "host": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_at_end": [round(x, 1) for x in load],
            },
            "budget": args.budget,
            "lookahead": args.lookahead,
            "measure_ms": args.measure_ms,
            "overall": overall_summary(cases),
            "cases": [
                {k: v for k, v in c.items() if args.keep_trials or k != "trials"} for c in cases
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
