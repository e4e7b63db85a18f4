"""The reduce_sum spec (sum over the last dim): constraints, defaults, rendering, launch geometry,
problems, and the exact float32 model of the kernel's summation tree (2**26 elements vs a serial
float32 sum)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, get_operator, limits, list_operators
from kato.kernels.reduce_sum import (
    SPLIT_ROWS,
    ReduceSumSpec,
    row_sum_model,
    rows_per_block,
    split_parts,
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
    (1, 2**26 + 3),
    (3, 1000003),
    (100000, 7),
    (4, 16777216),
    (1, 67108863),
    (300, 50257),
]


def cfg(block=256, row_threads=32, vec=4, unroll=4, split=0):
    return {
        "BLOCK_SIZE": block,
        "ROW_THREADS": row_threads,
        "VEC": vec,
        "UNROLL": unroll,
        "SPLIT": split,
    }


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
        (cfg(split=1), (4, 2**20), "float32", "needs ROW_THREADS=0"),
        (cfg(row_threads=0, split=1), (132, 2**20), "float32", "would not split"),
        (cfg(row_threads=0, split=8), (1055, 2**20), "float32", None),
        (cfg(row_threads=0, split=8), (1056, 2**20), "float32", "would not split"),
        (cfg(row_threads=0, block=1024, split=8), (1, 4 * 1024 * 1056 - 1), "float32", "fewer"),
        (cfg(row_threads=0, block=1024, split=8), (1, 4 * 1024 * 1056), "float32", None),
        (cfg(split=3), (4, 2**20), "float32", "not one of"),
        (cfg(row_threads=0, block=1024, unroll=8), (4, 4099), "float32", "spills"),
        (cfg(row_threads=0, block=1024, unroll=8), (4, 4100), "float32", None),
        (cfg(row_threads=0, block=1024, unroll=8, split=1), (4, 2**24), "float32", "spills"),
        (cfg(row_threads=3), (4, 1024), "float32", "not one of"),
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
    if reason is None:
        assert why is None, why
    else:
        assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["VEC"]
    assert "missing parameter VEC" in SPEC.check(partial, (4, 64), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "TILE": 1}, (4, 64), "float32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_vector_width_is_valid_for_every_cols_and_splits_only_where_they_split(
    shape, dtype
) -> None:
    rows, cols = shape
    valid = SearchSpace(SPEC.params, lambda c: SPEC.check(c, shape, dtype)).valid_configs()
    vecs = [v for v in SPEC.params["VEC"] if v * DTYPES[dtype][2] <= 16]
    unsplit = [c for c in valid if c["SPLIT"] == 0]
    # BLOCK_SIZE x ROW_THREADS x VEC x UNROLL, less 1024 threads x 128 bytes in flight where
    # rows have a scalar head or tail (they would spill)
    groups = len(SPEC.params["ROW_THREADS"])
    spilling = sum(1 for v in vecs if cols % v and v * DTYPES[dtype][2] == 16) * groups
    assert len(unsplit) == 4 * groups * len(vecs) * 3 - spilling
    for config in valid:
        assert config["VEC"] in vecs
        in_flight = config["UNROLL"] * config["VEC"] * DTYPES[dtype][2]
        if config["SPLIT"] or cols % config["VEC"]:
            assert config["BLOCK_SIZE"] < 1024 or in_flight < 128
        if config["SPLIT"]:
            parts = split_parts(config, rows)
            assert config["ROW_THREADS"] == 0 and parts > 1
            assert cols // config["VEC"] // parts >= config["BLOCK_SIZE"]
            assert rows < SPLIT_ROWS and rows * parts < 2 * SPLIT_ROWS
    if rows <= 4 and cols >= 2**24:  # few long rows: every split value is in the space
        assert {c["SPLIT"] for c in valid} == set(SPEC.params["SPLIT"])


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_default_config_is_valid(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None


@pytest.mark.parametrize(
    ("shape", "dtype", "row_threads", "vec"),
    [
        ((8388608, 7), "float32", 1, 1),  # issue 31's case: a thread per row, no shuffles
        ((1000, 1), "float16", 1, 1),
        ((1000, 16), "float32", 1, 4),  # 4 vectors a thread
        ((1000, 13), "bfloat16", 2, 1),  # 13 scalars over 2 threads
        ((1000, 31), "float16", 4, 1),
        ((1000, 32), "float32", 8, 4),  # from 32 elements on: as before
    ],
)
def test_default_gives_rows_of_a_few_elements_a_thread_or_a_few(
    shape, dtype, row_threads, vec
) -> None:
    config = SPEC.default_config(shape, dtype)
    assert (config["ROW_THREADS"], config["VEC"]) == (row_threads, vec)
    assert SPEC.check(config, shape, dtype) is None
    rows_per_block = config["BLOCK_SIZE"] // row_threads
    assert SPEC.launch(config, shape, dtype).grid[0] == -(-shape[0] // rows_per_block)


def test_groups_smaller_than_a_vector_are_valid_on_split_rows() -> None:
    """A thread per row takes a split row's head and tail itself: any VEC on any cols."""
    for vec in (1, 2, 4):
        config = cfg(row_threads=1, vec=vec)
        assert SPEC.check(config, (1001, 7), "float32") is None
        assert SPEC.defines(config, (1001, 7), "float32")["ALIGNED_ROWS"] == int(vec == 1)


