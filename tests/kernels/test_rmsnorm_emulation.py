"""The rmsnorm kernel's logic on the CPU: the real template compiled as host C++ against
tests/kernels/cuda_emulation.py, every (dtype, ROW_THREADS, CACHE) on awkward shapes
(tests/kernels/rowwise_emulation.py: odd widths whose head moves from row to row, and widths
where the weight stays in registers), y and rstd verified with the spec's tolerances exactly as
the GPU backend verifies."""

from __future__ import annotations

import numpy as np
import rowwise_emulation
from cuda_emulation import run_cases
from kato.kernels import get_operator

SPEC = get_operator("rmsnorm")


def test_kernel_logic_on_the_cpu(tmp_path, monkeypatch) -> None:
    rowwise_emulation.set_up(monkeypatch)
    cases = rowwise_emulation.cases(SPEC, {}, seed=1)
    covered = {(c.dtype, c.config["ROW_THREADS"], c.config["CACHE"]) for c in cases}
    assert len(covered) == 3 * 4 * 3
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    assert any(SPEC.defines(c.config, c.shape, c.dtype)["WB_REGS"] for c in cases)
    failures = run_cases(cases, tmp_path, np.random.default_rng(2027))
    assert not failures, "\n".join(failures[:20])
