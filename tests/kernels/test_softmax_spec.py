"""The softmax spec: constraints, defaults, rendering, launch geometry, problems, references."""

from __future__ import annotations

import math
from pathlib import Path

import kato.kernels.softmax as softmax_module
import ml_dtypes
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, limits, list_operators
from kato.kernels.softmax import SoftmaxSpec, softmax_reference
from kato.kernels.spec import template_source
from kato.tuner.space import SearchSpace

SPEC = get_operator("softmax")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
#: Shapes any default must handle: single elements, odd and prime widths, many short rows,
#: a few enormous rows.
SHAPES = [
    (1, 1),
    (1, 2),
    (1, 4097),
    (3, 7),
    (2, 30),
    (128, 128),
    (3000, 3001),
    (4096, 1024),
    (4096, 4096),
    (8192, 32768),
    (32768, 4096),
    (65536, 128),
    (1024, 50257),
    (16, 131072),
    (7, 1000003),
    (5, 2**20),
]


def cfg(
    block: int = 256,
    vec: int = 4,
    strategy: int = 1,
    cache: int = 0,
    min_blocks: int = 0,
    lanes: int = 32,
):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "STRATEGY": strategy,
        "CACHE": cache,
        "MIN_BLOCKS": min_blocks,
        "LANES": lanes,
    }


# --- identity and registry ---------------------------------------------------------------------


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, SoftmaxSpec)
    assert SPEC in list_operators()
    assert SPEC.name == "softmax"
    assert SPEC.kernel_name == "softmax_kernel"
    assert SPEC.rank == 2
    assert SPEC.shape_names == ("rows", "cols")
    assert SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == ["BLOCK_SIZE", "VEC", "STRATEGY", "CACHE", "MIN_BLOCKS", "LANES"]
    assert all(isinstance(v, int) for values in SPEC.params.values() for v in values)
    assert SPEC.space_size() == 6 * 4 * 3 * 3 * 4 * 4
    assert SPEC.kernel_names == ("softmax_kernel", "softmax_split_stats")
    assert SPEC.template.is_file()
    assert 'extern "C" __global__' in SPEC.template.read_text()


def test_version_is_stable_and_follows_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    again = SoftmaxSpec()
    assert again.version == SPEC.version
    assert len(SPEC.version) == 12
    changed = SoftmaxSpec()
    monkeypatch.setattr(changed, "params", {**SPEC.params, "VEC": (1, 2, 4)})
    assert changed.version != SPEC.version


def test_version_follows_the_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "softmax.cu"
    copy.write_text(SPEC.template.read_text() + "\n// changed\n")
    changed = SoftmaxSpec()
    monkeypatch.setattr(changed, "template", copy)
    assert changed.version != SPEC.version


