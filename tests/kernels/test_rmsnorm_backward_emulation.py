"""The rmsnorm_backward kernels' logic on the CPU: the real template compiled as host C++
against tests/kernels/cuda_emulation.py, both stages run as the spec's steps, every (dtype,
ROW_THREADS, CACHE, DW_ACC) that is valid on some awkward shape (tests/kernels/
rowwise_emulation.py), dx and dweight verified with the problem's tolerances exactly as the GPU
backend verifies."""

from __future__ import annotations

import numpy as np
import rowwise_emulation
from cuda_emulation import run_cases
from kato.kernels import get_operator

SPEC = get_operator("rmsnorm_backward")


def test_kernel_logic_on_the_cpu(tmp_path, monkeypatch) -> None:
    rowwise_emulation.set_up(monkeypatch)
    cases = rowwise_emulation.cases(SPEC, {"DW_ACC": (0, 1, 2)}, seed=2)
    covered = {
        (c.dtype, c.config["ROW_THREADS"], c.config["CACHE"], c.config["DW_ACC"]) for c in cases
    }
    # DW_ACC=2 only in block mode: 3 dtypes x (3 warp widths x 3 caches x 2 + 3 caches x 3).
    assert len(covered) == 3 * (3 * 3 * 2 + 3 * 3)
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    assert {c.config["SPLIT"] for c in cases} == set(SPEC.params["SPLIT"])
    failures = run_cases(cases, tmp_path, np.random.default_rng(2028))
    assert not failures, "\n".join(failures[:20])
