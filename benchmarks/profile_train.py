"""Where a training step's time goes, Kato vs eager PyTorch: torch.profiler over a few steps of
one model (benchmarks/torch_train.py's), the top kernels by GPU time and the GPU's busy share
of the wall time (a step whose GPU idles is bound by the CPU: Python and launch overhead).

    python benchmarks/profile_train.py --model gpt2 --dtype bfloat16 --db sqlite:///kato.db

``--compile`` profiles ``torch.compile`` of both models too and lists the keys the policy sent
to Kato's kernels while tracing (a compiled graph's decisions are made once, at trace time).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import kato_torch  # noqa: E402
from benchmarks.torch_train import DbLookups, build, step  # noqa: E402


def run(label, model, inputs, steps, top):
    for _ in range(3):
        step(model, inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, inputs)
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - start) * 1e3 / steps
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(model, inputs)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    # Kernels and copies only: an aten op's device time is its kernels' again.
    gpu_ms = sum(e.self_device_time_total for e in events
                 if e.device_type == DeviceType.CUDA) / 1e3 / steps  # fmt: skip
    print(f"== {label}: {plain_ms:.2f} ms/step unprofiled; profiled: wall {wall_ms:.2f} "
          f"ms/step, GPU busy {gpu_ms:.2f} ms/step ({100 * gpu_ms / wall_ms:.0f}%)")  # fmt: skip
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def python_profile(label, model, inputs, steps, top):
    """cProfile of the step's Python: where the CPU time of a CPU-bound step goes."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    with cProfile.Profile() as pr:
        for _ in range(steps):
            step(model, inputs)
        torch.cuda.synchronize()
    print(f"== {label}: Python profile over {steps} steps (by own time)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--db")
    ap.add_argument("--policy", default="auto", choices=["auto", "kato"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--python", action="store_true", help="also cProfile the Kato step")
    ap.add_argument("--compile", action="store_true", help="also torch.compile of both")
    args = ap.parse_args()
    base, inputs, _ = build(args.model, getattr(torch, args.dtype), None)
    kato_model = kato_torch.patch(copy.deepcopy(base))
    kato_torch.configure(client=DbLookups(args.db) if args.db else None, policy=args.policy)
    with kato_torch.record() as rec:
        step(kato_model, inputs)
    kato_torch.prepare(rec.keys)
    run("eager", base, inputs, args.steps, args.top)
    run("kato", kato_model, inputs, args.steps, args.top)
    if args.python:
        python_profile("kato", kato_model, inputs, args.steps, args.top)
    if args.compile:
        from kato_torch import policy

        decided = []
        verdict = policy.verdict  # what kato_torch.ops asks, traced calls included

        def logged(operator, shape, dtype, device, compiled=False):
            answer = verdict(operator, shape, dtype, device, compiled)
            decided.append((operator, tuple(shape), dtype, compiled, answer == policy.KATO))
            return answer

        policy.verdict = logged
        run("compile", torch.compile(base), inputs, args.steps, args.top)
        run("kato+compile", torch.compile(kato_model), inputs, args.steps, args.top)
        policy.verdict = verdict
        chosen = sorted({d for d in decided if d[4] and d[3]})
        print(f"== traced decisions: {len(decided)}, Kato's kernel for {len(chosen)}: {chosen}")


if __name__ == "__main__":
    main()
