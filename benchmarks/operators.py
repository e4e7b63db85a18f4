"""Tuned Kato kernels vs PyTorch, side by side on one GPU, with the copy bandwidth as ceiling.

For each (operator, shape, dtype) case: the stored winner from the database (what the service
would serve for this GPU; ``--tune N`` tunes missing cases first with budget N), timed by the
pycuda backend (CUDA events, warm-up, median of repeats, inputs rotated past the L2), and the
PyTorch equivalent timed the same way in the same process. The device-to-device copy bandwidth
(read + write bytes) is measured in the same run.

    python benchmarks/operators.py --db sqlite:///kato.db --out results.json [--tune 100]

Prints a table and writes JSON. Needs a CUDA GPU, PyCUDA and PyTorch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOFTMAX_SHAPES = [(4096, 4096), (32768, 4096), (65536, 1024), (8192, 32768)]
DEFAULT_CASES = [("softmax", s, d) for d in ("float32", "float16") for s in SOFTMAX_SHAPES]


def torch_time_ms(fn, repeats: int = 30, batch: int = 10) -> float:
    """Median per-call milliseconds of ``fn`` (CUDA events around batches, after warm-up)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read + written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = torch_time_ms(lambda: dst.copy_(src), repeats=20, batch=5)
    return 2 * nbytes / ms / 1e6


def torch_equivalent(operator: str, shape, dtype: str):
    import torch

    tdtype = getattr(torch, dtype)
    if operator == "softmax":
        # Several input copies, rotated like Kato's, so neither side times the L2 cache.
        n = max(1, min(8, (2 * 60 * 2**20) // (2 * shape[0] * shape[1] * tdtype.itemsize) + 1))
        xs = [torch.randn(*shape, device="cuda", dtype=tdtype) for _ in range(n)]
        state = {"i": 0}

        def run():
            state["i"] = (state["i"] + 1) % n
            return torch.softmax(xs[state["i"]], dim=-1)

        return run
    raise ValueError(f"no PyTorch equivalent for {operator}")


def lookup(sessions, spec, shape, dtype, gpu_model):
    """The stored winner for a case and where it came from (exact, nearest or default)."""
    from db import queries

    with sessions() as s:
        return queries.lookup_best_config(
            s,
            operator=spec.name,
            operator_version=spec.version,
            shape=shape,
            dtype=dtype,
            gpu_model=gpu_model,
        )


def tune_case(sessions, db_url, operator, shape, dtype, budget):
    from db import queries
    from kernels import get_operator
    from tuner.backends.pycuda import describe_device
    from tuner.worker import JobRunner, default_worker_id, pycuda_backend_factory

    spec = get_operator(operator)
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
        job_id = job.id
    return JobRunner(
        sessions, db_url, pycuda_backend_factory(0), worker_id=wid, lease_seconds=600
    ).run(job_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="SQLAlchemy URL of the results database")
    ap.add_argument("--out", default="operators.json")
    ap.add_argument("--tune", type=int, default=0, help="tune missing cases with this budget")
    ap.add_argument("--operator", action="append", help="only these operators")
    args = ap.parse_args()

    from db.session import init_db, session_factory
    from kernels import get_operator
    from tuner.backends.pycuda import PyCudaBackend, describe_device

    sessions = session_factory(init_db(args.db))
    device = describe_device(0)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for operator, shape, dtype in DEFAULT_CASES:
        if args.operator and operator not in args.operator:
            continue
        spec = get_operator(operator)

        best, source = lookup(sessions, spec, shape, dtype, device.model)
        if source != "exact" and args.tune:
            tune_case(sessions, args.db, operator, shape, dtype, args.tune)
            best, source = lookup(sessions, spec, shape, dtype, device.model)
        config = best.config if best is not None else spec.default_config(shape, dtype)
        backend = PyCudaBackend(spec, shape, dtype, repeats=30)
        result = backend.evaluate(config)
        backend.close()
        torch_ms = torch_time_ms(torch_equivalent(operator, shape, dtype))
        nbytes = spec.bytes_moved(shape, dtype)
        kato_ms = result.time_ms
        row = {
            "operator": operator,
            "shape": list(shape),
            "dtype": dtype,
            "source": source,
            "config": config,
            "status": result.status.value,
            "error": result.error,
            "kato_ms": kato_ms,
            "torch_ms": torch_ms,
            "speedup": torch_ms / kato_ms if kato_ms else None,
            "kato_gbs": nbytes / kato_ms / 1e6 if kato_ms else None,
            "torch_gbs": nbytes / torch_ms / 1e6,
        }
        row["kato_pct_copy"] = 100 * row["kato_gbs"] / copy_gbs if kato_ms else None
        row["torch_pct_copy"] = 100 * row["torch_gbs"] / copy_gbs
        rows.append(row)
    report = {
        "device": device.name,
        "cuda": device.cuda_version,
        "copy_gbs": copy_gbs,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"{device.name}  device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    hdr = (
        f"{'operator':9} {'shape':>12} {'dtype':8} {'src':7} {'Kato ms':>9} {'torch ms':>9} "
        f"{'speedup':>7} {'Kato GB/s':>9} {'%copy':>6} {'torch GB/s':>10} {'%copy':>6}"
    )
    print(hdr)
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if r["kato_ms"] is None:
            print(f"{r['operator']:9} {shape:>12} {r['dtype']:8} FAILED {r['error']}")
            continue
        print(
            f"{r['operator']:9} {shape:>12} {r['dtype']:8} {r['source']:7} {r['kato_ms']:9.4f} "
            f"{r['torch_ms']:9.4f} {r['speedup']:7.2f} {r['kato_gbs']:9.0f} "
            f"{r['kato_pct_copy']:6.1f} {r['torch_gbs']:10.0f} {r['torch_pct_copy']:6.1f}"
        )


if __name__ == "__main__":
    main()
