"""Kernel Tuner's kind of examples tuned through ``kato.tune_kernel`` and through Kernel Tuner,
at equal budget, on this machine's GPU (the H200 for the record).

The cases (``benchmarks/kt_examples/cases.py``: vector add, a shared-memory matmul, a 2-D
convolution, a one-launch sum reduction) are ``tune_kernel`` arguments given unchanged to
``kernel_tuner.tune_kernel`` and to ``kato.tune_kernel``: only the import differs. Per case:

- Kato: ``kato.tune_kernel(..., strategy="forest", strategy_options={"max_fevals": B})`` in a
  fresh SQLite database, every config verified against the case's answer;
- Kernel Tuner: each of ``--kt`` strategies with ``max_fevals=B`` (``lang="PYCUDA"``, its answer
  check with the same ``atol``);
- every run in its own process (Kernel Tuner's launches failed in a process where Kato had used
  the device, ``benchmarks/tuning_throughput.py``);
- then both sides' winners re-timed back to back with one timer (Kato's pycuda backend: CUDA
  events, inputs rotated past the L2), so "best" compares like with like.

``--kt-scripts DIR`` (a checkout's ``examples/cuda``) runs Kernel Tuner's own example scripts
(``--scripts``; default vector_add.py, stencil.py, spmv.py, matmul.py, vector_add_codegen.py
and, where jinja2 imports, vector_add_jinja.py; ``generators`` names the scripts whose
``kernel_source`` is a code generator, :data:`GENERATOR_SCRIPTS`) unchanged, each twice in
a fresh process: with Kernel Tuner, and with ``kernel_tuner.tune_kernel`` made
``kato.tune_kernel`` (``benchmarks/kt_examples/shim/sitecustomize.py``): literally only the
import changed. Their own settings hold (most are brute force, so both measure the same
space); the report gives each call's configs/min, best config and best time on each tool's
own timer.

Configs per minute = distinct configs measured / wall time of the tuning call (compiles
included). Output: a table on stdout and ``--out`` JSON.

    python benchmarks/kt_examples.py --budget 50 --out data/benchmarks/kt_examples_h200.json
    python benchmarks/kt_examples.py --cases vector_add --budget 20 --scale 0.05   # quick
    python benchmarks/kt_examples.py --cases none --kt-scripts ~/kernel_tuner/examples/cuda

Needs a CUDA GPU, PyCUDA and kernel_tuner (``pip install 'kato[cuda,bench]'``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_KT = ("random_sample", "genetic_algorithm", "greedy_ils", "dual_annealing")


def _kw(case: str, scale: float) -> dict[str, Any]:
    from kt_examples.cases import CASES

    return CASES[case](scale)


def _params_of(row: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {k: row[k] for k in names}


def run_one(tool: str, case: str, budget: int, scale: float, seed: int) -> dict[str, Any]:
    """One tuning run in this process: ``tool`` is ``kato`` or ``kt:<strategy>``."""
    kw = _kw(case, scale)
    names = list(kw["tune_params"])
    t0 = time.perf_counter()
    if tool == "kato":
        import kato

        with tempfile.TemporaryDirectory() as tmp:
            results, env = kato.tune_kernel(
                **kw, strategy="forest", strategy_options={"max_fevals": budget}, seed=seed,
                db=f"sqlite:///{tmp}/kato.db", quiet=True,
            )  # fmt: skip
        failed = [r for r in results if not isinstance(r["time"], float)]
        ok = [r for r in results if isinstance(r["time"], float)]
        errors = sorted({str(r.get("error"))[:200] for r in failed})[:3]
    else:
        import kernel_tuner

        strategy = tool.split(":", 1)[1]
        results, env = kernel_tuner.tune_kernel(
            **kw, lang="PYCUDA", strategy=strategy,
            strategy_options={"max_fevals": budget}, quiet=True, iterations=7,
        )  # fmt: skip
        ok = [r for r in results if isinstance(r.get("time"), float)]
        failed = [r for r in results if not isinstance(r.get("time"), float)]
        errors = sorted({str(r.get("time"))[:200] for r in failed})[:3]
    wall = time.perf_counter() - t0
    best = min(ok, key=lambda r: r["time"]) if ok else None
    return {
        "tool": tool,
        "case": case,
        "measured": len(results),
        "failed": len(failed),
        "errors": errors,
        "wall_s": wall,
        "configs_per_minute": 60.0 * len(results) / wall if wall > 0 else None,
        "best_config": _params_of(best, names) if best else None,
        "best_time_own_ms": best["time"] if best else None,
    }


def retime(case: str, configs: list[dict[str, Any]], scale: float) -> list[float | None]:
    """Each config timed with Kato's backend (15 repeats, median), in this process."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    from kato.kernel_tuner import operator_from_arguments, problem_dims

    kw = _kw(case, scale)
    args = {k: kw.pop(k) for k in ("kernel_name", "kernel_source", "problem_size", "arguments",
                                   "tune_params")}  # fmt: skip
    op, _ = operator_from_arguments(**args, **kw)
    backend = PyCudaBackend(op, problem_dims(args["problem_size"]), op.dtypes[0], repeats=15)
    try:
        out = []
        for config in configs:
            result = backend.evaluate(config)
            out.append(result.time_ms if result.ok else None)
        return out
    finally:
        backend.close()


