"""The add_rmsnorm kernel's logic on the CPU: the real template compiled as host C++ against
tests/kernels/cuda_emulation.py, every (dtype, ROW_THREADS, CACHE) that is valid on some awkward
shape (tests/kernels/rowwise_emulation.py: 1 row, 1 column, odd and prime widths, rows whose
head moves), s, y and rstd verified with the problem's tolerances exactly as the GPU backend
verifies."""

from __future__ import annotations

import numpy as np
import rowwise_emulation
from cuda_emulation import run_cases
from kato.kernels import get_operator

SPEC = get_operator("add_rmsnorm")


def test_kernel_logic_on_the_cpu(tmp_path, monkeypatch) -> None:
    rowwise_emulation.set_up(monkeypatch)
    cases = rowwise_emulation.cases(SPEC, {}, seed=4)
    covered = {(c.dtype, c.config["ROW_THREADS"], c.config["CACHE"]) for c in cases}
    assert len(covered) == 3 * 4 * 3
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    assert {c.shape[1] for c in cases} >= {1, 31, 1031}
    failures = run_cases(cases, tmp_path, np.random.default_rng(2030))
    assert not failures, "\n".join(failures[:20])
