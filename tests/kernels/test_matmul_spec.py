"""The matmul specs (``matmul``, ``matmul_nt``, ``matmul_tn``): constraints, defaults, rendering,
launch geometry, problems, references, and the kernels' index logic re-implemented in numpy
(tile rasterization, the float32 warp-tiled thread layout, the tensor-core swizzle, ldmatrix/mma
fragment layouts of every operand layout)."""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, get_operator, list_operators
from kato.kernels.matmul import (
    FP32_TILES,
    GROUP_M,
    MAX_M,
    MMA_PARAMS,
    MMA_PINNED,
    TC_TILES,
    MatmulNTSpec,
    MatmulSpec,
    MatmulTNSpec,
    matmul_reference,
    register_cap,
    registers_needed,
    shared_bytes,
    threads_per_block,
)


@functools.cache
def valid(shape: tuple[int, ...], dtype: str) -> list[dict]:
    """The valid mma.sync configs of the space (the wgmma path's are
    tests/kernels/test_matmul_wgmma_spec.py's)."""
    return valid_for(SPEC, shape, dtype)


SPEC = get_operator("matmul")
NT = get_operator("matmul_nt")
TN = get_operator("matmul_tn")
SPECS = (SPEC, NT, TN)
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1, 1),
    (1, 4096, 4096),
    (4096, 1, 4096),
    (127, 131, 257),
    (64, 64, 64),
    (70000, 64, 64),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (1000, 1000, 1000),
    (4097, 4095, 33),
    (3, 5, 100003),
    (MAX_M, 1, 1),
]


def fp32_cfg(**kw):
    base = {
        "BM": 128,
        "BN": 128,
        "BK": 8,
        "WM": 32,
        "WN": 64,
        "TM": 8,
        "TN": 8,
        "VEC": 4,
        "STAGES": 2,
        "PAD": 4,
        "MIN_BLOCKS": 0,
        "ENGINE": "mma",
        **MMA_PINNED,
    }
    return {**base, **kw}


def tc_cfg(**kw):
    base = {
        "BM": 128,
        "BN": 128,
        "BK": 32,
        "WM": 64,
        "WN": 64,
        "TM": 4,
        "TN": 4,
        "VEC": 8,
        "STAGES": 3,
        "PAD": 0,
        "MIN_BLOCKS": 0,
        "ENGINE": "mma",
        **MMA_PINNED,
    }
    return {**base, **kw}


# --- identity and registry ---------------------------------------------------------------------


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, MatmulSpec)
    assert SPEC in list_operators()
    assert SPEC.kernel_name == "matmul_kernel"
    assert SPEC.rank == 3
    assert SPEC.shape_names == ("M", "N", "K")
    assert SPEC.dtypes == DTYPE_NAMES
    assert SPEC.template.is_file()
    text = SPEC.template.read_text()
    assert 'extern "C" __global__' in text
    assert "namespace KATO_NS" in text and "#pragma once" not in text
    assert len(SPEC.version) == 12


@pytest.mark.parametrize(
    ("spec", "cls", "name", "stored"),
    [
        (NT, MatmulNTSpec, "matmul_nt", ((7, 5), (3, 5))),  # A (M, K), B (N, K)
        (TN, MatmulTNSpec, "matmul_tn", ((5, 7), (5, 3))),  # A (K, M), B (K, N)
    ],
)
def test_layouts_are_registered_with_the_matmul_contract(spec, cls, name, stored) -> None:
    assert isinstance(spec, cls) and spec.name == name and spec in list_operators()
    assert spec.shape_names == ("M", "N", "K") and spec.rank == 3
    assert spec.kernel_name == SPEC.kernel_name and spec.template == SPEC.template
    assert spec.params == SPEC.params and spec.dtypes == SPEC.dtypes
    assert spec.describe()["name"] == name and spec.describe()["space_size"] == SPEC.space_size()
    problem = spec.make_problem((7, 3, 5), "float32", np.random.default_rng(0))
    a, b, c = problem.args[:3]
    assert (a.shape, b.shape, c.shape) == (*stored, (7, 3))
    assert [int(x) for x in problem.args[3:]] == [7, 3, 5]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_reference_is_the_product_of_the_stored_operands(spec, dtype) -> None:
    problem = spec.make_problem((9, 11, 13), dtype, np.random.default_rng(2))
    a, b = (x.astype(np.float64) for x in problem.args[:2])
    want = np.einsum(
        ("km" if spec.trans_a else "mk") + "," + ("nk" if spec.trans_b else "kn") + "->mn", a, b
    )
    np.testing.assert_allclose(problem.references[0], want, rtol=1e-13)
    assert problem.tolerances == [spec.tolerance_for(13, dtype)]
    assert np.isnan(problem.args[2].astype(np.float64)).all()


