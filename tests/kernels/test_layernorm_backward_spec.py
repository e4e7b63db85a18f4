"""The layernorm_backward spec: constraints (DW_ACC, the float2 row reduction), defaults,
rendering, the two steps' launch geometry, problems, references (against torch's autograd of
F.layer_norm in float64), tolerances and buffers."""

from __future__ import annotations

import math

import kato.kernels.layernorm_backward as lb
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, Step, get_operator, limits, list_operators
from kato.kernels.layernorm import layernorm_reference
from kato.kernels.layernorm_backward import LayerNormBackwardSpec, layernorm_backward_reference

SPEC = get_operator("layernorm_backward")
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
    assert isinstance(SPEC, LayerNormBackwardSpec) and SPEC in list_operators()
    assert SPEC.kernel_names == ("layernorm_bwd", "layernorm_bwd_reduce")
    assert list(SPEC.params)[-3:] == ["DW_ACC", "SPLIT", "REDUCE_LANES"]
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2 * 3 * 4 * 2


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(dw_acc=0, vec=4), (64, 1022), "float32", "DW_ACC=0 needs cols % VEC == 0"),
        (cfg(dw_acc=2, row_threads=32), (64, 1024), "float32", "needs ROW_THREADS=0"),
        (cfg(dw_acc=1), (64, 30000), "float32", "shared memory"),  # 240000 bytes: dw and db
        (cfg(dw_acc=1, row_threads=16, block=1024), (64, 768), "float32", "shared memory"),
        (cfg(dw_acc=0, row_threads=8, block=128, vec=1), (64, 256), "float32", "ITEMS=32"),
        (cfg(dw_acc=0, block=1024, vec=4), (64, 32768), "float32", "would spill"),
        (cfg(cache=2, dw_acc=2, block=1024, vec=4), (64, 32768), "float32", "would spill"),
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
        (cfg(dw_acc=1, vec=8), (64, 20011), "bfloat16"),  # odd width: dw, db in shared memory
        (cfg(dw_acc=2, vec=4, block=1024), (7, 1000003), "float32"),  # or in global memory
        (cfg(dw_acc=0, vec=8, row_threads=32, cache=2), (64, 768), "bfloat16"),
        (cfg(dw_acc=0, vec=4), (64, 4096), "float32"),
        (cfg(dw_acc=1, row_threads=32, block=512), (64, 768), "float32"),  # 16 x 6 KiB
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_the_row_reduction_counts_two_floats_per_warp() -> None:
    """Block mode's static shared memory is a double-buffered float2 per warp: a config whose
    dynamic shared memory fits with rmsnorm_backward's float per warp but not with the float2
    is rejected."""
    config = cfg(block=1024, dw_acc=1, cache=0)
    assert lb.reduction_shared_bytes(config) == 2 * 32 * 8
    assert lb.reduction_shared_bytes({**config, "ROW_THREADS": 32}) == 0
    cols = (limits.MAX_SHARED_PER_BLOCK - 2 * 32 * 4) // 8  # dw and db rows: 8 bytes a column
    assert SPEC.check_common(config, (4, cols), "float32") is None
    assert "shared memory" in SPEC.check(config, (4, cols), "float32")


def test_register_model() -> None:
    """DW_ACC=0 holds float accumulators for dweight and dbias, and streaming (CACHE 0/1) also
    the x and dy vectors its unrolled pass loads first; the weight joins them only where it
    fits."""
    c = cfg(dw_acc=0, vec=4, row_threads=32, cache=0)
    assert lb.accumulator_registers(c, 768) == 4 * 6 * 4
    assert lb.accumulator_registers({**c, "CACHE": 2}, 768) == 2 * 6 * 4
    assert lb.accumulator_registers({**c, "DW_ACC": 1}, 768) == 0
    assert SPEC.defines({**c, "CACHE": 2}, (64, 768), "float32")["WB_REGS"] == 1
    assert SPEC.defines({**c, "DW_ACC": 1}, (64, 768), "float32")["WB_REGS"] == 0
    assert SPEC.defines({**c, "CACHE": 2}, (64, 768), "float32")["ITEMS"] == 6
    assert SPEC.defines({**c, "DW_ACC": 1}, (64, 768), "float32")["ITEMS"] == 0  # streaming
    assert "would spill" in SPEC.check(
        cfg(dw_acc=0, vec=4, block=1024, cache=2), (64, 8192), "float32"
    )


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
    assert SPEC.default_config((1024, 20011), "bfloat16")["DW_ACC"] == 1  # odd: shared
    assert SPEC.default_config((7, 1000003), "float32")["DW_ACC"] == 2  # too long: global
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 0), "float32")


