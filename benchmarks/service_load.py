"""Load on the lookup path: 64 concurrent clients on loopback while a tuning job writes trials.

What it does, in one run:

1. a database (a temp SQLite file, or ``--db URL``) seeded with ``--seed-configs`` best configs
   of softmax on the H200 (several shapes, two dtypes);
2. ``kato serve --no-workers --api-workers N`` in a subprocess on a free loopback port;
3. a tuning writer in another subprocess: replay-backed jobs (``tuner.worker.JobRunner`` on the
   recorded softmax space in ``tests/data/recorded``, ``--trial-delay`` seconds per trial, as a
   GPU would take) run back to back for the whole run, storing trials, Optuna studies and
   winners in the same database;
4. for each endpoint in turn (``GET /v1/ping``, which touches nothing: the ceiling; then
   ``GET /v1/configs/softmax`` over the seeded shapes and unseeded ones, answered ``exact`` or
   ``nearest``), ``--clients`` closed-loop clients (keep-alive HTTP/1.1 connections, spread over
   ``--client-procs`` processes) send requests back to back for ``--seconds``, after
   ``--warmup`` unmeasured seconds (connections open, lookup caches filled);
5. prints requests/s, p50/p99/max latency and errors per endpoint, the lookup/ceiling ratio and
   the trials written meanwhile; ``--out`` writes the same as JSON.

Targets (issue 5): lookups at no less than half the ceiling's requests/s, p99 under 25 ms, no
errors. Run from the repository root::

    python3 benchmarks/service_load.py --seconds 10 --out data/benchmarks/service_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECORDING = REPO / "tests" / "data" / "recorded" / "softmax_H200_4096x4096_float16.json.gz"
ROWS = (256, 1024, 4096, 16384, 65536)
COLS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the database ----------------------------------------------------------------------------


def seed(db_url: str, count: int) -> list[tuple[list[int], str]]:
    """Store ``count`` best configs of softmax on the H200; return their (shape, dtype)."""
    from db import queries
    from db.session import init_db, session_factory
    from kernels import get_operator

    spec = get_operator("softmax")
    keys = [([r, c], d) for d in ("float16", "float32") for r in ROWS for c in COLS][:count]
    sessions = session_factory(init_db(db_url))
    rng = random.Random(0)
    with sessions() as session:
        for shape, dtype in keys:
            queries.upsert_best_config(
                session,
                operator="softmax",
                operator_version=spec.version,
                shape=shape,
                dtype=dtype,
                gpu_model="H200",
                compute_capability="9.0",
                cuda_version="13.0",
                config=spec.default_config(shape, dtype),
                time_ms=rng.uniform(0.005, 2.0),
                job_id=None,
            )
    return keys


def lookup_paths(keys: list[tuple[list[int], str]]) -> list[str]:
    """Seeded shapes (answered ``exact``) and shapes in between them (``nearest``)."""
    paths = [f"/v1/configs/softmax?shape={r}x{c}&dtype={d}&gpu=H200" for (r, c), d in keys]
    paths += [
        f"/v1/configs/softmax?shape={r * 3 // 2}x{c * 3 // 2}&dtype={d}&gpu=H200"
        for (r, c), d in keys
    ]
    random.Random(1).shuffle(paths)
    return paths


def run_writer(db_url: str, trial_delay: float) -> None:
    """Replay-backed tuning jobs back to back until killed (the ``--writer`` mode)."""
    from db import queries
    from db.session import init_db, session_factory
    from kernels import get_operator
    from tuner.backends.replay import ReplayBackend
    from tuner.worker import JobRunner, default_worker_id

    class SlowReplay(ReplayBackend):
        def evaluate(self, config: dict[str, Any]) -> Any:
            time.sleep(trial_delay)
            return super().evaluate(config)

    sessions = session_factory(init_db(db_url))
    version = get_operator("softmax").version
    worker_id = default_worker_id()
    for seed_ in itertools.count():
        with sessions() as session:
            queries.create_job(
                session,
                operator="softmax",
                operator_version=version,
                shape=[4096, 4096],
                dtype="float16",
                gpu_model="H200",
                budget_configs=100,
                seed=seed_,
            )
            job = queries.claim_next_job(
                session, gpu_models=["H200"], worker_id=worker_id, lease_seconds=60
            )
        if job is None:
            continue
        runner = JobRunner(
            sessions, db_url, lambda _job: SlowReplay(RECORDING), worker_id=worker_id
        )
        runner.run(job.id)


def trials_written(db_url: str) -> int:
    from sqlalchemy import func, select

    from db.models import Trial
    from db.session import make_engine, session_factory

    with session_factory(make_engine(db_url))() as session:
        return int(session.scalar(select(func.count()).select_from(Trial)) or 0)


# --- the load --------------------------------------------------------------------------------


async def _client(
    port: int, paths: list[str], start: int, deadline: float, out: dict[str, Any]
) -> None:
    """One closed-loop keep-alive client: a request, its whole answer, the next request."""
    reader = writer = None
    i = start
    while time.perf_counter() < deadline:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert reader is not None
            path = paths[i % len(paths)]
            i += 1
            t0 = time.perf_counter()
            writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            out["latencies"].append(time.perf_counter() - t0)
            if status != 200:
                out["errors"] += 1
                out["statuses"][status] = out["statuses"].get(status, 0) + 1
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            out["errors"] += 1
            out["exceptions"][type(exc).__name__] = out["exceptions"].get(type(exc).__name__, 0) + 1
            if writer is not None:
                writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


def _load_proc(
    port: int, paths: list[str], clients: int, offset: int, t_start: float, seconds: float, q: Any
) -> None:
    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"latencies": [], "errors": 0, "statuses": {}, "exceptions": {}}
        while time.time() < t_start:  # every process starts at the same moment
            await asyncio.sleep(0.001)
        deadline = time.perf_counter() + seconds
        step = max(1, len(paths) // max(clients, 1))
        await asyncio.gather(
            *(_client(port, paths, offset + k * step, deadline, out) for k in range(clients))
        )
        return out

    q.put(asyncio.run(main()))


def load(port: int, paths: list[str], clients: int, procs: int, seconds: float) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``procs`` processes for ``seconds``: the numbers."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t_start = time.time() + 1.0
    per = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    ps = [
        ctx.Process(target=_load_proc, args=(port, paths, n, k * 997, t_start, seconds, q))
        for k, n in enumerate(per)
    ]
    for p in ps:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = sorted(x for r in results for x in r["latencies"])
    errors = sum(r["errors"] for r in results)
    statuses: dict[str, int] = {}
    exceptions: dict[str, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[str(k)] = statuses.get(str(k), 0) + v
        for k, v in r["exceptions"].items():
            exceptions[k] = exceptions.get(k, 0) + v

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {
        "requests": len(lat),
        "requests_per_s": round(len(lat) / seconds, 1),
        "p50_ms": round(pct(0.50), 2),
        "p99_ms": round(pct(0.99), 2),
        "max_ms": round(lat[-1] * 1000, 2) if lat else None,
        "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else None,
        "errors": errors,
        "error_statuses": statuses,
        "error_exceptions": exceptions,
    }


# --- the run ---------------------------------------------------------------------------------


def wait_up(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/ping", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"kato serve exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit("kato serve did not come up")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", help="SQLAlchemy URL (default: a temp SQLite file)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per endpoint")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--api-workers", type=int, default=2, help="kato serve --api-workers")
    ap.add_argument("--seed-configs", type=int, default=80)
    ap.add_argument("--trial-delay", type=float, default=0.05, help="seconds per replayed trial")
    ap.add_argument("--cache-seconds", type=float, default=None, help="KATO_LOOKUP_CACHE_SECONDS")
    ap.add_argument("--no-writer", action="store_true", help="no tuning job during the run")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="kato-load-")
    db_url = args.db or f"sqlite:///{tmp.name}/kato.db"
    if args.writer:
        run_writer(db_url, args.trial_delay)
        return

    keys = seed(db_url, args.seed_configs)
    paths = lookup_paths(keys)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "KATO_DB_URL": db_url}
    if args.cache_seconds is not None:
        env["KATO_LOOKUP_CACHE_SECONDS"] = str(args.cache_seconds)
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--no-workers", "--port", str(port),
         "--api-workers", str(args.api_workers), "--db", db_url],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    writer = None
    try:
        wait_up(port, server)
        trials_before = trials_written(db_url)
        if not args.no_writer:
            writer = subprocess.Popen(
                [sys.executable, __file__, "--writer", "--db", db_url,
                 "--trial-delay", str(args.trial_delay)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(2.0)  # the writer is writing when the clients start
        t0 = time.monotonic()
        results = {}
        for name, endpoint_paths in (("ping", ["/v1/ping"]), ("lookups", paths)):
            if args.warmup > 0:  # connections made, caches filled: steady state is measured
                load(port, endpoint_paths, args.clients, args.client_procs, args.warmup)
            results[name] = load(
                port, endpoint_paths, args.clients, args.client_procs, args.seconds
            )
        ping, lookups = results["ping"], results["lookups"]
        elapsed = time.monotonic() - t0
        trials = trials_written(db_url) - trials_before
    finally:
        for proc in (writer, server):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()

    ratio = lookups["requests_per_s"] / ping["requests_per_s"] if ping["requests_per_s"] else 0
    result = {
        "endpoints": {"ping (ceiling)": ping, "config lookup": lookups},
        "lookup_over_ceiling": round(ratio, 3),
        "targets": {
            "lookup_over_ceiling_at_least": 0.5,
            "p99_ms_below": 25,
            "errors": 0,
            "met": ratio >= 0.5 and lookups["p99_ms"] < 25 and lookups["errors"] == 0,
        },
        "trials_written_during_load": trials,
        "load_seconds": round(elapsed, 1),
        "setup": {
            "clients": args.clients,
            "client_procs": args.client_procs,
            "api_workers": args.api_workers,
            "seconds_per_endpoint": args.seconds,
            "warmup_seconds_per_endpoint": args.warmup,
            "seeded_configs": len(keys),
            "distinct_lookup_paths": len(paths),
            "trial_delay_s": args.trial_delay,
            "writer": not args.no_writer,
            "lookup_cache_seconds": args.cache_seconds,
            "db": "sqlite (temp file)" if not args.db else db_url.split("://")[0],
            "cpus": os.cpu_count(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 1),
            "python": platform.python_version(),
        },
        "command": "python3 " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
    }
    print(f"{'endpoint':<16} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>7}")
    for name, r in result["endpoints"].items():
        print(
            f"{name:<16} {r['requests_per_s']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['max_ms']:>8.2f} {r['errors']:>7}"
        )
    print(
        f"lookup / ceiling = {ratio:.2f}; trials written meanwhile: {trials}; "
        f"targets met: {result['targets']['met']}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
