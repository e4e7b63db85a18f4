"""The rmsnorm_backward spec: constraints (DW_ACC), defaults, rendering, the two steps' launch
geometry, problems, references, tolerances and buffers."""

from __future__ import annotations

import math

import kato.kernels.rmsnorm_backward as rb
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, Step, get_operator, limits, list_operators
from kato.kernels.rmsnorm_backward import RMSNormBackwardSpec, rmsnorm_backward_reference

SPEC = get_operator("rmsnorm_backward")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 2),
    (3, 7),
    (1000, 1),
    (1048576, 128),
    (8192, 768),
    (8192, 4096),
    (3000, 3001),
    (1024, 50257),
    (16, 131072),
    (7, 1000003),
]


def cfg(block=256, vec=4, row_threads=0, cache=0, dw_acc=1, split=2, lanes=16, min_blocks=0):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "ROW_THREADS": row_threads,
        "CACHE": cache,
        "MIN_BLOCKS": min_blocks,
        "DW_ACC": dw_acc,
        "SPLIT": split,
        "REDUCE_LANES": lanes,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, RMSNormBackwardSpec) and SPEC in list_operators()
    assert SPEC.kernel_names == ("rmsnorm_bwd", "rmsnorm_bwd_reduce")
    assert list(SPEC.params)[-3:] == ["DW_ACC", "SPLIT", "REDUCE_LANES"]
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2 * 3 * 4 * 2


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(dw_acc=0, vec=4), (64, 1022), "float32", "DW_ACC=0 needs cols % VEC == 0"),
        (cfg(dw_acc=2, row_threads=32), (64, 1024), "float32", "needs ROW_THREADS=0"),
        (cfg(dw_acc=1), (64, 60000), "float32", "shared memory"),  # 240000 bytes of dweight
        (cfg(dw_acc=1, row_threads=8, block=1024), (64, 768), "float32", "shared memory"),
        (cfg(dw_acc=0, row_threads=8, block=128, vec=1), (64, 256), "float32", "ITEMS=32"),
        (cfg(dw_acc=0, block=1024, vec=4), (64, 65536), "float32", "would spill"),
        (cfg(cache=2, dw_acc=1, block=1024, vec=4), (64, 32768), "float32", "would spill"),
        (cfg(split=3), (64, 1024), "float32", "not one of"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(dw_acc=1, vec=8), (64, 50257), "bfloat16"),  # odd width: dweight in shared memory
        (cfg(dw_acc=2, vec=4, block=1024), (7, 1000003), "float32"),  # or in global memory
        (cfg(dw_acc=0, vec=8, row_threads=32, cache=2), (64, 768), "bfloat16"),
        (cfg(dw_acc=0, vec=4), (64, 4096), "float32"),
        (cfg(dw_acc=1, row_threads=32, block=1024), (64, 768), "float32"),  # 32 x 3 KiB
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_register_model() -> None:
    """DW_ACC=0 holds its float accumulators, and streaming (CACHE 0/1) also the x and dy
    vectors its unrolled pass loads first; the weight joins them only where it fits."""
    c = cfg(dw_acc=0, vec=4, row_threads=32, cache=0)
    assert rb.accumulator_registers(c, 768) == 3 * 6 * 4
    assert rb.accumulator_registers({**c, "CACHE": 2}, 768) == 6 * 4
    assert rb.accumulator_registers({**c, "DW_ACC": 1}, 768) == 0
    assert SPEC.defines({**c, "CACHE": 2}, (64, 768), "float32")["WB_REGS"] == 1
    assert SPEC.defines({**c, "DW_ACC": 1}, (64, 768), "float32")["WB_REGS"] == 0
    big = cfg(dw_acc=0, vec=4, block=512, cache=2)  # a cap of 128 registers
    assert SPEC.check(big, (64, 8192), "float32") is None  # 16 + 2 x 16 + 64
    assert SPEC.defines(big, (64, 8192), "float32")["WB_REGS"] == 0  # + 16 + 72 - 64: no room
    assert SPEC.defines(big, (64, 4096), "float32")["WB_REGS"] == 1
    assert "would spill" in SPEC.check({**big, "BLOCK_SIZE": 1024}, (64, 4096), "float32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    for step in SPEC.steps(config, shape, dtype):
        assert step.launch.grid[0] >= 1 and step.launch.threads_per_block <= 1024


def test_default_config_choices() -> None:
    assert SPEC.default_config((8192, 768), "bfloat16")["DW_ACC"] == 0  # registers
    assert SPEC.default_config((8192, 4096), "float32")["DW_ACC"] == 0
    assert SPEC.default_config((8192, 50257), "bfloat16")["DW_ACC"] == 1  # odd: shared
    assert SPEC.default_config((7, 1000003), "float32")["DW_ACC"] == 2  # too long: global
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 0), "float32")


