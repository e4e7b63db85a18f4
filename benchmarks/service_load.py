"""Load on the API: 64 and 256 concurrent clients on loopback while a tuning job writes trials.

What it does, in one run:

1. a database (a temp SQLite file, or ``--db URL``) seeded with ``--seed-configs`` best configs
   of softmax on the H200 (several shapes, two dtypes), ``--seed-jobs`` queued jobs for an L4
   (no worker here runs L4 jobs, so they stay queued) and an API token without a queue limit;
2. ``kato serve --no-workers --api-workers N`` in a subprocess on a free loopback port
   (``--api-threads``: ``KATO_API_THREADS``, each process's thread limit and pool size);
3. a tuning writer in another subprocess: replay-backed jobs (``tuner.job_runner.JobRunner`` on the
   recorded softmax space in ``tests/data/recorded``, ``--trial-delay`` seconds per trial, as a
   GPU would take) run back to back for the whole run, storing trials, Optuna studies and
   winners in the same database;
4. for each count of ``--clients`` (64 and 256) and each phase in turn, that many closed-loop
   clients (keep-alive HTTP/1.1 connections, spread over ``--client-procs`` processes) send
   requests back to back for ``--seconds``, after ``--warmup`` unmeasured seconds
   (connections open, lookup caches filled). Phases:

   - ``ping (ceiling)``: ``GET /v1/ping``, answered on the event loop, touching nothing;
   - ``config lookup``: ``GET /v1/configs/softmax`` over the seeded shapes and unseeded ones
     (``exact`` or ``nearest``), mostly answered from the API's lookup cache;
   - ``config lookup (database)``: the same with ``Cache-Control: no-cache``: read from the
     database every time;
   - ``job status``: ``GET /v1/jobs/{id}`` over the seeded jobs (the job, then the live
     workers for its note: two queries);
   - ``job submit``: ``POST /v1/jobs`` with the token (token check, quota check and insert in
     one transaction, then the live workers);

5. prints requests/s, p50/p99/max latency and the count of each status code per phase and
   client count; ``--out`` writes the same as JSON.

Targets (issue 29): no 5xx on any phase at 256 clients; p99 under 100 ms for the reads that hit
the database (job status, database lookups). With N closed-loop clients the mean latency is
N / throughput (Little's law), so p99 under 100 ms at 256 clients needs more than 2560
requests/s of that route; the JSON reports that floor per phase next to the measured p99.
Run from the repository root::

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
import shlex
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
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator

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


#: Jobs the benchmark queues (seeded and submitted) are for a GPU no worker here runs.
JOB_BODY = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "L4"}


def seed_jobs(db_url: str, count: int) -> tuple[list[str], str]:
    """Queue ``count`` L4 jobs; make an API token with no practical queue limit. Returns the
    jobs' ids and the token's secret."""
    from kato.db import queries, tokens
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator

    version = get_operator("softmax").version
    sessions = session_factory(init_db(db_url))
    with sessions() as session:
        _, secret = tokens.create_token(session, "service_load", max_queued_jobs=2**31 - 1)
        jobs = queries.create_jobs(
            session,
            [
                {
                    "operator": "softmax",
                    "operator_version": version,
                    "shape": [4096, 4096],
                    "dtype": "float16",
                    "gpu_model": "L4",
                    "budget_configs": 100,
                    "seed": k,
                }
                for k in range(count)
            ],
        )
        return [job.id for job in jobs], secret


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
    from kato.db import queries
    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.tuner.backends.replay import ReplayBackend
    from kato.tuner.job_runner import JobRunner, default_worker_id

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
    from kato.db.models import Trial
    from kato.db.session import make_engine, session_factory
    from sqlalchemy import func, select

    with session_factory(make_engine(db_url))() as session:
        return int(session.scalar(select(func.count()).select_from(Trial)) or 0)


# --- the load --------------------------------------------------------------------------------

#: Longest a client waits for one answer before counting it as a ``TimeoutError`` (a stalled
#: server must show up as failed requests, not hang the run).
ANSWER_TIMEOUT_S = 60.0


def get(path: str, headers: dict[str, str] | None = None) -> bytes:
    """A keep-alive HTTP/1.1 GET, as bytes."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


