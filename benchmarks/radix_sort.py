"""The radix path of sort_1d and sort_1d_pairs against torch.sort and CUB, in one run (issue 32),
and the row sort's radix path (``sort`` ALGO=radix, rows longer than 8192 keys) against
``torch.sort(dim=-1)``.

For each case, every valid radix config in the sweep (all of them for the first case of its
group, 1-D or rows, the fastest few of it and the fastest of each ranking method RANK and of each
histogram method HIST for the others) is compiled,
verified and timed by the pycuda backend (as a tuning trial: CUDA events, inputs rotated past
the L2), beside the bitonic default (sort_1d),
``torch.sort`` (torch has no keys-only sort: it always returns the indices too, so its figure is
a sort of keys with int64 values; ``stable=True`` too) and CUB (``benchmarks/cub_sort.cu``
built with nvcc): for 1-D cases ``DeviceRadixSort`` (keys only and pairs), for row cases
``DeviceSegmentedRadixSort`` and ``DeviceSegmentedSort`` (keys only, a segment per row). Writes
JSON and prints a table, then each case's fastest config per RANK and per HIST.

    python3 benchmarks/radix_sort.py --out $OUT/radix_sort.json [--quick] [--rank ballot ...]
        [--hist vec4 ...]
    python3 benchmarks/radix_sort.py --rows --out $OUT/radix_rows.json [--rank atomic ...]

The whole radix space of sort_1d is 855 configs (95 per RANK and HIST); ``--rank atomic`` (the
fastest ranking on the H100) sweeps the 285 of every HIST, ``--rank atomic --hist scalar --hist
vec4_split4`` 190. ``sort``'s radix space at long rows is the same 855. ``--rows`` runs the row
cases alone (:data:`ROW_CASES`: top-p sampling's 64 x 128256 logits, few rows of 2**20, many
rows of 16384), the default run the 1-D cases then the row cases.

Needs a CUDA GPU, PyCUDA, PyTorch and nvcc.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.operators import torch_time_ms  # noqa: E402

#: (operator, shape, dtype); the first case sweeps the whole radix space.
CASES = [
    ("sort_1d", (2**24,), "float32"),
    ("sort_1d", (2**24,), "int32"),
    ("sort_1d_pairs", (2**24,), "float32"),
    ("sort_1d", (2**20,), "float32"),
    ("sort_1d", (2**26,), "float32"),
]
#: The row sort's radix path (rows longer than MAX_ROW); the first case sweeps its radix space.
ROW_CASES = [
    ("sort", (64, 128256), "float32"),
    ("sort", (16, 2**20), "float32"),
    ("sort", (4096, 16384), "float32"),
    ("sort", (64, 128256), "int32"),
]
#: How many of the first case's fastest configs the other cases time.
TOP = 8


def radix_configs(
    spec,
    shape: tuple[int, ...],
    dtype: str,
    ranks: list[str] | None = None,
    hists: list[str] | None = None,
) -> list[dict]:
    """The valid radix configs, those of the ``ranks`` and ``hists`` methods only where given."""
    from kato.tuner.space import SearchSpace

    space = SearchSpace(spec.params, lambda c: spec.check(c, shape, dtype))
    return [
        c
        for c in space.valid_configs()
        if c.get("ALGO", "radix") == "radix"
        and (not ranks or c["RANK"] in ranks)
        and (not hists or c["HIST"] in hists)
    ]


def fastest_first(rows: list[dict]) -> list[dict]:
    """The first case's radix configs to time on the others: the TOP fastest, then the fastest
    of every ranking method and of every histogram method not among them."""
    ok = sorted(
        (r for r in rows if r["time_ms"] and r["config"].get("ALGO", "radix") == "radix"),
        key=lambda r: r["time_ms"],
    )
    chosen = [r["config"] for r in ok[:TOP]]
    for name in ("RANK", "HIST"):
        for row in ok:
            if row["config"][name] not in {c[name] for c in chosen}:
                chosen.append(row["config"])
    return chosen


def best_per(rows: list[dict], name: str) -> dict[str, dict]:
    """Per value of the tunable ``name`` (RANK, HIST), the fastest radix row."""
    best: dict[str, dict] = {}
    for row in rows:
        value = row["config"].get(name)
        if not (row["time_ms"] and value and row["config"].get("ALGO", "radix") == "radix"):
            continue
        if value not in best or row["time_ms"] < best[value]["time_ms"]:
            best[value] = row
    return best


def as_pairs_config(spec, config: dict) -> dict:
    return {k: config[k] for k in spec.params}


def time_configs(spec, shape: tuple[int, ...], dtype: str, configs: list[dict]) -> list[dict]:
    """Evaluate configs as tuning trials (verified first); one row per config."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(spec, shape, dtype, repeats=10, warmup=2, seed=0)
    rows = []
    try:
        backend.precompile(configs)
        for config in configs:
            result = backend.evaluate(config)
            rows.append(
                {
                    "config": config,
                    "status": result.status.value,
                    "time_ms": result.time_ms,
                    "registers": result.registers,
                    "occupancy": result.occupancy,
                    "error": (result.error or "")[:300] or None,
                }
            )
            shown = f"{result.time_ms:.4f} ms" if result.time_ms else result.status.value
            print(f"  {spec.name} {_name(shape)} {dtype} {config}: {shown}", flush=True)
    finally:
        backend.close()
    return rows


