"""Host cost of a ``kato_torch.user_kernel`` call on the CPU, without a GPU: ``plan()`` (the
argument checks, the shape, the outputs allocated), the gate that sends a plain eager call past
the dispatcher (``_direct`` + ``eager()``, as for Kato's own operators), and a whole call up to
the device check (on CPU tensors a call is refused there, after planning). The test folder's
vector_add at n = 4096, float32; timeit, best and median of 7 repeats.

    python3 benchmarks/user_kernel_host.py
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from kato.kernels import InvalidInput  # noqa: E402
from kato.kernels.user import spec_from_folder  # noqa: E402

import kato_torch  # noqa: E402
from kato_torch._op import _direct, eager  # noqa: E402


def best(fn, number: int) -> tuple[float, float]:
    """(min, median) microseconds a call of ``fn``."""
    times = timeit.repeat(fn, number=number, repeat=7)
    return min(times) / number * 1e6, statistics.median(times) / number * 1e6


def main() -> None:
    add = kato_torch.user_kernel(spec_from_folder(ROOT / "tests/user_ops/data/vector_add"))
    a, b = torch.randn(4096), torch.randn(4096)

    def call() -> None:
        with contextlib.suppress(InvalidInput):  # CPU tensors: refused after plan()
            add(a, b, 4096)

    rows = {
        "plan": best(lambda: add.plan(a, b, 4096), 2000),
        "eager gate": best(lambda: (_direct((a, b, 4096)), eager()), 20000),
        "call to the device check": best(call, 2000),
    }
    for name, (low, median) in rows.items():
        print(f"{name:26s} {low:8.2f} us best, {median:8.2f} us median")


if __name__ == "__main__":
    main()
