"""Every wgmma (or mma.sync / CUDA-core) config of matmul / matmul_nt / matmul_tn against cuBLAS.

For each (operator, shape, dtype) case every valid ``ENGINE="wgmma"`` config is compiled, verified
(float64 reference, poisoned output, twice) and timed by the pycuda backend exactly as a tuning
trial is (CUDA events, inputs rotated past the L2), beside ``torch.matmul`` on the same layout
(cuBLAS) timed in the same process. A wgmma source does not depend on the shape, so each config
compiles once per (operator, dtype). Prints a table, writes JSON after every case.

    python3 benchmarks/matmul_sweep.py --out $OUT/matmul_sweep.json [--case matmul:4096x4096x4096]
        [--where CLUSTER_M=1 --where STAGES=3,4,5,6]
    python3 benchmarks/matmul_sweep.py --out $OUT/f32.json --engine mma --dtypes float32 \
        --case matmul:1000x1001x999

``--engine mma`` sweeps the other template instead (CUDA cores for float32, ``mma.sync`` for
16-bit types), ``any`` both. ``--list`` prints each case's configs and exits (no GPU: nvcc,
PyCUDA and PyTorch are not needed), e.g. stream-K beside the rest at issue 32's layout::

    python3 benchmarks/matmul_sweep.py --out /dev/null --list --dtypes bfloat16 \
        --case matmul_tn:768x3072x8192 --where STREAM_K=0,1 --where PERSISTENT=1

``--best-by STREAM_K`` prints, under each case's line, its best config per value of that
parameter (with the ratio to cuBLAS timed in the same process).

Needs an sm_90 GPU, PyCUDA, PyTorch and nvcc. Issue 32's shapes by default.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.operators import parse_where, sweep_configs, torch_time_ms  # noqa: E402

#: Issue 32's square shapes and a GPT-2 small training step's (M x N x K): the MLP's two GEMMs
#: and the vocabulary head, forward (matmul) and the two backward layouts.
CASES = [
    ("matmul", (4096, 4096, 4096)),
    ("matmul", (6144, 6144, 6144)),
    ("matmul", (8192, 8192, 8192)),
    ("matmul", (8192, 3072, 768)),
    ("matmul", (8192, 768, 3072)),
    ("matmul_nt", (8192, 768, 3072)),
    ("matmul_tn", (768, 3072, 8192)),
    ("matmul", (8192, 50264, 768)),
]
DTYPES = ("bfloat16", "float16")


def torch_case(operator: str, shape: tuple[int, int, int], dtype: str):
    """``torch.matmul`` on the operator's layout, as a zero-argument callable."""
    import torch

    m, n, k = shape
    kind = getattr(torch, dtype)
    a = torch.randn((k, m) if operator == "matmul_tn" else (m, k), device="cuda", dtype=kind)
    b = torch.randn((n, k) if operator == "matmul_nt" else (k, n), device="cuda", dtype=kind)
    a_op = a.t() if operator == "matmul_tn" else a
    b_op = b.t() if operator == "matmul_nt" else b
    out = torch.empty(m, n, device="cuda", dtype=kind)
    return lambda: torch.matmul(a_op, b_op, out=out)


def select(
    operator: str,
    shape: tuple[int, int, int],
    dtype: str,
    where: dict[str, set[int]] | None = None,
    engine: str = "wgmma",
) -> list[dict]:
    """The valid configs of the case on ``engine`` with the ``where`` values, in the spec's
    candidates order (:func:`benchmarks.operators.sweep_configs`, filtered by engine).

    Raises:
        SystemExit: a ``where`` name is not a parameter of the operator, or no config is valid.
    """
    from kato.kernels import get_operator

    configs = sweep_configs(get_operator(operator), shape, dtype, where or {})
    return [c for c in configs if engine in ("any", c["ENGINE"])]


