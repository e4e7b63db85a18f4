"""Kernel Tuner's reduction example (``problem_size="num_blocks"``, ``verify=`` its partial
reduction check) through a local ``kato.tune_kernel`` on the GPU: a verify function that
pickles runs in the measuring child, a lambda in this process; one that says False or raises
makes every config a verify error carrying why."""

from __future__ import annotations

import numpy as np
import pytest
from user_ops.test_problem_size_expressions import SUM_FLOATS, TUNE, N
from user_ops.test_verify_function import verify_partial_reduce

import kato


def _tune(tmp_path, verify, **kw):
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    args = [np.zeros(max(TUNE["num_blocks"]), np.float32), x, np.int32(N)]
    return kato.tune_kernel(
        "sum_floats", SUM_FLOATS, "num_blocks", args, TUNE, grid_div_x=[],
        answer=[x.sum(dtype=np.float64), None, None], atol=0.05, verify=verify,
        db=f"sqlite:///{tmp_path / 'kato.db'}", quiet=True, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "verify",
    [verify_partial_reduce, lambda a, r, atol=None: np.isclose(a[0], r[0].sum(), atol=atol)],
    ids=["module-level (child)", "lambda (in process)"],
)
def test_kernel_tuners_reduction_example_verifies(tmp_path, verify):
    results, env = _tune(tmp_path, verify, name=f"gpu_sum_floats_{id(verify) % 1000}")
    assert env["status"] == "done", env
    bad = [r for r in results if r["status"] != "ok"]
    assert len(results) == 36 and not bad, bad[:3]
    print("sum_floats", env["best_config"], env["best_time"], env["configs_per_minute"])


@pytest.mark.parametrize(
    ("verify", "says"),
    [
        (lambda a, r, atol=None: False, "the verify function returned False"),
        (lambda a, r, atol=None: r[7], "the verify function raised IndexError"),
    ],
)
def test_a_failing_verify_function_is_a_verify_error(tmp_path, verify, says):
    results, _ = _tune(tmp_path, verify, name="gpu_sum_floats_wrong",
                       strategy_options={"max_fevals": 4}, strategy="random")  # fmt: skip
    assert results and all(r["status"] == "verify_error" for r in results), results
    assert all(says in r["error"] for r in results)