def post_json(path: str, body: Any, headers: dict[str, str]) -> bytes:
    """A keep-alive HTTP/1.1 POST of ``body`` as JSON, as bytes."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    """Send one request and read its whole answer; its status code."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


async def _client(
    port: int, requests: list[bytes], start: int, deadline: float, out: dict[str, Any]
) -> None:
    """One closed-loop keep-alive client: a request, its whole answer, the next request."""
    reader = writer = None
    i = start
    while time.perf_counter() < deadline:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert reader is not None
            request = requests[i % len(requests)]
            i += 1
            t0 = time.perf_counter()
            status = await asyncio.wait_for(_exchange(reader, writer, request), ANSWER_TIMEOUT_S)
            out["latencies"].append(time.perf_counter() - t0)
            _count(out["statuses"], str(status))
        except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
            _count(out["exceptions"], type(exc).__name__)
            if writer is not None:
                writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


def _load_proc(
    port: int,
    requests: list[bytes],
    clients: int,
    offset: int,
    t_start: float,
    seconds: float,
    q: Any,
) -> None:
    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"latencies": [], "statuses": {}, "exceptions": {}}
        while time.time() < t_start:  # every process starts at the same moment
            await asyncio.sleep(0.001)
        deadline = time.perf_counter() + seconds
        step = max(1, len(requests) // max(clients, 1))
        await asyncio.gather(
            *(_client(port, requests, offset + k * step, deadline, out) for k in range(clients))
        )
        return out

    q.put(asyncio.run(main()))


def load(
    port: int, requests: list[bytes], clients: int, procs: int, seconds: float
) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``procs`` processes for ``seconds``: the numbers.

    ``little_floor_ms``: the mean latency that ``clients`` closed-loop clients must see at the
    measured throughput (Little's law: clients / requests per second); no p99 is below it.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t_start = time.time() + 1.0
    procs = max(1, min(procs, clients))
    per = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    ps = [
        ctx.Process(target=_load_proc, args=(port, requests, n, k * 997, t_start, seconds, q))
        for k, n in enumerate(per)
    ]
    for p in ps:
        p.start()
    results = [q.get(timeout=seconds + ANSWER_TIMEOUT_S + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = sorted(x for r in results for x in r["latencies"])
    statuses: dict[str, int] = {}
    exceptions: dict[str, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        for k, v in r["exceptions"].items():
            exceptions[k] = exceptions.get(k, 0) + v

    def pct(p: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None

    rate = len(lat) / seconds
    return {
        "clients": clients,
        "requests": len(lat),
        "requests_per_s": round(rate, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(lat[-1] * 1000, 2) if lat else None,
        "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else None,
        "little_floor_ms": round(clients / rate * 1000, 1) if rate else None,
        "statuses": dict(sorted(statuses.items())),
        "5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "exceptions": exceptions,
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


#: The phases: name -> (reads the database, the routes' requests).
Phases = dict[str, tuple[bool, list[bytes]]]


def phases(paths: list[str], job_ids: list[str], secret: str) -> Phases:
    auth = {"Authorization": f"Bearer {secret}"}
    fresh = {"Cache-Control": "no-cache"}
    return {
        "ping (ceiling)": (False, [get("/v1/ping")]),
        "config lookup": (False, [get(p) for p in paths]),
        "config lookup (database)": (True, [get(p, fresh) for p in paths]),
        "job status": (True, [get(f"/v1/jobs/{j}") for j in job_ids]),
        "job submit": (False, [post_json("/v1/jobs", JOB_BODY, auth)]),
    }


def targets(results: dict[str, dict[str, dict[str, Any]]], reads: set[str]) -> dict[str, Any]:
    """Issue 29's targets, each with whether it was met, at the largest client count."""
    top = str(max(int(c) for r in results.values() for c in r))
    five_xx = {name: r[top]["5xx"] for name, r in results.items()}
    failed = {name: r[top]["exceptions"] for name, r in results.items() if r[top]["exceptions"]}
    p99 = {name: results[name][top]["p99_ms"] for name in sorted(reads)}
    floor = {name: results[name][top]["little_floor_ms"] for name in sorted(reads)}
    return {
        "clients": int(top),
        "no_5xx_on_any_phase": {"5xx": five_xx, "met": not any(five_xx.values())},
        "no_failed_requests": {"exceptions": failed, "met": not failed},
        "database_reads_p99_below_100_ms": {
            "p99_ms": p99,
            "little_floor_ms": floor,
            "met": all(v is not None and v < 100 for v in p99.values()),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", help="SQLAlchemy URL (default: a temp SQLite file)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase and client count")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    ap.add_argument("--clients", default="64,256", help="comma-separated concurrent client counts")
    ap.add_argument("--phases", help="comma-separated phase names (default: all)")
    ap.add_argument("--client-procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--api-workers", type=int, default=2, help="kato serve --api-workers")
    ap.add_argument("--api-threads", type=int, default=None, help="KATO_API_THREADS")
    ap.add_argument("--seed-configs", type=int, default=80)
    ap.add_argument("--seed-jobs", type=int, default=200)
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
    client_counts = [int(c) for c in args.clients.split(",") if c.strip()]

    keys = seed(db_url, args.seed_configs)
    paths = lookup_paths(keys)
    job_ids, secret = seed_jobs(db_url, args.seed_jobs)
    all_phases = phases(paths, job_ids, secret)
    if args.phases:
        wanted = [name.strip() for name in args.phases.split(",")]
        unknown = [name for name in wanted if name not in all_phases]
        if unknown:
            raise SystemExit(f"unknown phase(s) {unknown}; phases: {list(all_phases)}")
        all_phases = {name: all_phases[name] for name in wanted}
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "KATO_DB_URL": db_url}
    if args.cache_seconds is not None:
        env["KATO_LOOKUP_CACHE_SECONDS"] = str(args.cache_seconds)
    if args.api_threads is not None:
        env["KATO_API_THREADS"] = str(args.api_threads)
    server = subprocess.Popen(
        [sys.executable, "-m", "kato.service.cli", "serve", "--no-workers", "--port", str(port),
         "--api-workers", str(args.api_workers), "--db", db_url],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    writer = None
    results: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in all_phases}
    load_avg_start = os.getloadavg()[0]
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
        for clients in client_counts:
            for name, (_, requests) in all_phases.items():
                if args.warmup > 0:  # connections made, caches filled: steady state is measured
                    load(port, requests, clients, args.client_procs, args.warmup)
                r = load(port, requests, clients, args.client_procs, args.seconds)
                results[name][str(clients)] = r
                print(
                    f"{name:<26} {clients:>4} clients {r['requests_per_s']:>8.0f} req/s "
                    f"p50 {r['p50_ms']:>8} ms p99 {r['p99_ms']:>8} ms  {r['statuses']} "
                    f"{r['exceptions'] or ''}",
                    flush=True,
                )
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

    reads = {name for name, (reads_db, _) in all_phases.items() if reads_db}
    result: dict[str, Any] = {
        "phases": results,
        "targets": targets(results, reads),
        "trials_written_during_load": trials,
        "load_seconds": round(elapsed, 1),
        "setup": {
            "clients": client_counts,
            "client_procs": args.client_procs,
            "api_workers": args.api_workers,
            "api_threads": args.api_threads if args.api_threads is not None else "default (40)",
            "seconds_per_phase": args.seconds,
            "warmup_seconds_per_phase": args.warmup,
            "seeded_configs": len(keys),
            "distinct_lookup_paths": len(paths),
            "seeded_jobs": len(job_ids),
            "trial_delay_s": args.trial_delay,
            "writer": not args.no_writer,
            "lookup_cache_seconds": args.cache_seconds,
            "db": "sqlite (temp file)" if not args.db else db_url.split("://")[0],
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": round(load_avg_start, 1),
            "load_average_1m_at_end": round(os.getloadavg()[0], 1),
            "python": platform.python_version(),
        },
        "command": "python3 " + shlex.join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
    }
    print(json.dumps(result["targets"], indent=2))
    print(f"trials written meanwhile: {trials}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