def test_layout_specific_constraints() -> None:
    # A^T @ B transposes no tile into shared memory: PAD is pinned to 0 there (VEC 1 too).
    assert "PAD is unused" in TN.check(fp32_cfg(), (64, 64, 64), "float32")
    assert TN.check(fp32_cfg(PAD=0), (64, 64, 64), "float32") is None
    assert TN.check(fp32_cfg(PAD=0, VEC=1), (65, 67, 69), "float32") is None
    assert "PAD=4" in NT.check(fp32_cfg(PAD=0, VEC=1), (64, 64, 64), "float32")
    assert "spills" in TN.check(fp32_cfg(PAD=0, MIN_BLOCKS=2), (64, 64, 64), "float32")
    assert SPEC.check(fp32_cfg(MIN_BLOCKS=2), (64, 64, 64), "float32") is None
    # B (N, K) is transposed into Bs[k][n], padded like A's tile
    assert shared_bytes(fp32_cfg(), "float32", trans_b=True) == 2 * (8 * 132 + 8 * 132) * 4
    assert shared_bytes(fp32_cfg(PAD=0), "float32", trans_a=True) == 2 * (8 * 128 + 8 * 128) * 4
    assert NT.launch(fp32_cfg(), (64, 64, 64), "float32").shared_bytes == 2 * (8 * 132) * 2 * 4
    for spec in SPECS:
        for dtype in DTYPE_NAMES:
            assert {c["VEC"] for c in valid_for(spec, (127, 129, 131), dtype)} == (
                {1, 4} if dtype == "float32" else {1, 8}
            )


@functools.cache
def valid_for(spec, shape: tuple[int, ...], dtype: str) -> list[dict]:
    """The valid mma.sync configs (checking ~60k configs takes a second or two), from the
    spec's candidates (test_matmul_wgmma_spec.py holds them equal to the whole space's)."""
    candidates = spec.candidates(shape, dtype)
    return [c for c in candidates if c["ENGINE"] == "mma" and spec.check(c, shape, dtype) is None]


def test_layouts_render_distinct_sources_per_class() -> None:
    for dtype in DTYPE_NAMES:
        for shape in ((4096, 4096, 4096), (127, 129, 131), (4096, 4095, 4096)):
            sources = [
                spec.render(c, shape, dtype)
                for spec in SPECS
                for c in valid_for(spec, shape, dtype)
            ]
            assert len(set(sources)) == len(sources)


# --- validation and constraints ----------------------------------------------------------------