def sweep(
    operator: str,
    shape: tuple[int, int, int],
    dtype: str,
    limit_s: float,
    where: dict[str, set[int]] | None = None,
    shuffle: bool = False,
    engine: str = "wgmma",
) -> dict:
    from kato.kernels import get_operator
    from kato.tuner.backends.pycuda import PyCudaBackend

    spec = get_operator(operator)
    configs = select(operator, shape, dtype, where, engine)
    if shuffle:  # a time limit then cuts a random sample, not the configs listed last
        random.Random(0).shuffle(configs)
    backend = PyCudaBackend(spec, shape, dtype, repeats=10, warmup=2, seed=0)
    rows = []
    try:
        backend.precompile(configs)
        # The time limit is for measuring, not for nvcc: wait for the compiles ahead first.
        waited = time.monotonic()
        while time.monotonic() - waited < 300 and not all(map(backend.is_compiled, configs)):
            time.sleep(0.2)
        started = time.monotonic()
        for config in configs:
            if time.monotonic() - started > limit_s:
                break
            result = backend.evaluate(config)
            rows.append(
                {
                    "config": config,
                    "status": result.status.value,
                    "time_ms": result.time_ms,
                    "error": (result.error or "")[:300] or None,
                }
            )
    finally:
        backend.close()
    flop = 2.0 * shape[0] * shape[1] * shape[2]
    torch_ms = torch_time_ms(torch_case(operator, shape, dtype), repeats=20, batch=5)
    ok = [r for r in rows if r["time_ms"]]
    best = min(ok, key=lambda r: r["time_ms"], default=None)
    return {
        "operator": operator,
        "shape": list(shape),
        "dtype": dtype,
        "configs": len(configs),
        "measured": len(rows),
        "failed": sum(r["status"] != "ok" for r in rows),
        "best": best,
        "best_tflops": flop / best["time_ms"] / 1e9 if best else None,
        "cublas_ms": torch_ms,
        "cublas_tflops": flop / torch_ms / 1e9,
        "vs_cublas": torch_ms / best["time_ms"] if best else None,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", help="operator:MxNxK (repeatable)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument(
        "--limit-s", type=float, default=60.0, help="per case: stop timing after (compiles apart)"
    )
    ap.add_argument("--shuffle", action="store_true", help="time the configs in a random order")
    ap.add_argument(
        "--engine",
        choices=("wgmma", "mma", "any"),
        default="wgmma",
        help="which template's configs (mma: CUDA cores for float32, mma.sync for 16-bit)",
    )
    ap.add_argument(
        "--where",
        action="append",
        help="PARAM=V1,V2 (repeatable): time only the configs with these values",
    )
    ap.add_argument("--list", action="store_true", help="print the configs and exit (no GPU)")
    ap.add_argument(
        "--best-by",
        metavar="PARAM",
        help="also print each case's best config per value of PARAM (e.g. STREAM_K)",
    )
    args = ap.parse_args()
    cases = CASES
    if args.case:
        cases = [
            (c.split(":")[0], tuple(int(v) for v in c.split(":")[1].split("x"))) for c in args.case
        ]
    if args.list:
        for operator, shape in cases:
            for dtype in args.dtypes.split(","):
                configs = select(operator, shape, dtype, parse_where(args.where), args.engine)
                print(f"{operator} {'x'.join(map(str, shape))} {dtype}: {len(configs)} configs")
                for c in configs:
                    print("  " + " ".join(f"{k}={c[k]}" for k in _summary_keys(c)))
        return
    report = {"cases": []}
    print(f"{'case':36} {'best TFLOP/s':>14} {'cuBLAS':>8} {'ratio':>6} {'ok/all':>8}  best")
    for operator, shape in cases:
        for dtype in args.dtypes.split(","):
            where = parse_where(args.where)
            case = sweep(operator, shape, dtype, args.limit_s, where, args.shuffle, args.engine)
            report["cases"].append(case)
            Path(args.out).write_text(json.dumps(report, indent=1))
            name = f"{operator} {'x'.join(map(str, shape))} {dtype}"
            best = case["best"]
            tiles = {k: best["config"][k] for k in _summary_keys(best["config"])} if best else "-"
            ok = case["measured"] - case["failed"]
            print(
                f"{name:36} {case['best_tflops'] or 0:14.1f} {case['cublas_tflops']:8.1f} "
                f"{case['vs_cublas'] or 0:6.3f} {ok:>3}/{case['configs']:<4}  {tiles}",
                flush=True,
            )
            if args.best_by:
                for value, row in best_by(case, args.best_by).items():
                    summary = {k: row["config"][k] for k in _summary_keys(row["config"])}
                    print(
                        f"  {args.best_by}={value}: {row['time_ms']:.4f} ms, "
                        f"{case['cublas_ms'] / row['time_ms']:.3f} of cuBLAS, {summary}",
                        flush=True,
                    )


def best_by(case: dict, param: str) -> dict:
    """The fastest measured row of a :func:`sweep` case per value of ``param``, by value."""
    best: dict = {}
    for row in case["rows"]:
        value = row["config"].get(param)
        if row["time_ms"] and (value not in best or row["time_ms"] < best[value]["time_ms"]):
            best[value] = row
    return dict(sorted(best.items(), key=lambda item: str(item[0])))


def _summary_keys(config: dict) -> tuple[str, ...]:
    """The parameters that tell a config of its engine apart."""
    if config["ENGINE"] == "wgmma":
        return (
            "BM", "BN", "STAGES", "CLUSTER_M", "PERSISTENT", "EPILOGUE", "SPLIT_K", "PINGPONG",
            "STREAM_K",
        )  # fmt: skip
    return ("BM", "BN", "BK", "WM", "WN", "TM", "TN", "VEC", "STAGES", "MIN_BLOCKS")


if __name__ == "__main__":
    main()
