"""The row sort's ALGO (bitonic rows up to MAX_ROW keys, radix rows beyond): checks, defaults,
the space (no two configs one program), problems and their scratch, the radix step sequence
over all rows, and the bitonic path unchanged for the shapes it took before ALGO."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kato.kernels import get_operator
from kato.kernels.sort import MAX_ROW, ROW_BITONIC_ONLY, ROWS_LAYOUT, radix
from kato.tuner.space import SearchSpace

SORT = get_operator("sort")
KEYS = ("float32", "int32")
LONG = [(1, MAX_ROW + 1), (3, 8193), (2, 10007), (64, 128256), (16, 2**20), (4096, 16384)]
LONG += [(1, 2**30 - 1), (1024, 2**30 - 1), (2**27 - 2**14, 8193)]  # 2**40 - 2**14 keys
SHORT = [(1, 1), (3, 7), (100000, 7), (4096, 4096), (5, 4097), (2, MAX_ROW)]


def radix_cfg(block=512, items=16, bits=8, rank="atomic", hist="scalar", **extra):
    config = {"BLOCK": block, "ITEMS": items, "WARP_SHFL": 0, "SMEM_FUSE": 1, "ALGO": "radix"}
    return {**config, "RADIX_BITS": bits, "RANK": rank, "HIST": hist, **extra}


def bitonic_cfg(block=1024, items=8, shfl=1, smem_fuse=2, **extra):
    config = {"BLOCK": block, "ITEMS": items, "WARP_SHFL": shfl, "SMEM_FUSE": smem_fuse}
    config.update(ALGO="bitonic", RADIX_BITS=4, RANK="match", HIST="scalar")
    return {**config, **extra}


def test_the_space_appends_algo_and_the_radix_tunables() -> None:
    """Existing configs keep their meaning: the old parameters and values come first, ALGO's
    first value is the old program, and so is every radix tunable's first value."""
    assert list(SORT.params)[:4] == ["BLOCK", "ITEMS", "WARP_SHFL", "SMEM_FUSE"]
    assert SORT.params["ITEMS"][:4] == (1, 2, 4, 8)
    assert SORT.params["ALGO"] == ("bitonic", "radix")
    assert SORT.params["RADIX_BITS"] == radix.RADIX_BITS
    assert SORT.params["RANK"] == radix.RANKS and SORT.params["HIST"] == radix.HISTS
    assert SORT.space_size() == 5 * 8 * 2 * 2 * 2 * 5 * 3 * 3


def test_check_splits_the_rows_between_the_algorithms() -> None:
    long, short = (3, MAX_ROW + 1), (3, MAX_ROW)
    reason = SORT.check(bitonic_cfg(), long, "float32")
    assert str(MAX_ROW) in reason and "ALGO=radix" in reason
    assert SORT.check(bitonic_cfg(), short, "float32") is None
    reason = SORT.check(radix_cfg(), short, "float32")
    assert "longer than 8192" in reason and "ALGO=bitonic" in reason
    assert SORT.check(radix_cfg(), long, "float32") is None
    # A tunable the algorithm ignores stays at its first value.
    for name in ROW_BITONIC_ONLY:
        other = SORT.params[name][1]
        assert "ignored by ALGO=radix" in SORT.check(radix_cfg(**{name: other}), long, "int32")
    for name, value in (("RADIX_BITS", 8), ("RANK", "atomic"), ("HIST", "vec4")):
        reason = SORT.check(bitonic_cfg(**{name: value}), short, "int32")
        assert "ignored by ALGO=bitonic" in reason
    assert "ALGO=bitonic takes ITEMS" in SORT.check(bitonic_cfg(items=16), short, "int32")
    # The radix sort's own limits: tiles of at least 2048 keys, registers, shared memory.
    assert "needs 2048" in SORT.check(radix_cfg(block=128, items=8), long, "int32")
    assert "spill" in SORT.check(radix_cfg(block=1024, items=24), long, "int32")
    assert SORT.check(radix_cfg(block=1024, items=2), long, "int32") is None  # 2048 keys


