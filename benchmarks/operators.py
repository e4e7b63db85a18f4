"""Tuned Kato kernels vs PyTorch, side by side on one GPU, with the copy bandwidth as ceiling.

For each (operator, shape, dtype) case: the stored winner from the database (what the service
would serve for this GPU; ``--tune N`` tunes missing cases first with budget N), timed by the
pycuda backend (CUDA events, warm-up, median of repeats, inputs rotated past the L2), and the
PyTorch equivalent timed the same way in the same process. The device-to-device copy bandwidth
(read + write bytes) is measured in the same run.

    python benchmarks/operators.py --db sqlite:///kato.db --out results.json [--tune 100]
    python benchmarks/operators.py --db sqlite:///awkward.db --awkward --tune 20 \
        --max-minutes 4 --out awkward.json

``--awkward`` runs :data:`AWKWARD_CASES` instead of the torch_ops modules' cases: shapes no tuned
benchmark names (issue 31), each a launch of 0.05 to 5 ms on the H200. Every row reports Kato's
and PyTorch's ms, the speedup, the share of the measured copy bandwidth (memory-bound operators)
and, for matmul, the share of cuBLAS (PyTorch's matmul) as ``pct_cublas``.

``--where PARAM=V1,V2`` (repeatable) sweeps instead: every valid config of each case whose
parameters take the listed values, one row each, beside the same PyTorch time and copy bandwidth;
no database and no tuning. The summary then gives each case's best row per value of every
parameter listed with several values (issue 31's cache hints, side by side)::

    python benchmarks/operators.py --case transpose:8191x8193:float32 \
        --case transpose:8192x8192:float32 --where TILE=64 --where VEC=1,2,4 \
        --where HINTS=0,1,2 --out transpose_hints.json

Prints a table and writes JSON. Needs a CUDA GPU, PyCUDA and PyTorch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Issue 31's awkward shapes, one launch of 0.05 to 5 ms each on the H200 (tests/tuner/
#: test_operators_benchmark.py holds that at the catalog's bandwidth and FLOP rate): (operator,
#: shape, dtype, what makes it awkward). Matmul's FLOP-bound cases are float32, where Kato's
#: loads must handle N and K that are no multiple of 4.
AWKWARD_CASES: list[tuple[str, tuple[int, ...], str, str]] = [
    ("softmax", (2048, 50257), "float16", "odd prime row (a vocabulary)"),
    ("softmax", (16384, 4099), "float32", "prime row just past 4096"),
    ("softmax", (4194304, 7), "float32", "many short rows"),
    ("softmax", (8, 4194301), "float32", "few long rows"),
    ("softmax", (64, 1048573), "bfloat16", "few long odd rows"),
    ("layernorm", (16384, 4097), "bfloat16", "row just past a power of two"),
    ("layernorm", (64, 1048573), "float32", "few long odd rows"),
    ("rmsnorm", (16384, 4099), "float16", "prime row"),
    ("cross_entropy", (4096, 50257), "bfloat16", "odd prime vocabulary"),
    ("reduce_sum", (4, 16777216), "float32", "few long rows"),
    ("reduce_sum", (1, 67108863), "float32", "one odd row of 2**26-1"),
    ("reduce_sum", (8388608, 7), "float32", "many short rows"),
    ("reduce_sum_all", (2**26 + 1,), "float32", "just past a power of two"),
    ("relu", (2**27 + 3,), "float16", "odd length"),
    ("transpose", (8191, 8193), "float32", "odd sides"),
    ("matmul", (1000, 1001, 999), "float32", "unaligned M, N, K"),
    ("matmul", (4095, 4097, 1003), "float32", "unaligned M, N, K"),
]

#: Operators whose PyTorch equivalent is cuBLAS (torch.matmul): their rows get ``pct_cublas``.
CUBLAS_OPERATORS = ("matmul", "matmul_nt", "matmul_tn")


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


def lookup(sessions, spec, shape, dtype, gpu_model):
    """The stored winner for a case and where it came from (exact, nearest or default), as
    the service selects it (:class:`service.lookup.Lookups` under its settings)."""
    from kato.service.lookup import Lookups
    from kato.service.settings import Settings

    settings = Settings()
    with sessions() as s:
        lookups = Lookups(
            s, max_distance=settings.nearest_max_distance, min_gain=settings.nearest_min_gain
        )
        return lookups.pick(spec, shape, dtype, gpu_model)


def tune_case(sessions, db_url, operator, shape, dtype, budget):
    from kato.db import queries
    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.job_runner import JobRunner, default_worker_id

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


def cases(
    selectors: list[str] | None, awkward: bool = False
) -> list[tuple[str, tuple[int, ...], str]]:
    """The benchmark cases of the torch_ops modules (or, with ``awkward``, :data:`AWKWARD_CASES`
    in their order), all (by operator name) or those matching ``selectors`` in the order given
    (tuning spends device time in that order). A selector is ``operator``, ``operator:shape``
    or ``operator:shape:dtype`` (shape as ``32768x4096``); the last names a case of its own
    where the set lacks it (any shape the operator takes)."""
    from benchmarks.torch_ops import modules

    available = modules()
    if awkward:
        every = [(name, tuple(shape), dtype) for name, shape, dtype, _ in AWKWARD_CASES]
    else:
        every = [
            (name, tuple(shape), dtype)
            for name in sorted(available)
            for shape, dtype in available[name].CASES
        ]
    if not selectors:
        return every
    found: list[tuple[str, tuple[int, ...], str]] = []
    for selector in selectors:
        name, _, rest = selector.partition(":")
        shape, _, dtype = rest.partition(":")
        if name not in available:
            raise SystemExit(f"no benchmark cases for operator {name!r}")
        listed = False
        for case in every:
            matches = case[0] == name and (not shape or "x".join(map(str, case[1])) == shape)
            if matches and (not dtype or case[2] == dtype):
                listed = True
                if case not in found:
                    found.append(case)
        if not listed and shape and dtype:
            from kato.kernels import InvalidInput, get_operator

            try:
                sizes = tuple(get_operator(name).validate(map(int, shape.split("x")), dtype))
            except (InvalidInput, ValueError) as exc:
                raise SystemExit(f"case {selector!r}: {exc}") from exc
            if (name, sizes, dtype) not in found:
                found.append((name, sizes, dtype))
    return found


def parse_where(items: list[str] | None) -> dict[str, set[int]]:
    """``["STAGES=3,4", "CLUSTER_M=1"]`` -> ``{"STAGES": {3, 4}, "CLUSTER_M": {1}}``."""
    where: dict[str, set[int]] = {}
    for item in items or []:
        name, _, values = item.partition("=")
        try:
            where[name] = {int(v) for v in values.split(",")}
        except ValueError:
            name = ""
        if not name:
            raise SystemExit(f"--where takes PARAM=V1,V2 (integers), got {item!r}")
    return where


def sweep_configs(spec, shape, dtype, where: dict[str, set[int]]) -> list[dict]:
    """The valid configs of ``spec`` for the case whose parameters take the values ``where``
    lists (the others any), in the product order of its parameters: the last varies fastest,
    so configs that differ in it alone are timed one after another. Drawn from the spec's
    candidates where it lists them (matmul's whole product is 24 million configs, which took
    about a minute per case to check)."""
    import itertools

    unknown = sorted(set(where) - set(spec.params))
    if unknown:
        raise SystemExit(f"{spec.name} has no parameter {', '.join(unknown)}")
    configs = spec.candidates(shape, dtype)
    if configs is None:
        values = [
            [v for v in vs if k not in where or v in where[k]] for k, vs in spec.params.items()
        ]
        configs = [dict(zip(spec.params, c, strict=True)) for c in itertools.product(*values)]
    selected = [c for c in configs if all(c[k] in where[k] for k in where)]
    valid = [c for c in selected if spec.check(c, shape, dtype) is None]
    if not valid:
        raise SystemExit(f"no valid {spec.name} config for {shape} {dtype} where {where}")
    return valid


def best_by(rows: list[dict], name: str) -> dict[int, dict]:
    """The fastest timed row (``kato_ms``) per value of parameter ``name`` in their configs."""
    best: dict[int, dict] = {}
    for row in rows:
        value = row["config"][name]
        if row["kato_ms"] and (value not in best or row["kato_ms"] < best[value]["kato_ms"]):
            best[value] = row
    return dict(sorted(best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="SQLAlchemy URL of the results database (required unless --where)")
    ap.add_argument("--out", default="operators.json", help="JSON report path")
    ap.add_argument("--tune", type=int, default=0, help="tune missing cases with this budget")
    ap.add_argument("--tune-only", action="store_true", help="tune missing cases, time nothing")
    ap.add_argument(
        "--max-minutes", type=float, default=None, help="stop starting new tuning jobs after this"
    )
    ap.add_argument(
        "--case",
        action="append",
        help="only these cases, in this order: operator[:shape[:dtype]] (repeatable)",
    )
    ap.add_argument(
        "--awkward", action="store_true", help="the awkward shapes (AWKWARD_CASES) instead"
    )
    ap.add_argument(
        "--where",
        action="append",
        metavar="PARAM=V1,V2",
        help="time every valid config of each case whose parameters take these values "
        "(repeatable) instead of the stored winner: no database, no tuning",
    )
    args = ap.parse_args()
    where = parse_where(args.where)
    if where:
        sweep(args, where)
        return
    if not args.db:
        ap.error("--db is required unless --where sweeps configs")

    import time

    from kato.db.session import init_db, session_factory
    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import PyCudaBackend, describe_device

    from benchmarks.torch_ops import modules

    started = time.monotonic()
    sessions = session_factory(init_db(args.db))
    device = describe_device(0)
    torch_ops = modules()
    copy_gbs = None if args.tune_only else copy_bandwidth_gbs()
    rows = []
    kinds = {(o, tuple(s), d): why for o, s, d, why in AWKWARD_CASES} if args.awkward else {}
    for operator, shape, dtype in cases(args.case, args.awkward):
        spec = get_operator(operator)
        best, source = lookup(sessions, spec, shape, dtype, device.model)
        out_of_time = args.max_minutes and time.monotonic() - started > 60 * args.max_minutes
        if source != "exact" and args.tune and not out_of_time:
            t0 = time.monotonic()
            outcome = tune_case(sessions, args.db, operator, shape, dtype, args.tune)
            print(f"tuned {operator} {shape} {dtype} in {time.monotonic() - t0:.0f} s: {outcome}")
            best, source = lookup(sessions, spec, shape, dtype, device.model)
        if args.tune_only:
            continue
        config = best.config if best is not None else spec.default_config(shape, dtype)
        if spec.check(config, shape, dtype) is not None:
            # A nearest shape's winner need not fit this shape (the service checks the same).
            config, source = spec.default_config(shape, dtype), "default"
        backend = PyCudaBackend(spec, shape, dtype, repeats=30)
        result = backend.evaluate(config)
        backend.close()
        torch_ms = torch_time_ms(torch_ops[operator].make(shape, dtype))
        row = trial_row(spec, shape, dtype, config, result, torch_ms, copy_gbs, source)
        if kinds:
            row["awkward"] = kinds[(operator, tuple(shape), dtype)]
        rows.append(row)
        print_row(row, flush=True)
    if args.tune_only:
        return
    report = {
        "device": device.name,
        "cuda": device.cuda_version,
        "copy_gbs": copy_gbs,
        "case_set": "awkward" if args.awkward else "torch_ops",
        "tune_budget": args.tune,
        "seconds": time.monotonic() - started,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{device.name}  device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    print(HEADER)
    for r in rows:
        print_row(r)
    print("%copy: share of the copy bandwidth; for matmul, Kato's column is its % of cuBLAS")


def sweep(args: argparse.Namespace, where: dict[str, set[int]]) -> None:
    """``--where``: every matching valid config of each case, timed as a tuning trial is
    (verified first), one row each beside the case's PyTorch time and the copy bandwidth
    measured once at the start; then each case's best per value of the parameters listed
    with several values. Writes the JSON after every case."""
    import time

    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import PyCudaBackend, describe_device

    from benchmarks.torch_ops import modules

    started = time.monotonic()
    device = describe_device(0)
    torch_ops = modules()
    copy_gbs = copy_bandwidth_gbs()
    compared = [name for name, values in where.items() if len(values) > 1]
    report = {
        "device": device.name,
        "cuda": device.cuda_version,
        "copy_gbs": copy_gbs,
        "where": {k: sorted(v) for k, v in where.items()},
        "rows": [],
        "best_by": [],
    }
    print(f"{device.name}  device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    print(HEADER)
    for operator, shape, dtype in cases(args.case, args.awkward):
        spec = get_operator(operator)
        configs = sweep_configs(spec, shape, dtype, where)
        torch_ms = torch_time_ms(torch_ops[operator].make(shape, dtype))
        backend = PyCudaBackend(spec, shape, dtype, repeats=30)
        rows = []
        try:
            backend.precompile(configs)
            for config in configs:
                result = backend.evaluate(config)
                row = trial_row(spec, shape, dtype, config, result, torch_ms, copy_gbs, "sweep")
                row["registers"] = result.registers
                rows.append(row)
                print_row(row, flush=True)
        finally:
            backend.close()
        report["rows"] += rows
        for name in compared:
            for value, row in best_by(rows, name).items():
                report["best_by"].append({"param": name, "value": value, **row})
        report["seconds"] = time.monotonic() - started
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    names = ", ".join(compared) or "-"
    print(f"\nbest per value of {names} ({device.name}, copy {copy_gbs:.0f} GB/s)")
    print(HEADER)
    for row in report["best_by"]:
        print_row(row, prefix=f"{row['param']}={row['value']}")


def trial_row(spec, shape, dtype, config, result, torch_ms, copy_gbs, source) -> dict:
    """:func:`make_row` of one measured config (``result``: its backend's ``TrialResult``),
    with where the config came from (``source``), the config and the trial's status."""
    row = make_row(
        spec.name, shape, dtype, bytes_moved=spec.bytes_moved(shape, dtype),
        flops=spec.flops(shape, dtype), kato_ms=result.time_ms, torch_ms=torch_ms,
        copy_gbs=copy_gbs,
    )  # fmt: skip
    row.update(source=source, config=config, status=result.status.value, error=result.error)
    return row


def make_row(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    *,
    bytes_moved: int,
    flops: int,
    kato_ms: float | None,
    torch_ms: float,
    copy_gbs: float,
) -> dict:
    """One case's figures: both sides' ms, the speedup (PyTorch ms / Kato ms), GB/s and
    TFLOP/s, each side's share of the copy bandwidth (``*_pct_copy``, memory-bound operators:
    no FLOPs counted) and, where PyTorch's side is cuBLAS, Kato's share of it (``pct_cublas``).
    ``kato_ms`` None: Kato's config failed (its figures are None)."""
    memory_bound = not flops
    row = {
        "operator": operator,
        "shape": list(shape),
        "dtype": dtype,
        "kato_ms": kato_ms,
        "torch_ms": torch_ms,
        "speedup": torch_ms / kato_ms if kato_ms else None,
        "bytes": bytes_moved,
        "flops": flops,
        "kato_gbs": bytes_moved / kato_ms / 1e6 if kato_ms else None,
        "torch_gbs": bytes_moved / torch_ms / 1e6,
        "kato_tflops": flops / kato_ms / 1e9 if kato_ms and flops else None,
        "torch_tflops": flops / torch_ms / 1e9 if flops else None,
        "kato_pct_copy": None,
        "torch_pct_copy": None,
        "pct_cublas": None,
    }
    if memory_bound:
        row["kato_pct_copy"] = 100 * row["kato_gbs"] / copy_gbs if kato_ms else None
        row["torch_pct_copy"] = 100 * row["torch_gbs"] / copy_gbs
    if operator in CUBLAS_OPERATORS and kato_ms:
        row["pct_cublas"] = 100 * torch_ms / kato_ms
    return row


HEADER = (
    f"{'operator':10} {'shape':>14} {'dtype':8} {'src':7} {'Kato ms':>9} {'torch ms':>9} "
    f"{'speedup':>7} {'Kato':>15} {'%copy':>6} {'torch':>15} {'%copy':>6}"
)


def print_row(r: dict, flush: bool = False, prefix: str = "") -> None:
    """One table line; a sweep's row (source ``sweep``) ends with its config, after
    ``prefix``."""
    shape = "x".join(map(str, r["shape"]))
    config = ""
    if r.get("source") == "sweep":
        config = f"  {prefix + ': ' if prefix else ''}" + " ".join(
            f"{k}={v}" for k, v in r["config"].items()
        )
    if r["kato_ms"] is None:
        print(
            f"{r['operator']:10} {shape:>14} {r['dtype']:8} FAILED {r['error']}{config}",
            flush=flush,
        )
        return
    if r["flops"]:
        kato, torch = f"{r['kato_tflops']:7.1f} TFLOP/s", f"{r['torch_tflops']:7.1f} TFLOP/s"
    else:
        kato, torch = f"{r['kato_gbs']:8.0f} GB/s", f"{r['torch_gbs']:8.0f} GB/s"
    # %copy for memory-bound operators; % of cuBLAS (Kato's column) for matmul.
    kato_pct = r["kato_pct_copy"] if r["pct_cublas"] is None else r["pct_cublas"]
    kato_pct = "" if kato_pct is None else f"{kato_pct:6.1f}"
    torch_pct = "" if r["torch_pct_copy"] is None else f"{r['torch_pct_copy']:6.1f}"
    print(
        f"{r['operator']:10} {shape:>14} {r['dtype']:8} {r['source']:7} {r['kato_ms']:9.4f} "
        f"{r['torch_ms']:9.4f} {r['speedup']:7.2f} {kato:>15} {kato_pct:>6} "
        f"{torch:>15} {torch_pct:>6}{config}",
        flush=flush,
    )


if __name__ == "__main__":
    main()