# --- check ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(block=1024, min_blocks=4), (64, 1024), "float32", "2048 threads per SM"),
        (cfg(block=512, min_blocks=8), (64, 1024), "float32", "not one of"),
        (cfg(block=48), (64, 1024), "float32", "not one of"),
        (cfg(cache=1, vec=4), (64, 65536), "float32", "shared memory"),
        (cfg(cache=1, strategy=0, block=1024, vec=8), (64, 4096), "float16", "32 row(s)"),
        (cfg(cache=2, strategy=0, vec=4), (64, 4096), "float32", "ITEMS=32"),
        (cfg(cache=2, block=256, vec=1), (64, 4097), "float16", "ITEMS=17"),
        (cfg(cache=2, block=1024, vec=4), (64, 65536), "float32", "would spill"),
        (cfg(cache=2, block=512, vec=8, min_blocks=4), (64, 16384), "float16", "would spill"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
        (cfg(), (64, 0), "float32", "at least 1"),
        (cfg(), (64, 2**31 - 2**16 + 1), "float32", "2**31-2**16 columns"),
        (cfg(), (2**31, 64), "float32", "2**31-1 rows"),
        (cfg(), (64, 1024, 1), "float32", "rank 2"),
        (cfg(lanes=2), (64, 1024), "float32", "not one of"),
        (cfg(strategy=1, lanes=8), (64, 1024), "float32", "STRATEGY=1 takes LANES=32"),
        (cfg(strategy=2, lanes=8), (8, 2**20), "float32", "STRATEGY=2 takes LANES=32"),
        (cfg(strategy=2, cache=1), (8, 2**20), "float32", "CACHE=0, got CACHE=1"),
        (cfg(strategy=2, cache=2), (8, 2**20), "float32", "CACHE=0, got CACHE=2"),
        # 67 rows of a grid sized for 132 blocks: 1 piece each, nothing to split.
        (cfg(strategy=2), (67, 2**20), "float32", "67 rows would not be split"),
        (cfg(strategy=2, min_blocks=4, block=256), (265, 2**20), "float32", "528 blocks"),
        (cfg(strategy=2, min_blocks=4, block=512), (8, 2**20), "float32", "32 registers"),
        (cfg(strategy=2, min_blocks=2, block=1024), (8, 2**20), "float32", "32 registers"),
        # 8 rows of 16 pieces: 16 * 256 * 4 elements per row at least.
        (cfg(strategy=2, block=256, vec=4), (8, 16 * 256 * 4 - 4), "float32", "pieces of 255"),
        (cfg(strategy=2, block=256, vec=4), (8, 16 * 256 * 4 + 1), "float32", "pieces of 255"),
        (cfg(strategy=0, lanes=4, vec=8), (64, 1024), "float16", "LANES=4 < VEC=8"),
        (cfg(strategy=0, lanes=4, vec=1, block=1024, cache=1), (64, 256), "float32", "256 row"),
        (cfg(strategy=0, lanes=4, vec=4, cache=2), (64, 257), "float32", "4 threads per row"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["VEC"]
    assert "missing parameter VEC" in SPEC.check(partial, (4, 64), "float32")
    extra = {**cfg(), "TILE": 4}
    assert "unknown parameter" in SPEC.check(extra, (4, 64), "float32")


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=8), (64, 1024), "float16"),  # 16-byte half vectors
        (cfg(vec=4), (64, 1024), "float32"),
        (cfg(vec=1), (7, 1000003), "float32"),  # streaming: no limit on cols
        (cfg(block=512, min_blocks=4), (64, 1024), "float32"),  # exactly 2048 threads
        (cfg(block=1024, min_blocks=2), (64, 1024), "bfloat16"),
        (cfg(cache=1, vec=4), (64, 58000), "float32"),  # 232000 bytes + 128 static fit
        (cfg(cache=1, strategy=0, block=64, vec=8), (64, 32768), "float16"),  # 2 rows x 64 KiB
        (cfg(cache=2, strategy=0, vec=8), (64, 4096), "float16"),  # ITEMS = 16 exactly
        (cfg(cache=2, block=1024, vec=4), (64, 32768), "float32"),  # 32 data registers
        (cfg(strategy=0, lanes=4, vec=4, cache=2), (64, 256), "float32"),  # ITEMS = 16 exactly
        (cfg(strategy=0, lanes=8, vec=8, cache=0), (64, 7), "bfloat16"),  # all head and tail
        (cfg(strategy=0, lanes=4, vec=1, block=1024, cache=1), (64, 221), "float32"),
        (cfg(strategy=2, block=256, vec=4), (8, 16 * 256 * 4), "float32"),  # 16 x 256 vectors
        (cfg(strategy=2, block=256, vec=4), (8, 16 * 256 * 4 + 3), "float32"),  # head 0: 3 left
        (cfg(strategy=2, min_blocks=4, block=256), (264, 2**20), "float32"),  # 2 pieces a row
        (cfg(strategy=2, min_blocks=1, block=1024), (8, 2**20), "float32"),  # 64 registers
        (cfg(strategy=2, block=1024, vec=8), (1, 2**24), "bfloat16"),
        (cfg(strategy=2, block=32, vec=1), (66, 64), "float16"),  # 2 pieces of 32
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_check_shared_memory_limit_is_exact() -> None:
    """CACHE=1, block per row of 1024 threads: static 512 bytes + cols * 4 <= 227 KiB."""
    limit_cols = (227 * 1024 - 512) // 4
    assert SPEC.check(cfg(block=1024, cache=1), (8, limit_cols), "float32") is None
    assert "shared memory" in SPEC.check(cfg(block=1024, cache=1), (8, limit_cols + 4), "float32")