def torch_times(shape: tuple[int, ...], dtype: str) -> dict:
    """torch.sort along the last dimension (values and int64 indices: torch has no keys-only
    sort), unstable and stable."""
    import torch

    if dtype == "float32":
        x = torch.randn(shape, device="cuda") * 1000
    else:
        x = torch.randint(-(2**31), 2**31 - 1, shape, device="cuda", dtype=torch.int32)
    return {
        "torch.sort": torch_time_ms(lambda: torch.sort(x, dim=-1)),
        "torch.sort(stable=True)": torch_time_ms(lambda: torch.sort(x, dim=-1, stable=True)),
    }


def _name(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def build_cub(workdir: Path) -> Path | None:
    binary = workdir / "cub_sort"
    proc = subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90", "-std=c++17", "-o", str(binary), "cub_sort.cu"],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(f"CUB program did not build:\n{proc.stderr[-2000:]}")
        return None
    return binary


def cub_time(
    binary: Path | None, n: int, dtype: str, kind: str, cols: int | None = None
) -> float | None:
    """CUB's median ms for n keys (kinds "keys", "pairs"; "rows", "rows_segsort": n / cols rows
    of cols keys)."""
    if binary is None:
        return None
    extra = [str(cols)] if cols else []
    command = [str(binary), str(n), dtype, kind, "20", *extra]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"CUB {n} {dtype} {kind} failed: {proc.stderr[-500:]}")
        return None
    return json.loads(proc.stdout)["ms"]


def fmt(value: float | None) -> str:
    return f"{value:9.4f}" if value else f"{'-':>9}"


