"""The softmax_backward kernel's logic on the CPU: the real template compiled as host C++
against tests/kernels/cuda_emulation.py, every (dtype, ROW_THREADS, CACHE) on awkward shapes
(tests/kernels/rowwise_emulation.py), verified with the spec's tolerance exactly as the GPU
backend verifies."""

from __future__ import annotations

import numpy as np
import rowwise_emulation
from cuda_emulation import run_cases
from kato.kernels import get_operator

SPEC = get_operator("softmax_backward")


def test_kernel_logic_on_the_cpu(tmp_path, monkeypatch) -> None:
    rowwise_emulation.set_up(monkeypatch)
    cases = rowwise_emulation.cases(SPEC, {})
    covered = {(c.dtype, c.config["ROW_THREADS"], c.config["CACHE"]) for c in cases}
    assert len(covered) == 3 * 4 * 3
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    failures = run_cases(cases, tmp_path, np.random.default_rng(2026))
    assert not failures, "\n".join(failures[:20])