def test_validate_rejects_what_the_kernel_cannot_index() -> None:
    with pytest.raises(InvalidInput, match="rank 3"):
        SPEC.validate((4, 4), "float32")
    with pytest.raises(InvalidInput, match="at least 1"):
        SPEC.validate((0, 4, 4), "float32")
    with pytest.raises(InvalidInput, match="M up to"):
        SPEC.validate((MAX_M + 1, 4, 4), "float32")
    with pytest.raises(InvalidInput, match="up to 2"):
        SPEC.validate((4, 2**31, 4), "float16")
    with pytest.raises(InvalidInput, match="dtype"):
        SPEC.validate((4, 4, 4), "int32")
    assert SPEC.validate((MAX_M, 2**31 - 2**16, 7), "float32") == (MAX_M, 2**31 - 2**16, 7)


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (fp32_cfg(VEC=8), (64, 64, 64), "float32", "VEC 1 or 4"),
        (fp32_cfg(BK=32), (64, 64, 64), "float32", "BK 8 or 16"),
        (fp32_cfg(STAGES=3), (64, 64, 64), "float32", "STAGES 1 or 2"),
        (fp32_cfg(WN=32), (64, 64, 64), "float32", "not in FP32_TILES"),
        (fp32_cfg(BM=64, BN=256), (64, 64, 64), "float32", "not in FP32_TILES"),
        (fp32_cfg(VEC=1, STAGES=1), (64, 64, 64), "float32", "VEC=1"),
        (fp32_cfg(BM=64, WM=128), (64, 64, 64), "float32", "is not one of"),
        (fp32_cfg(BN=64, MIN_BLOCKS=2), (64, 64, 64), "float32", "does not lower"),
        (tc_cfg(STAGES=3), (64, 60, 60), "float16", "no load is a cp.async"),
        (tc_cfg(STAGES=2), (64, 64, 60), "float16", "spill"),  # unaligned A, 64 x 64 warps
        (fp32_cfg(BN=256), (64, 64, 61), "float32", "spill"),  # unaligned A, at the cap
        (tc_cfg(VEC=4), (64, 64, 64), "float16", "VEC 1 or 8"),
        (tc_cfg(TM=8), (64, 64, 64), "bfloat16", "pinned"),
        (tc_cfg(PAD=4), (64, 64, 64), "float16", "pinned"),
        (tc_cfg(BK=16), (64, 64, 64), "float16", "BK 32 or 64"),
        (tc_cfg(STAGES=1), (64, 64, 64), "float16", "STAGES 2, 3 or 4"),
        (tc_cfg(VEC=1, STAGES=3), (64, 64, 64), "float16", "synchronous"),
        (tc_cfg(BN=256, WN=32), (64, 64, 64), "float16", "not in TC_TILES"),
        (tc_cfg(BM=128, BN=128, WM=64, WN=32, MIN_BLOCKS=2), (64, 64, 64), "float16", "spill"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    got = SPEC.check(config, shape, dtype)
    assert got is not None and reason in got, got


def test_check_rejects_missing_and_unknown_parameters() -> None:
    config = fp32_cfg()
    del config["PAD"]
    assert "missing" in SPEC.check(config, (64, 64, 64), "float32")
    assert "unknown" in SPEC.check({**fp32_cfg(), "X": 1}, (64, 64, 64), "float32")
    assert "at least 1" in SPEC.check(fp32_cfg(), (0, 64, 64), "float32")


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (fp32_cfg(), (4096, 4096, 4096), "float32"),
        (fp32_cfg(VEC=1), (127, 131, 257), "float32"),
        (fp32_cfg(VEC=4, BK=16), (127, 131, 257), "float32"),
        (fp32_cfg(VEC=4, BN=256), (127, 132, 256), "float32"),  # A unaligned, STAGES 2 at cap
        (fp32_cfg(BK=16, STAGES=1, PAD=0, MIN_BLOCKS=2), (64, 62, 30), "float32"),
        (tc_cfg(WN=32, STAGES=2), (1, 1, 1), "float16"),
        (tc_cfg(WN=32, STAGES=4), (64, 64, 60), "bfloat16"),
        (fp32_cfg(BK=16, MIN_BLOCKS=2, STAGES=1, PAD=0), (1, 4, 4), "float32"),
        (tc_cfg(), (8192, 8192, 8192), "float16"),
        (tc_cfg(VEC=1, STAGES=2), (1, 1, 1), "bfloat16"),
        (tc_cfg(BM=256, BN=128, BK=32, STAGES=4), (64, 64, 64), "float16"),
        (tc_cfg(BM=128, BN=128, WM=64, WN=32, BK=64, STAGES=4), (64, 64, 64), "float16"),
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_space_is_rich_but_compiles_in_bounded_sources() -> None:
    """Every valid config renders a distinct source that depends on the shape only through its
    alignment class, and there are at most ~150 per dtype (the compile test compiles them all
    for two archs)."""
    for dtype in DTYPE_NAMES:
        configs = valid((4096, 4096, 4096), dtype)
        sources = {SPEC.render(c, (4096, 4096, 4096), dtype) for c in configs}
        assert len(sources) == len(configs)
        assert 60 <= len(configs) <= 150, (dtype, len(configs))
        # the same configs at another shape of the class render the same sources
        assert {SPEC.render(c, (128, 8, 8), dtype) for c in configs} == sources
        wide = {1, 4} if dtype == "float32" else {1, 8}
        assert {c["VEC"] for c in configs} == wide
        # odd shapes keep every vector width, with their own sources where VEC > 1
        odd = valid((127, 131, 257), dtype)
        assert {c["VEC"] for c in odd} == wide
        odd_sources = {SPEC.render(c, (127, 131, 257), dtype) for c in odd}
        assert len(odd_sources) == len(odd)
        assert {SPEC.render(c, (3, 5, 7), dtype) for c in odd} == odd_sources
        for c in odd:
            same = SPEC.render(c, (127, 131, 257), dtype) in sources
            # float32's SPLIT_K > 1 exists only for few tiles: never at 4096^3
            assert same == (c["VEC"] == 1 and c["SPLIT_K"] == 1), c


def test_every_listed_tile_is_reachable() -> None:
    configs = valid((4096, 4096, 4096), "float32")
    got = {tuple(c[p] for p in ("BM", "BN", "WM", "WN", "TM", "TN")) for c in configs}
    assert got == set(FP32_TILES)
    configs = valid((4096, 4096, 4096), "float16")
    got = {tuple(c[p] for p in ("BM", "BN", "WM", "WN")) for c in configs}
    assert got == set(TC_TILES)


def test_constraints_hold_for_every_valid_config() -> None:
    for dtype in DTYPE_NAMES:
        for c in valid((4096, 4096, 4096), dtype):
            threads = threads_per_block(c)
            assert 64 <= threads <= 512
            assert c["MIN_BLOCKS"] * threads <= 2048
            assert shared_bytes(c, dtype) <= 227 * 1024
            assert registers_needed(c, dtype) <= register_cap(c)
            assert registers_needed(c, dtype, (False, True)) >= registers_needed(c, dtype)
            if dtype == "float32":
                lanes_m = c["WM"] // c["TM"]
                assert c["WN"] == (32 // lanes_m) * c["TN"]
                assert c["BM"] * c["BN"] == threads * c["TM"] * c["TN"]
            else:
                assert c["WM"] % 16 == 0 and c["WN"] % 16 == 0 and c["BN"] % 64 == 0


def test_register_cap_follows_launch_bounds() -> None:
    assert register_cap(fp32_cfg()) == 255  # 256 threads
    assert register_cap(fp32_cfg(MIN_BLOCKS=2)) == 128
    assert register_cap(fp32_cfg(BM=256, WM=64, WN=32)) == 128  # 512 threads
    assert register_cap(tc_cfg()) == 255


def test_shared_memory_model() -> None:
    assert shared_bytes(fp32_cfg(), "float32") == 2 * (8 * 132 + 8 * 128) * 4
    assert shared_bytes(fp32_cfg(STAGES=1, PAD=0), "float32") == (8 * 128 + 8 * 128) * 4
    assert shared_bytes(tc_cfg(), "float16") == 3 * (128 * 32 + 32 * 128) * 2
    # the largest tensor-core stage sets: 4 x (256x32 + 32x128) halves = 96 KiB, and
    # 4 x (128x64 + 64x128) = 128 KiB (a 64 x 64 warp tile with BK=64 would spill)
    c = tc_cfg(BM=256, BK=32, STAGES=4)
    assert shared_bytes(c, "float16") == 98304
    assert SPEC.check(c, (4096, 4096, 4096), "float16") is None
    c = tc_cfg(WN=32, BK=64, STAGES=4)
    assert shared_bytes(c, "float16") == 131072
    assert SPEC.check(c, (4096, 4096, 4096), "float16") is None
    assert "spill" in SPEC.check(tc_cfg(BK=64), (4096, 4096, 4096), "float16")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(spec, shape, dtype) -> None:
    config = spec.default_config(shape, dtype)
    assert spec.check(config, shape, dtype) is None
    assert config["VEC"] == (4 if dtype == "float32" else 8)  # full width on every shape
    launch = spec.launch(config, shape, dtype)
    assert 1 <= launch.grid[0] <= 2**31 - 1 and 1 <= launch.grid[1] <= 65535


def test_default_config_picks_vectors_and_tiles() -> None:
    # float32: 128 x 256 tiles where 512 of them fill waves of 132 SMs (97%).
    assert SPEC.default_config((4096, 4096, 4096), "float32") == fp32_cfg(BN=256)
    assert SPEC.default_config((3072, 1024, 4096), "float32")["BN"] == 128  # 96 wide tiles
    # unaligned rows: still float4s; the wide tile would spill with element-wise prefetches
    assert SPEC.default_config((4097, 4095, 33), "float32") == fp32_cfg()
    assert SPEC.default_config((4096, 4096, 33), "float32") == fp32_cfg()
    assert NT.default_config((4096, 4095, 4096), "float32") == fp32_cfg(BN=256)  # only C is
    assert SPEC.default_config((4096, 4096, 4096), "float16") == tc_cfg()
    assert SPEC.default_config((127, 131, 257), "float32")["VEC"] == 4
    # tensor cores: 3 stages where both operands stream by cp.async, else 2 (and 64 x 32 warps)
    assert SPEC.default_config((4096, 4096, 4090), "bfloat16") == tc_cfg(STAGES=2, WN=32)
    assert SPEC.default_config((4096, 4090, 4090), "bfloat16") == tc_cfg(STAGES=2, WN=32)
    assert SPEC.default_config((1, 4096, 4096), "float16")["BM"] == 64
    # matmul_tn transposes no tile into shared memory: no padding
    assert TN.default_config((4096, 4096, 4096), "float32") == fp32_cfg(BN=256, PAD=0)
    assert NT.default_config((4096, 4096, 4096), "float32") == fp32_cfg(BN=256)


def test_default_config_rejects_invalid_shapes() -> None:
    with pytest.raises(InvalidInput):
        SPEC.default_config((0, 1, 1), "float32")
    with pytest.raises(InvalidInput):
        SPEC.default_config((1, 1, 1), "int32")


# --- rendering and launching -------------------------------------------------------------------


DERIVED = ["DTYPE", "IS_HALF", "IS_BF16", "TRANS_A", "TRANS_B", "ALIGN_A", "ALIGN_B", "ALIGN_C"]


def test_render_puts_defines_first_and_depends_on_the_alignment_class_only() -> None:
    src = SPEC.render(fp32_cfg(), (4096, 4096, 4096), "float32")
    lines = src.splitlines()
    names = [line.split()[1] for line in lines[: len(MMA_PARAMS) + len(DERIVED)]]
    # the wgmma path's tunables render nothing here: the source is what it was before them
    assert names == [*MMA_PARAMS, *DERIVED]
    assert lines[len(names)].startswith("//")
    assert lines[0] == "#define BM 128"
    assert src == SPEC.render(fp32_cfg(), (5, 8, 12), "float32")
    assert src != SPEC.render(fp32_cfg(), (5, 8, 9), "float32")


@pytest.mark.parametrize(
    ("spec", "shape", "want"),
    [
        (SPEC, (4096, 4096, 4096), (1, 1, 1)),
        (SPEC, (4096, 4096, 4095), (0, 1, 1)),  # A's pitch is K
        (SPEC, (4096, 4095, 4096), (1, 0, 0)),  # B's and C's are N
        (NT, (4096, 4096, 4095), (0, 0, 1)),  # A's and B's are K
        (NT, (4096, 4095, 4096), (1, 1, 0)),
        (TN, (4095, 4096, 4096), (0, 1, 1)),  # A's pitch is M
        (TN, (4096, 4095, 4095), (1, 0, 0)),
        (TN, (4097, 4097, 7), (0, 0, 0)),
    ],
)
def test_alignment_follows_each_matrix_row_pitch(spec, shape, want) -> None:
    macros = spec.defines(fp32_cfg(PAD=0), shape, "float32")
    assert (macros["ALIGN_A"], macros["ALIGN_B"], macros["ALIGN_C"]) == want
    assert spec.alignment(fp32_cfg(), shape) == tuple(bool(w) for w in want)
    # the scalar path is aligned everywhere: one source per config
    assert spec.alignment(fp32_cfg(VEC=1), shape) == (True, True, True)
    tc = spec.defines(tc_cfg(), shape, "float16")
    assert (tc["TRANS_A"], tc["TRANS_B"]) == (int(spec.trans_a), int(spec.trans_b))


@pytest.mark.parametrize(
    ("dtype", "ctype", "flags"),
    [
        ("float32", "float", (0, 0)),
        ("float16", "__half", (1, 0)),
        ("bfloat16", "__nv_bfloat16", (0, 1)),
    ],
)
def test_defines_name_the_cuda_type(dtype, ctype, flags) -> None:
    config = fp32_cfg() if dtype == "float32" else tc_cfg()
    macros = SPEC.defines(config, (64, 64, 64), dtype)
    assert macros["DTYPE"] == ctype
    assert (macros["IS_HALF"], macros["IS_BF16"]) == flags


def test_launch_geometry() -> None:
    launch = SPEC.launch(fp32_cfg(), (4096, 4096, 4096), "float32")
    assert launch.block == (256, 1, 1)
    assert launch.grid == (8 * 32, 4, 1)  # 32 tile-rows in 4 groups of 8, 32 tile-columns
    assert launch.shared_bytes == shared_bytes(fp32_cfg(), "float32")
    launch = SPEC.launch(tc_cfg(BM=64, WM=32), (1, 1000, 64), "float16")
    assert launch.grid == (8, 1, 1)  # one tile-row: no dead blocks
    assert launch.block == (128, 1, 1)
    launch = SPEC.launch(tc_cfg(BM=64, BN=64, WM=32, WN=32), (MAX_M, 1, 64), "float16")
    assert launch.grid == (8, 65535, 1)


# --- the kernels' index logic in numpy ---------------------------------------------------------


def tile_coords(bx: int, by: int, tiles_m: int, tiles_n: int) -> tuple[int, int] | None:
    """tile_coords() of matmul.cu."""
    first_m = by * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    if bx >= rows * tiles_n:
        return None
    q = bx // rows
    return first_m + bx - q * rows, q


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (8, 5), (9, 1), (17, 4), (64, 64), (100, 3)])
def test_every_tile_is_visited_once(shape) -> None:
    tiles_m, tiles_n = shape
    config = {"BM": 64, "BN": 64}
    launch_grid = (min(tiles_m, GROUP_M) * tiles_n, math.ceil(tiles_m / GROUP_M))
    m, n = tiles_m * 64, tiles_n * 64
    assert (
        SPEC.launch({**tc_cfg(BM=64, BN=64, WM=32, WN=32)}, (m, n, 8), "float16").grid[:2]
        == launch_grid
    )
    seen = []
    for by in range(launch_grid[1]):
        for bx in range(launch_grid[0]):
            t = tile_coords(bx, by, tiles_m, tiles_n)
            if t is not None:
                seen.append(t)
    assert sorted(seen) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]
    assert config  # grouping: the first GROUP_M blocks share one tile-column
    assert [tile_coords(x, 0, tiles_m, tiles_n)[1] for x in range(min(tiles_m, 8))] == [0] * min(
        tiles_m, 8
    )