def test_default_picks_the_strategy_by_row_length() -> None:
    assert SPEC.default_config((1048576, 128), "float32")["ROW_THREADS"] == 8
    assert SPEC.default_config((65536, 1024), "float32")["ROW_THREADS"] == 32
    assert SPEC.default_config((32768, 4096), "float32")["ROW_THREADS"] == 32
    assert SPEC.default_config((8192, 32768), "float32")["ROW_THREADS"] == 0
    assert SPEC.default_config((3000, 3001), "float16")["VEC"] == 8  # head and tail scalar
    assert SPEC.default_config((3000, 3), "float16")["VEC"] == 1
    with pytest.raises(InvalidInput):
        SPEC.default_config((0, 3), "float32")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((4, 16777216), "float32"), ((1, 67108863), "float16"), ((3, 1000003), "bfloat16")],
    ids=str,
)
def test_the_default_splits_few_long_rows_over_every_sm(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert config["SPLIT"] > 0 and config["VEC"] * DTYPES[dtype][2] == 16
    assert SPEC.launch(config, shape, dtype).grid[0] >= 2 * limits.NUM_SMS


def test_the_default_does_not_split_rows_that_fill_the_gpu() -> None:
    assert SPEC.default_config((264, 2**20), "float32")["SPLIT"] == 0
    assert SPEC.default_config((100000, 7), "float32")["SPLIT"] == 0


def test_source_depends_on_the_shape_only_through_row_alignment() -> None:
    assert SPEC.render(cfg(), (3, 64), "bfloat16") == SPEC.render(cfg(), (70000, 4096), "bfloat16")
    assert SPEC.render(cfg(), (3, 65), "bfloat16") == SPEC.render(cfg(), (7, 50257), "bfloat16")
    assert "#define ALIGNED_ROWS 1" in SPEC.render(cfg(), (3, 64), "bfloat16")
    assert "#define ALIGNED_ROWS 0" in SPEC.render(cfg(), (3, 66), "bfloat16")
    split = cfg(row_threads=0, split=2)
    assert SPEC.render(split, (3, 2**20), "float32") == SPEC.render(split, (1, 99999), "float32")
    assert SPEC.render(split, (3, 2**20), "float32") == SPEC.render(
        {**split, "SPLIT": 8}, (3, 2**20), "float32"
    )  # SPLIT's value is launch geometry


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
    rows = shape[0]
    for split in SPEC.params["SPLIT"][1:]:
        config = cfg(row_threads=0, block=128, vec=1, split=split)
        if SPEC.check(config, shape, "float32") is None:
            parts = math.ceil(split * limits.NUM_SMS / rows)
            assert SPEC.launch(config, shape, "float32").grid == (rows * parts, 1, 1)
            assert split * limits.NUM_SMS <= rows * parts < 2 * SPLIT_ROWS


def test_static_shared_model() -> None:
    assert static_shared_bytes(cfg(row_threads=0, block=1024)) == 2 * 32 * 4
    assert static_shared_bytes(cfg(row_threads=32, block=1024)) == 0
    assert static_shared_bytes(cfg(row_threads=0, block=512, split=4)) == 2 * 16 * 4


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
@pytest.mark.parametrize(
    "shape",
    [(5, 8), (3, 136), (2, 4104), (2, 40008), (7, 1), (5, 7), (3, 4097), (2, 40009)],
    ids=str,
)
def test_row_model_matches_float64(shape, config) -> None:
    """Any cols with any VEC: rows off a vector boundary have a scalar head and tail."""
    x = np.random.default_rng(shape[1]).uniform(0.5, 1.5, size=shape).astype(np.float32)
    got = row_sum_model(x, config).astype(np.float64)
    exact = np.array([math.fsum(row) for row in x.astype(np.float64)])
    assert (np.abs(got - exact) <= 8 * EPS32 * exact).all()


@pytest.mark.parametrize("parts", [2, 3, 33, 132])
@pytest.mark.parametrize("shape", [(1, 65536), (3, 100003), (2, 65541)], ids=str)
def test_split_row_model_matches_float64(shape, parts) -> None:
    """A row cut into pieces (the first one holding the head and tail) sums as the float64
    reference does, whatever the number of pieces."""
    x = np.random.default_rng(parts).uniform(0.5, 1.5, size=shape).astype(np.float32)
    config = cfg(row_threads=0, block=128, vec=4, unroll=2, split=1)
    got = row_sum_model(x, config, parts=parts).astype(np.float64)
    exact = np.array([math.fsum(row) for row in x.astype(np.float64)])
    assert (np.abs(got - exact) <= 8 * EPS32 * exact).all()
    # every element counted once: a piece lost or doubled would be off by thousands of EPS
    one = row_sum_model(np.ones(shape, dtype=np.float32), config, parts=parts)
    np.testing.assert_array_equal(one, np.full(shape[0], shape[1], dtype=np.float32))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((1, 2**26 + 3), "float32"), ((3, 1000003), "float16"), ((100000, 7), "bfloat16")],
    ids=str,
)
def test_default_at_awkward_shapes_is_within_the_problems_tolerance(shape, dtype) -> None:
    """The kernel's arithmetic (the model, bit for bit) under the default config, against the
    problem's float64 reference and the tolerance verification applies."""
    problem = SPEC.make_problem(shape, dtype, np.random.default_rng(31))
    config = SPEC.default_config(shape, dtype)
    got = row_sum_model(problem.args[0], config).astype(np.float64)
    ((atol, _),) = problem.tolerances
    error = np.abs(got - problem.references[0])
    assert (error <= atol).all(), (config, error.max(), atol)
    del problem


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
