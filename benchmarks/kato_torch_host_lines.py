"""Lines of kato_torch's Python a layer norm call executes, without a GPU: a deterministic
proxy for its host cost where no GPU (or only a loaded CPU) is at hand.

The kernels are replaced by a stand-in that reads each argument's data pointer, the policy is
forced to Kato's kernels, and ``sys.settrace`` counts the lines run in kato_torch's modules, in
PyTorch's and elsewhere, for one forward (no grad) and one forward + backward of a 64 x 768
float32 CPU tensor. Timing on a GPU: ``benchmarks/kato_torch_overhead.py``.

    python3 benchmarks/kato_torch_host_lines.py
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kato_torch  # noqa: E402
from kato_torch import ops, policy  # noqa: E402


class StandInLaunch:
    """A bound operator that launches nothing (it reads the pointers, as a launch does; its
    config is empty: a ReLU's MASK is then the default)."""

    config: dict = {}

    def run(self, args, steps=None, aligned_to=1):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                arg.data_ptr()


def count_lines(fn) -> dict[str, int]:
    """Lines of Python ``fn`` runs (any thread), by where they are: kato_torch, torch, other.
    A tracer already set (coverage's, say) is restored afterwards."""
    counts = {"kato_torch": 0, "torch": 0, "other": 0}

    def tracer(frame, event, arg):
        if event == "line":
            name = frame.f_code.co_filename
            kind = (
                "kato_torch"
                if "/kato_torch/" in name
                else "torch"
                if "/torch/" in name
                else "other"
            )
            counts[kind] += 1
        return tracer

    before = sys.gettrace(), threading.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(before[0])
        threading.settrace(before[1])
    return counts


def main() -> None:
    kato_torch.configure(client=None, policy="kato")
    ops._decide = lambda *a, **k: policy.KATO  # a CPU tensor would get PyTorch's op
    ops.bind = lambda *a, **k: StandInLaunch()
    cols = 768
    x, w, b = torch.randn(64, cols), torch.ones(cols), torch.zeros(cols)
    xg, dy = x.clone().requires_grad_(True), torch.randn(64, cols)

    def forward() -> None:
        kato_torch.layer_norm(x, (cols,), w, b)

    def forward_backward() -> None:
        torch.autograd.grad(kato_torch.layer_norm(xg, (cols,), w, b), (xg,), dy)

    report = {}
    for name, fn in (("forward, no grad", forward), ("forward + backward", forward_backward)):
        for _ in range(5):  # caches filled: the steady state of a training loop
            fn()
        report[name] = count_lines(fn)
        print(f"{name:20} {report[name]}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