def emulate_fp32(config: dict, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The float32 kernel's index math, block by block and thread by thread (numpy vectors over
    the k of one tile): zero-filled tile loads, A transposed into As[k][m] with PAD, Bs[k][n],
    fragments read as float4s at the warp-tiled offsets, guarded stores. Returns C with NaN
    where nothing was stored."""
    bm, bn, bk, wm, wn, tm, tn, pad = (
        config[p] for p in ("BM", "BN", "BK", "WM", "WN", "TM", "TN", "PAD")
    )
    vec = config["VEC"]
    m, k = a.shape
    n = b.shape[1]
    lm_lanes = wm // tm
    ln_lanes = 32 // lm_lanes
    warps_n = bn // wn
    threads = threads_per_block(config)
    c = np.full((m, n), np.nan)
    writes = np.zeros((m, n), dtype=int)
    launch = SPEC.launch(config, (m, n, k), "float32")
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    for by in range(launch.grid[1]):
        for bx in range(launch.grid[0]):
            t = tile_coords(bx, by, tiles_m, tiles_n)
            if t is None:
                continue
            m0, n0 = t[0] * bm, t[1] * bn
            acc = np.zeros((threads, tm, tn))
            for k0 in range(0, k, bk):
                a_s = np.full((bk, bm + pad), np.nan)
                b_s = np.full((bk, bn), np.nan)
                for idx in range(bm * bk // vec):  # load_tiles + store_tiles, A
                    r, cc = divmod(idx, bk // vec)
                    cc *= vec
                    for e in range(vec):
                        gm, gk = m0 + r, k0 + cc + e
                        inside = gm < m and k0 + cc < k  # whole vector in or out
                        if vec == 1:
                            inside = gm < m and gk < k
                        a_s[cc + e, r] = a[gm, gk] if inside else 0.0
                for idx in range(bk * bn // vec):
                    r, cc = divmod(idx, bn // vec)
                    cc *= vec
                    for e in range(vec):
                        gk, gn = k0 + r, n0 + cc + e
                        inside = gk < k and (n0 + cc < n if vec == 4 else gn < n)
                        b_s[r, cc + e] = b[gk, gn] if inside else 0.0
                for tid in range(threads):
                    warp, lane = divmod(tid, 32)
                    lm, ln = divmod(lane, ln_lanes)
                    a_off = (warp // warps_n) * wm + lm * 4
                    b_off = (warp % warps_n) * wn + ln * 4
                    rows = [a_off + (i // 4) * 4 * lm_lanes + i % 4 for i in range(tm)]
                    cols = [b_off + (j // 4) * 4 * ln_lanes + j % 4 for j in range(tn)]
                    frag_a = a_s[:, rows]  # (bk, tm)
                    frag_b = b_s[:, cols]  # (bk, tn)
                    assert not np.isnan(frag_a).any() and not np.isnan(frag_b).any()
                    acc[tid] += frag_a.T @ frag_b
            for tid in range(threads):
                warp, lane = divmod(tid, 32)
                lm, ln = divmod(lane, ln_lanes)
                a_off = (warp // warps_n) * wm + lm * 4
                b_off = (warp % warps_n) * wn + ln * 4
                for i in range(tm):
                    gm = m0 + a_off + (i // 4) * 4 * lm_lanes + i % 4
                    for j in range(tn):
                        gn = n0 + b_off + (j // 4) * 4 * ln_lanes + j % 4
                        if gm < m and gn < n:
                            c[gm, gn] = acc[tid, i, j]
                            writes[gm, gn] += 1
    assert (writes == 1).all(), "every output written exactly once"
    return c


FP32_EMULATED = [
    (fp32_cfg(BM=64, BN=64, WM=16, WN=32, TM=4, TN=4, BK=8, VEC=1), (70, 75, 37)),
    (fp32_cfg(BM=64, BN=64, WM=16, WN=32, TM=4, TN=4, BK=16, STAGES=1), (64, 68, 36)),
    (fp32_cfg(BM=64, BN=128, VEC=4), (65, 132, 20)),
    (fp32_cfg(BM=128, BN=128, WM=32, WN=32, TM=8, TN=4, VEC=1), (130, 129, 9)),
    (fp32_cfg(BM=128, BN=128, WM=64, WN=32), (1, 136, 8)),
]


@pytest.mark.parametrize(("config", "shape"), FP32_EMULATED)
def test_fp32_thread_layout_computes_the_product(config, shape) -> None:
    assert SPEC.check(config, shape, "float32") is None
    rng = np.random.default_rng(1)
    m, n, k = shape
    a = rng.uniform(-1, 1, (m, k))
    b = rng.uniform(-1, 1, (k, n))
    np.testing.assert_allclose(emulate_fp32(config, a, b), a @ b, rtol=1e-12, atol=1e-12)


def fp32_fragment_reads_are_conflict_free(config: dict) -> bool:
    """Every float4 shared read of compute_tile: within each quarter-warp (8 lanes, one
    128-bit phase) the distinct addresses must be distinct 16-byte slots of one 128-byte line
    set, i.e. 4-word groups with distinct bank quads."""
    wm, tm, tn, bm, pad = config["WM"], config["TM"], config["TN"], config["BM"], config["PAD"]
    lm_lanes = wm // tm
    ln_lanes = 32 // lm_lanes
    for phase in range(4):
        lanes = range(phase * 8, phase * 8 + 8)
        for i in range(tm // 4):  # As reads, k = 1 (row stride bm + pad)
            words = {(bm + pad) + (lane // ln_lanes) * 4 + i * 4 * lm_lanes for lane in lanes}
            if len({(w // 4) % 8 for w in words}) != len(words):
                return False
        for j in range(tn // 4):
            words = {(lane % ln_lanes) * 4 + j * 4 * ln_lanes for lane in lanes}
            if len({(w // 4) % 8 for w in words}) != len(words):
                return False
    return True


def test_fp32_fragment_reads_are_conflict_free_for_every_tile() -> None:
    for bm, bn, wm, wn, tm, tn in FP32_TILES:
        for pad in (0, 4):
            cfg = fp32_cfg(BM=bm, BN=bn, WM=wm, WN=wn, TM=tm, TN=tn, PAD=pad)
            assert fp32_fragment_reads_are_conflict_free(cfg), cfg


def swizzle(chunks: int, r: int, c: int) -> int:
    """swizzle<C>() of matmul.cu."""
    if chunks >= 8:
        return c ^ (r & 7)
    return c ^ ((r // (8 // chunks)) & (chunks - 1))


@pytest.mark.parametrize("chunks", [4, 8, 16, 32])
def test_swizzle_is_a_permutation_and_ldmatrix_is_conflict_free(chunks) -> None:
    for r in range(64):
        assert sorted(swizzle(chunks, r, c) for c in range(chunks)) == list(range(chunks))
    # 8 consecutive rows (a multiple of 8 first) at one logical chunk: 8 distinct 16-byte bank
    # groups of the 128-byte line (row r starts at word r * chunks * 4).
    for r0 in range(0, 64, 8):
        for c in range(chunks):
            groups = {(r * chunks + swizzle(chunks, r, c)) % 8 for r in range(r0, r0 + 8)}
            assert len(groups) == 8


def ldmatrix(smem: np.ndarray, row_addr: list[int], trans: bool) -> np.ndarray:
    """ldmatrix.x4 on a flat smem of 16-bit values: lane l gives the address of one 8-element
    row; matrix q is rows of lanes 8q..8q+7. Returns regs[lane][q] as pairs (2 values)."""
    regs = np.zeros((32, 4, 2))
    for q in range(4):
        mat = np.array([smem[row_addr[8 * q + i] : row_addr[8 * q + i] + 8] for i in range(8)])
        if trans:
            mat = mat.T
        for lane in range(32):
            regs[lane, q] = mat[lane // 4, 2 * (lane % 4) : 2 * (lane % 4) + 2]
    return regs


def mma16816(a_regs: np.ndarray, b_regs: np.ndarray) -> np.ndarray:
    """The m16n8k16 product from per-lane fragments (PTX ISA layouts): a_regs[lane][4][2],
    b_regs[lane][2][2]; returns the 16x8 product."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate(
            [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
        ):
            a[row, col : col + 2] = a_regs[lane, reg]
        for reg, krow in enumerate([2 * t, 2 * t + 8]):
            b[krow : krow + 2, g] = b_regs[lane, reg]
    return a @ b