def test_check_items_limit_is_exact() -> None:
    """CACHE=2, warp per row, 16-byte half vectors: 32 lanes * 8 * 16 = 4096 columns."""
    config = cfg(strategy=0, block=128, cache=2, vec=8)
    assert SPEC.check(config, (8, 4096), "float16") is None
    assert "ITEMS=17" in SPEC.check(config, (8, 4104), "float16")


def test_register_cap_follows_launch_bounds() -> None:
    assert softmax_module.register_cap(cfg(block=1024)) == 64
    assert softmax_module.register_cap(cfg(block=1024, min_blocks=2)) == 32
    assert softmax_module.register_cap(cfg(block=256, min_blocks=1)) == 255
    assert softmax_module.register_cap(cfg(block=128, min_blocks=4)) == 128
    assert softmax_module.register_cap(cfg(block=32, min_blocks=4)) == 255


def test_valid_variants_for_a_representative_shape() -> None:
    """Exact counts pin the constraints (float32 loses VEC=8; the half types keep it)."""
    shape = (4096, 4096)
    valid = {
        dtype: len(
            SearchSpace(SPEC.params, lambda c, d=dtype: SPEC.check(c, shape, d)).valid_configs()
        )
        for dtype in DTYPE_NAMES
    }
    warp_or_block = {
        dtype: len(
            SearchSpace(
                SPEC.params,
                lambda c, d=dtype: SPEC.check(c, shape, d) if c["LANES"] == 32 else "sub-warp",
            ).valid_configs()
        )
        for dtype in DTYPE_NAMES
    }
    assert warp_or_block == {"float32": 297, "float16": 441, "bfloat16": 441}  # as before LANES
    assert valid == {"float32": 576, "float16": 830, "bfloat16": 830}


# --- default config ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert set(config) == set(SPEC.params)
    assert SPEC.check(config, shape, dtype) is None
    launch = SPEC.launch(config, shape, dtype)
    assert launch.grid[0] >= 1
    assert launch.shared_bytes <= 227 * 1024


def test_default_config_picks_the_widest_vector_and_sensible_strategy() -> None:
    assert SPEC.default_config((4096, 4096), "float16")["VEC"] == 8
    assert SPEC.default_config((4096, 4096), "float32")["VEC"] == 4
    # Rows that are not whole vectors split (head, vectors, tail) at the widest vector too.
    assert SPEC.default_config((4096, 4098), "float16")["VEC"] == 8
    assert SPEC.default_config((3000, 3001), "float32")["VEC"] == 4
    assert SPEC.default_config((8192, 50257), "bfloat16")["VEC"] == 8
    assert SPEC.default_config((16, 3), "float16")["VEC"] == 1  # short rows: a divisor
    short = SPEC.default_config((65536, 128), "float32")
    assert (short["STRATEGY"], short["CACHE"]) == (0, 2)  # a warp per row, in registers
    medium = SPEC.default_config((32768, 4096), "float16")
    assert (medium["STRATEGY"], medium["CACHE"]) == (1, 2)
    huge = SPEC.default_config((7, 1000003), "float32")
    assert (huge["STRATEGY"], huge["CACHE"], huge["VEC"]) == (2, 0, 4)  # few long rows: split


