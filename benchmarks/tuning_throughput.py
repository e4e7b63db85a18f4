"""Tuning throughput: Kato vs Kernel Tuner on the same kernel, space, budget and GPU, one run.

The case of issue 4: softmax 32768x4096 float16, budget 100 distinct measured configs.

- Kato: a job in a fresh SQLite database, run by the worker's JobRunner with the pycuda backend
  (compile-ahead in parallel nvcc processes, verification of every config on the device), from a
  cold compile cache.
- Kernel Tuner (its pycuda backend, ``lang="PYCUDA"``): the same template, rendered with the
  same macros (``defines`` computed from Kato's spec), the same launch geometry, the same
  constraint set (``restrictions`` = the spec's check, minus configs over 48 KiB of dynamic shared
  memory, which its backend cannot launch) and the same tolerance test (a ``verify`` function,
  on the host in float32). Its default strategy (brute force, which takes no budget: it runs on
  a seeded random sample of ``--kt-sample`` or ``budget`` valid configs) and the strategies named
  with ``--kt``, each with ``max_fevals=budget`` and ``--kt-time-limit`` seconds.
- Every tuner runs in its own fresh process: in one process Kernel Tuner's launches failed with
  "invalid argument" after Kato's run had used the device.

Trials per minute = distinct configs measured / wall time of the whole tuning run (compiles
included). Then every side's winner is re-timed with the same timer (Kato's pycuda backend,
CUDA events, inputs rotated past the L2) back to back, so "best config found" compares like
with like.

    python benchmarks/tuning_throughput.py --out throughput.json [--budget 100] \
        [--kt simulated_annealing] [--kt-time-limit 240] [--kt-sample N] [--kt-only]

Results on the H200: docs/results_h200.md.

Needs a CUDA GPU, PyCUDA and kernel_tuner (``pip install 'kato[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_KT_STRATEGIES = ("genetic_algorithm", "greedy_ils", "dual_annealing")

from kato.tuner.job_runner import DEFAULT_LOOKAHEAD  # noqa: E402 - after the path insert


def run_kato(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    budget: int,
    lookahead: int,
    isolate: bool = False,
) -> dict[str, Any]:
    """One Kato tuning job, cold compile cache, fresh database; ``lookahead``: configs the
    search may ask for ahead while the GPU would wait on nvcc (the worker's setting);
    ``isolate``: measured in a child process, as the service's workers do by default."""
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.job_runner import JobRunner, default_worker_id

    spec = get_operator(operator)
    tmp = Path(tempfile.mkdtemp(prefix="kato-throughput-"))
    os.environ["KATO_COMPILE_CACHE"] = str(tmp / "cubin")  # cold cache: like Kernel Tuner
    db_url = f"sqlite:///{tmp / 'kato.db'}"
    sessions = session_factory(init_db(db_url))
    model = describe_device(0).model
    wid = default_worker_id()
    with sessions() as s:
        job = queries.create_job(
            s,
            operator=operator,
            operator_version=spec.version,
            shape=list(shape),
            dtype=dtype,
            gpu_model=model,
            budget_configs=budget,
        )
        queries.claim_next_job(s, gpu_models=[model], worker_id=wid, lease_seconds=600)
        job_id, strategy = job.id, job.strategy
    made: list[Any] = []
    factory = pycuda_backend_factory(0, isolate=isolate)
    evaluating = {"s": 0.0, "first": None, "prepare_s": 0.0}
    measured_s: list[float] = []  # each evaluate's seconds, in order

    def make(job):  # the job's backend, with its evaluations timed
        backend = factory(job)
        made.append(backend)
        evaluate = backend.evaluate

        def timed(config):
            t0 = time.perf_counter()
            if evaluating["first"] is None:
                evaluating["first"] = t0
            try:
                return evaluate(config)
            finally:
                measured_s.append(time.perf_counter() - t0)
                evaluating["s"] += measured_s[-1]

        backend.evaluate = timed
        prepare = getattr(backend, "prepare", None)  # in-process only (the child's is unseen)
        if prepare is None:
            return backend

        def timed_prepare():  # inputs and buffers, made inside the first evaluate
            t0 = time.perf_counter()
            try:
                return prepare()
            finally:
                evaluating["prepare_s"] += time.perf_counter() - t0

        backend.prepare = timed_prepare
        return backend

    # Made before the clock, as a worker makes it when it starts (it imports the search's model
    # libraries, ~2 s once per process); Kernel Tuner's imports are outside its clock too.
    runner = JobRunner(
        sessions, db_url, make, worker_id=wid, lease_seconds=600, lookahead=lookahead
    )
    from benchmarks.search_overhead import parts_ms, per_trial, recorded_searches

    with recorded_searches() as searches:
        start = time.perf_counter()
        runner.run(job_id)
        wall = time.perf_counter() - start
    trial_split = per_trial(searches, measured_s)
    stats = made[0].compile_stats if made else None
    with sessions() as s:
        trials = queries.job_trials(s, job_id)
        job = queries.get_job(s, job_id)
        measured = len(trials)
        ok = sum(t.status == "ok" for t in trials)
        best = dict(job.best_config) if job.best_config else None
        best_ms = job.best_time_ms
    return {
        "tuner": f"Kato ({strategy}, lookahead {lookahead}{', isolated' if isolate else ''})",
        "lookahead": lookahead,
        "measured": measured,
        "ok": ok,
        "wall_s": wall,
        "trials_per_min": 60 * measured / wall,
        "best_config": best,
        "best_ms_during_tuning": best_ms,
        # Where the wall time went: before the first measurement (CUDA context, space, job and
        # study), inside evaluate (the deferred inputs, float64 references, buffers and verifier
        # of the first one: prepare_s; compile waits included), the rest (proposals, database);
        # compile_wait_s is the time the GPU sat idle on nvcc.
        "setup_s": (evaluating["first"] or start) - start,
        "evaluate_s": evaluating["s"],
        "prepare_s": evaluating["prepare_s"],
        "compile_wait_s": stats.wait_s if stats else None,
        "compiled_ahead": stats.ahead if stats else None,
        "compiled_inline": stats.inline if stats else None,
        # Per trial (benchmarks/search_overhead.py): the search's proposals, the database on
        # the path (reservation, sync, the records' wait), the backend's evaluate (measuring,
        # compile waits, the first one's inputs), mean and p95 ms; and the sums over the job.
        "per_trial_ms": parts_ms(trial_split) if trial_split else None,
        "search_s": sum(t["propose"] for t in trial_split),
        "database_s": sum(t["db"] for t in trial_split),
        "sum_of_measurements_s": sum(t["measure"] for t in trial_split),
    }


def run_kernel_tuner(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    budget: int,
    strategy: str,
    seed: int,
    time_limit: float = 240,
    sample_size: int | None = None,
) -> dict[str, Any]:
    """One Kernel Tuner run on the same template, space, geometry and verification."""
    import kernel_tuner
    from kato.kernels import get_operator
    from kato.kernels.spec import template_source
    from kato.tuner.space import SearchSpace

    spec = get_operator(operator)
    problem = spec.make_problem(shape, dtype, np.random.default_rng(seed))
    atol, rtol = spec.tolerance(dtype)
    out = problem.outputs[0]
    reference = problem.references[0]

    # The spec's tolerance test, in float32 with the bound precomputed: the check is the same
    # as Kato's on-device verifier, and it keeps the host-side cost Kernel Tuner pays per config
    # low (a float64 pass over 134M elements took about 1.5 s per config).
    reference32 = reference.astype(np.float32)
    bound = (atol + rtol * np.abs(reference)).astype(np.float32)

    def verify(answer, result_host, atol=None) -> bool:
        got = np.asarray(result_host[out]).astype(np.float32, copy=False)
        return bool(np.all(np.abs(got - reference32) <= bound))

    space = SearchSpace(spec.params, lambda c: spec.check(c, shape, dtype))
    valid = space.valid_configs()
    allowed: set[tuple] | None = None
    # A time limit too, so that a stuck strategy cannot eat the device call.
    options: dict[str, Any] = {"max_fevals": budget, "time_limit": time_limit}
    if strategy == "brute_force":
        # Its default strategy takes no budget: give it a seeded sample of `budget` configs.
        launchable = [c for c in valid if spec.launch(c, shape, dtype).shared_bytes <= 48 * 1024]
        sample = random.Random(seed).sample(launchable, min(sample_size or budget, len(launchable)))
        allowed = {tuple(c[k] for k in spec.params) for c in sample}
        options = {}  # brute force takes neither max_fevals nor time_limit

    def restrict(p: dict[str, Any]) -> bool:
        config = {k: p[k] for k in spec.params}
        if allowed is not None and tuple(config.values()) not in allowed:
            return False
        if spec.check(config, shape, dtype) is not None:
            return False
        # Kernel Tuner's pycuda backend does not opt in to more than 48 KiB of dynamic shared
        # memory, and aborts the whole run on the launch error: keep such configs out.
        return spec.launch(config, shape, dtype).shared_bytes <= 48 * 1024

    def macro(name: str):
        return lambda p: spec.defines({k: p[k] for k in spec.params}, shape, dtype)[name]

    defines = {name: macro(name) for name in spec.defines(valid[0], shape, dtype)}

    def grid(p: dict[str, Any]) -> tuple[int, int, int]:
        return spec.launch({k: p[k] for k in spec.params}, shape, dtype).grid

    def smem(p: dict[str, Any]) -> int:
        return spec.launch({k: p[k] for k in spec.params}, shape, dtype).shared_bytes

    _explain_launch_errors()
    start = time.perf_counter()
    results, _env = kernel_tuner.tune_kernel(
        spec.kernel_name,
        template_source(spec.template),  # the shared headers inlined: a self-contained source
        grid,
        problem.args,
        {k: list(v) for k, v in spec.params.items()},
        grid_div_x=[],
        grid_div_y=[],
        grid_div_z=[],
        block_size_names=["BLOCK_SIZE"],
        smem_args={"size": smem},
        restrictions=restrict,
        defines=defines,
        # The output's slot must be non-None so that Kernel Tuner copies it back for `verify`.
        answer=[reference if i == out else None for i in range(len(problem.args))],
        verify=verify,
        lang="PYCUDA",  # its pycuda backend ("CUDA" may pick the NVRTC-based one)
        compiler_options=["-O3", "-std=c++17"],  # Kato's nvcc options, minus the ptxas report
        strategy=strategy,
        strategy_options=options or None,
        iterations=7,
        verbose=False,
        quiet=True,
    )
    wall = time.perf_counter() - start
    ok = [r for r in results if isinstance(r.get("time"), float)]
    best = min(ok, key=lambda r: r["time"]) if ok else None
    return {
        "tuner": f"Kernel Tuner ({strategy})",
        "measured": len(results),
        "ok": len(ok),
        "wall_s": wall,
        "trials_per_min": 60 * len(results) / wall,
        "best_config": {k: best[k] for k in spec.params} if best else None,
        "best_ms_during_tuning": best["time"] if best else None,
    }


def _explain_launch_errors() -> None:
    """Make a launch error inside Kernel Tuner name the config's geometry (it aborts the run
    with the bare driver message otherwise)."""
    from kernel_tuner.backends.pycuda import PyCudaFunctions

    original = PyCudaFunctions.run_kernel
    if getattr(original, "_kato_wrapped", False):
        return

    def run_kernel(self, func, gpu_args, threads, grid, stream=None):
        try:
            return original(self, func, gpu_args, threads, grid, stream)
        except Exception as exc:
            types = [type(a).__name__ for a in gpu_args]
            raise RuntimeError(
                f"{exc!r} launching {getattr(func, 'function_name', func)} with block={threads} "
                f"grid={grid} shared={self.smem_size} args={types}"
            ) from exc

    run_kernel._kato_wrapped = True
    PyCudaFunctions.run_kernel = run_kernel


def _in_child(fn, *args) -> dict[str, Any]:
    """Run one tuner in a fresh process: no CUDA context or module state is shared between
    the tuners, and one's crash cannot take the others down."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # Not a multiprocessing.Pool: its workers are daemons, and Kato's worker starts its own
    # measuring child process.
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def retime(operator: str, shape, dtype: str, rows: list[dict[str, Any]]) -> None:
    """Re-time every winner with Kato's timer, back to back (same inputs, same process)."""
    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = get_operator(operator)
    backend = PyCudaBackend(spec, shape, dtype, repeats=30, seed=1)
    try:
        for row in rows:
            if row["best_config"] is None:
                row["best_ms"] = None
                continue
            result = backend.evaluate(row["best_config"])
            row["best_ms"] = result.time_ms
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--operator", default="softmax")
    ap.add_argument("--shape", default="32768x4096")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--kt", action="append", help="Kernel Tuner strategies besides brute_force")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kt-time-limit", type=float, default=240, help="seconds per Kernel Tuner strategy"
    )
    ap.add_argument(
        "--kt-sample",
        type=int,
        default=None,
        help="configs of the brute-force sample (default: the budget); it takes no time limit",
    )
    ap.add_argument("--kt-only", action="store_true", help="skip Kato (diagnosing Kernel Tuner)")
    ap.add_argument(
        "--kato-runs", type=int, default=1, help="Kato jobs in a row (the spread between runs)"
    )
    ap.add_argument("--no-kt", action="store_true", help="Kato only (diagnosing Kato)")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="Kato measures in a child process (the service's default; off: in-process)",
    )
    ap.add_argument(
        "--lookahead",
        default=str(DEFAULT_LOOKAHEAD),
        help="Kato's lookahead; a comma list runs Kato's jobs for each (1: ask, measure, ask)",
    )
    ap.add_argument("--out", default="tuning_throughput.json")
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))

    rows = []
    lookaheads = [int(n) for n in args.lookahead.split(",")]
    for _ in range(0 if args.kt_only else args.kato_runs):
        for lookahead in lookaheads:
            rows.append(
                _in_child(
                    run_kato,
                    args.operator,
                    shape,
                    args.dtype,
                    args.budget,
                    lookahead,
                    args.isolate,
                )
            )
            print(rows[-1], flush=True)
    strategies = [] if args.no_kt else ["brute_force", *(args.kt or DEFAULT_KT_STRATEGIES)]
    for strategy in strategies:
        try:
            rows.append(
                _in_child(
                    run_kernel_tuner,
                    args.operator,
                    shape,
                    args.dtype,
                    args.budget,
                    strategy,
                    args.seed,
                    args.kt_time_limit,
                    args.kt_sample,
                )
            )
        except Exception as exc:  # a peer's failure is reported, not fatal
            rows.append({"tuner": f"Kernel Tuner ({strategy})", "error": repr(exc)})
        print(rows[-1], flush=True)
        Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, default=str))
    retime(args.operator, shape, args.dtype, [r for r in rows if "error" not in r])

    if args.kt_only:
        print(json.dumps(rows, indent=1, default=str))
        return
    kato = next((r for r in rows if r.get("lookahead") == DEFAULT_LOOKAHEAD), rows[0])
    print(f"\n{args.operator} {args.shape} {args.dtype}, budget {args.budget}")
    print(
        f"{'tuner':34} {'measured':>8} {'ok':>4} {'wall s':>7} {'trials/min':>10} "
        f"{'best ms':>9} {'Kato x':>7}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['tuner']:34} ERROR {r['error'][:80]}")
            continue
        ratio = kato["trials_per_min"] / r["trials_per_min"]
        best = f"{r['best_ms']:9.4f}" if r.get("best_ms") else f"{'-':>9}"
        print(
            f"{r['tuner']:34} {r['measured']:8d} {r['ok']:4d} {r['wall_s']:7.1f} "
            f"{r['trials_per_min']:10.1f} {best} {ratio:7.2f}"
        )
    for r in rows:
        if r.get("compile_wait_s") is not None:
            print(
                f"{r['tuner']}: wall {r['wall_s']:.1f} s = setup {r['setup_s']:.1f} + measuring"
                f" {r['evaluate_s']:.1f} (of which making the inputs {r['prepare_s']:.1f},"
                f" waiting on nvcc {r['compile_wait_s']:.2f};"
                f" compiled ahead {r['compiled_ahead']}, inline {r['compiled_inline']}) + search"
                f" and database {r['wall_s'] - r['setup_s'] - r['evaluate_s']:.1f}"
            )
        if r.get("per_trial_ms"):
            split = r["per_trial_ms"]
            print(
                f"{r['tuner']}: per trial (mean / p95 ms) search {split['propose']['mean_ms']:.1f}"
                f" / {split['propose']['p95_ms']:.1f}, database {split['db']['mean_ms']:.1f} /"
                f" {split['db']['p95_ms']:.1f}, all but measuring"
                f" {split['overhead']['mean_ms']:.1f} / {split['overhead']['p95_ms']:.1f};"
                f" over the job search {r['search_s']:.2f} s,"
                f" database {r['database_s']:.2f} s, measurements {r['sum_of_measurements_s']:.2f}"
                f" s of the {r['wall_s']:.1f} s wall"
            )
    report = {
        "operator": args.operator,
        "shape": list(shape),
        "dtype": args.dtype,
        "budget": args.budget,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