def _subprocess(argv: list[str], timeout: float) -> Any:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, *argv, "--result", f.name]
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        return json.loads(Path(f.name).read_text())


SHIM = ROOT / "benchmarks" / "kt_examples" / "shim"
#: Kernel Tuner's examples whose ``kernel_source`` is a code generator, which
#: ``kato.tune_kernel`` runs locally (issue 34): a function (15 configs) and Jinja2 templates'
#: ``render`` (vector_add_jinja.py 15 configs, vector_add_jinja2.py 3072: brute force, so not
#: in the default). The Jinja2 ones import jinja2.
GENERATOR_SCRIPTS = ("vector_add_codegen.py", "vector_add_jinja.py", "vector_add_jinja2.py")
_JINJA_SCRIPTS = ("vector_add_jinja.py", "vector_add_jinja2.py")
DEFAULT_SCRIPTS = (
    "vector_add.py,stencil.py,spmv.py,matmul.py,"  # expdist.py: 960 configs
    "vector_add_codegen.py,vector_add_jinja.py"
)


def runnable_scripts(names: str) -> list[str]:
    """``--scripts``: comma-separated script names, ``generators`` standing for
    :data:`GENERATOR_SCRIPTS`; the Jinja2 examples are left out (with a note) where jinja2
    does not import here, since both tools' runs would fail on the script's own import."""
    out: list[str] = []
    for name in (n for n in names.split(",") if n):
        for script in GENERATOR_SCRIPTS if name == "generators" else (name,):
            if script not in out:
                out.append(script)
    try:
        import jinja2  # noqa: F401
    except ImportError:
        skipped = [s for s in out if s in _JINJA_SCRIPTS]
        if skipped:
            print(f"jinja2 does not import: skipping {', '.join(skipped)}", file=sys.stderr)
        out = [s for s in out if s not in _JINJA_SCRIPTS]
    return out


