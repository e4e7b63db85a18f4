"""The reduce_sum spec (sum over the last dim): constraints, defaults, rendering, launch geometry,
problems, and the exact float32 model of the kernel's summation tree (2**26 elements vs a serial
float32 sum)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, get_operator, list_operators
from kato.kernels.reduce_sum import (
    ReduceSumSpec,
    row_sum_model,
    rows_per_block,
    static_shared_bytes,
)
from kato.kernels.reduce_sum_all import EPS32, ERROR_ROUNDINGS
from kato.tuner.space import SearchSpace

SPEC = get_operator("reduce_sum")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 2),
    (3, 7),
    (2, 30),
    (5, 33),
    (128, 128),
    (3000, 3001),
    (65536, 1024),
    (32768, 4096),
    (8192, 32768),
    (1048576, 128),
    (7, 1000003),
    (2, 2**24),
]


def cfg(block=256, row_threads=32, vec=4, unroll=4):
    return {"BLOCK_SIZE": block, "ROW_THREADS": row_threads, "VEC": vec, "UNROLL": unroll}


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, ReduceSumSpec)
    assert SPEC in list_operators()
    assert SPEC.rank == 2 and SPEC.shape_names == ("rows", "cols")
    assert SPEC.dtypes == DTYPE_NAMES
    assert SPEC.kernel_name == "reduce_sum_kernel"
    source = SPEC.template.read_text()
    assert 'extern "C" __global__' in source and "namespace KATO_NS" in source


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (4, 1024), "float32", "32-byte vector"),
        (cfg(vec=4), (4, 1022), "float32", "not a multiple of VEC=4"),
        (cfg(vec=8), (4, 1020), "float16", "not a multiple of VEC=8"),
        (cfg(row_threads=4), (4, 1024), "float32", "not one of"),
        (cfg(unroll=16), (4, 1024), "float32", "not one of"),
        (cfg(), (4, 1024), "int32", "does not support dtype"),
        (cfg(), (0, 4), "float32", "at least 1"),
        (cfg(), (4, 2**31 - 2**16 + 1), "float32", "2**31-2**16 columns"),
        (cfg(), (2**31, 4), "float32", "2**31-1 rows"),
        (cfg(), (4,), "float32", "rank 2"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["VEC"]
    assert "missing parameter VEC" in SPEC.check(partial, (4, 64), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "TILE": 1}, (4, 64), "float32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_valid_configs_are_exactly_those_whose_vector_divides_cols(shape, dtype) -> None:
    valid = SearchSpace(SPEC.params, lambda c: SPEC.check(c, shape, dtype)).valid_configs()
    for config in valid:
        assert shape[1] % config["VEC"] == 0 and config["VEC"] * DTYPES[dtype][2] <= 16
    vecs = [v for v in SPEC.params["VEC"] if v * DTYPES[dtype][2] <= 16 and shape[1] % v == 0]
    assert len(valid) == SPEC.space_size() // len(SPEC.params["VEC"]) * len(vecs)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_default_config_is_valid(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None


def test_default_picks_the_strategy_by_row_length() -> None:
    assert SPEC.default_config((1048576, 128), "float32")["ROW_THREADS"] == 8
    assert SPEC.default_config((65536, 1024), "float32")["ROW_THREADS"] == 32
    assert SPEC.default_config((32768, 4096), "float32")["ROW_THREADS"] == 32
    assert SPEC.default_config((8192, 32768), "float32")["ROW_THREADS"] == 0
    assert SPEC.default_config((3000, 3001), "float16")["VEC"] == 1
    with pytest.raises(InvalidInput):
        SPEC.default_config((0, 3), "float32")


def test_source_does_not_depend_on_the_shape() -> None:
    assert SPEC.render(cfg(), (3, 64), "bfloat16") == SPEC.render(cfg(), (70000, 4096), "bfloat16")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_launch_covers_every_row(shape) -> None:
    for config in (
        cfg(row_threads=8, vec=1),
        cfg(row_threads=32, vec=1),
        cfg(row_threads=0, vec=1),
    ):
        launch = SPEC.launch(config, shape, "float32")
        assert launch.grid[0] * rows_per_block(config) >= shape[0]
        assert launch.grid[0] <= 2**31 - 1 and launch.shared_bytes == 0


def test_static_shared_model() -> None:
    assert static_shared_bytes(cfg(row_threads=0, block=1024)) == 2 * 32 * 4
    assert static_shared_bytes(cfg(row_threads=32, block=1024)) == 0


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    rows, cols = 9, 1001
    p = SPEC.make_problem((rows, cols), dtype, np.random.default_rng(1))
    x, out, r, c = p.args
    assert x.dtype == DTYPES[dtype][0] and x.shape == (rows, cols)
    assert not (x == 0).any()
    assert np.isnan(out).all() and out.dtype == np.float32 and out.shape == (rows,)
    assert (r, c) == (rows, cols) and isinstance(r, np.int32) and isinstance(c, np.int32)
    x64 = x.astype(np.float64)
    for i in range(rows):
        assert p.references[0][i] == pytest.approx(math.fsum(x64[i]), rel=1e-12, abs=1e-9)
    # positive-biased rows sum to ~cols/2, the N(0, 1) rows (3 mod 4) cancel to ~sqrt(cols)
    assert (p.references[0][[0, 1, 2, 4]] > cols / 4).all()
    assert abs(p.references[0][3]) < 8 * math.sqrt(cols)
    ((atol, rtol),) = p.tolerances
    assert rtol == 0.0
    assert atol == pytest.approx(ERROR_ROUNDINGS * EPS32 * np.abs(x64).sum(axis=1).max())


def test_bytes_moved() -> None:
    assert SPEC.bytes_moved((32768, 4096), "float32") == 32768 * (4096 * 4 + 4)
    assert SPEC.bytes_moved((32768, 4096), "float16") == 32768 * (4096 * 2 + 4)


# --- the summation model ------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        cfg(row_threads=8, vec=1, unroll=2),
        cfg(row_threads=8, vec=4, unroll=8),
        cfg(row_threads=32, vec=2, unroll=4),
        cfg(row_threads=0, block=128, vec=4, unroll=2),
        cfg(row_threads=0, block=1024, vec=8, unroll=8),
    ],
    ids=str,
)
@pytest.mark.parametrize("shape", [(5, 8), (3, 136), (2, 4104), (2, 40008)], ids=str)
def test_row_model_matches_float64(shape, config) -> None:
    x = np.random.default_rng(shape[1]).uniform(0.5, 1.5, size=shape).astype(np.float32)
    if shape[1] % config["VEC"]:
        pytest.skip("VEC does not divide cols")
    got = row_sum_model(x, config).astype(np.float64)
    exact = np.array([math.fsum(row) for row in x.astype(np.float64)])
    assert (np.abs(got - exact) <= 8 * EPS32 * exact).all()


def test_row_model_beats_naive_float32_on_2_pow_26_elements() -> None:
    """One row of 2**26 U(0.5, 1.5) values: the kernel's tree (bit for bit) vs float64, against a
    serial float32 sum (np.cumsum's last element, which stalls once past 2**24)."""
    x = np.random.default_rng(26).uniform(0.5, 1.5, size=(1, 2**26)).astype(np.float32)
    exact = x.astype(np.float64).sum(axis=1)
    naive = np.abs(np.cumsum(x, axis=1, dtype=np.float32)[:, -1] - exact)
    for config in (cfg(row_threads=0, block=512, vec=4, unroll=8), cfg(row_threads=0, block=1024)):
        error = np.abs(row_sum_model(x, config) - exact)
        assert (error < naive / 1000).all(), (config, error.max(), naive.min())
        assert (error <= ERROR_ROUNDINGS * EPS32 * exact / 16).all()
