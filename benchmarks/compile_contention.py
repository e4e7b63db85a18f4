"""Compile contention between the jobs of one worker: how long a job's measurement waits on nvcc
while the other jobs compile their spaces ahead (issue 35), with the process's nvcc slots taken
first come, first served (as before session 14) or handed out by urgency
(:mod:`tuner.compile_slots`).

No GPU: real nvcc runs of real operator configs (``--fake-compile-s`` replaces them with a
sleep that holds a slot, for a quick look at the scheduling alone). Each of ``--jobs`` jobs is
one :class:`~tuner.compile_queue.CompileQueue` over one key's valid space, queued whole at its
start (as a backend's ``precompile`` does); each job's search then asks for ``--budget``
configs in a random order, hinting each one ``--think`` seconds before it takes it (as the
search names its next configs), and "measures" each for ``--measure`` seconds. Modes:

- ``fifo``: the queue picks its configs as its threads start and every compile asks for a slot
  at the same urgency: the order of arrival decides (the semaphore before session 14);
- ``urgency``: the queue shares the process's slots (a take blocks at NOW, a hint is NEXT, the
  rest BULK, which leaves the reserve free and runs at niceness 19).

Each mode runs in a fresh compile cache. Per mode: the seconds each take() waited (mean, p95,
max), each job's wall time, nvcc runs.

    python3 benchmarks/compile_contention.py --out data/benchmarks/compile_contention.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kato.kernels import get_operator
from kato.tuner import nvcc
from kato.tuner.backends.pycuda import compile_config, operator_space
from kato.tuner.compile_queue import CompileQueue
from kato.tuner.compile_slots import CompileSlots, Urgency, Want, nvcc_slots, wanting

#: (operator, shape, dtype) of each job, in order; --jobs takes the first N.
KEYS = [
    ("softmax", (4096, 1024), "float16"),
    ("transpose", (1024, 1024), "float32"),
    ("relu", (1 << 22,), "float16"),
    ("layernorm", (4096, 1024), "float16"),
]


def _job(
    key: tuple[str, tuple[int, ...], str],
    mode: str,
    args: argparse.Namespace,
    cache: Path,
    slots: CompileSlots,
    seed: int,
) -> dict[str, Any]:
    name, shape, dtype = key
    spec = get_operator(name)
    space = operator_space(spec, shape, dtype, lambda c: spec.check(c, shape, dtype))
    configs = space.valid_configs()

    if args.fake_compile_s:

        def compile_fn(config: dict[str, Any]) -> str:
            with slots.held():
                time.sleep(args.fake_compile_s)
            return space.key(config)
    else:

        def compile_fn(config: dict[str, Any]) -> Any:
            return compile_config(spec, shape, dtype, config, args.arch, cache)

    if mode == "urgency":
        queue = CompileQueue(compile_fn, space.key, args.workers, slots)
    else:
        # Every compile at one urgency: the order of arrival decides, no reserve, one niceness.
        def fifo(config: dict[str, Any]) -> Any:
            with wanting(Want(Urgency.NOW)):
                return compile_fn(config)

        queue = CompileQueue(fifo, space.key, args.workers)
    rng = random.Random(seed)
    asked = rng.sample(configs, min(args.budget, len(configs)))
    started = time.perf_counter()
    queue.add(configs)
    waits: list[float] = []
    failed = 0
    try:
        for config in asked:
            queue.hint([config])
            time.sleep(args.think)
            t0 = time.perf_counter()
            try:
                queue.take(config)
            except nvcc.CompileError:
                failed += 1  # a config that does not build: a failed trial, timed all the same
            waits.append(time.perf_counter() - t0)
            time.sleep(args.measure)
    finally:
        queue.close()
    return {
        "key": f"{name}/{'x'.join(map(str, shape))}/{dtype}",
        "space": len(configs),
        "asked": len(asked),
        "failed": failed,
        "waits_s": waits,
        "wall_s": time.perf_counter() - started,
        "ahead": queue.stats.ahead,
        "inline": queue.stats.inline,
    }


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return {"mean": statistics.fmean(values), "p95": p95, "max": ordered[-1]}


def run_mode(mode: str, args: argparse.Namespace, slots: CompileSlots) -> dict[str, Any]:
    """Every job of the run at once in ``mode``, each in its own thread and fresh cache."""
    before = nvcc.compile_stats()
    results: list[dict[str, Any]] = [{} for _ in range(args.jobs)]
    with tempfile.TemporaryDirectory(prefix=f"kato-contention-{mode}-") as tmp:

        def one(i: int) -> None:
            results[i] = _job(KEYS[i], mode, args, Path(tmp), slots, args.seed + i)

        started = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    after = nvcc.compile_stats()
    waits = [w for r in results for w in r["waits_s"]]
    return {
        "mode": mode,
        "wall_s": wall,
        "take_wait_s": _summary(waits),
        "nvcc_runs": after["nvcc_runs"] - before["nvcc_runs"],
        "jobs": results,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3, choices=range(1, len(KEYS) + 1))
    parser.add_argument("--budget", type=int, default=8, help="configs each job's search takes")
    parser.add_argument("--think", type=float, default=0.05, help="s from a hint to its take")
    parser.add_argument("--measure", type=float, default=0.1, help="s a measurement takes")
    parser.add_argument(
        "--workers", type=int, default=None, help="compile threads a job (default: cores - 1)"
    )
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--modes", default="fifo,urgency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fake-compile-s", type=float, default=0.0, help="a sleep holding a slot, not nvcc"
    )
    parser.add_argument(
        "--slots", type=int, help="with --fake-compile-s: this many slots (a larger host's)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.slots and not args.fake_compile_s:
        parser.error("--slots needs --fake-compile-s: real nvcc runs take the process's slots")
    slots = CompileSlots(args.slots) if args.slots else nvcc_slots()
    report: dict[str, Any] = {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "nvcc_slots": slots.slots,
        "reserved": slots.reserved,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "modes": [run_mode(mode, args, slots) for mode in args.modes.split(",")],
    }
    print(f"{args.jobs} jobs, {args.budget} configs each, {slots.slots} nvcc slots on "
          f"{os.cpu_count()} cores ({slots.reserved} reserved)")  # fmt: skip
    print(f"{'mode':<8} {'wall s':>7} {'wait mean s':>11} {'p95 s':>7} {'max s':>7} {'nvcc':>5}")
    for m in report["modes"]:
        w = m["take_wait_s"]
        print(f"{m['mode']:<8} {m['wall_s']:7.1f} {w['mean']:11.2f} {w['p95']:7.2f} "
              f"{w['max']:7.2f} {m['nvcc_runs']:5d}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
