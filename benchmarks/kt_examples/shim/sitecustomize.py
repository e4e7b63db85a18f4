"""Imported at start-up by the Python that runs a Kernel Tuner example script for
``benchmarks/kt_examples.py --kt-scripts`` (this directory is put first on ``PYTHONPATH``).

``KATO_KT_SHIM=kato`` makes ``kernel_tuner.tune_kernel`` Kato's (``kato.tune_kernel``): the
script runs unchanged, as if its import had been changed. ``KATO_KT_SHIM=kt`` keeps Kernel
Tuner's. Either way every call is recorded (configs measured, wall time, best config and
time, failures) as a JSON line in ``KATO_KT_SHIM_OUT``.

``KATO_KT_SHIM_MAX_FEVALS=N`` gives a call that names no strategy (Kernel Tuner's brute force)
a budget of N configs on both sides, for the examples whose spaces no one brute-forces: Kernel
Tuner's ``KATO_KT_SHIM_KT_STRATEGY`` (default ``random_sample``) and Kato's default search.

``KATO_KT_SHIM_RETIME=FILE`` (Kato's run; FILE: the Kernel Tuner run's JSON lines): after each
call, Kato's best config and then Kernel Tuner's best config of the same call are measured
again, each as a one-config ``kato.tune_kernel`` job in this process (``retimed``: ms, or the
failure), so that both tools' winners are compared on one timer, verified against the
script's ``answer`` where it gives one (each tool's own timer differs: Kernel Tuner's never
reads under about 24 us on an H100, Kato's times a launch of 2 us).
"""

from __future__ import annotations

import json
import os
import time

_MODE = os.environ.get("KATO_KT_SHIM")
_OUT = os.environ.get("KATO_KT_SHIM_OUT")
_MAX_FEVALS = int(os.environ.get("KATO_KT_SHIM_MAX_FEVALS") or 0)
_KT_STRATEGY = os.environ.get("KATO_KT_SHIM_KT_STRATEGY") or "random_sample"
_RETIME = os.environ.get("KATO_KT_SHIM_RETIME")
#: Settings a one-config re-measurement drops (it measures exactly the config it is given).
_NOT_RETIMED = (
    "cache", "strategy", "strategy_options", "verbose", "tune_params", "metrics", "quiet",
    "isolate",
)  # fmt: skip
_calls = [0]  # tune_kernel calls made so far by the script
_seen: dict[str, int] = {}  # Kato's calls so far by signature (their pairing)


def _plain(value):
    """A tunable's value as JSON keeps it (numpy's scalars as Python's)."""
    return value.item() if hasattr(value, "item") else value


def _signature(kernel_name, args, kwargs) -> str | None:
    """What pairs a call of Kernel Tuner's run with Kato's: the kernel, the problem size, the
    tunables and the arguments' shapes and types (a script calling one kernel on several
    problems, as reduction.py does, differs only there); None where it cannot be told."""
    try:
        return _described(kernel_name, args, kwargs)
    except Exception:
        return None


def _described(kernel_name, args, kwargs) -> str:
    tune_params = args[3] if len(args) > 3 else kwargs.get("tune_params", {})
    problem = args[1] if len(args) > 1 else kwargs.get("problem_size")
    arguments = args[2] if len(args) > 2 else kwargs.get("arguments", ())
    shapes = [
        [str(getattr(a, "dtype", type(a).__name__)), list(a.shape)]
        if getattr(a, "shape", ()) != ()
        else [str(getattr(a, "dtype", type(a).__name__)), _plain(a)]  # a scalar: its value
        for a in arguments
    ]
    if callable(problem):
        problem = getattr(problem, "__qualname__", "<callable>")  # not its address
    params = {k: [_plain(v) for v in vs] for k, vs in dict(tune_params).items()}
    return json.dumps([kernel_name, problem, params, shapes], default=str)


def _kt_calls() -> list[dict]:
    if not _RETIME or not os.path.exists(_RETIME):
        return []
    with open(_RETIME) as f:
        return [json.loads(line) for line in f if line.strip()]


def _paired(record: dict):
    """Kernel Tuner's call that ``record`` (Kato's) pairs with: the n-th of its calls with the
    same signature where ``record`` is the n-th of Kato's; None if there is none."""
    signature = record["signature"]
    if signature is None:
        return None
    _seen[signature] = nth = _seen.get(signature, 0) + 1
    same = [c for c in _kt_calls() if c.get("signature") == signature]
    return same[nth - 1] if nth <= len(same) else None


