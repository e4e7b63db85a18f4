"""The rmsnorm spec: constraints, defaults, rendering (WB_REGS), launch geometry, problems,
references and tolerances."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, list_operators
from kato.kernels.rmsnorm import EPS, RSTD_TOLERANCE, RMSNormSpec, rmsnorm_reference

SPEC = get_operator("rmsnorm")
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


def cfg(block=256, vec=4, row_threads=0, cache=0, min_blocks=0, group_rows=1):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "ROW_THREADS": row_threads,
        "CACHE": cache,
        "MIN_BLOCKS": min_blocks,
        "GROUP_ROWS": group_rows,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, RMSNormSpec) and SPEC in list_operators()
    assert SPEC.kernel_name == "rmsnorm_fwd" and SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == [
        "BLOCK_SIZE",
        "VEC",
        "ROW_THREADS",
        "CACHE",
        "MIN_BLOCKS",
        "GROUP_ROWS",
    ]
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2 * 3


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(block=1024, min_blocks=2), (64, 1024), "float32", "cap registers at 32"),
        (cfg(cache=1, vec=4), (64, 65536), "float32", "shared memory"),
        (cfg(cache=2, row_threads=32, vec=4), (64, 4096), "float32", "ITEMS=32"),
        (cfg(cache=2, block=1024, vec=4), (64, 65536), "float32", "would spill"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
        (cfg(), (2**31, 64), "float32", "2**31-1 rows"),
        (cfg(group_rows=2), (64, 1024), "float32", "not one of"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=4), (64, 1022), "float32"),
        (cfg(vec=8, cache=2, row_threads=32), (64, 769), "bfloat16"),
        (cfg(vec=1), (7, 1000003), "float32"),
        (cfg(cache=1, vec=4), (64, 58000), "float32"),  # 232000 + 32 static bytes fit
        (cfg(cache=2, block=1024, vec=4), (64, 8192), "float32"),
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_weight_stays_in_registers_only_where_every_row_has_the_same_head() -> None:
    aligned = cfg(cache=2, row_threads=32, vec=8)
    assert SPEC.defines(aligned, (64, 768), "bfloat16")["WB_REGS"] == 1
    assert SPEC.defines(aligned, (64, 769), "bfloat16")["WB_REGS"] == 0  # heads move per row
    assert SPEC.defines({**aligned, "CACHE": 0}, (64, 768), "bfloat16")["WB_REGS"] == 0
    # 1024 threads leave 64 registers: a row of 16 floats per thread fits, the weight beside
    # it not.
    big = cfg(cache=2, block=1024, vec=4)
    assert SPEC.check(big, (64, 16384), "float32") is None
    assert SPEC.defines(big, (64, 16384), "float32")["WB_REGS"] == 0
    assert SPEC.defines(big, (64, 8192), "float32")["WB_REGS"] == 1


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    assert SPEC.launch(config, shape, dtype).grid[0] >= 1


def test_default_config_choices() -> None:
    short = SPEC.default_config((1048576, 128), "float32")
    assert (short["VEC"], short["ROW_THREADS"], short["CACHE"], short["GROUP_ROWS"]) == (
        4,
        16,
        2,
        4,
    )
    hidden = SPEC.default_config((8192, 768), "bfloat16")
    assert (hidden["VEC"], hidden["ROW_THREADS"], hidden["CACHE"]) == (8, 32, 2)
    assert SPEC.default_config((7, 1000003), "float32")["CACHE"] == 0
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 4), "int32")


def test_group_rows_is_launch_geometry_only() -> None:
    a, b = cfg(block=128, row_threads=32), cfg(block=128, row_threads=32, group_rows=16)
    assert SPEC.render(a, (1000, 128), "float32") == SPEC.render(b, (1000, 128), "float32")
    assert SPEC.launch(b, (1000, 128), "float32") == Launch(
        grid=(math.ceil(1000 / 64), 1, 1), block=(128, 1, 1)
    )


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 300), dtype, np.random.default_rng(1))
    x, w, y, rstd, rows, cols, eps = problem.args
    assert x.dtype == w.dtype == y.dtype == DTYPES[dtype][0] and rstd.dtype == np.float32
    assert (rows, cols) == (37, 300) and eps == np.float32(EPS)
    assert problem.outputs == [2, 3]
    assert np.isnan(y.astype(np.float64)).all() and np.isnan(rstd).all()
    assert problem.tolerances == [SPEC.tolerance(dtype), RSTD_TOLERANCE]
    x64 = x.astype(np.float64)
    assert np.all(np.abs(x64[0::4].mean(axis=1) - 1e3) < 5)  # squares past float16's range
    assert np.all(np.abs(w.astype(np.float64)) >= 0.49)


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((5, 9), "bfloat16", np.random.default_rng(2))
    x, w = (a.astype(np.float64) for a in problem.args[:2])
    y_ref, rstd_ref = problem.references
    for r in range(5):
        rstd = 1 / math.sqrt(sum(v * v for v in x[r]) / 9 + EPS)
        assert rstd_ref[r] == pytest.approx(rstd, rel=1e-12)
        np.testing.assert_allclose(y_ref[r], x[r] * rstd * w, rtol=1e-12)


def test_reference_of_zero_rows_is_zero() -> None:
    y, rstd = rmsnorm_reference(np.zeros((2, 3), np.float32), np.ones(3, np.float32), EPS)
    np.testing.assert_array_equal(y, 0)
    np.testing.assert_allclose(rstd, 1 / math.sqrt(EPS))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_reference_is_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    atol, rtol = SPEC.tolerance(dtype)
    ref = problem.references[0]
    ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
    np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
    assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    rstd = problem.references[1]
    assert not np.allclose(rstd * (1 + 4 * RSTD_TOLERANCE[1]), rstd, *RSTD_TOLERANCE[::-1])


def test_bytes_moved_and_buffers() -> None:
    assert SPEC.bytes_moved((8192, 768), "bfloat16") == 2 * 8192 * 768 * 2 + 768 * 2 + 4 * 8192
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")
