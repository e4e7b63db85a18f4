"""How fast ``KatoClient.config`` answers: cached in process, from the disk cache, over HTTP.

Starts ``kato serve`` (no workers) in a subprocess on a free loopback port over a temporary
SQLite database seeded with a few softmax best configs, then measures:

- ``memory_hit``: ``client.config(...)`` on a cached key, each call timed alone with
  ``time.perf_counter_ns`` (the timer's own cost, measured and reported as
  ``timer_overhead_ns``, is included: the figures are an upper bound); also the mean over a tight
  loop of calls timed together;
- ``disk_hit``: the first lookup of a key in a new client whose disk cache already holds it;
- ``http_cold``: the first lookup of a key never asked before (client and server miss: an HTTP
  round trip and a database query), one new shape per call;
- ``http_server_cached``: a client miss the service answers from its own short-lived cache;
- ``prefetch_100``: one ``prefetch`` of 100 new keys (one HTTP request).

Usage: ``python3 benchmarks/client_lookup.py [--calls 200000] [--out FILE.json]``

The load average is recorded beside the figures: on a busy machine the HTTP figures and the
tail of the in-process ones grow with the load (other processes take the CPU mid-call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kato.db import queries  # noqa: E402
from kato.db.session import init_db, session_factory  # noqa: E402
from kato.kernels import get_operator  # noqa: E402

from kato_client import KatoClient  # noqa: E402

SEEDED = [
    ((4096, 4096), "float16", {"BLOCK_SIZE": 128, "VEC": 8, "STRATEGY": 1, "CACHE": 2,
                               "MIN_BLOCKS": 4, "LANES": 32}, 0.020),
    ((65536, 1024), "float16", {"BLOCK_SIZE": 32, "VEC": 8, "STRATEGY": 0, "CACHE": 2,
                                "MIN_BLOCKS": 0, "LANES": 32}, 0.070),
    ((1024, 1024), "float32", {"BLOCK_SIZE": 256, "VEC": 4, "STRATEGY": 0, "CACHE": 0,
                               "MIN_BLOCKS": 0, "LANES": 32}, 0.010),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed(db_url: str) -> None:
    version = get_operator("softmax").version
    with session_factory(init_db(db_url))() as session:
        for shape, dtype, config, time_ms in SEEDED:
            queries.upsert_best_config(
                session, operator="softmax", operator_version=version, shape=list(shape),
                dtype=dtype, gpu_model="H200", compute_capability="9.0", cuda_version="13.0",
                config=config, time_ms=time_ms, job_id=None,
            )  # fmt: skip


def start_service(db_url: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kato.service.cli", "serve", "--no-workers", "--port", str(port),
         "--db", db_url],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kato serve did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)


def summary(ns: list[int]) -> dict[str, float]:
    ordered = sorted(ns)
    n = len(ordered)
    return {
        "calls": n,
        "median_us": ordered[n // 2] / 1e3,
        "p99_us": ordered[min(n - 1, int(n * 0.99))] / 1e3,
        "mean_us": statistics.fmean(ordered) / 1e3,
        "min_us": ordered[0] / 1e3,
    }


def bench_memory(client: KatoClient, calls: int) -> dict[str, Any]:
    config, clock = client.config, time.perf_counter_ns
    shape = (4096, 4096)
    config("softmax", shape, "float16")
    overhead = []
    for _ in range(min(calls, 100_000)):
        t0 = clock()
        overhead.append(clock() - t0)
    samples = []
    for _ in range(calls):
        t0 = clock()
        config("softmax", shape, "float16")
        samples.append(clock() - t0)
    t0 = clock()
    for _ in range(calls):
        config("softmax", shape, "float16")
    loop_ns = (clock() - t0) / calls
    out = summary(samples)
    out["timer_overhead_ns"] = sorted(overhead)[len(overhead) // 2]
    out["tight_loop_mean_us"] = loop_ns / 1e3
    return out


def bench_disk(url: str, cache_dir: Path, keys: list[tuple]) -> dict[str, Any]:
    with KatoClient(url, gpu="H200", cache_dir=cache_dir) as warm:
        warm.prefetch(keys)
    samples = []
    with KatoClient(url, gpu="H200", cache_dir=cache_dir) as client:
        for key in keys:
            t0 = time.perf_counter_ns()
            client.config(*key)
            samples.append(time.perf_counter_ns() - t0)
        assert client.http_requests == 0, "disk hits must not ask the service"
    return summary(samples)


def bench_http(url: str, keys: list[tuple]) -> dict[str, Any]:
    samples = []
    with KatoClient(url, gpu="H200", disk_cache=False) as client:
        client.config("softmax", (8, 8), "float32")  # connection set up, not measured
        for key in keys:
            t0 = time.perf_counter_ns()
            client.config(*key)
            samples.append(time.perf_counter_ns() - t0)
        assert client.http_requests == len(keys) + 1
    return summary(samples)


def bench_prefetch(url: str, keys: list[tuple], repeats: int = 5) -> dict[str, Any]:
    samples = []
    for r in range(repeats):
        batch = [(op, (shape[0] + 100_000 * (r + 1), shape[1]), dt) for op, shape, dt in keys]
        with KatoClient(url, gpu="H200", disk_cache=False) as client:
            client.config("softmax", (8, 8), "float32")
            t0 = time.perf_counter_ns()
            client.prefetch(batch)
            samples.append(time.perf_counter_ns() - t0)
            assert client.http_requests == 2
    out = summary(samples)
    out["keys_per_request"] = len(keys)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="timed in-process hits")
    parser.add_argument("--http-calls", type=int, default=300, help="timed cold HTTP lookups")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{tmp}/kato.db"
        seed(db_url)
        port = free_port()
        proc = start_service(db_url, port)
        url = f"http://127.0.0.1:{port}"
        try:
            with KatoClient(url, gpu="H200", cache_dir=Path(tmp) / "c0") as client:
                memory = bench_memory(client, args.calls)
            disk_keys = [("softmax", (rows, 4096), "float16") for rows in range(1, 301)]
            disk = bench_disk(url, Path(tmp) / "c1", disk_keys)
            cold_keys = [("softmax", (rows, 2048), "float16") for rows in range(1, args.http_calls)]
            cold = bench_http(url, cold_keys)
            cached = bench_http(url, cold_keys[:200])  # the service's cache holds them for 1 s
            prefetch = bench_prefetch(
                url, [("softmax", (rows, 1024), "float32") for rows in range(1, 101)]
            )
        finally:
            proc.terminate()
            proc.wait(30)

    results = {
        "memory_hit": memory,
        "disk_hit": disk,
        "http_cold": cold,
        "http_server_cached": cached,
        "prefetch_100": prefetch,
        "target": "memory_hit median < 2 us",
        "meets_target": memory["median_us"] < 2.0,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "command": "python3 benchmarks/client_lookup.py --out data/benchmarks/client_lookup.json",
    }
    print(f"{'lookup':<22}{'calls':>9}{'median us':>12}{'p99 us':>12}{'mean us':>12}")
    for name in ("memory_hit", "disk_hit", "http_cold", "http_server_cached", "prefetch_100"):
        r = results[name]
        print(
            f"{name:<22}{r['calls']:>9}{r['median_us']:>12.3f}{r['p99_us']:>12.3f}"
            f"{r['mean_us']:>12.3f}"
        )
    print(
        f"memory_hit: timer overhead {memory['timer_overhead_ns']} ns (included above), "
        f"tight-loop mean {memory['tight_loop_mean_us'] * 1e3:.0f} ns/call; "
        f"target < 2 us median: {'met' if results['meets_target'] else 'NOT met'}; "
        f"load average {load_before[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