def _retime(kernel_name, args, kwargs, kato_best, kt_record):
    """Kato's best and Kernel Tuner's best of this call, each measured by a one-config Kato
    job in this process (Kato's first: a config that ran), as {tool: {"config", "ms" or
    "failure"}}."""
    import kato

    out = {}
    for tool, config in (("kato", kato_best), ("kt", (kt_record or {}).get("best_config"))):
        if not config:
            continue
        params = {k: [v] for k, v in config.items()}
        rest = list(args)
        kw = {k: v for k, v in kwargs.items() if k not in _NOT_RETIMED}
        if kwargs.get("simulation_mode"):
            kw["cache"] = kwargs.get("cache")  # replayed, not written
        if len(rest) > 3:
            rest[3] = params
        else:
            kw["tune_params"] = params
        row = {"config": config}
        try:
            results, _ = kato.tune_kernel(kernel_name, *rest, **kw, isolate=False, quiet=True)
            (first,) = results
            if isinstance(first.get("time"), float):
                row["ms"] = first["time"]
            else:
                why = first.get("error") or first.get("time")
                row["failure"] = f"{first.get('status', '')} {why}"[:300]
        except Exception as exc:
            row["failure"] = f"{type(exc).__name__}: {exc}"[:300]
        out[tool] = row
    return out


if _MODE in ("kato", "kt") and _OUT:
    import kernel_tuner
    import kernel_tuner.interface

    _real = kernel_tuner.tune_kernel

    def tune_kernel(kernel_name, *args, **kwargs):
        t0 = time.perf_counter()
        call, _calls[0] = _calls[0], _calls[0] + 1  # a failed call counts too
        record = {"tool": _MODE, "kernel_name": kernel_name, "call": call,
                  "signature": _signature(kernel_name, args, kwargs)}  # fmt: skip
        if _MAX_FEVALS and kwargs.get("strategy") in (None, "brute_force"):
            kwargs["strategy"] = _KT_STRATEGY if _MODE == "kt" else None
            kwargs["strategy_options"] = {"max_fevals": _MAX_FEVALS}
            record["max_fevals"], record["strategy"] = _MAX_FEVALS, kwargs["strategy"] or "kato"
        try:
            if _MODE == "kato":
                import kato

                results, env = kato.tune_kernel(kernel_name, *args, **kwargs)
            else:
                results, env = _real(kernel_name, *args, **kwargs)
        except Exception as exc:
            record.update(error=f"{type(exc).__name__}: {exc}"[:2000],
                          wall_s=time.perf_counter() - t0)  # fmt: skip
            with open(_OUT, "a") as f:
                f.write(json.dumps(record) + "\n")
            raise
        wall = time.perf_counter() - t0
        ok = [r for r in results if isinstance(r.get("time"), float)]
        best = min(ok, key=lambda r: r["time"]) if ok else None
        params = list(args[3]) if len(args) > 3 else list(kwargs.get("tune_params", {}))
        record.update(
            measured=len(results),
            failed=len(results) - len(ok),
            wall_s=wall,
            configs_per_minute=60.0 * len(results) / wall if wall > 0 else None,
            best_config={k: _plain(best[k]) for k in params} if best else None,
            best_time_own_ms=best["time"] if best else None,
            # Where a call's time went: its configs' compile time (ms each, both tools' rows).
            compile_s=sum(r.get("compile_time") or 0.0 for r in results) / 1e3,
            failures=sorted(
                {
                    f"{r.get('status', '')} {r.get('error') or r.get('time')}"[:300]
                    for r in results
                    if r not in ok
                }
            )[:5],
        )
        with open(_OUT, "a") as f:  # before the re-measurements: a cut run keeps the call
            f.write(json.dumps(record, default=str) + "\n")
        if _MODE == "kato" and _RETIME:
            kt_record = _paired(record)
            retimed = _retime(kernel_name, args, kwargs, record["best_config"], kt_record)
            with open(_OUT, "a") as f:
                f.write(json.dumps({"retimed_call": call, "retimed": retimed}) + "\n")
        return results, env

    kernel_tuner.tune_kernel = tune_kernel
    kernel_tuner.interface.tune_kernel = tune_kernel
