"""Kernel Tuner's ``verify=`` functions in a local ``kato.tune_kernel``: called as Kernel Tuner
calls them (``verify(answer, result_host, atol=...)``) in place of the comparison with the
answer, which may then have any size; part of the version; refused through a service and where
it cannot reach the measuring process that was asked for. The device path runs in
tests/gpu/test_user_verify_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels.spec import InvalidInput

import kato
from kato.kernel_tuner import operator_from_arguments
from user_ops.recording import record
from user_ops.test_problem_size_expressions import SUM_FLOATS, TUNE, N

seen: list = []


def verify_partial_reduce(cpu_result, gpu_result, atol=None):
    """Kernel Tuner's examples/cuda/reduction.py verify function."""
    seen.append((cpu_result, gpu_result, atol))
    return np.isclose(cpu_result[0], np.sum(gpu_result[0]), atol=atol)


def _args():
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    return [np.zeros(max(TUNE["num_blocks"]), np.float32), x, np.int32(N)], x


def _op(verify=verify_partial_reduce, answer="sum"):
    args, x = _args()
    answer = [np.float32(x.sum(dtype=np.float64)), None, None] if answer == "sum" else answer
    op, spec = operator_from_arguments(
        "sum_floats", SUM_FLOATS, "num_blocks", args, TUNE, grid_div_x=[], answer=answer,
        atol=1e-3, verify=verify,
    )  # fmt: skip
    return op, spec, args, x


def test_the_function_decides_as_kernel_tuners_does():
    op, spec, args, x = _op()
    assert not any(a.get("output") for a in spec["arguments"])  # nothing compared on device
    problem = op.make_problem((N,), "float32", np.random.default_rng(0))
    assert problem.outputs == [] and problem.references == []
    assert op.device_reference((N,), "float32") is None
    assert op.verified_arguments() == [0]
    partial = np.zeros(1024, np.float32)
    partial[:3] = [x[:10].sum(), x[10:500].sum(), x[500:].sum()]  # what 3 blocks would write
    seen.clear()
    assert op.check_results([partial, None, None], "float32") is None
    ((answer, result, atol),) = seen
    assert answer[0] == pytest.approx(x.sum(dtype=np.float64), rel=1e-6) and answer[1] is None
    assert result[0] is partial and result[1] is None and atol == 1e-3
    partial[1] += 1
    assert op.check_results([partial, None, None], "float32") == (
        "the verify function returned False"
    )


def test_a_function_that_raises_fails_the_config_with_its_error():
    def broken(answer, result, atol=None):
        return result[5].sum()  # no such argument

    op, *_ = _op(verify=broken)
    assert op.check_results([np.zeros(3), None, None], "float32") == (
        "the verify function raised IndexError: list index out of range"
    )


def test_without_an_answer_every_array_is_handed_over():
    op, *_ = _op(verify=lambda answer, result, atol=None: answer is None, answer=None)
    assert op.verified_arguments() == [0, 1]
    assert op.check_results([np.zeros(1), np.zeros(1), None], "float32") is None


def test_the_function_is_part_of_the_version():
    def other(answer, result, atol=None):
        return True

    assert _op()[0].version != _op(verify=other)[0].version
    assert _op()[0].version == _op()[0].version


def test_simulation_mode_takes_a_verify_function(tmp_path):
    op, _, args, x = _op()
    path, best = record(op, (N,), tmp_path / "sum_floats.json")
    results, env = kato.tune_kernel(
        "sum_floats", SUM_FLOATS, "num_blocks", args, TUNE, grid_div_x=[],
        answer=[x.sum(), None, None], verify=verify_partial_reduce, cache=str(path),
        simulation_mode=True, db=f"sqlite:///{tmp_path / 'kato.db'}",
    )  # fmt: skip
    assert env["status"] == "done" and env["best_config"] == best and len(results) == 36


def test_refused_where_it_cannot_run():
    args, x = _args()
    common = ("sum_floats", SUM_FLOATS, "num_blocks", args, TUNE)
    with pytest.raises(InvalidInput, match="verify functions run only in a local"):
        kato.tune_kernel(*common, verify=verify_partial_reduce, service="http://kato:8000")
    with pytest.raises(InvalidInput, match="cannot be sent to the measuring process"):
        kato.tune_kernel(*common, verify=lambda a, r, atol=None: True, isolate=True)