def test_radix_rows_reject_more_tiles_than_one_grid_holds() -> None:
    config = radix_cfg(block=128, items=16)
    assert radix.check(config, 8193, pairs=False, rows=2**31 // 5) is None  # 5 tiles a row
    reason = radix.check(config, 8193, pairs=False, rows=2**31 // 5 + 1)
    assert "grid.x" in reason and str(radix.MAX_SEG_TILES) in reason


@pytest.mark.parametrize("dtype", KEYS)
def test_no_two_configs_run_the_same_program(dtype) -> None:
    """The valid configs of a long-row shape are radix only (95 tile shapes x RANK x HIST,
    sort_1d's radix space), of a short-row shape bitonic only; within each, every config renders
    a source of its own (float and int keys share them)."""
    for shape, algo, count in (((64, 128256), "radix", 9 * 95), ((1, 1), "bitonic", None)):
        space = SearchSpace(SORT.params, lambda c, s=shape: SORT.check(c, s, dtype))
        valid = space.valid_configs()
        assert {c["ALGO"] for c in valid} == {algo}
        if count is not None:
            assert len(valid) == count
        sources = {SORT.render(c, shape, dtype) for c in valid}
        assert len(sources) == len(valid)
    config = radix_cfg()
    assert SORT.render(config, (2, 9000), "float32") == SORT.render(config, (5, 20000), "int32")
    assert "#define SEGMENTED 1" in SORT.render(config, (2, 9000), "float32")


@pytest.mark.parametrize("dtype", KEYS)
@pytest.mark.parametrize("shape", LONG + SHORT, ids=lambda s: "x".join(map(str, s)))
def test_the_default_is_bitonic_where_rows_fit_a_block(shape, dtype) -> None:
    config = SORT.default_config(shape, dtype)
    assert SORT.check(config, shape, dtype) is None
    rows, cols = shape
    if cols <= MAX_ROW:
        # The default from before ALGO, with the radix tunables at their first value.
        block = min(1024, max(128, (1 << max(0, (cols - 1).bit_length())) // 8))
        old = {"BLOCK": block, "ITEMS": 8, "WARP_SHFL": 1, "SMEM_FUSE": 2}
        assert config == {**old, "ALGO": "bitonic", "RADIX_BITS": 4, "RANK": "match"} | {
            "HIST": "scalar"
        }
        return
    assert config == radix_cfg(block=256, hist="vec4")
    steps = SORT.steps(config, shape, dtype)
    assert [s.kernel for s in steps] == ["radix_init", "radix_histogram"] + 4 * ["radix_pass"]
    for step in steps:
        assert 1 <= step.launch.grid[0] <= 2**31 - 1 and step.launch.threads_per_block <= 1024
    assert steps[-1].launch.grid[0] == rows * math.ceil(cols / 4096)


@pytest.mark.parametrize("bits", radix.RADIX_BITS)
def test_radix_steps_over_all_rows(bits) -> None:
    """Init and histogram with the row count after n, one pass per digit ping-ponging between
    y and the scratch keys so that the last writes y; every argument of the right kind."""
    shape, dtype = (3, 10007), "float32"
    config = radix_cfg(block=256, items=12, bits=bits)
    problem = SORT.make_problem(shape, dtype, np.random.default_rng(0))
    args = problem.args
    steps = SORT.steps(config, shape, dtype)
    passes = radix.passes(bits)
    assert [s.kernel for s in steps] == ["radix_init", "radix_histogram"] + passes * ["radix_pass"]
    lay = ROWS_LAYOUT
    assert steps[0].args == (lay.hist, lay.counters, lay.status, lay.n, lay.rows)
    assert steps[1].args == (lay.keys_in, lay.n, lay.rows, lay.hist, lay.scalar(1))
    assert args[lay.n] == 10007 and args[lay.rows] == 3
    assert args[lay.n].dtype == args[lay.rows].dtype == np.int64
    assert args[lay.hist].size == 3 * radix.HIST_WORDS >= 3 * passes << bits
    tiles = math.ceil(10007 / 3072)
    assert args[lay.status].size >= 2 * 3 * tiles << bits
    assert args[lay.keys_tmp].size == 3 * 10007
    src = lay.keys_in
    for p, step in enumerate(steps[2:]):
        assert step.launch.grid == (3 * tiles, 1, 1)
        assert step.launch.shared_bytes == radix.shared_bytes(config, pairs=False)
        assert step.args[0] == src and step.args[1] in (lay.keys_out, lay.keys_tmp)
        assert step.args[2:7] == (lay.n, lay.rows, lay.hist, lay.counters, lay.status)
        assert step.args[7:] == (lay.scalar(p), lay.scalar(1))
        src = step.args[1]
    assert src == lay.keys_out == 1
    assert int(args[lay.first_scalar + 5]) == 5


@pytest.mark.parametrize("dtype", KEYS)
def test_problems_of_short_rows_are_unchanged(dtype) -> None:
    """Rows up to MAX_ROW: the bitonic kernel's five arguments, the row kernel launched on all
    of them (the launch and the problem from before ALGO), no scratch in the buffers."""
    shape = (5, MAX_ROW)
    problem = SORT.make_problem(shape, dtype, np.random.default_rng(1))
    assert len(problem.args) == 5
    assert [type(a) for a in problem.args[2:]] == [np.int32] * 3
    assert int(problem.args[4]) == (dtype == "float32")
    (step,) = SORT.steps(bitonic_cfg(), shape, dtype)
    assert step.kernel == "sort_rows_kernel" and step.args is None
    assert SORT.buffer_bytes(shape, dtype) == problem.nbytes == 2 * 5 * MAX_ROW * 4


@pytest.mark.parametrize("shape", [(3, 10007), (64, 128256)], ids=str)
def test_long_rows_carry_the_radix_scratch(shape) -> None:
    problem = SORT.make_problem(shape, "int32", np.random.default_rng(2))
    assert SORT.buffer_bytes(shape, "int32") == problem.nbytes
    rows, cols = shape
    assert problem.nbytes == 2 * rows * cols * 4 + radix.scratch_bytes(cols, False, rows)
    np.testing.assert_array_equal(
        problem.references[0], np.sort(problem.args[0].astype(np.int64), axis=-1)
    )


def test_configs_from_before_algo_render_the_bitonic_program() -> None:
    old = {"BLOCK": 512, "ITEMS": 8, "WARP_SHFL": 1, "SMEM_FUSE": 2}
    shape = (4096, 4096)
    assert SORT.render(old, shape, "float32") == SORT.render(bitonic_cfg(512), shape, "float32")
    assert SORT.launch(old, shape, "float32") == SORT.launch(bitonic_cfg(512), shape, "float32")


def test_the_histogram_chunk_is_the_kernels() -> None:
    """The host sizes the rows' histogram grid by radix.cu's chunk (any grid is correct, a
    different chunk only a worse grid)."""
    assert f"constexpr int kSegChunk = {radix.SEG_HIST_CHUNK};" in radix.TEMPLATE.read_text()
    config = radix_cfg()
    steps = SORT.steps(config, (3, 40009), "float32")
    assert steps[1].kernel == "radix_histogram" and steps[1].launch.grid == (3 * 3, 1, 1)
    steps = SORT.steps(config, (4096, 16384), "float32")
    assert steps[1].launch.grid == (radix.MAX_AUX_GRID, 1, 1)
