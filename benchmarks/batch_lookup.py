"""How long ``POST /v1/configs/batch`` takes for 1000 lookups, through FastAPI's TestClient.

Each scenario seeds a fresh SQLite database with softmax float16 H200 best configs (each row's
config is the operator's default config *for the stored shape*, so many of them are not valid
for other shapes and a nearest lookup has to check several candidates), then times the same
batch ``--repeats`` times (the lookup cache is off; the batch route does not use it anyway):

- ``nearest_300``: 300 stored shapes, 1000 random shapes ``[randint(1, 2**16),
  randint(1, 2**15)]`` (almost all miss the stored shapes: nearest or default);
- ``exact_300``: 300 stored shapes, 1000 lookups of stored shapes (each asked 3 or 4 times);
- ``exact_1000``: 1000 stored shapes, each asked once;
- ``get_nearest``: ``GET /v1/configs/softmax`` one at a time (``Cache-Control: no-cache``) for
  the first ``--gets`` shapes of ``nearest_300``, per request.

``answers_sha256`` hashes each scenario's response body, so runs on two versions of the code can
be compared for identical answers as well as for time.

Usage: ``python3 benchmarks/batch_lookup.py [--repeats 5] [--gets 100] [--only SCENARIO ...]
[--out FILE.json]``

The load average is recorded beside the figures: on a shared machine the times grow with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kato.db import queries, tokens  # noqa: E402
from kato.kernels import get_operator  # noqa: E402
from kato.service.app import create_app  # noqa: E402
from kato.service.settings import Settings  # noqa: E402

SPEC = get_operator("softmax")
SCENARIOS = ("nearest_300", "exact_300", "exact_1000", "get_nearest")


def shapes_300() -> list[list[int]]:
    """The 300 stored shapes of the reported profile: 20 row counts x 15 column counts."""
    return [
        [2 ** (r % 12 + 4) * (1 + r // 12), 2 ** (c % 11 + 5)] for r in range(20) for c in range(15)
    ]


def shapes_1000() -> list[list[int]]:
    """1000 distinct stored shapes: 40 row counts x 25 column counts."""
    return [[64 * (r + 1), 32 * (c + 1)] for r in range(40) for c in range(25)]


def seed(app: Any, shapes: list[list[int]], rng: random.Random) -> str:
    """Store one best config per shape (its default config, a random time); return a token."""
    with app.state.session_factory() as session:
        for shape in shapes:
            queries.upsert_best_config(
                session,
                operator="softmax",
                operator_version=SPEC.version,
                shape=shape,
                dtype="float16",
                gpu_model="H200",
                compute_capability="9.0",
                cuda_version="13.0",
                config=SPEC.default_config(shape, "float16"),
                time_ms=1.0 + rng.random(),
                job_id=None,
            )
        return tokens.create_token(session, "bench")[1]


def item(shape: list[int]) -> dict[str, Any]:
    return {"operator": "softmax", "shape": shape, "dtype": "float16", "gpu": "H200"}


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(samples_s) * 1e3,
        "min_ms": min(samples_s) * 1e3,
        "max_ms": max(samples_s) * 1e3,
    }


def bench_batch(
    stored: list[list[int]], lookups: list[list[int]], repeats: int, tmp: Path
) -> dict[str, Any]:
    """Seed ``stored``, then time one batch of ``lookups`` ``repeats`` times (after a warm-up)."""
    app = create_app(Settings(db_url=f"sqlite:///{tmp}/kato.db", lookup_cache_seconds=0))
    try:
        secret = seed(app, stored, random.Random(0))
        body = {"lookups": [item(shape) for shape in lookups]}
        headers = {"Authorization": f"Bearer {secret}"}
        with TestClient(app, headers=headers) as client:
            warm = client.post("/v1/configs/batch", json=body)  # imports, first connection
            assert warm.status_code == 200, warm.text
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                response = client.post("/v1/configs/batch", json=body)
                samples.append(time.perf_counter() - t0)
                assert response.content == warm.content
        results = warm.json()["results"]
        sources: dict[str, int] = {}
        for result in results:
            key = result["result"]["source"] if result["status"] == 200 else str(result["status"])
            sources[key] = sources.get(key, 0) + 1
        return {
            "stored": len(stored),
            "lookups": len(lookups),
            "repeats": repeats,
            **summary_ms(samples),
            "sources": dict(sorted(sources.items())),
            "answers_sha256": hashlib.sha256(warm.content).hexdigest(),
        }
    finally:
        app.state.engine.dispose()


def bench_get(stored: list[list[int]], lookups: list[list[int]], tmp: Path) -> dict[str, Any]:
    """Time ``GET /v1/configs/softmax`` per request, answered from the database each time."""
    app = create_app(Settings(db_url=f"sqlite:///{tmp}/kato.db", lookup_cache_seconds=0))
    try:
        secret = seed(app, stored, random.Random(0))
        headers = {"Authorization": f"Bearer {secret}", "Cache-Control": "no-cache"}
        samples = []
        digest = hashlib.sha256()
        with TestClient(app, headers=headers) as client:
            client.get("/v1/configs/softmax", params={**item(lookups[0]), "shape": "1x1"})
            for shape in lookups:
                params = {**item(shape), "shape": f"{shape[0]}x{shape[1]}"}
                t0 = time.perf_counter()
                response = client.get("/v1/configs/softmax", params=params)
                samples.append(time.perf_counter() - t0)
                assert response.status_code == 200, response.text
                digest.update(response.content)
        return {
            "stored": len(stored),
            "lookups": len(lookups),
            **summary_ms(samples),
            "answers_sha256": digest.hexdigest(),
        }
    finally:
        app.state.engine.dispose()


def git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "db", "service"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    if not head:
        return "unknown"  # not a git checkout (a copy of the code elsewhere)
    return head + ("+dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per scenario")
    parser.add_argument("--gets", type=int, default=100, help="timed single GETs")
    parser.add_argument(
        "--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="scenarios to run"
    )
    parser.add_argument("--label", default="", help="recorded in the JSON, e.g. the code's name")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    rng = random.Random(0)
    random_shapes = [[rng.randint(1, 1 << 16), rng.randint(1, 1 << 15)] for _ in range(1000)]
    stored_300 = shapes_300()
    exact_300 = [stored_300[i % len(stored_300)] for i in range(1000)]
    rng.shuffle(exact_300)
    stored_1000 = shapes_1000()
    exact_1000 = list(stored_1000)
    rng.shuffle(exact_1000)

    load_before = os.getloadavg()
    scenarios: dict[str, dict[str, Any]] = {}
    for name, run in (
        ("nearest_300", lambda tmp: bench_batch(stored_300, random_shapes, args.repeats, tmp)),
        ("exact_300", lambda tmp: bench_batch(stored_300, exact_300, args.repeats, tmp)),
        ("exact_1000", lambda tmp: bench_batch(stored_1000, exact_1000, args.repeats, tmp)),
        ("get_nearest", lambda tmp: bench_get(stored_300, random_shapes[: args.gets], tmp)),
    ):
        if name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            scenarios[name] = run(Path(tmp))

    results = {
        "scenarios": scenarios,
        "revision": git_revision(),
        "label": args.label,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "command": "python3 benchmarks/batch_lookup.py --out data/benchmarks/batch_lookup.json",
    }
    print(f"{'scenario':<13}{'stored':>7}{'lookups':>8}{'median ms':>11}{'min ms':>9}  sources")
    for name, r in scenarios.items():
        per = " (per request)" if name.startswith("get") else ""
        print(
            f"{name:<13}{r['stored']:>7}{r['lookups']:>8}{r['median_ms']:>11.2f}"
            f"{r['min_ms']:>9.2f}  {r.get('sources', '')}{per}  sha256 {r['answers_sha256'][:12]}"
        )
    print(f"revision {results['revision']}; load average {load_before[0]:.1f} on {os.cpu_count()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
