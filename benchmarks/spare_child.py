"""A job's measuring child started fresh or from a warm spare (issue 35): seconds from creating
the job's isolated backend to its first result, on the CPU.

For each backend kind, ``--rounds`` times each: an :class:`IsolatedBackend` built, its first
config evaluated, closed; fresh (a new ``spawn`` child: interpreter, imports, the backend) and
from a spare of a :class:`SpareChildren` pool (started and warm before the backend is asked
for: a worker's next job). Before every measurement the pool's idle spare is warm, so a fresh
child does not share the CPU with a spare's warm-up; a measurement from a spare shares it with
the replacement spare's start, as in a worker. Kinds:

- ``replay``: the replay backend (what ``ReplayBackends(isolate=True)`` builds);
- ``standin``: ``benchmarks/standin_backend.py``, which imports what the ``pycuda`` kind's child
  imports apart from PyCUDA and the GPU. The ``pycuda`` kind's own warm-up also starts the
  driver and retains the device's CUDA context: not measured here (no GPU).

Reported per kind and start: ``ready_s`` (the backend built: its child announced the device)
and ``first_result_s`` (its first config measured), each round and the median.

    python3 benchmarks/spare_child.py --rounds 5 --out data/benchmarks/spare_child_cpu.json

Results: docs/design.md (Warm spare measuring children).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "tests" / "data" / "recorded" / "softmax_H200_4096x4096_float16.json.gz"
KINDS = {"replay": "replay", "standin": "benchmarks.standin_backend:make"}


def measure(spec: Any, spares: Any, config: dict[str, Any]) -> dict[str, float]:
    from kato.tuner.backends.isolated import IsolatedBackend

    start = time.perf_counter()
    backend = IsolatedBackend(spec, spares=spares)
    try:
        ready = time.perf_counter() - start
        result = backend.evaluate(config)
        first = time.perf_counter() - start
        assert result.ok, result.error
        assert backend.spares_taken == (1 if spares is not None else 0)
    finally:
        backend.close()
    return {"ready_s": round(ready, 4), "first_result_s": round(first, 4)}


def run_kind(name: str, rounds: int) -> dict[str, Any]:
    from kato.tuner.backends.isolated import BackendSpec, SpareChildren
    from kato.tuner.backends.replay import ReplayBackend

    spec = BackendSpec(kind=KINDS[name], replay_file=str(RECORDING))
    config = ReplayBackend(RECORDING).space().valid_configs()[0]
    pool = SpareChildren(spec.kind)
    pool.start()
    runs: dict[str, list[dict[str, float]]] = {"fresh": [], "spare": []}
    try:
        for _ in range(rounds):
            for start in ("fresh", "spare"):
                if not pool.wait_warm(120):
                    raise RuntimeError("the spare did not warm up in 120 s")
                runs[start].append(measure(spec, pool if start == "spare" else None, config))
    finally:
        pool.close()
    report: dict[str, Any] = {"kind": spec.kind, "rounds": runs}
    for start, values in runs.items():
        report[f"{start}_median"] = {
            k: round(statistics.median(v[k] for v in values), 4) for k in values[0]
        }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--out", type=Path, help="write the report as JSON")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT)]  # the children inherit it: benchmarks.standin_backend
    report: dict[str, Any] = {
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": round(os.getloadavg()[0], 2),  # other processes on the host
        },
        "recording": str(RECORDING.relative_to(ROOT)),
        "kinds": {},
    }
    for name in args.kinds:
        report["kinds"][name] = result = run_kind(name, args.rounds)
        for start in ("fresh", "spare"):
            m = result[f"{start}_median"]
            ready, first = m["ready_s"], m["first_result_s"]
            print(f"{name:8s} {start:6s} ready {ready:.3f} s, first result {first:.3f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
