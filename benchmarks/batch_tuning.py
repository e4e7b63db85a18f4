"""A batch of tuning jobs on one worker's GPU: wall time, configs per minute, GPU busy fraction,
per-key winners (issue 35).

The batch (default): 32 keys over four operators whose templates take the shape at run time
(relu, transpose, reduce_sum, cross_entropy: one cubin serves every shape of a config, so the
batch's compiles are shared), four shapes each, float16 and float32, budget 50 each. Cheap
shapes (8-70 MB moved per call) so that a run fits a few minutes on the H200. It is queued as
one batch (queue order: group by group, each group's shapes in the warm-start order of
``benchmarks/batch_order.py``) and tuned by one worker holding ``--jobs-at-once`` jobs (3),
which interleaves them on its GPU (``tuner/worker.py``, ``tuner/gpu_gate.py``). Claims take
the group with the most jobs still queued first (``db.queries.claim_next_job``): queue order
breaks ties and keeps each group's shapes in order.

Measured: the batch's wall time (first claim to last job's end), configs measured per minute,
the GPU's busy fraction (seconds the GPU was held for measurements, verify and timed launches,
over the wall time; ``after_first_minute``: from 60 s on, the issue's target of 80%), where
it sat idle (``gpu_idle_s``: held by a backend's close, which no other job may measure
through, at job turnover, or with every slot held), the batch's ``tail``
(from the last moment every slot held a job to the end, and how busy the GPU was in it),
each job's span and the order jobs started (``start_order``), each job's ``setup_s`` (claim to
first GPU turn), ``ending_s`` (last turn to done) and ``close_s`` (its backend's close, in a
turn of the gate after done) with their sums and means (``job_phases_s``: where a slot's
turnover goes), per-key winners, and nvcc runs / compiles
shared across jobs.

- ``--replay DIR``: the recorded spaces in DIR (H200, current operator versions) instead of the
  GPU (``--delay`` seconds per measurement stand in for the GPU): checks the scheduling, not
  the speed (every key tuned once, every budget exact, nothing measured twice); CI runs it
  (tests/tuner/test_batch_tuning_bench.py).
- ``--no-spare-child``: every job's measuring child starts fresh, as before the warm spares
  (``tuner/backends/isolated.py``, ``SpareChildren``): compare ``job_phases_s`` with and
  without (the report's ``spare_child`` says which).
- ``--long-groups-last``: queues the groups of fewest keys first, so that the longest chains
  come last (the worst case for claims in plain queue order; the replay batch's groups hold
  1 to 4 keys, the GPU batch's 4 each, where it changes nothing).
- ``--compare-serial``: tunes the same keys again one job at a time (a fresh database; on the
  GPU the interleaved run's compile cache, so that both fit one 10-minute call: the serial wall
  time is then without nvcc waits, a lower bound; ``--cold-serial`` gives it a cold cache of
  its own) and checks every interleaved winner is within 2% of the serial one (on replay:
  equal, and every job's trials identical). On the GPU, winners that differ are re-timed side
  by side first (``--retime-rounds``): each run's stored best was timed under other load.

PyTorch's baseline after each job is off (``KATO_FRAMEWORK_BASELINE=false``; it is not tuning)
unless ``--framework-baseline``; its timing holds the gate uncounted too, so with that option
``close_s`` and ``idle_closing_s`` hold PyTorch's baseline beside the closes.

    python3 benchmarks/batch_tuning.py --compare-serial --out $OUT/batch_tuning_h200.json
    python3 benchmarks/batch_tuning.py --replay data/spaces --budget 5 --compare-serial
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kato.db import queries  # noqa: E402
from kato.db.models import RESERVED  # noqa: E402
from kato.db.session import init_db, session_factory  # noqa: E402
from kato.kernels import get_operator  # noqa: E402
from kato.tuner import nvcc  # noqa: E402
from kato.tuner.factories import (  # noqa: E402
    Recording,
    ReplayBackends,
    find_recordings,
    pycuda_backend_factory,
)
from kato.tuner.worker import Worker  # noqa: E402

from benchmarks.batch_order import warm_order  # noqa: E402

#: The GPU batch: operator -> shapes (each in float16 and float32).
GPU_KEYS: dict[str, list[tuple[int, ...]]] = {
    "relu": [(1 << 20,), (3 << 20,), (1 << 22,), (1 << 24,)],
    "transpose": [(1024, 1024), (2048, 2048), (4096, 1024), (1024, 4096)],
    "reduce_sum": [(4096, 1024), (8192, 512), (1024, 4096), (16384, 256)],
    "cross_entropy": [(4096, 1024), (2048, 4096), (8192, 512), (1024, 8192)],
}
DTYPES = ("float16", "float32")
#: The winners of the interleaved batch must be within this of the serial ones.
WINNER_TOLERANCE = 0.02


@dataclass(frozen=True)
class Key:
    operator: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.operator}/{'x'.join(map(str, self.shape))}/{self.dtype}"


def batch_order(keys: list[Key], *, long_groups_last: bool = False) -> list[Key]:
    """Group by group ((operator, dtype), in first-seen order; with ``long_groups_last``, the
    groups of fewest keys first, ties in first-seen order), each group's shapes in the
    nearest-neighbour warm-start order."""
    groups: dict[tuple[str, str], list[Key]] = {}
    for key in keys:
        groups.setdefault((key.operator, key.dtype), []).append(key)
    members_in_order = list(groups.values())
    if long_groups_last:
        members_in_order.sort(key=len)
    ordered: list[Key] = []
    for members in members_in_order:
        ordered += [members[i] for i in warm_order([k.shape for k in members])]
    return ordered


def gpu_keys() -> list[Key]:
    return [
        Key(op, shape, dt) for op, shapes in GPU_KEYS.items() for dt in DTYPES for shape in shapes
    ]


def replay_recordings(directories: list[Path], gpu_model: str) -> list[Recording]:
    """The recordings in ``directories`` for ``gpu_model`` at their operator's current version,
    one per problem (the first directory's first)."""
    kept: dict[tuple[Any, ...], Recording] = {}
    for r in [r for d in directories for r in find_recordings(d)]:
        p = r.problem
        if p.gpu_model == gpu_model and p.operator_version == get_operator(p.operator).version:
            kept.setdefault(r.key, r)
    return list(kept.values())


def run_batch(
    keys: list[Key],
    factory: Any,
    *,
    gpu_model: str,
    budget: int,
    jobs_at_once: int,
    workdir: Path,
    label: str,
) -> dict[str, Any]:
    """Queue ``keys`` as one batch in a fresh SQLite database, tune it with one worker holding
    ``jobs_at_once`` jobs, and report (see the module docstring)."""
    url = f"sqlite:///{workdir / f'{label}.db'}"
    sessions = session_factory(init_db(url))
    with sessions() as s:
        jobs = queries.create_jobs(
            s,
            [
                dict(
                    operator=k.operator,
                    operator_version=get_operator(k.operator).version,
                    shape=list(k.shape),
                    dtype=k.dtype,
                    gpu_model=gpu_model,
                    budget_configs=budget,
                    seed=i,
                )  # fmt: skip
                for i, k in enumerate(keys)
            ],
        )
        ids = {j.id: k for j, k in zip(jobs, keys, strict=True)}
    worker = Worker(
        sessions, url, [gpu_model], factory, worker_id=f"bench-{label}", poll_seconds=0.05,
        lease_seconds=60, jobs_at_once=jobs_at_once,
    )  # fmt: skip
    gate = worker.runner.gpu_gate
    compiles_before = nvcc.compile_stats()
    t0, t0_epoch = time.perf_counter(), time.time()
    ended = worker.run_forever(max_jobs=len(ids))
    wall = time.perf_counter() - t0
    compiles = {k: v - compiles_before[k] for k, v in nvcc.compile_stats().items()}
    holds = gate.timeline()
    closes = [h for h in gate.uncounted() if h[0] >= t0]
    busy = sum(e - s for s, e, _ in holds if s >= t0)
    late = t0 + 60.0
    busy_late = sum(max(0.0, e - max(s, late)) for s, e, _ in holds if e > late)
    idle = idle_breakdown(holds, t0, t0 + wall, jobs_at_once, closes)
    close_s: dict[str, float] = {}
    for s, e, holder in closes:
        close_s[holder] = close_s.get(holder, 0.0) + e - s
    tail = drain_tail(holds, t0, t0 + wall, jobs_at_once)
    spans = job_spans(holds, t0)
    per_key: dict[str, Any] = {}
    problems: list[str] = []
    measured = 0
    with sessions() as s:
        for job_id, key in ids.items():
            job = queries.get_job(s, job_id)
            trials = sorted(queries.job_trials(s, job_id), key=lambda t: t.number)
            measured += len(trials)
            distinct = len({t.config_key for t in trials})
            if job is None or job.status != "done":
                problems.append(f"{key.name}: {job.status if job else 'missing'}")
            elif job.trials_done != budget or len(trials) != budget or distinct != budget:
                problems.append(f"{key.name}: {len(trials)} trials ({distinct} distinct)")
            if any(t.status == RESERVED for t in trials):
                problems.append(f"{key.name}: a reservation left")
            per_key[key.name] = {
                "job_id": job_id,
                "status": job.status if job else None,
                "trials": len(trials),
                "best_ms": job.best_time_ms if job else None,
                "best_config": job.best_config if job else None,
                "gpu_busy_fraction": job.gpu_busy_fraction if job else None,
                "trial_keys": [t.config_key for t in trials],
                "span_s": spans.get(job_id),
                **job_phases(job, spans.get(job_id), t0_epoch),
                "close_s": close_s.get(job_id),
            }
    return {
        "label": label,
        "jobs_at_once": jobs_at_once,
        "keys": len(keys),
        "budget": budget,
        "jobs_ended": ended,
        "wall_s": wall,
        "configs_measured": measured,
        "configs_per_min": measured / wall * 60 if wall > 0 else None,
        "gpu_busy_s": busy,
        "gpu_busy_fraction": busy / wall if wall > 0 else None,
        "gpu_busy_fraction_after_first_minute": busy_late / (wall - 60.0) if wall > 90 else None,
        "gate_waits": gate.waits,
        "gpu_idle_s": {k: v for k, v in idle.items() if k != "busy_s"},
        "tail": tail,
        "job_phases_s": phase_totals(per_key.values()),
        "start_order": [ids[j].name for j in sorted(spans, key=lambda j: spans[j][0]) if j in ids],
        "nvcc": compiles,
        "problems": problems,
        "per_key": per_key,
    }


def idle_breakdown(
    holds: list[tuple[float, float, str]],
    start: float,
    end: float,
    jobs_at_once: int,
    closes: list[tuple[float, float, str]] = (),
) -> dict[str, float]:
    """Where the GPU sat idle between ``start`` and ``end`` (seconds), from the gate's holds
    (start, end, holder): ``closing``, while a backend's close held the gate (``closes``, the
    uncounted holds: no measurement, and none of another job's either); else ``turnover``,
    while fewer than ``jobs_at_once`` jobs were between their first and last hold (a job
    setting up or ending, the queue draining: the next job's set-up did not overlap), and
    ``steady``, while that many were (every held job busy on the host: verification, its
    search, the database, nvcc). ``busy`` is the holds' union."""
    spans: dict[str, list[float]] = {}
    for s, e, holder in holds:
        span = spans.setdefault(holder, [s, e])
        span[0], span[1] = min(span[0], s), max(span[1], e)
    # A sweep over the moments where something changes (holds and spans clipped to the
    # window): between two of them the counts are constant. Linear after the sort: a long
    # batch's timeline holds up to 200 000 holds.
    holding: dict[float, int] = {}
    spanned: dict[float, int] = {}
    closing: dict[float, int] = {}
    for counts, intervals in (
        (holding, [(s, e) for s, e, _ in holds]),
        (spanned, spans.values()),
        (closing, [(s, e) for s, e, _ in closes]),
    ):
        for s, e in intervals:
            if e > start and s < end and e > s:
                counts[max(s, start)] = counts.get(max(s, start), 0) + 1
                counts[min(e, end)] = counts.get(min(e, end), 0) - 1
    edges = sorted({start, end, *holding, *spanned, *closing})
    busy = turnover = steady = closed = 0.0
    held = spans_open = in_close = 0
    for a, b in zip(edges, edges[1:], strict=False):
        held += holding.get(a, 0)
        spans_open += spanned.get(a, 0)
        in_close += closing.get(a, 0)
        if held > 0:
            busy += b - a
        elif in_close > 0:
            closed += b - a
        elif spans_open < jobs_at_once:
            turnover += b - a
        else:
            steady += b - a
    return {
        "busy_s": busy,
        "idle_closing_s": closed,
        "idle_turnover_s": turnover,
        "idle_steady_s": steady,
    }


def _seconds_since(moment: Any, epoch: float) -> float | None:
    """A database timestamp as seconds after ``epoch`` (a ``time.time()``); naive ones are UTC."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp() - epoch


def job_phases(job: Any, span: list[float] | None, epoch: float) -> dict[str, float | None]:
    """Where a job's slot time went outside its GPU turns: ``setup_s``, from its claim
    (``started_at``) to its first turn (the measuring child, inputs, the first compiles), and
    ``ending_s``, from its last turn to ``finished_at`` (the winner and the job's records).
    None where a timestamp or the span is missing."""
    claimed = _seconds_since(job.started_at, epoch) if job is not None else None
    finished = _seconds_since(job.finished_at, epoch) if job is not None else None
    return {
        "setup_s": span[0] - claimed if span and claimed is not None else None,
        "ending_s": finished - span[1] if span and finished is not None else None,
    }


def phase_totals(rows: Any) -> dict[str, float]:
    """The jobs' setup, ending (:func:`job_phases`) and close seconds, summed and averaged."""
    out: dict[str, float] = {}
    rows = list(rows)
    for phase in ("setup_s", "ending_s", "close_s"):
        values = [r[phase] for r in rows if r.get(phase) is not None]
        out[f"{phase[:-2]}_total_s"] = sum(values)
        out[f"{phase[:-2]}_mean_s"] = sum(values) / len(values) if values else 0.0
    return out


def job_spans(holds: list[tuple[float, float, str]], start: float) -> dict[str, list[float]]:
    """Each holder's (job's) first hold's start and last hold's end, seconds from ``start``."""
    spans: dict[str, list[float]] = {}
    for s, e, holder in holds:
        span = spans.setdefault(holder, [s - start, e - start])
        span[0], span[1] = min(span[0], s - start), max(span[1], e - start)
    return spans


def drain_tail(
    holds: list[tuple[float, float, str]], start: float, end: float, jobs_at_once: int
) -> dict[str, float]:
    """The batch's tail: from the last moment ``jobs_at_once`` jobs were between their first
    and last hold to ``end`` (``tail_s``; all of it if that never happened), the seconds the
    GPU was busy in it (``tail_busy_s``) and the most jobs spanned at once in it
    (``tail_jobs``). A long tail with few jobs is the schedule's end, not the slots' use."""
    spans = job_spans(holds, 0.0).values()
    opened: dict[float, int] = {}
    for s, e in spans:
        if e > start and s < end and e > s:
            opened[max(s, start)] = opened.get(max(s, start), 0) + 1
            opened[min(e, end)] = opened.get(min(e, end), 0) - 1
    edges = sorted({start, end, *opened})
    tail_start, count, counts = start, 0, []
    for a, b in zip(edges, edges[1:], strict=False):
        count += opened.get(a, 0)
        counts.append((a, count))
        if count >= jobs_at_once:
            tail_start = b
    tail_jobs = max((c for a, c in counts if a >= tail_start), default=0)
    busy = (
        idle_breakdown(holds, tail_start, end, jobs_at_once)["busy_s"] if end > tail_start else 0.0
    )
    return {"tail_s": end - tail_start, "tail_busy_s": busy, "tail_jobs": tail_jobs}


def compare(
    interleaved: dict[str, Any],
    serial: dict[str, Any],
    exact: bool,
    retimed: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Per key: the interleaved winner's time over the serial one's, as each run stored it
    (``winner_ratio``) and, where given, re-timed side by side (``retimed_ratio``, see
    :func:`retime_winners`), which then decides the tolerance; with ``exact`` (replay) also
    whether the trials were the same, in the same order."""
    rows, worst = {}, 0.0
    off, differ = [], []
    retimed = retimed or {}
    for name, mine in interleaved["per_key"].items():
        theirs = serial["per_key"][name]
        if mine["best_ms"] is None or theirs["best_ms"] is None:
            off.append(name)
            continue
        rows[name] = mine["best_ms"] / theirs["best_ms"]
        ratio = retimed.get(name, rows[name])
        worst = max(worst, ratio)
        if ratio > 1 + WINNER_TOLERANCE:
            off.append(name)
        if exact and mine["trial_keys"] != theirs["trial_keys"]:
            differ.append(name)
    return {
        "winner_ratio": rows,
        "retimed_ratio": retimed or None,
        "worst_ratio": worst,
        "keys_over_tolerance": off,
        "keys_with_other_trials": differ if exact else None,
        "wall_speedup": serial["wall_s"] / interleaved["wall_s"],
    }


def retime_winners(
    keys: list[Key],
    interleaved: dict[str, Any],
    serial: dict[str, Any],
    *,
    device: int,
    rounds: int,
) -> dict[str, float]:
    """GPU: the interleaved winner's time over the serial one's, both re-timed back to back in
    this process (same inputs, same timer, ``rounds`` alternating pairs, medians), for every key
    whose two runs chose different configs. Each run's stored best is timed at another moment,
    under other load: for kernels of a few microseconds that spread alone can pass 2%."""
    from statistics import median

    from kato.tuner.backends.pycuda import PyCudaBackend

    ratios: dict[str, float] = {}
    for key in keys:
        mine = interleaved["per_key"][key.name]["best_config"]
        theirs = serial["per_key"][key.name]["best_config"]
        if mine is None or theirs is None:
            continue
        if mine == theirs:
            ratios[key.name] = 1.0
            continue
        backend = PyCudaBackend(
            get_operator(key.operator), key.shape, key.dtype, device_index=device, seed=1
        )
        try:
            times: dict[str, list[float]] = {"mine": [], "theirs": []}
            for _ in range(rounds):
                for side, config in (("mine", mine), ("theirs", theirs)):
                    result = backend.evaluate(config)
                    if result.time_ms is not None:
                        times[side].append(result.time_ms)
        finally:
            backend.close()
        if times["mine"] and times["theirs"]:
            ratios[key.name] = median(times["mine"]) / median(times["theirs"])
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); the environment is given back after it."""
    saved = {k: os.environ.get(k) for k in ("KATO_FRAMEWORK_BASELINE", "KATO_COMPILE_CACHE")}
    try:
        return _main(argv)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _main(argv: list[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replay",
        type=Path,
        action="append",
        help="recorded spaces instead of the GPU (a file or directory; repeatable)",
    )
    parser.add_argument("--gpu-model", default="H200", help="replay: the recordings' GPU model")
    parser.add_argument("--budget", type=int, default=50)
    parser.add_argument("--jobs-at-once", type=int, default=3)
    parser.add_argument("--keys", type=int, help="only the first N keys of the batch")
    parser.add_argument(
        "--long-groups-last",
        action="store_true",
        help="queue the groups of fewest keys first (the longest chains last)",
    )
    parser.add_argument("--compare-serial", action="store_true")
    parser.add_argument("--cold-serial", action="store_true", help="serial: its own nvcc cache")
    parser.add_argument("--framework-baseline", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0, help="replay: seconds per measurement")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--no-isolate", action="store_true", help="GPU: measure in the worker process"
    )
    parser.add_argument(
        "--no-spare-child",
        action="store_true",
        help="GPU: every job's measuring child starts fresh (no warm spare, issue 35)",
    )
    parser.add_argument(
        "--retime-rounds",
        type=int,
        default=3,
        help="GPU: re-time differing winners side by side, this many alternating pairs (0: off)",
    )
    parser.add_argument("--out", type=Path, help="write the report as JSON")
    args = parser.parse_args(argv)

    if args.replay is not None:
        recordings = replay_recordings(args.replay, args.gpu_model)
        if not recordings:
            parser.error(f"no {args.gpu_model} recordings at current versions in {args.replay}")
        by_key = {
            Key(r.problem.operator, tuple(r.problem.shape), r.problem.dtype): r for r in recordings
        }
        keys = batch_order(
            sorted(by_key, key=lambda k: (k.operator, k.dtype, k.shape)),
            long_groups_last=args.long_groups_last,
        )
        gpu_model = args.gpu_model
    else:
        keys = batch_order(gpu_keys(), long_groups_last=args.long_groups_last)
        gpu_model = None
    keys = keys[: args.keys] if args.keys else keys

    def factory() -> Any:
        if args.replay is not None:
            return ReplayBackends([by_key[k] for k in keys], delay_s=args.delay)
        return pycuda_backend_factory(
            args.device, isolate=not args.no_isolate, defer_prepare=args.jobs_at_once > 1,
            spares=not args.no_spare_child,
        )  # fmt: skip

    if gpu_model is None:
        from kato.tuner.backends.pycuda import describe_device

        gpu_model = describe_device(args.device).model
    report: dict[str, Any] = {
        "backend": "replay" if args.replay is not None else "pycuda",
        "serial_compile_cache": "cold" if args.cold_serial else "the interleaved run's",
        "spare_child": args.replay is None and not args.no_isolate and not args.no_spare_child,
        "gpu_model": gpu_model,
        "keys": [k.name for k in keys],
        "operators": sorted({k.operator for k in keys}),
    }
    os.environ["KATO_FRAMEWORK_BASELINE"] = "true" if args.framework_baseline else "false"
    with tempfile.TemporaryDirectory(prefix="kato-batch-") as tmp:
        workdir = Path(tmp)
        runs = [("interleaved", args.jobs_at_once)]
        if args.compare_serial:
            runs.append(("serial", 1))
        for label, at_once in runs:
            if args.replay is None and (label == "interleaved" or args.cold_serial):
                os.environ["KATO_COMPILE_CACHE"] = str(workdir / f"cubins-{label}")
            report[label] = run_batch(
                keys, factory(), gpu_model=gpu_model, budget=args.budget, jobs_at_once=at_once,
                workdir=workdir, label=label,
            )  # fmt: skip
            summarize(report[label])
            if args.out:  # after each run: a run cut short still leaves the first
                write(args.out, report)
    if args.compare_serial:
        retimed = None
        if args.replay is None and args.retime_rounds > 0:
            retimed = retime_winners(
                keys, report["interleaved"], report["serial"], device=args.device,
                rounds=args.retime_rounds,
            )  # fmt: skip
        report["comparison"] = compare(
            report["interleaved"], report["serial"], exact=args.replay is not None,
            retimed=retimed,
        )  # fmt: skip
        c = report["comparison"]
        print(
            f"winners: worst interleaved/serial {c['worst_ratio']:.4f}, "
            f"{len(c['keys_over_tolerance'])} key(s) over {WINNER_TOLERANCE:.0%}"
            + (
                f", {len(c['keys_with_other_trials'])} with other trials"
                if c["keys_with_other_trials"] is not None
                else ""
            )
            + f"; wall speed-up {c['wall_speedup']:.2f}x"
        )
    if args.out:
        write(args.out, report)
    return report


def summarize(run: dict[str, Any]) -> None:
    late = run["gpu_busy_fraction_after_first_minute"]
    print(
        f"{run['label']} ({run['jobs_at_once']} at once): {run['keys']} keys x {run['budget']}, "
        f"{run['wall_s']:.1f} s, {run['configs_per_min']:.0f} configs/min, GPU busy "
        f"{run['gpu_busy_fraction']:.1%}"
        + (f" ({late:.1%} after the first minute)" if late is not None else "")
        + f"; idle {run['gpu_idle_s']['idle_closing_s']:.1f} s in backends' closes, "
        f"{run['gpu_idle_s']['idle_turnover_s']:.1f} s at job turnover, "
        f"{run['gpu_idle_s']['idle_steady_s']:.1f} s with every slot held"
        + f"; tail {run['tail']['tail_s']:.1f} s with fewer jobs than slots "
        f"({run['tail']['tail_busy_s'] / max(run['tail']['tail_s'], 1e-9):.0%} busy)"
        + f"; per job: setup {run['job_phases_s']['setup_mean_s']:.2f} s (claim to first "
        f"GPU turn), ending {run['job_phases_s']['ending_mean_s']:.2f} s (last turn to done), "
        f"close {run['job_phases_s']['close_mean_s']:.2f} s"
        + f"; nvcc runs {run['nvcc']['nvcc_runs']}, shared {run['nvcc']['shared']}"
        + (f"; PROBLEMS: {run['problems']}" if run["problems"] else "")
    )


def write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