@pytest.mark.parametrize(
    ("bm", "bn", "bk", "wm", "wn"),
    [(128, 128, 32, 64, 64), (64, 256, 64, 32, 64), (128, 64, 32, 64, 32)],
)
def test_tensor_core_fragments_compute_the_warp_tile(bm, bn, bk, wm, wn) -> None:
    """Store random A/B tiles with the kernel's swizzle, read them back with the kernel's
    ldmatrix addresses, multiply with the mma fragment layouts, compare with numpy."""
    rng = np.random.default_rng(3)
    a_tile = rng.integers(-8, 8, (bm, bk)).astype(float)
    b_tile = rng.integers(-8, 8, (bk, bn)).astype(float)
    ca, cb = bk // 8, bn // 8
    a_s = np.full(bm * bk, np.nan)
    b_s = np.full(bk * bn, np.nan)
    for r in range(bm):
        for c in range(ca):
            p = swizzle(ca, r, c)
            a_s[r * bk + p * 8 : r * bk + p * 8 + 8] = a_tile[r, c * 8 : c * 8 + 8]
    for r in range(bk):
        for c in range(cb):
            p = swizzle(cb, r, c)
            b_s[r * bn + p * 8 : r * bn + p * 8 + 8] = b_tile[r, c * 8 : c * 8 + 8]
    assert not np.isnan(a_s).any() and not np.isnan(b_s).any()
    warps_n = bn // wn
    for warp in range((bm // wm) * warps_n):
        wm0, wn0 = (warp // warps_n) * wm, (warp % warps_n) * wn
        acc = np.zeros((wm // 16, wn // 8, 16, 8))
        for kk in range(bk // 16):
            a_frag = []
            for i in range(wm // 16):
                addrs = []
                for lane in range(32):
                    r = wm0 + i * 16 + (lane & 15)
                    c = kk * 2 + (lane >> 4)
                    addrs.append(r * bk + swizzle(ca, r, c) * 8)
                a_frag.append(ldmatrix(a_s, addrs, trans=False))
            b_frag = []
            for j in range(wn // 16):
                addrs = []
                for lane in range(32):
                    r = kk * 16 + (lane & 15)
                    c = (wn0 + j * 16) // 8 + (lane >> 4)
                    addrs.append(r * bn + swizzle(cb, r, c) * 8)
                q = ldmatrix(b_s, addrs, trans=True)
                b_frag += [q[:, 0:2], q[:, 2:4]]
            for i in range(wm // 16):
                for j in range(wn // 8):
                    acc[i, j] += mma16816(a_frag[i], b_frag[j])
        want = a_tile[wm0 : wm0 + wm] @ b_tile[:, wn0 : wn0 + wn]
        got = acc.transpose(0, 2, 1, 3).reshape(wm, wn)
        np.testing.assert_array_equal(got, want)


def store_swizzled(tile: np.ndarray) -> np.ndarray:
    """A (rows, cols) tile in 16-byte chunks of 8 values, chunk c of row r at swizzle(r, c)."""
    rows, cols = tile.shape
    chunks = cols // 8
    flat = np.full(rows * cols, np.nan)
    for r in range(rows):
        for c in range(chunks):
            p = swizzle(chunks, r, c)
            flat[r * cols + p * 8 : r * cols + p * 8 + 8] = tile[r, c * 8 : c * 8 + 8]
    return flat


def conflict_free(addrs: list[int]) -> bool:
    """Each of ldmatrix.x4's 4 phases (8 rows of 16 bytes) hits 8 distinct 16-byte bank groups."""
    return all(len({(addrs[8 * q + i] // 8) % 8 for i in range(8)}) == 8 for q in range(4))


@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize(
    ("bm", "bn", "bk", "wm", "wn"),
    [(128, 128, 32, 64, 64), (64, 256, 64, 32, 64), (256, 64, 32, 64, 64), (64, 64, 64, 32, 32)],
)
def test_transposed_layout_fragments_compute_the_warp_tile(
    trans_a, trans_b, bm, bn, bk, wm, wn
) -> None:
    """matmul_tn's As[BK][BM] read by ldmatrix.trans and matmul_nt's Bs[BN][BK] read by plain
    ldmatrix, with the template's lane addresses: the mma fragments multiply to the warp tile,
    and every ldmatrix phase is free of bank conflicts."""
    rng = np.random.default_rng(4)
    a_tile = rng.integers(-8, 8, (bm, bk)).astype(float)  # logical (m, k)
    b_tile = rng.integers(-8, 8, (bk, bn)).astype(float)  # logical (k, n)
    a_ld, b_ld = (bm if trans_a else bk), (bk if trans_b else bn)
    a_s = store_swizzled(a_tile.T if trans_a else a_tile)
    b_s = store_swizzled(b_tile.T if trans_b else b_tile)
    assert not np.isnan(a_s).any() and not np.isnan(b_s).any()
    ca, cb = a_ld // 8, b_ld // 8
    warps_n = bn // wn
    for warp in range((bm // wm) * warps_n):
        wm0, wn0 = (warp // warps_n) * wm, (warp % warps_n) * wn
        acc = np.zeros((wm // 16, wn // 8, 16, 8))
        for kk in range(bk // 16):
            a_frag = []
            for i in range(wm // 16):
                addrs = []
                for lane in range(32):
                    if trans_a:
                        q = lane >> 3
                        r = kk * 16 + (q >> 1) * 8 + (lane & 7)
                        c = (wm0 + i * 16) // 8 + (q & 1)
                    else:
                        r, c = wm0 + i * 16 + (lane & 15), kk * 2 + (lane >> 4)
                    addrs.append(r * a_ld + swizzle(ca, r, c) * 8)
                assert conflict_free(addrs)
                a_frag.append(ldmatrix(a_s, addrs, trans=trans_a))
            b_frag = []
            for j in range(wn // 16):
                addrs = []
                for lane in range(32):
                    if trans_b:
                        p = lane >> 3
                        r = wn0 + j * 16 + (p >> 1) * 8 + (lane & 7)
                        c = kk * 2 + (p & 1)
                    else:
                        r, c = kk * 16 + (lane & 15), (wn0 + j * 16) // 8 + (lane >> 4)
                    addrs.append(r * b_ld + swizzle(cb, r, c) * 8)
                assert conflict_free(addrs)
                q = ldmatrix(b_s, addrs, trans=not trans_b)
                b_frag += [q[:, 0:2], q[:, 2:4]]
            for i in range(wm // 16):
                for j in range(wn // 8):
                    acc[i, j] += mma16816(a_frag[i], b_frag[j])
        want = a_tile[wm0 : wm0 + wm] @ b_tile[:, wn0 : wn0 + wn]
        got = acc.transpose(0, 2, 1, 3).reshape(wm, wn)
        np.testing.assert_array_equal(got, want)


def test_epilogue_fragment_positions_cover_the_warp_tile() -> None:
    """c0,c1 at (g, 2t..2t+1), c2,c3 at (g+8, same): every element of a 16x8 tile once."""
    seen = set()
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            for e in range(2):
                seen.add((g + 8 * h, 2 * t + e))
    assert seen == {(r, c) for r in range(16) for c in range(8)}


# --- problems and references --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem_shapes_dtypes_and_args(dtype) -> None:
    problem = SPEC.make_problem((37, 41, 43), dtype, np.random.default_rng(0))
    a, b, c, m, n, k = problem.args
    np_dtype = DTYPES[dtype][0]
    assert a.shape == (37, 43) and b.shape == (43, 41) and c.shape == (37, 41)
    assert a.dtype == b.dtype == c.dtype == np_dtype
    assert (m, n, k) == (37, 41, 43)
    assert all(isinstance(x, np.int32) for x in (m, n, k))
    assert problem.outputs == [2]
    assert np.isnan(c.astype(np.float64)).all()
    assert (a != 0).all() and (b != 0).all()
    assert np.abs(a.astype(np.float64)).max() <= 1.0
    assert problem.tolerances == [SPEC.tolerance_for(43, dtype)]
    np.testing.assert_array_equal(
        problem.references[0], a.astype(np.float64) @ b.astype(np.float64)
    )


def test_reference_is_an_independent_float64_product() -> None:
    rng = np.random.default_rng(5)
    a = rng.uniform(-1, 1, (13, 7)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-1, 1, (7, 11)).astype(ml_dtypes.bfloat16)
    ref = matmul_reference(a, b)
    want = np.einsum("ik,kj->ij", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(ref, want, rtol=1e-14)
    assert ref.dtype == np.float64


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("k", [1, 7, 256, 4099])
def test_float32_accumulation_and_rounding_are_within_tolerance(dtype, k) -> None:
    """What the kernels do (float32 sums in BK-sized chunks, C rounded to dtype) passes; an
    output off by one product does not."""
    rng = np.random.default_rng(k)
    problem = SPEC.make_problem((16, 24, k), dtype, rng)
    a, b = problem.args[0].astype(np.float32), problem.args[1].astype(np.float32)
    acc = np.zeros((16, 24), np.float32)
    for k0 in range(0, k, 8):
        for kk in range(k0, min(k, k0 + 8)):
            acc += np.outer(a[:, kk], b[kk, :]).astype(np.float32)
    out = acc.astype(DTYPES[dtype][0]).astype(np.float64)
    ref = problem.references[0]
    atol, rtol = problem.tolerances[0]
    assert np.all(np.abs(out - ref) <= atol + rtol * np.abs(ref))
    wrong = out.copy()
    biggest = np.argmax(np.abs(a[3, :] * b[:, 5]))
    wrong[3, 5] -= a[3, biggest] * b[biggest, 5]  # one product missing
    assert not np.all(np.abs(wrong - ref) <= atol + rtol * np.abs(ref))


def test_tolerance_grows_with_k_and_is_ordered_by_precision() -> None:
    assert SPEC.tolerance("float32") == SPEC.tolerance_for(1, "float32")
    assert SPEC.tolerance_for(8192, "float32")[0] > SPEC.tolerance_for(64, "float32")[0]
    assert SPEC.tolerance_for(4096, "float32")[0] < 2e-3
    rtols = [SPEC.tolerance_for(64, d)[1] for d in DTYPE_NAMES]
    assert rtols == sorted(rtols)
    with pytest.raises(InvalidInput):
        SPEC.tolerance("int32")


def test_bytes_flops_and_buffers() -> None:
    assert SPEC.bytes_moved((2, 3, 5), "float32") == (10 + 15 + 6) * 4
    assert SPEC.bytes_moved((2, 3, 5), "float16") == (10 + 15 + 6) * 2
    assert SPEC.flops((4096, 4096, 4096), "float16") == 2 * 4096**3
    assert SPEC.buffer_bytes((8192, 8192, 8192), "float32") == 4 * 8192**2 * 4


def test_describe_is_json_ready() -> None:
    import json

    d = SPEC.describe()
    json.dumps(d)
    assert d["name"] == "matmul" and d["space_size"] == SPEC.space_size()