def run_scripts(
    folder: Path, scripts: list[str], timeout: float, max_fevals: int = 0,
    kt_strategy: str = "random_sample", retime: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Each Kernel Tuner example script run by Kernel Tuner, then through Kato (the shim).
    ``max_fevals`` > 0 gives every call that names no strategy that budget on both sides
    (Kernel Tuner's ``kt_strategy``, Kato's default search) instead of a brute force.
    ``retime``: Kato's run measures both tools' best config of each call again on its own
    timer (the shim's ``KATO_KT_SHIM_RETIME``; a call's ``retimed``)."""
    import os

    out: dict[str, Any] = {}
    for script in scripts:
        runs: list[dict[str, Any]] = []
        for tool in ("kt", "kato"):
            with tempfile.TemporaryDirectory() as tmp:
                record = Path(tmp) / "calls.jsonl"
                env = dict(os.environ)
                env.update(
                    KATO_KT_SHIM=tool,
                    KATO_KT_SHIM_OUT=str(record),
                    KATO_KT_SHIM_MAX_FEVALS=str(max_fevals),
                    KATO_KT_SHIM_KT_STRATEGY=kt_strategy,
                    KATO_DB_URL=f"sqlite:///{tmp}/kato.db",
                    PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT), env.get("PYTHONPATH", "")]),
                )
                if retime and tool == "kato" and runs:
                    kt_calls = Path(tmp) / "kt_calls.jsonl"
                    kt_calls.write_text("".join(json.dumps(c) + "\n" for c in runs[0]["calls"]))
                    env["KATO_KT_SHIM_RETIME"] = str(kt_calls)
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(
                        [sys.executable, script], cwd=folder, env=env, timeout=timeout,
                        capture_output=True, text=True,
                    )  # fmt: skip
                    rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
                except subprocess.TimeoutExpired as exc:
                    # What it printed before the cut says where the time went.
                    text = "".join(
                        part.decode(errors="replace") if isinstance(part, bytes) else part
                        for part in (exc.stdout, exc.stderr) if part
                    )  # fmt: skip
                    rc, tail = None, f"{text[-1500:]}\ntimed out after {timeout} s"
                calls = _calls(record)
            runs.append({"tool": tool, "returncode": rc, "wall_s": time.perf_counter() - t0,
                         "calls": calls, "output_tail": tail if rc != 0 else ""})  # fmt: skip
            print(f"{script} {tool}: rc={rc} {json.dumps(calls)[:300]}", file=sys.stderr)
        out[script] = runs
    return out


def _calls(record: Path) -> list[dict[str, Any]]:
    """A run's calls from the shim's JSON lines, each re-measurement (a ``retimed_call``
    line, written after its call's) set on its call as ``retimed``."""
    if not record.exists():
        return []
    calls: list[dict[str, Any]] = []
    for line in record.read_text().splitlines():
        row = json.loads(line)
        if "retimed_call" in row:
            for call in calls:
                if call.get("call") == row["retimed_call"]:
                    call["retimed"] = row["retimed"]
        else:
            calls.append(row)
    return calls


def _fmt(value: Any, form: str = "{:.4f}") -> str:
    return form.format(value) if isinstance(value, int | float) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="vector_add,matmul,convolution,reduction")
    parser.add_argument("--budget", type=int, default=50)
    parser.add_argument("--kt", default=",".join(DEFAULT_KT), help="Kernel Tuner strategies")
    parser.add_argument("--scale", type=float, default=1.0, help="< 1: smaller problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kt-scripts", type=Path, help="Kernel Tuner's examples/cuda folder")
    parser.add_argument(
        "--scripts", default=DEFAULT_SCRIPTS,
        help="its scripts to run, comma-separated ('generators': the code-generator examples)",
    )  # fmt: skip
    parser.add_argument(
        "--script-budget", type=int, default=0,
        help="> 0: a script's brute-force calls get this many configs on both sides instead",
    )  # fmt: skip
    parser.add_argument(
        "--script-kt-strategy", default="random_sample",
        help="Kernel Tuner's strategy for --script-budget",
    )  # fmt: skip
    parser.add_argument(
        "--script-retime", action="store_true",
        help="measure both tools' best config of each script call again on Kato's timer",
    )  # fmt: skip
    parser.add_argument("--one", nargs=2, metavar=("TOOL", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--retime", metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        data = run_one(a.one[0], a.one[1], a.budget, a.scale, a.seed)
        Path(a.result).write_text(json.dumps(data, default=str))
        return
    if a.retime:
        data = retime(a.retime, json.loads(a.configs), a.scale)
        Path(a.result).write_text(json.dumps(data))
        return
    report: dict[str, Any] = {"budget": a.budget, "scale": a.scale, "seed": a.seed, "cases": {}}
    tools = ["kato"] + [f"kt:{s}" for s in a.kt.split(",") if s]
    for case in [c for c in a.cases.split(",") if c and c != "none"]:
        runs = []
        for tool in tools:
            argv = ["--one", tool, case, "--budget", str(a.budget), "--scale", str(a.scale),
                    "--seed", str(a.seed)]  # fmt: skip
            run = _subprocess(argv, a.timeout)
            run.setdefault("tool", tool)
            runs.append(run)
            print(f"{case} {tool}: {json.dumps(run, default=str)[:300]}", file=sys.stderr)
        configs = [r.get("best_config") for r in runs if r.get("best_config")]
        times = _subprocess(
            ["--retime", case, "--configs", json.dumps(configs), "--scale", str(a.scale)],
            a.timeout,
        )
        if isinstance(times, list):
            it = iter(times)
            for run in runs:
                if run.get("best_config"):
                    run["best_time_retimed_ms"] = next(it)
        else:
            report.setdefault("retime_errors", {})[case] = times.get("error")
        kt_best = [r.get("best_time_retimed_ms") for r in runs[1:]]
        kt_best = [t for t in kt_best if t is not None]
        kato_t = runs[0].get("best_time_retimed_ms")
        verdict = None
        if kato_t is not None and kt_best:
            verdict = "kato at least as fast" if kato_t <= min(kt_best) * 1.01 else "kato slower"
        report["cases"][case] = {"runs": runs, "verdict": verdict}
    print(f"{'case':<12} {'tool':<22} {'measured':>8} {'failed':>6} {'cfg/min':>8} "
          f"{'best own ms':>12} {'best retimed ms':>15}")  # fmt: skip
    for case, data in report["cases"].items():
        for r in data["runs"]:
            cells = [
                _fmt(r.get("measured"), "{}"),
                _fmt(r.get("failed"), "{}"),
                _fmt(r.get("configs_per_minute"), "{:.1f}"),
                _fmt(r.get("best_time_own_ms")),
                _fmt(r.get("best_time_retimed_ms")),
            ]
            widths = (8, 6, 8, 12, 15)
            print(f"{case:<12} {r['tool']:<22} " + " ".join(
                c.rjust(w) for c, w in zip(cells, widths, strict=True)
            ))  # fmt: skip
        print(f"{case:<12} verdict: {data['verdict']}")
    if a.kt_scripts is not None:
        report["scripts"] = run_scripts(
            a.kt_scripts, runnable_scripts(a.scripts), a.timeout, a.script_budget,
            a.script_kt_strategy, a.script_retime,
        )  # fmt: skip
        for script, runs in report["scripts"].items():
            for run in runs:
                for call in run["calls"] or [{}]:
                    cells = [
                        call.get("measured"),
                        call.get("failed"),
                        call.get("configs_per_minute"),
                        call.get("best_time_own_ms"),
                    ]
                    print(f"{script:<14} {run['tool']:<5} rc={run['returncode']} "
                          + " ".join(_fmt(c, "{}") if isinstance(c, int) else _fmt(c)
                                     for c in cells)
                          + (f" {call['error'][:80]}" if call.get("error") else "")
                          + "".join(f" | {who} best on Kato's timer: "
                                    + (_fmt(r.get("ms")) if "ms" in r else r["failure"][:60])
                                    for who, r in (call.get("retimed") or {}).items()))  # fmt: skip
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