def test_steps_and_launch_geometry() -> None:
    config = cfg(block=256, row_threads=32, dw_acc=1, split=4, lanes=4, vec=8)
    steps = SPEC.steps(config, (100000, 768), "bfloat16")
    shared = 8 * 2 * 768 * 4  # 8 row groups' dweight and dbias rows
    assert steps == [
        Step(
            "layernorm_bwd",
            Launch(grid=(4 * limits.NUM_SMS, 1, 1), block=(256, 1, 1), shared_bytes=shared),
        ),
        Step("layernorm_bwd_reduce", Launch(grid=(48, 1, 1), block=(32, 4, 1))),
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
    x, w, mean, rstd, dy, dx, dw, db, partials, nparts, rows, cols = problem.args
    t = DTYPES[dtype][0]
    assert x.dtype == w.dtype == dy.dtype == dx.dtype == dw.dtype == db.dtype == t
    assert mean.dtype == rstd.dtype == partials.dtype == np.float32 and nparts.dtype == np.int32
    assert partials.size == lb.partial_rows(37) * 2 * 300 and nparts.tolist() == [0]
    assert (rows, cols) == shape and problem.outputs == [5, 6, 7]
    for out in (dx, dw, db):
        assert np.isnan(out.astype(np.float64)).all()
    # mean and rstd are what the forward saves (its float64 reference, stored as float32).
    _, ref_mean, ref_rstd = layernorm_reference(x, w, w, lb.EPS)
    np.testing.assert_array_equal(mean, ref_mean.astype(np.float32))
    np.testing.assert_array_equal(rstd, ref_rstd.astype(np.float32))
    (dx_tol, (dw_atol, dw_rtol), (db_atol, db_rtol)) = problem.tolerances
    assert dx_tol == SPEC.tolerance(dtype) and dw_rtol == db_rtol == lb.DW_RTOL[dtype]
    _, _, _, dw_abs, db_abs = layernorm_backward_reference(x, w, mean, rstd, dy)
    assert dw_atol == pytest.approx(lb.DW_SUM_ERROR * dw_abs.max())
    assert db_atol == pytest.approx(lb.DW_SUM_ERROR * db_abs.max())
    # Rows 1, 5, ... make the xhat mean(w dy xhat) term, rows 2, 6, ... the mean(w dy) term as
    # large as w dy.
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    xhat = (x64 - mean[:, None]) * rstd[:, None]
    g = w64 * dy64
    scale = np.abs(g).mean()
    b = np.abs(xhat * (g * xhat).mean(axis=1, keepdims=True)).mean(axis=1)
    assert np.all(b[1::4] > 0.3 * scale)
    assert np.all(np.abs(g.mean(axis=1))[2::4] > 0.3 * scale)


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((5, 9), "bfloat16", np.random.default_rng(2))
    x, w, mean, rstd, dy = (a.astype(np.float64) for a in problem.args[:5])
    ref_dx, ref_dw, ref_db = problem.references
    for r in range(5):
        xh = [(x[r, c] - mean[r]) * rstd[r] for c in range(9)]
        a = sum(w[c] * dy[r, c] for c in range(9)) / 9
        b = sum(w[c] * dy[r, c] * xh[c] for c in range(9)) / 9
        for c in range(9):
            want = rstd[r] * (w[c] * dy[r, c] - a - xh[c] * b)
            assert ref_dx[r, c] == pytest.approx(want, rel=1e-12, abs=1e-14)
    for c in range(9):
        want_w = sum(dy[r, c] * (x[r, c] - mean[r]) * rstd[r] for r in range(5))
        assert ref_dw[c] == pytest.approx(want_w, rel=1e-12, abs=1e-14)
        assert ref_db[c] == pytest.approx(sum(dy[r, c] for r in range(5)), rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("shape", [(3, 7), (16, 1), (5, 300)], ids=lambda s: "x".join(map(str, s)))
def test_reference_equals_torch_autograd_in_float64(shape) -> None:
    """dx, dweight and dbias are torch's autograd of F.layer_norm (float64 on the CPU), given
    the forward's mean and rstd in float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    rows, cols = shape
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, (rows, 1)) + rng.uniform(-4, 4, (rows, 1))
    w = rng.uniform(-1.5, 1.5, cols)
    bias = rng.uniform(-1, 1, cols)
    dy = rng.standard_normal(shape)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, bias))
    y = torch.nn.functional.layer_norm(tx, (cols,), tw, tb, lb.EPS)
    want = torch.autograd.grad(y, (tx, tw, tb), torch.tensor(dy))
    _, mean, rstd = layernorm_reference(x, w, bias, lb.EPS)
    got = layernorm_backward_reference(x, w, mean, rstd, dy)[:3]
    for g, t in zip(got, want, strict=True):
        np.testing.assert_allclose(g, t.numpy(), rtol=1e-10, atol=1e-12)


def test_reference_gradient_matches_finite_differences() -> None:
    """dx, dweight and dbias are the gradient of sum(dy * layernorm(x, w, b)) (central
    differences: mean and rstd recomputed from x each time)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 6))
    w = rng.uniform(0.5, 1.5, 6)
    bias = rng.uniform(-1, 1, 6)
    dy = rng.standard_normal((3, 6))

    def loss(x_, w_, b_):
        return float((dy * layernorm_reference(x_, w_, b_, lb.EPS)[0]).sum())

    _, mean, rstd = layernorm_reference(x, w, bias, lb.EPS)
    dx, dw, db, _, _ = layernorm_backward_reference(x, w, mean, rstd, dy)
    h = 1e-6
    for i, j in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i, j] = h
        fd = (loss(x + e, w, bias) - loss(x - e, w, bias)) / (2 * h)
        assert dx[i, j] == pytest.approx(fd, rel=1e-6, abs=1e-8)
    for j in range(6):
        e = np.zeros_like(w)
        e[j] = h
        assert dw[j] == pytest.approx((loss(x, w + e, bias) - loss(x, w - e, bias)) / (2 * h))
        assert db[j] == pytest.approx((loss(x, w, bias + e) - loss(x, w, bias - e)) / (2 * h))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_references_are_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((64, 1000), dtype, np.random.default_rng(8))
    for ref, (atol, rtol) in zip(problem.references, problem.tolerances, strict=True):
        ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
        np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
        assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    # One row's dweight and dbias terms left out fail.
    x, w, mean, rstd, dy = problem.args[:5]
    _, dw_missing, db_missing, _, _ = layernorm_backward_reference(
        x[1:], w, mean[1:], rstd[1:], dy[1:]
    )
    for missing, ref, (atol, rtol) in zip(
        (dw_missing, db_missing), problem.references[1:], problem.tolerances[1:], strict=True
    ):
        assert not np.allclose(missing, ref, atol=atol, rtol=rtol)


def test_bytes_moved_and_buffers() -> None:
    rows, cols = 8192, 768
    assert (
        SPEC.bytes_moved((rows, cols), "bfloat16") == 3 * rows * cols * 2 + 3 * cols * 2 + 8 * rows
    )
    assert SPEC.buffer_bytes((rows, cols), "bfloat16") == (
        SPEC.bytes_moved((rows, cols), "bfloat16") + 8 * lb.MAX_SPLIT * limits.NUM_SMS * cols + 4
    )
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