def test_steps_and_launch_geometry() -> None:
    config = cfg(block=256, row_threads=32, dw_acc=1, split=4, lanes=4, vec=8)
    steps = SPEC.steps(config, (100000, 768), "bfloat16")
    assert steps == [
        Step(
            "rmsnorm_bwd",
            Launch(grid=(4 * limits.NUM_SMS, 1, 1), block=(256, 1, 1), shared_bytes=8 * 768 * 4),
        ),
        Step("rmsnorm_bwd_reduce", Launch(grid=(24, 1, 1), block=(32, 4, 1))),
    ]
    few = SPEC.launch(config, (20, 768), "bfloat16")
    assert few.grid == (math.ceil(20 / 8), 1, 1)  # one block per row group of rows
    assert SPEC.render(config, (20, 768), "bfloat16") == SPEC.render(
        {**config, "SPLIT": 1, "REDUCE_LANES": 16}, (20, 768), "bfloat16"
    )  # launch geometry only


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    shape = (37, 300)
    problem = SPEC.make_problem(shape, dtype, np.random.default_rng(1))
    x, w, rstd, dy, dx, dw, partials, nparts, rows, cols = problem.args
    t = DTYPES[dtype][0]
    assert x.dtype == w.dtype == dy.dtype == dx.dtype == dw.dtype == t
    assert rstd.dtype == partials.dtype == np.float32 and nparts.dtype == np.int32
    assert partials.size == rb.partial_rows(37) * 300 and nparts.tolist() == [0]
    assert (rows, cols) == shape and problem.outputs == [4, 5]
    assert np.isnan(dx.astype(np.float64)).all() and np.isnan(dw.astype(np.float64)).all()
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rstd, 1 / np.sqrt((x64 * x64).mean(axis=1) + rb.EPS), rtol=1e-6)
    (dx_tol, (dw_atol, dw_rtol)) = problem.tolerances
    assert dx_tol == SPEC.tolerance(dtype) and dw_rtol == rb.DW_RTOL[dtype]
    _, _, dw_abs = rmsnorm_backward_reference(x, w, rstd, dy)
    assert dw_atol == pytest.approx(rb.DW_SUM_ERROR * dw_abs.max())
    # The rows that correlate dy with y make the mean(w dy x) term as large as w dy.
    g = (w.astype(np.float64) * dy.astype(np.float64) * x64).mean(axis=1)
    term = np.abs(x64 * (rstd[:, None] ** 2 * g[:, None])).mean(axis=1)
    assert np.all(term[1::4] > 0.3 * np.abs(w.astype(np.float64) * dy.astype(np.float64)).mean())


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((5, 9), "bfloat16", np.random.default_rng(2))
    x, w, rstd, dy = (a.astype(np.float64) for a in problem.args[:4])
    ref_dx, ref_dw = problem.references
    for r in range(5):
        s = sum(w[c] * dy[r, c] * x[r, c] for c in range(9)) / 9
        for c in range(9):
            want = rstd[r] * (w[c] * dy[r, c] - x[r, c] * rstd[r] ** 2 * s)
            assert ref_dx[r, c] == pytest.approx(want, rel=1e-12, abs=1e-14)
    for c in range(9):
        want = sum(dy[r, c] * x[r, c] * rstd[r] for r in range(5))
        assert ref_dw[c] == pytest.approx(want, rel=1e-12, abs=1e-14)


def test_reference_gradient_matches_finite_differences() -> None:
    """dx and dweight are the gradient of sum(dy * rmsnorm(x, w)) (central differences)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 6))
    w = rng.uniform(0.5, 1.5, 6)
    dy = rng.standard_normal((3, 6))
    eps = rb.EPS

    def loss(x_, w_):
        r = 1 / np.sqrt((x_ * x_).mean(axis=1, keepdims=True) + eps)
        return float((dy * x_ * r * w_).sum())

    rstd = 1 / np.sqrt((x * x).mean(axis=1) + eps)
    dx, dw, _ = rmsnorm_backward_reference(x, w, rstd, dy)
    h = 1e-6
    for i, j in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i, j] = h
        assert dx[i, j] == pytest.approx((loss(x + e, w) - loss(x - e, w)) / (2 * h), rel=1e-6)
    for j in range(6):
        e = np.zeros_like(w)
        e[j] = h
        assert dw[j] == pytest.approx((loss(x, w + e) - loss(x, w - e)) / (2 * h), rel=1e-6)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_references_are_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((64, 1000), dtype, np.random.default_rng(8))
    for ref, (atol, rtol) in zip(problem.references, problem.tolerances, strict=True):
        ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
        np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
        assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    # One row's dweight term left out fails.
    x, w, rstd, dy = problem.args[:4]
    _, dw_missing, _ = rmsnorm_backward_reference(x[1:], w, rstd[1:], dy[1:])
    atol, rtol = problem.tolerances[1]
    assert not np.allclose(dw_missing, problem.references[1], atol=atol, rtol=rtol)


def test_bytes_moved_and_buffers() -> None:
    rows, cols = 8192, 768
    assert (
        SPEC.bytes_moved((rows, cols), "bfloat16") == 3 * rows * cols * 2 + 2 * cols * 2 + 4 * rows
    )
    assert SPEC.buffer_bytes((rows, cols), "bfloat16") == (
        SPEC.bytes_moved((rows, cols), "bfloat16") + 4 * rb.MAX_SPLIT * limits.NUM_SMS * cols + 4
    )
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
