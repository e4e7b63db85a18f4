"""Asking ahead, simulated: nvcc waits, wall time and fraction of optimum on recorded spaces.

A worker compiles configs in parallel (a bounded queue; hinted configs first; a space of at most
``tuner.job_runner.PRECOMPILE_MAX_CONFIGS`` queued whole when the job starts) while the GPU
measures;
with ``lookahead`` above 1 the search asks for more configs while the one it asked for compiles
(``Search(ahead=, ready=, wait_ready=)``). This drives the real ``Search`` (default strategy) on
a recorded space with a simulated clock: each config compiles for its recorded ``compile_time``
on one of ``--compile-workers`` processes, each proposal costs ``--search-s``, each measurement
``--measure-s``, the job's inputs ``--prepare-s`` at the first measurement. It shows what
asking ahead costs in search quality (proposals made without the results in flight) and gains
in wall time, before spending GPU time on it.

    python3 benchmarks/lookahead_sim.py --lookahead 1,4 --seeds 20 FILE...   (default: the
    datasets' convolution and gemm files and the H200 softmax space)
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kato.tuner.proposers.forest as forest_module  # noqa: E402 - after the path insert
from kato.tuner.backends.replay import ReplayBackend  # noqa: E402
from kato.tuner.job_runner import PRECOMPILE_MAX_CONFIGS  # noqa: E402
from kato.tuner.search import Budget, Search  # noqa: E402
from kato.tuner.surrogate import ForestProposer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ROOT / "data" / "datasets" / "benchmark_hub" / "cachefiles"
DEFAULT_FILES = [
    DATASETS / "convolution_milo" / "A100.json.gz",
    DATASETS / "convolution_milo" / "A4000.json.gz",
    DATASETS / "gemm_kerneltuner" / "RTX_3090.json.gz",
    # The name ends in the operator's version, which changes with its code: whichever is there.
    *sorted((ROOT / "data" / "spaces" / "h200").glob("softmax_H200_32768x4096_float16_*.json.gz")),
]


class SimulatedJob:
    """One job's clock, compile queue and GPU (see the module docstring)."""

    def __init__(self, backend: ReplayBackend, args: argparse.Namespace):
        self.backend, self.args = backend, args
        self.space = backend.space()
        self.clock = 0.0
        self.nvcc_wait = 0.0
        self.compile_s: dict[str, float] = {}
        for key, entry in backend.cache.entries.items():
            value = entry.get("compile_time")
            self.compile_s[key] = value / 1000 if isinstance(value, int | float) else 0.6
        valid = self.space.valid_configs()
        bulk = valid if len(valid) <= PRECOMPILE_MAX_CONFIGS else []
        self.queued: OrderedDict[str, Any] = OrderedDict((self.space.key(c), c) for c in bulk)
        self.done_at: dict[str, float] = {}
        self.free = [0.0] * args.compile_workers  # when each compile process is next free
        self.prepared = False

    def _seconds(self, config: Any) -> float:
        return self.compile_s.get(self.backend.cache.key(config), 0.6)

    def advance(self) -> None:
        """Start queued compiles on every process free by now."""
        while self.queued and self.free[0] <= self.clock:
            at = heapq.heappop(self.free)
            key, config = self.queued.popitem(last=False)
            self.done_at[key] = at + self._seconds(config)
            heapq.heappush(self.free, self.done_at[key])

    def hint(self, configs: list[Any]) -> None:
        self.advance()
        for config in reversed(configs):
            key = self.space.key(config)
            if key not in self.done_at:
                self.queued[key] = config
                self.queued.move_to_end(key, last=False)
        self.advance()

    def proposed(self) -> None:
        self.clock += self.args.search_s
        self.advance()

    def ready(self, config: Any) -> bool:
        done = self.done_at.get(self.space.key(config))
        return done is not None and done <= self.clock

    def wait_ready(self, configs: list[Any]) -> None:
        times = [t for c in configs if (t := self.done_at.get(self.space.key(c))) is not None]
        if times and min(times) > self.clock:
            self.nvcc_wait += min(times) - self.clock
            self.clock = min(times)
            self.advance()

    def evaluate(self, config: Any):
        if not self.prepared:  # the job's inputs, made at the first measurement
            self.clock += self.args.prepare_s
            self.prepared = True
            self.advance()
        key = self.space.key(config)
        if key not in self.done_at:  # never started: compiled inline now
            self.queued.pop(key, None)
            self.done_at[key] = self.clock + self._seconds(config)
        wait = max(0.0, self.done_at[key] - self.clock)
        self.nvcc_wait += wait
        self.clock += wait + self.args.measure_s
        self.advance()
        return self.backend.evaluate(config)


def run(path: Path, lookahead: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    backend = ReplayBackend(path)
    job = SimulatedJob(backend, args)

    class TimedProposer(ForestProposer):
        def propose(self, results):
            job.proposed()
            return super().propose(results)

    forest_module.ForestProposer = TimedProposer  # type: ignore[misc]
    try:
        search = Search(
            job.space,
            job.evaluate,
            seed=seed,
            on_upcoming=job.hint,
            ahead=lookahead,
            ready=job.ready,
            wait_ready=job.wait_ready,
        )
        result = search.run(Budget(max_configs=args.budget))
    finally:
        forest_module.ForestProposer = ForestProposer  # type: ignore[misc]
    best = result.best.time_ms if result.best else None
    return {
        "fraction_of_optimum": backend.best_time_ms() / best if best else 0.0,
        "wall_s": job.clock,
        "nvcc_wait_s": job.nvcc_wait,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--lookahead", default="1,4")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=40)
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--compile-workers", type=int, default=15, help="the H200 host: 16 cores")
    ap.add_argument("--search-s", type=float, default=0.075, help="seconds per proposal")
    ap.add_argument("--measure-s", type=float, default=0.02, help="seconds per measurement")
    ap.add_argument(
        "--prepare-s",
        type=float,
        default=5.5,
        help="seconds to make the inputs at the first measurement (softmax 32768x4096, H200)",
    )
    ap.add_argument("--out", default="lookahead_sim.json")
    args = ap.parse_args()
    files = args.files or [f for f in DEFAULT_FILES if f.exists()]
    lookaheads = [int(n) for n in args.lookahead.split(",")]
    rows = []
    print(f"{'space':44} {'lookahead':>9} {'fraction':>8} {'wall s':>7} {'nvcc wait s':>11}")
    for path in files:
        for lookahead in lookaheads:
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            runs = [run(path, lookahead, s, args) for s in seeds]
            row = {
                "file": str(path),
                "lookahead": lookahead,
                "seeds": args.seeds,
                **{k: statistics.fmean(r[k] for r in runs) for k in runs[0]},
            }
            rows.append(row)
            name = f"{path.parent.name}/{path.name}"[:44]
            print(
                f"{name:44} {lookahead:9d} {row['fraction_of_optimum']:8.3f} "
                f"{row['wall_s']:7.1f} {row['nvcc_wait_s']:11.2f}",
                flush=True,
            )
    Path(args.out).write_text(json.dumps({"args": vars(args) | {"files": None}, "rows": rows}))


if __name__ == "__main__":
    main()
