"""Host cost of a training step through kato_torch, without a GPU: the MLP of
``benchmarks/torch_train.py`` (small widths, CPU tensors), patched and fused, against the plain
model, with the policy's verdict forced for every key.

Modes (``--modes``):

- ``eager``: the plain PyTorch model (no kato_torch);
- ``torch``: every key's verdict TORCH (PyTorch's op; the drop-ins' fallback path);
- ``when_busy``: every key WHEN_BUSY, the backlog answering "not lagging" (a step bound by the
  host: PyTorch's op after the probe);
- ``when_busy_lagging``: every key WHEN_BUSY, the backlog answering "lagging" (Kato's kernels);
- ``kato``: every key KATO.

A CPU tensor's key is always PyTorch's op (``policy.verdict``), so the benchmark forces the
verdict where kato_torch asks it (``ops._decide``), stands in for the backlog's CUDA probe
(``_backlog.stream_lags``) and for the kernels (a bound operator that reads each argument's
data pointer, as ``kato_torch_host_lines.py`` does). For each mode: lines of Python per step
(``sys.settrace``, in kato_torch's modules, in PyTorch's and elsewhere: deterministic), backlog
probes per step, and the median and best host CPU time per step (microseconds of the
thread's CPU time, one intra-op thread; they vary with the machine and, less, its load).

    python3 benchmarks/kato_torch_mlp_host.py --out mlp_host.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kato_torch  # noqa: E402
from benchmarks.kato_torch_host_lines import StandInLaunch, count_lines  # noqa: E402
from benchmarks.torch_train import MLP  # noqa: E402
from kato_torch import _backlog, ops, policy  # noqa: E402

MODES = ("eager", "torch", "when_busy", "when_busy_lagging", "kato")
VERDICTS = {
    "torch": policy.TORCH,
    "when_busy": policy.WHEN_BUSY,
    "when_busy_lagging": policy.WHEN_BUSY,
    "kato": policy.KATO,
}


class StandInBacklog:
    """The backlog's answer, fixed (``lag``), counting the probes."""

    def __init__(self, lag: bool):
        self.lag = lag
        self.probes = 0

    def __call__(self, t: torch.Tensor) -> bool:
        self.probes += 1
        return self.lag


def force(verdict: int) -> None:
    """Every key kato_torch decides gets ``verdict``; kernels launch nothing."""
    kato_torch.configure(client=None, policy="auto")  # drops every cached decision
    ops._decide = lambda *a, **k: verdict
    ops.bind = lambda *a, **k: StandInLaunch()


def stand_in_backlog(backlog: StandInBacklog) -> None:
    """The backlog's CUDA probe (``_backlog.stream_lags``: an event per stream) answered by
    ``backlog``, and no CUDA graph being captured (``_backlog.capturing``); everything around
    them (one answer per call, the backoff) runs as on a GPU."""
    _backlog.stream_lags = backlog
    _backlog.capturing = lambda: False


def models(dims: tuple[int, ...]) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    base = MLP(dims=dims)
    return base, kato_torch.fuse(kato_torch.patch(copy.deepcopy(base)))


def step_fn(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor):
    def step() -> None:
        model(x, labels).backward()

    return step


def per_step_us(step, steps: int, repeats: int) -> tuple[float, float]:
    """(median, best) microseconds of this thread's CPU time per step over ``repeats`` blocks
    of ``steps`` (CPU time, not wall time: a loaded machine's other processes count less)."""
    for _ in range(steps):
        step()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(steps):
            step()
        times.append((time.thread_time() - start) / steps * 1e6)
    return statistics.median(times), min(times)


def measure(mode: str, dims, batch: int, steps: int, repeats: int) -> dict:
    base, fused = models(dims)
    x, labels = torch.randn(batch, dims[0]), torch.randint(0, dims[-1], (batch,))
    backlog = StandInBacklog(lag=mode == "when_busy_lagging")
    saved = ops._decide, ops.bind, _backlog.stream_lags, _backlog.capturing
    try:
        if mode != "eager":
            force(VERDICTS[mode])
            stand_in_backlog(backlog)
        step = step_fn(base if mode == "eager" else fused, x, labels)
        for _ in range(100):  # caches filled, any backoff settled: a training loop's state
            step()
        backlog.probes = 0
        lines = count_lines(step)
        probes = backlog.probes
        median, best = per_step_us(step, steps, repeats)
    finally:
        ops._decide, ops.bind, _backlog.stream_lags, _backlog.capturing = saved
        kato_torch.configure(client=None)
    return {"mode": mode, "lines": lines, "probes": probes, "us_per_step": round(median, 1),
            "best_us_per_step": round(best, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dims", default="16,32,32,10", help="MLP widths (in, hidden, hidden, out)"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=200, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=7, help="timed blocks (median)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dims = tuple(int(d) for d in args.dims.split(","))
    torch.set_num_threads(1)
    rows = []
    head = ("kato_torch", "torch", "other", "probes", "us/step", "best")
    print(f"{'mode':18} " + " ".join(f"{h:>10}" for h in head))
    for mode in args.modes.split(","):
        row = measure(mode, dims, args.batch, args.steps, args.repeats)
        rows.append(row)
        lines = row["lines"]
        cells = (lines["kato_torch"], lines["torch"], lines["other"], row["probes"],
                 row["us_per_step"], row["best_us_per_step"])  # fmt: skip
        print(f"{mode:18} " + " ".join(f"{c:>10}" for c in cells))
    report = {"dims": dims, "batch": args.batch, "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
