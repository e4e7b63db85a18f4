"""A stand-in for the framework baseline's CUDA side, imported first by the measuring child
(``tuner.framework.measure_in_child(..., imports=["framework_child_stand_in"])``; the child finds
it on the inherited sys.path): a fake ``torch`` that sees one H200, and a fake
``kato.tuner.torch_ops`` whose eager measurement answers at once and whose compiled one does
what ``KATO_TEST_COMPILED_STAND_IN`` says:

- ``ok`` (default): a timed result;
- ``exit``: ``os._exit(3)`` (the child dies while compiling, without a word).

Both results name the problem's seed in ``op`` (``"seed N"``), and in ``detail`` how many
distinct problem objects the child has handed the two so far (``"problems N"``, 0 for none); the
compiled one adds Inductor's ``compile_threads`` as the child left it, so a test sees what the
child passed.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import kato.tuner
from kato.tuner.framework import OK, FrameworkResult

torch: Any = ModuleType("torch")
torch.__version__ = "9.9.9+stand-in"
torch.cuda = SimpleNamespace(
    is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda index: "NVIDIA H200"
)
inductor: Any = ModuleType("torch._inductor")
inductor.config = ModuleType("torch._inductor.config")
inductor.config.compile_threads = 16
torch._inductor = inductor
sys.modules.update(
    {"torch": torch, "torch._inductor": inductor, "torch._inductor.config": inductor.config}
)


#: The problems handed to either measurement, kept alive so that their ids stay distinct.
_problems: list[Any] = []


def _problems_seen(problem: Any) -> str:
    if problem is not None:
        _problems.append(problem)
    return f"problems {len({id(p) for p in _problems})}"


def measure(
    spec, shape, dtype, *, device_index=0, seed=None, problem=None, **_: Any
) -> FrameworkResult:
    return FrameworkResult(
        OK, "torch 9.9.9+stand-in", f"seed {seed}", (0.2, 0.1, 0.3), _problems_seen(problem)
    )


def measure_compiled(
    spec, shape, dtype, *, device_index=0, seed=None, before_timing=None, problem=None, **_
):
    if os.environ.get("KATO_TEST_COMPILED_STAND_IN") == "exit":
        os._exit(3)
    if before_timing is not None:  # compiled and checked: the timing waits for the GPU's turn
        before_timing()
    threads = torch._inductor.config.compile_threads
    return FrameworkResult(
        OK, "torch.compile 9.9.9+stand-in inductor", f"seed {seed}", (0.05, 0.04, 0.06),
        detail=f"compile_threads {threads}; {_problems_seen(problem)}",
    )  # fmt: skip


torch_ops: Any = ModuleType("kato.tuner.torch_ops")
torch_ops.EQUIVALENTS = {"softmax": None}
torch_ops.measure, torch_ops.measure_compiled = measure, measure_compiled
sys.modules["kato.tuner.torch_ops"] = torch_ops
kato.tuner.torch_ops = torch_ops