@pytest.mark.parametrize(
    ("shape", "dtype", "block"),
    [
        ((8, 4194304), "float32", 512),
        ((1, 2**24), "float32", 512),
        ((64, 1048573), "bfloat16", 512),
        ((66, 65536), "float16", 512),  # 4 pieces of 2048 vectors
        ((8, 32768), "float32", 128),  # 33 pieces of 248 vectors: 128 threads
        ((1, 32768), "float32", 128),  # 264 pieces of 31 vectors: too short, not split
    ],
)
def test_default_config_splits_few_long_rows(shape, dtype, block) -> None:
    """Rows fewer than half the SMs, of 128 KiB or more: STRATEGY 2, 2 blocks per SM, the
    largest block whose pieces hold a vector per thread (else not split)."""
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    if shape == (1, 32768):
        assert config["STRATEGY"] == 1
        return
    assert (config["STRATEGY"], config["CACHE"], config["MIN_BLOCKS"]) == (2, 0, 2)
    assert (config["BLOCK_SIZE"], config["VEC"] * DTYPES[dtype][2]) == (block, 16)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((67, 2**20), "float32"), ((8, 32767), "float32"), ((8, 65535), "bfloat16")],
)
def test_default_config_keeps_a_block_per_row_beyond_few_long_rows(shape, dtype) -> None:
    """67 rows (more than half the SMs) or rows under 128 KiB: no split."""
    assert SPEC.default_config(shape, dtype)["STRATEGY"] != 2


@pytest.mark.parametrize(
    ("shape", "dtype", "vec", "lanes"),
    [
        ((4194304, 7), "float32", 1, 8),  # issue 31's case: 7 of 8 lanes busy, 4 rows a warp
        ((1024, 1), "float16", 1, 4),
        ((1024, 3), "float32", 1, 4),
        ((1024, 9), "bfloat16", 1, 16),
        ((99, 16), "float32", 4, 4),  # 4 vectors of 16 bytes, 8 rows a warp
        ((99, 24), "float16", 4, 8),  # 8-wide vectors would make only 3 of them
        ((99, 30), "float32", 2, 16),
        ((99, 31), "float32", 1, 32),
        ((99, 32), "float32", 1, 32),  # from 32 elements on: a warp per row, as before LANES
        ((65536, 128), "float16", 4, 32),
    ],
)
def test_default_config_gives_short_rows_sub_warp_groups(shape, dtype, vec, lanes) -> None:
    """Rows shorter than 32 elements: the widest vector dividing the row into at least 4, and
    the smallest group of lanes holding it in one vector per lane (issue 31)."""
    config = SPEC.default_config(shape, dtype)
    assert (config["STRATEGY"], config["CACHE"]) == (0, 2)
    assert (config["VEC"], config["LANES"]) == (vec, lanes)
    assert SPEC.defines(config, shape, dtype)["ITEMS"] == 1