def main() -> None:
    from kato.kernels import get_operator
    from kato.kernels.sort.radix import HISTS, RANKS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--quick", action="store_true", help="the first two 1-D cases only")
    ap.add_argument("--rows", action="store_true", help="the row cases (sort) only")
    ap.add_argument(
        "--rank",
        action="append",
        choices=RANKS,
        help="time only these ranking methods (repeatable; default: all)",
    )
    ap.add_argument(
        "--hist",
        action="append",
        choices=HISTS,
        help="time only these histogram kernels (repeatable; default: all)",
    )
    args = ap.parse_args()

    if args.rows:
        groups = [ROW_CASES]
    else:
        groups = [CASES[:2] if args.quick else CASES] + ([] if args.quick else [ROW_CASES])
    started = time.monotonic()
    report: dict = {"cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        cub = build_cub(Path(tmp))
        for cases in groups:
            best_first: list[dict] = []
            for index, (operator, shape, dtype) in enumerate(cases):
                spec = get_operator(operator)
                every = radix_configs(spec, shape, dtype, args.rank, args.hist)
                if index == 0:
                    configs = every
                else:
                    wanted = [as_pairs_config(spec, c) for c in best_first]
                    configs = [c for c in wanted if c in every] or every[:TOP]
                if operator in ("sort_1d", "sort"):
                    default = spec.default_config(shape, dtype)
                    configs = [default, *(c for c in configs if c != default)]
                print(f"{operator} {_name(shape)} {dtype}: {len(configs)} configs", flush=True)
                rows = time_configs(spec, shape, dtype, configs)
                if index == 0:
                    best_first = fastest_first(rows)
                case = {
                    "operator": operator,
                    "shape": list(shape),
                    "dtype": dtype,
                    "rows": rows,
                    **torch_times(shape, dtype),
                }
                if len(shape) == 1:
                    case["n"] = shape[0]
                    case["cub_keys_ms"] = cub_time(cub, shape[0], dtype, "keys")
                    case["cub_pairs_ms"] = cub_time(cub, shape[0], dtype, "pairs")
                else:
                    total = shape[0] * shape[1]
                    case["cub_rows_ms"] = cub_time(cub, total, dtype, "rows", shape[1])
                    case["cub_segsort_ms"] = cub_time(cub, total, dtype, "rows_segsort", shape[1])
                report["cases"].append(case)
                Path(args.out).write_text(json.dumps(report, indent=1))
    report["elapsed_s"] = time.monotonic() - started
    Path(args.out).write_text(json.dumps(report, indent=1))
    print()
    print("torch.sort returns int64 indices as well as the values (no keys-only sort in torch)")
    header = f"{'case':34} {'best radix':>11} {'default':>9} {'bitonic':>9} {'torch':>9}"
    print(f"{header} {'torch st.':>9} {'CUB':>9} {'CUB seg':>9}  best config")
    for case in report["cases"]:
        radix_rows = [
            r for r in case["rows"] if r["time_ms"] and r["config"].get("ALGO", "radix") == "radix"
        ]
        best = min(radix_rows, key=lambda r: r["time_ms"], default=None)
        bitonic = [r for r in case["rows"] if r["config"].get("ALGO") == "bitonic"]
        default = case["rows"][0] if case["operator"] != "sort_1d_pairs" else None
        pairs = case["operator"] == "sort_1d_pairs"
        if case["operator"] == "sort":  # DeviceSegmentedRadixSort, DeviceSegmentedSort
            cub_ms, cub_seg_ms = case["cub_rows_ms"], case["cub_segsort_ms"]
        else:
            cub_ms, cub_seg_ms = case["cub_pairs_ms" if pairs else "cub_keys_ms"], None

        name = f"{case['operator']} {_name(case['shape'])} {case['dtype']}"
        print(
            f"{name:34} {fmt(best and best['time_ms']):>11} "
            f"{fmt(default and default['time_ms'])} "
            f"{fmt(bitonic[0]['time_ms'] if bitonic else None)} {fmt(case['torch.sort'])} "
            f"{fmt(case['torch.sort(stable=True)'])} {fmt(cub_ms)} {fmt(cub_seg_ms)}  "
            f"{best['config'] if best else '-'}"
        )
    print()
    for case in report["cases"]:
        name = f"{case['operator']} {_name(case['shape'])} {case['dtype']}"
        for tunable in ("RANK", "HIST"):
            for value, row in sorted(best_per(case["rows"], tunable).items()):
                label = f"{tunable}={value}"
                print(f"{name:34} {label:16} {fmt(row['time_ms'])}  {row['config']}")
    failed = [r for c in report["cases"] for r in c["rows"] if r["status"] != "ok"]
    print(f"{len(failed)} configs failed (see the JSON)")


if __name__ == "__main__":
    main()