@pytest.mark.parametrize("cols", [1, 3, 127, 1000, 4097, 50257])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_vec_is_valid_on_any_row_length(cols, dtype) -> None:
    """VEC is a free tunable on every shape (issue 31): rows that are not whole vectors render
    ROW_SPLIT=1 (scalar head and tail around aligned vectors), whole-vector rows do not."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    for vec in (1, 2, 4, 8):
        config = cfg(vec=vec, cache=0)
        if vec * itemsize > 16:
            assert "vector" in SPEC.check(config, (64, cols), dtype)
            continue
        assert SPEC.check(config, (64, cols), dtype) is None
        split = SPEC.defines(config, (64, cols), dtype).get("ROW_SPLIT")
        assert split == (1 if cols % vec else None)


def test_default_config_rejects_invalid_shapes() -> None:
    with pytest.raises(InvalidInput):
        SPEC.default_config((0, 4), "float32")
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 4), "int32")
    with pytest.raises(InvalidInput):
        SPEC.default_config((4, 2**31), "float32")


# --- rendering --------------------------------------------------------------------------------


def test_render_puts_defines_first_tunables_in_key_order() -> None:
    config = cfg(block=128, vec=8, strategy=0, cache=2, min_blocks=2)
    source = SPEC.render(config, (100, 1000), "float16")
    lines = source.splitlines()
    assert lines[:10] == [
        "#define BLOCK_SIZE 128",
        "#define VEC 8",
        "#define STRATEGY 0",
        "#define CACHE 2",
        "#define MIN_BLOCKS 2",
        "#define LANES 32",
        "#define DTYPE __half",
        "#define IS_HALF 1",
        "#define IS_BF16 0",
        "#define ITEMS 4",  # ceil(1000 / (32 * 8))
    ]
    assert source.endswith(template_source(SPEC.template))  # the shared headers inlined


@pytest.mark.parametrize(
    ("dtype", "ctype", "flags"),
    [
        ("float32", "float", (0, 0)),
        ("float16", "__half", (1, 0)),
        ("bfloat16", "__nv_bfloat16", (0, 1)),
    ],
)
def test_defines_name_the_cuda_type(dtype, ctype, flags) -> None:
    macros = SPEC.defines(cfg(vec=2), (4, 64), dtype)
    assert macros["DTYPE"] == ctype
    assert (macros["IS_HALF"], macros["IS_BF16"]) == flags


def test_items_only_for_the_register_cache() -> None:
    """CACHE=0/1 sources do not depend on the shape, so one compile serves every shape."""
    streaming = cfg(cache=0)
    assert SPEC.defines(streaming, (4, 1024), "float32")["ITEMS"] == 0
    assert SPEC.render(streaming, (4, 1024), "float32") == SPEC.render(
        streaming, (99, 8192), "float32"
    )
    cached = cfg(cache=2, block=256, vec=4)
    assert SPEC.defines(cached, (4, 1024), "float32")["ITEMS"] == 1
    assert SPEC.defines(cached, (4, 1025 * 4), "float32")["ITEMS"] == 5


# --- launch geometry --------------------------------------------------------------------------


def test_launch_warp_per_row() -> None:
    launch = SPEC.launch(cfg(block=256, strategy=0, cache=0), (1000, 4096), "float32")
    assert launch == Launch(grid=(125, 1, 1), block=(256, 1, 1), shared_bytes=0)
    ragged = SPEC.launch(cfg(block=128, strategy=0, cache=2), (1001, 64), "float16")
    assert ragged.grid == (math.ceil(1001 / 4), 1, 1)


def test_launch_sub_warp_groups() -> None:
    """LANES=8: 4 rows per warp, 32 per block of 256 threads; CACHE=1 holds all 32 rows."""
    config = cfg(block=256, strategy=0, cache=1, lanes=8, vec=1)
    launch = SPEC.launch(config, (1000, 7), "float32")
    assert launch == Launch(grid=(32, 1, 1), block=(256, 1, 1), shared_bytes=32 * 7 * 4)
    assert softmax_module.rows_per_block(config) == 32
    assert softmax_module.threads_per_row(config) == 8
    assert softmax_module.items_per_thread({**config, "CACHE": 2}, 100) == 13


def test_launch_block_per_row() -> None:
    launch = SPEC.launch(cfg(block=512, strategy=1, cache=2), (70000, 4096), "float16")
    assert launch == Launch(grid=(70000, 1, 1), block=(512, 1, 1), shared_bytes=0)


def test_launch_shared_memory_for_the_shared_cache() -> None:
    block_row = SPEC.launch(cfg(block=1024, strategy=1, cache=1), (10, 8192), "float16")
    assert block_row.shared_bytes == 8192 * 2
    warp_rows = SPEC.launch(cfg(block=128, strategy=0, cache=1), (10, 1000), "float32")
    assert warp_rows.shared_bytes == 4 * 1000 * 4  # 4 rows per block
    assert warp_rows.grid == (3, 1, 1)


def test_split_rows_launch_twice_on_a_grid_of_one_wave() -> None:
    """STRATEGY 2: rows * (MIN_BLOCKS * 132 // rows) blocks (0 counts as 1), never more than
    the one wave of MIN_BLOCKS per SM: the stats kernel, then softmax_kernel, same geometry and
    every argument."""
    for rows, min_blocks, parts in ((8, 0, 16), (8, 1, 16), (8, 2, 33), (1, 4, 528), (64, 1, 2)):
        config = cfg(block=256, strategy=2, min_blocks=min_blocks)
        assert softmax_module.split_parts(config, rows) == parts
        launch = Launch(grid=(rows * parts, 1, 1), block=(256, 1, 1), shared_bytes=0)
        assert SPEC.launch(config, (rows, 2**20), "float32") == launch
        assert rows * parts <= max(min_blocks, 1) * 132 <= softmax_module.SPLIT_PIECES
        steps = SPEC.steps(config, (rows, 2**20), "float32")
        assert [(s.kernel, s.launch, s.args) for s in steps] == [
            ("softmax_split_stats", launch, None),
            ("softmax_kernel", launch, None),
        ]
    # The other strategies: one launch of softmax_kernel, as before STRATEGY 2.
    (only,) = SPEC.steps(cfg(strategy=1), (8, 2**20), "float32")
    assert (only.kernel, only.launch.grid) == ("softmax_kernel", (8, 1, 1))
    assert softmax_module.split_parts(cfg(strategy=1), 8) == 1


def test_split_workspace_size_matches_the_template() -> None:
    """kSplitPieces in softmax.cu holds the largest grid check() admits (MIN_BLOCKS 4)."""
    text = SPEC.template.read_text()
    assert f"constexpr int kSplitPieces = 4 * {limits.NUM_SMS};" in text
    assert max(SPEC.params["MIN_BLOCKS"]) * limits.NUM_SMS == softmax_module.SPLIT_PIECES
    for rows in (1, 2, 3, 7, 64, 131, 263, 264):
        for min_blocks in SPEC.params["MIN_BLOCKS"]:
            config = cfg(block=32, vec=1, strategy=2, min_blocks=min_blocks)
            if SPEC.check(config, (rows, 2**22), "float32") is None:
                assert SPEC.launch(config, (rows, 2**22), "float32").grid[0] <= 4 * 132


def test_split_rows_static_shared_memory() -> None:
    """A block per piece reduces over warps as a block per row does."""
    assert softmax_module.static_shared_bytes(cfg(strategy=2, block=1024)) == 2 * 32 * 8
    assert softmax_module.static_shared_bytes(cfg(strategy=2, block=32)) == 0


def test_launch_grid_is_capped() -> None:
    launch = SPEC.launch(cfg(block=32, strategy=1), (2**31 - 1, 1), "float32")
    assert launch.grid[0] == 2**31 - 1


# --- problems, references, tolerances ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem_shapes_dtypes_and_args(dtype) -> None:
    rng = np.random.default_rng(1)
    problem = SPEC.make_problem((37, 300), dtype, rng)
    x, y, rows, cols = problem.args
    np_dtype = DTYPES[dtype][0]
    assert x.dtype == np_dtype and y.dtype == np_dtype
    assert x.shape == y.shape == (37, 300)
    assert x.flags.c_contiguous and y.flags.c_contiguous
    assert (rows, cols) == (37, 300)
    assert isinstance(rows, np.int32) and isinstance(cols, np.int32)
    assert problem.outputs == [1]
    assert len(problem.references) == 1
    ref = problem.references[0]
    assert ref.dtype == np.float64 and ref.shape == (37, 300)
    assert np.all(np.isnan(y.astype(np.float64)))  # unwritten output cannot pass verification
    assert problem.nbytes == SPEC.bytes_moved((37, 300), dtype)


def test_bfloat16_inputs_use_ml_dtypes() -> None:
    problem = SPEC.make_problem((4, 16), "bfloat16", np.random.default_rng(2))
    assert problem.args[0].dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_inputs_are_random_with_large_offsets(dtype) -> None:
    x = SPEC.make_problem((12, 257), dtype, np.random.default_rng(3)).args[0].astype(np.float64)
    assert np.count_nonzero(x) > 0.99 * x.size
    assert np.all(x.std(axis=1) > 1.0)  # 3 * N(0, 1) per row
    means = x.mean(axis=1)
    assert np.all(means[0::4] > 900) and np.all(means[2::4] < -900)
    assert np.all(np.abs(means[1::2]) < 20)
    # Without subtracting the row max, exp overflows (or underflows to 0/0) on those rows.
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    assert not np.all(np.isfinite(naive))


def test_single_row_problems_stress_stability() -> None:
    x = SPEC.make_problem((1, 33), "float32", np.random.default_rng(4)).args[0]
    assert x.min() > 900


def test_make_problem_is_reproducible_per_seed() -> None:
    a = SPEC.make_problem((8, 64), "float16", np.random.default_rng(5)).args[0]
    b = SPEC.make_problem((8, 64), "float16", np.random.default_rng(5)).args[0]
    c = SPEC.make_problem((8, 64), "float16", np.random.default_rng(6)).args[0]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_reference_is_the_float64_softmax_of_the_stored_inputs(dtype) -> None:
    problem = SPEC.make_problem((21, 130), dtype, np.random.default_rng(7))
    x = problem.args[0].astype(np.float64)  # the values the kernel will see
    ref = problem.references[0]
    np.testing.assert_allclose(ref.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert np.all(ref >= 0) and np.all(ref <= 1)
    # Straightforward per-row definition, via logsumexp for the shifted rows.
    expected = np.empty_like(x)
    for r, row in enumerate(x):
        shifted = row - row.max()
        expected[r] = np.exp(shifted - np.log(np.sum(np.exp(shifted))))
    np.testing.assert_allclose(ref, expected, rtol=1e-12, atol=1e-300)
    # Argmax is preserved, and equal inputs give equal outputs.
    assert np.array_equal(ref.argmax(axis=1), x.argmax(axis=1))


def test_reference_handles_uniform_and_extreme_rows() -> None:
    x = np.array([[5.0, 5.0, 5.0, 5.0], [1e4, -1e4, 0.0, 1e4]], dtype=np.float32)
    ref = softmax_reference(x)
    np.testing.assert_allclose(ref[0], 0.25)
    np.testing.assert_allclose(ref[1], [0.5, 0.0, 0.0, 0.5])


def test_tolerances_are_ordered_by_precision() -> None:
    tolerances = {dtype: SPEC.tolerance(dtype) for dtype in DTYPE_NAMES}
    assert tolerances["float32"] == (2.0**-125, 1e-4)
    (a32, r32), (a16, r16), (ab, rb) = (tolerances[d] for d in DTYPE_NAMES)
    assert r32 < r16 < rb
    # The relative tolerance covers at least twice the half-ulp output rounding of each type.
    assert r16 >= 2 * 2.0**-11 and rb >= 2 * 2.0**-9
    with pytest.raises(InvalidInput):
        SPEC.tolerance("int32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_reference_is_within_tolerance(dtype) -> None:
    """An ideal kernel (exact math, one rounding to the output type) passes verification."""
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    ref = problem.references[0]
    ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
    atol, rtol = SPEC.tolerance(dtype)
    np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
    # ... and a kernel that forgot to normalise does not.
    assert not np.allclose(ref * 1.01, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_tolerance_does_not_pass_zeros_for_small_outputs(dtype) -> None:
    """A kernel that writes 0 for every output below 1/cols fails: atol is far below the small
    outputs a long row holds (with the old atol of 1e-6, most of a 4096-wide row passed as 0)."""
    problem = SPEC.make_problem((64, 4096), dtype, np.random.default_rng(3))
    ref = problem.references[0]
    atol, rtol = SPEC.tolerance(dtype)
    small = (ref < 1.0 / 4096) & (ref > 0)
    assert small.mean() > 0.5  # most of each row
    zeroed = np.where(small, 0.0, ref)
    within = np.isclose(zeroed, ref, atol=atol, rtol=rtol)
    # Every small output above twice the type's own underflow error is caught.
    underflow = {"float32": 2.0**-126, "float16": 2.0**-24, "bfloat16": 2.0**-126}[dtype]
    caught = small & (ref > 2 * underflow)
    assert caught.sum() > 0.5 * small.sum()
    assert not within[caught].any()


def test_bytes_moved_and_buffer_bytes() -> None:
    assert SPEC.bytes_moved((8192, 32768), "float16") == 2 * 8192 * 32768 * 2
    assert SPEC.bytes_moved((3, 5), "float32") == 2 * 3 * 5 * 4
    assert SPEC.buffer_bytes((3, 5), "bfloat16") == 2 * 3 * 5 * 2
    assert SPEC.flops((3, 5), "float32") == 0


def test_describe_is_json_ready() -> None:
    description = SPEC.describe()
    assert description["name"] == "softmax"
    assert description["space_size"] == 3456
    assert description["params"]["VEC"] == [1, 2, 4, 8]
