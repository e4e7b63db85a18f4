"""The transpose spec: constraints, defaults, rendering, launch geometry, problems, references,
and the kernel's index mapping replayed in numpy (tile by tile, with the 2x2 packing of 2-byte
elements and the shared-memory layouts), plus its shared-memory bank conflicts."""

from __future__ import annotations

import math

import kato.kernels.transpose as transpose_module
import ml_dtypes
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, get_operator, list_operators
from kato.kernels.transpose import (
    MAX_DIM,
    TransposeSpec,
    aligned,
    data_registers,
    edge_vectors,
    loaded_vectors,
    pack_pairs,
    register_cap,
    sector_elements,
    skew_applies,
    static_shared_bytes,
    threads,
    transpose_reference,
)
from kato.tuner.space import SearchSpace

SPEC = get_operator("transpose")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 4097),
    (4097, 1),
    (3, 7),
    (17, 333),
    (64, 64),
    (100, 36),
    (1000, 1002),
    (8192, 8192),
    (32768, 4096),
    (1, 2**20),
    (2**20, 3),
]


def cfg(tile=32, vec=4, rpt=4, smem=1, min_blocks=0, hints=0, skew=0):
    return {
        "TILE": tile,
        "VEC": vec,
        "RPT": rpt,
        "SMEM": smem,
        "MIN_BLOCKS": min_blocks,
        "HINTS": hints,
        "SKEW": skew,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, TransposeSpec)
    assert SPEC in list_operators()
    assert SPEC.rank == 2 and SPEC.shape_names == ("rows", "cols")
    assert SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == ["TILE", "VEC", "RPT", "SMEM", "MIN_BLOCKS", "HINTS", "SKEW"]
    assert SPEC.params["HINTS"] == (0, 1, 2)
    assert SPEC.params["SKEW"] == (0, 1)
    assert SPEC.kernel_names == ("transpose_kernel",)
    assert 'extern "C" __global__' in SPEC.template.read_text()
    assert "namespace KATO_NS" in SPEC.template.read_text()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_is_valid_everywhere(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    assert config["HINTS"] == 0  # streaming, as every recorded space measured
    assert config["SKEW"] == 0  # the skewed tiles are not measured yet
    launch = SPEC.launch(config, shape, dtype)
    assert 32 <= launch.threads_per_block <= 1024
    assert 1 <= launch.grid[0] <= 2**31 - 1 and launch.grid[1:] == (1, 1)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_default_uses_wide_vectors_on_the_benchmark_shapes(dtype) -> None:
    for shape in ((8192, 8192), (32768, 4096)):
        config = SPEC.default_config(shape, dtype)
        assert config["VEC"] * DTYPES[dtype][2] == 16


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_default_vector_rule(dtype) -> None:
    """The widest dividing vector where it is at least 8 bytes (aligned rows), else the widest
    of all with rows split (odd, 1 x n, n x 1, and float16 sizes only even)."""
    widest = 16 // DTYPES[dtype][2]
    for shape in ((8191, 8193), (1, 4097), (4097, 1), (17, 333), (4096, 1001), (1, 1)):
        config = SPEC.default_config(shape, dtype)
        assert config["VEC"] == widest and not aligned(config, shape), shape
        assert SPEC.defines(config, shape, dtype)["ALIGNED"] == 0
    # Sizes even but not multiples of 4: float32 pairs are 8 bytes (aligned VEC=2), float16
    # pairs 4 (split VEC=8); multiples of 4: float16's packed VEC=4 is 8 bytes.
    assert SPEC.default_config((8190, 8194), dtype)["VEC"] == (2 if widest == 4 else 8)
    assert SPEC.default_config((1000, 1004), dtype)["VEC"] == 4


def test_validate() -> None:
    with pytest.raises(InvalidInput, match="rank"):
        SPEC.validate((4,), "float32")
    with pytest.raises(InvalidInput, match="int32|dtype"):
        SPEC.validate((4, 4), "int32")
    with pytest.raises(InvalidInput, match="at least 1"):
        SPEC.validate((0, 4), "float32")
    with pytest.raises(InvalidInput, match="up to"):
        SPEC.validate((MAX_DIM + 1, 1), "float32")
    assert SPEC.validate((MAX_DIM, 1), "float32") == (MAX_DIM, 1)


def test_check_rejects_what_cannot_work() -> None:
    shape = (64, 64)
    assert SPEC.check(cfg(), shape, "float32") is None
    assert "16 bytes" in SPEC.check(cfg(vec=8), shape, "float32")
    assert "threads" in SPEC.check(cfg(tile=16, vec=4, rpt=4), shape, "float32")  # 16 threads
    assert "threads" in SPEC.check(cfg(tile=64, vec=1, rpt=2), shape, "float32")  # 2048 threads
    assert "even" in SPEC.check(cfg(tile=32, vec=2, rpt=1), shape, "float16")
    assert SPEC.check(cfg(tile=32, vec=2, rpt=1), (63, 64), "float16") is None  # no pairs: split
    assert SPEC.check(cfg(tile=32, vec=1, rpt=1), shape, "float16") is None  # no pairs at VEC 1
    assert "per SM" in SPEC.check(cfg(tile=32, vec=1, rpt=1, min_blocks=4), shape, "float32")
    assert "missing" in SPEC.check({"TILE": 32}, shape, "float32")
    assert "not one of" in SPEC.check(cfg(tile=128), shape, "float32")
    assert "not one of" in SPEC.check(cfg(hints=3), shape, "float32")
    assert "missing parameter HINTS" in SPEC.check(
        {k: v for k, v in cfg().items() if k != "HINTS"}, shape, "float32"
    )
    assert "unknown" in SPEC.check({**cfg(), "X": 1}, shape, "float32")


def test_register_model() -> None:
    # 256 threads x 4 blocks: 64 registers; 16-byte vectors x 8 = 32 data registers + overhead.
    config = cfg(tile=64, vec=4, rpt=8, min_blocks=4)
    assert threads(config) == 128 and register_cap(config) == 128
    assert SPEC.check(config, (64, 64), "float32") is None
    # Split rows add the edge vectors: ceil(TILE / threads) each.
    assert edge_vectors(config) == 1 and edge_vectors(cfg(tile=64, vec=8, rpt=8)) == 1
    assert edge_vectors({"TILE": 64, "VEC": 8, "RPT": 16}) == 2  # 32 threads, 64 tile rows
    assert data_registers(config, "float32") == 32
    assert data_registers(config, "float32", is_aligned=False) == 36
    assert SPEC.check(config, (63, 65), "float32") is None


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_any_shape_takes_every_vector_width(dtype) -> None:
    """Issue 31: odd, prime, 1 x n and n x 1 shapes admit the configs of an aligned shape
    (2-byte ones more: split rows use single 16-bit units, so no even RPT is needed), and
    render ALIGNED=0 exactly where a size is not a multiple of VEC."""

    def valid(shape):
        space = SearchSpace(SPEC.params, lambda c, s=shape: SPEC.check(c, s, dtype))
        return space.valid_configs()

    wide = valid((8192, 8192))
    for shape in ((8191, 8193), (1, 4099), (4099, 1), (8192, 8190), (4093, 8192)):
        configs = valid(shape)
        assert {c["VEC"] for c in configs} == {c["VEC"] for c in wide}, shape
        assert len(configs) >= len(wide), shape
        for c in configs:
            split = shape[0] % c["VEC"] != 0 or shape[1] % c["VEC"] != 0 or c["SKEW"] == 1
            assert aligned(c, shape) is not split
            assert SPEC.defines(c, shape, dtype).get("ALIGNED", 1) == (0 if split else 1)
    for c in wide:
        assert "ALIGNED" not in SPEC.defines(c, (8192, 8192), dtype)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_space_sizes_and_shape_independent_sources(dtype) -> None:
    sizes = {}
    sources = set()
    for shape in ((8192, 8192), (32768, 4096), (3, 5)):
        space = SearchSpace(SPEC.params, lambda c, s=shape: SPEC.check(c, s, dtype))
        valid = space.valid_configs()
        sizes[shape] = len(valid)
        sources |= {SPEC.render(c, shape, dtype) for c in valid}
    assert 3 * 100 <= sizes[(8192, 8192)] <= 3 * 170  # every config at each of 3 HINTS
    assert sizes[(8192, 8192)] == sizes[(32768, 4096)]  # no SKEW=1 on either
    assert sizes[(3, 5)] >= 2 * sizes[(8192, 8192)]  # every vector width, both SKEW values
    # Odd shapes add one split source per VEC > 1 config (VEC=1 ones are the aligned sources)
    # and one per SKEW=1 config.
    odd = SearchSpace(SPEC.params, lambda c: SPEC.check(c, (3, 5), dtype)).valid_configs()
    split = sum(c["VEC"] > 1 and not c["SKEW"] for c in odd)
    skewed = sum(c["SKEW"] for c in odd)
    assert skewed == sizes[(3, 5)] // 2
    assert len(sources) == sizes[(8192, 8192)] + split + skewed


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(8192, 8192), (8191, 8193), (37, 5)], ids=str)
def test_hints_are_valid_wherever_the_streaming_config_is(shape, dtype) -> None:
    """HINTS changes only the global accesses' cache qualifiers: the same configs are valid
    at every value, and each renders its own source (the macro), the same launch."""
    space = SearchSpace(SPEC.params, lambda c: SPEC.check(c, shape, dtype))
    by_hints: dict[int, set[tuple]] = {}
    for c in space.valid_configs():
        rest = tuple(v for k, v in c.items() if k != "HINTS")
        by_hints.setdefault(c["HINTS"], set()).add(rest)
    assert sorted(by_hints) == [0, 1, 2]
    assert by_hints[0] == by_hints[1] == by_hints[2]
    config = SPEC.default_config(shape, dtype)
    sources = set()
    for hints in (0, 1, 2):
        c = {**config, "HINTS": hints}
        assert SPEC.defines(c, shape, dtype)["HINTS"] == hints
        assert SPEC.launch(c, shape, dtype) == SPEC.launch(config, shape, dtype)
        sources.add(SPEC.render(c, shape, dtype))
    assert len(sources) == 3


def test_skew_is_valid_where_output_rows_start_mid_sector() -> None:
    """SKEW=1 where rows * itemsize is no multiple of 32 bytes (V = 8 float32, 16 for 2-byte
    elements), whatever VEC divides; rejected where every output row starts on a sector, where
    it would store exactly what SKEW=0 stores."""
    assert sector_elements("float32") == 8 and sector_elements("bfloat16") == 16
    on = cfg(tile=64, vec=4, rpt=4, skew=1)
    for shape in ((8191, 8193), (1, 37), (41, 1), (3, 5), (8190, 8194), (8196, 8192)):
        assert skew_applies(shape, "float32")
        assert SPEC.check(on, shape, "float32") is None, shape
    for shape in ((8192, 8192), (8, 3), (40, 37), (32768, 4096), (8, 1)):
        assert not skew_applies(shape, "float32")
        assert "mid 32-byte sector" in SPEC.check(on, shape, "float32"), shape
        assert SPEC.check(cfg(tile=64, vec=4, rpt=4), shape, "float32") is None
    half = cfg(tile=64, vec=8, rpt=8, skew=1)
    assert SPEC.check(half, (40, 37), "float16") is None  # 80 bytes: mid sector
    assert SPEC.check(half, (8200, 8192), "bfloat16") is None  # 16400 bytes
    assert "mid 32-byte sector" in SPEC.check(half, (48, 5), "float16")
    assert "mid 32-byte sector" in SPEC.check(half, (8192, 8191), "bfloat16")
    # Packed pairs never (single 16-bit units): an odd RPT is fine where pairs would need it even.
    odd_rpt = cfg(tile=32, vec=2, rpt=1, skew=1)
    assert SPEC.check(odd_rpt, (8190, 8194), "float16") is None
    assert "even" in SPEC.check({**odd_rpt, "SKEW": 0}, (8192, 8194), "float16")
    assert pack_pairs(cfg(vec=8, skew=1), "float16") == 1
    # VEC=1 takes skewed tiles too (scalar stores, each sector still whole in one block).
    assert SPEC.check(cfg(tile=32, vec=1, rpt=8, skew=1), (8191, 8193), "float32") is None


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_skew_renders_split_rows_and_skew_0_renders_as_before(dtype) -> None:
    """SKEW=1 renders ALIGNED=0 and SKEW=1 (last) on every shape, aligned to VEC or not, one
    source per config; SKEW=0 renders the #define lines of the program before SKEW existed."""
    base = cfg(tile=64, vec=2, rpt=4)
    for shape in ((8191, 8193), (8190, 8194), (37, 5)):
        macros = SPEC.defines({**base, "SKEW": 1}, shape, dtype)
        assert list(macros)[-2:] == ["ALIGNED", "SKEW"]
        assert macros["ALIGNED"] == 0 and macros["SKEW"] == 1
        zero = SPEC.defines(base, shape, dtype)
        assert "SKEW" not in zero
        assert list(zero)[:7] == ["TILE", "VEC", "RPT", "SMEM", "MIN_BLOCKS", "HINTS", "ELEM_BYTES"]
        assert zero.get("ALIGNED", 1) == (0 if shape[0] % 2 or shape[1] % 2 else 1)
    sources = {SPEC.render({**base, "SKEW": 1}, s, dtype) for s in ((8191, 8193), (8190, 8194))}
    assert len(sources) == 1
    for shape in ((8191, 8193), (37, 5)):
        launch = SPEC.launch({**base, "SKEW": 1}, shape, dtype)
        assert launch == SPEC.launch(base, shape, dtype)  # the same 1-D grid over the tiles


def test_skew_shared_and_register_model(monkeypatch) -> None:
    """SKEW=1's shared tile has V - 1 more rows of single elements; each thread loads the
    tile rows of RPT and of the halo, plus the edge vectors (none at VEC=1); check() rejects
    a config whose loads would not fit the registers the launch bounds leave."""
    on = cfg(tile=64, vec=4, rpt=4, smem=1, skew=1)
    assert static_shared_bytes(on, "float32") == 71 * 65 * 4
    assert static_shared_bytes({**on, "SMEM": 2}, "float32") == 71 * 64 * 4
    assert static_shared_bytes(cfg(64, 8, 8, 2, skew=1), "float16") == 79 * 64 * 2
    assert static_shared_bytes(cfg(16, 1, 1, 0, skew=1), "bfloat16") == 31 * 16 * 2
    # 256 threads, 16 thread rows: ceil(71 / 16) = 5 loads and ceil(71 / 256) = 1 edge vector.
    assert loaded_vectors(on, "float32") == 6 and data_registers(on, "float32") == 24
    assert loaded_vectors(cfg(64, 4, 4), "float32", is_aligned=False) == 5
    assert edge_vectors(on, "float32") == 1
    # VEC=1: aligned rows, no edges. 2-byte elements: 15 halo rows; 32 threads in 2 thread rows
    # load 16 of the 31 rows each, 2 bytes apiece.
    assert loaded_vectors(cfg(64, 1, 8, skew=1), "float32") == 8 + 1
    assert loaded_vectors(cfg(16, 1, 8, skew=1), "float16") == 16
    assert data_registers(cfg(16, 1, 8, skew=1), "float16") == 8
    # 64 threads in 8 thread rows, 79 tile rows: 10 loads and 2 edge vectors each.
    assert loaded_vectors(cfg(64, 8, 8, skew=1), "float16") == 10 + 2
    assert SPEC.check(cfg(64, 8, 8, skew=1), (8191, 8193), "float16") is None
    # The register check counts them: 128 threads x MIN_BLOCKS 4 leave 128 registers; with an
    # overhead that leaves 90, SKEW=0's 9 vectors (36 registers) fit and SKEW=1's 10 do not.
    config = cfg(tile=64, vec=4, rpt=8, min_blocks=4)
    assert register_cap(config) == 128
    assert loaded_vectors(config, "float32", is_aligned=False) == 9
    assert loaded_vectors({**config, "SKEW": 1}, "float32") == 10
    monkeypatch.setattr(transpose_module, "REGISTER_OVERHEAD", 128 - 38)
    assert SPEC.check(config, (8191, 8193), "float32") is None
    assert "spill" in SPEC.check({**config, "SKEW": 1}, (8191, 8193), "float32")


def test_static_shared_model() -> None:
    assert static_shared_bytes(cfg(tile=32, vec=4, smem=1), "float32") == 32 * 33 * 4
    assert static_shared_bytes(cfg(tile=64, vec=8, rpt=8, smem=2), "float16") == 32 * 64 * 4
    assert static_shared_bytes(cfg(tile=64, vec=1, rpt=8, smem=1), "bfloat16") == 64 * 65 * 2
    # Split rows: single 16-bit units at any VEC.
    assert static_shared_bytes(cfg(tile=64, vec=8, rpt=8, smem=2), "float16", False) == 64 * 64 * 2
    assert pack_pairs(cfg(vec=8), "float16", is_aligned=False) == 1


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_problem_and_reference(dtype) -> None:
    rng = np.random.default_rng(0)
    problem = SPEC.make_problem((37, 53), dtype, rng)
    x, y = problem.args[0], problem.args[1]
    assert x.shape == (37, 53) and y.shape == (53, 37)
    assert x.dtype == DTYPES[dtype][0] and y.dtype == x.dtype
    assert np.isnan(y.astype(np.float32)).all()
    assert (x.astype(np.float32) != 0).all()
    assert problem.args[2] == 37 and problem.args[3] == 53
    assert isinstance(problem.args[2], np.int32)
    ref = problem.references[0]
    assert ref.dtype == np.float64
    np.testing.assert_array_equal(ref, np.array([[float(v) for v in r] for r in x.T]))
    # Distinct neighbours: a misplaced element differs from the right one almost surely.
    assert len(np.unique(x)) > 0.75 * x.size
    assert SPEC.tolerance(dtype) == (0.0, 0.0)
    assert SPEC.bytes_moved((37, 53), dtype) == 2 * 37 * 53 * DTYPES[dtype][2]


def test_reference_is_a_transpose() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(transpose_reference(x), [[0, 3], [1, 4], [2, 5]])


# --- the kernel's index mapping in numpy ------------------------------------------------------


def emulate(config, x: np.ndarray, dtype: str) -> np.ndarray:
    """The kernel's algorithm with the same indices: for every tile, every thread's loads into
    units (2x2 packed pairs for 2-byte elements with VEC >= 2), stores into the physical shared
    layout, then every thread's reads of tile columns and vector stores."""
    rows, cols = x.shape
    tile, vec, rpt = config["TILE"], config["VEC"], config["RPT"]
    e = pack_pairs(config, dtype)
    bx, by = tile // vec, tile // rpt
    pad = 1 if config["SMEM"] == 1 else 0
    y = np.full((cols, rows), np.nan, dtype=x.dtype)
    smem = np.empty((tile // e, tile + pad, e), dtype=x.dtype)  # unit = e elements

    def phys(p, c):
        return c ^ (p & (tile - 1)) if config["SMEM"] == 2 else c

    tiles_c, tiles_r = math.ceil(cols / tile), math.ceil(rows / tile)
    for t in range(tiles_r * tiles_c):
        r0, c0 = (t // tiles_c) * tile, (t % tiles_c) * tile
        smem[...] = np.nan
        for ty in range(by):
            for tx in range(bx):
                col = c0 + tx * vec
                for k in range(rpt // e):
                    p = ty + k * by
                    for j in range(vec):
                        unit = [
                            x[r0 + p * e + ee, col + j]
                            if r0 + p * e + ee < rows and col < cols
                            else np.nan
                            for ee in range(e)
                        ]
                        smem[p, phys(p, tx * vec + j)] = unit
        for ty in range(by):
            for tx in range(bx):
                out_col = r0 + tx * vec
                for i in range(rpt):
                    cl = ty + i * by
                    if c0 + cl < cols and out_col < rows:
                        units = [
                            smem[p, phys(p, cl)] for p in range(tx * vec // e, (tx + 1) * vec // e)
                        ]
                        y[c0 + cl, out_col : out_col + vec] = np.concatenate(units)
    return y


@pytest.mark.parametrize(
    "config,shape,dtype",
    [
        (cfg(32, 4, 4, 1), (40, 72), "float32"),
        (cfg(16, 2, 2, 2), (34, 18), "float32"),
        (cfg(32, 8, 4, 2), (48, 24), "float16"),
        (cfg(16, 2, 2, 0), (6, 38), "bfloat16"),
        (cfg(64, 4, 8, 2), (20, 68), "float16"),
        (cfg(16, 1, 1, 1), (17, 5), "float16"),
        (cfg(32, 1, 8, 2), (33, 1), "float32"),
    ],
)
def test_kernel_algorithm_in_numpy(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None
    x = SPEC.make_problem(shape, dtype, np.random.default_rng(3)).args[0]
    y = emulate(config, x, dtype)
    np.testing.assert_array_equal(y, x.T)


def bank_conflicts(config, dtype: str) -> tuple[int, int]:
    """Worst n-way bank conflict of the shared-memory stores (load phase) and loads (store
    phase) of one warp, over the warps of a block, for 32-bit banks."""
    tile, vec, rpt = config["TILE"], config["VEC"], config["RPT"]
    e = pack_pairs(config, dtype)
    unit_bytes = e * DTYPES[dtype][2]
    bx, by = tile // vec, tile // rpt
    pad = 1 if config["SMEM"] == 1 else 0

    def bank(p, c):
        c = c ^ (p & (tile - 1)) if config["SMEM"] == 2 else c
        return (p * (tile + pad) + c) * unit_bytes // 4 % 32, (
            p * (tile + pad) + c
        ) * unit_bytes // 4

    def ways(addresses):
        per_bank: dict[int, set[int]] = {}
        for b, word in addresses:
            per_bank.setdefault(b, set()).add(word)
        return max(len(words) for words in per_bank.values())

    lanes = [(t % bx, t // bx) for t in range(bx * by)]
    worst_store = worst_load = 1
    for w in range(0, len(lanes), 32):
        warp = lanes[w : w + 32]
        for k in range(rpt // e):
            for j in range(vec):
                worst_store = max(
                    worst_store, ways([bank(ty + k * by, tx * vec + j) for tx, ty in warp])
                )
        for i in range(rpt):
            for m in range(vec // e):
                worst_load = max(
                    worst_load, ways([bank(tx * (vec // e) + m, ty + i * by) for tx, ty in warp])
                )
    return worst_store, worst_load


def test_padding_and_swizzle_remove_bank_conflicts() -> None:
    """Padded and swizzled layouts: conflict-free for fp32 32x32 tiles, at most 2-way
    everywhere with 4-byte units (64-wide tiles: 16 lanes x 4 words per row; packed fp16
    pairs: 2-way on the column reads); the plain layout has up to 32-way conflicts on the
    column reads, which is what they are for."""
    for dtype in ("float32", "float16"):
        for tile in (32, 64):
            for vec in (1, 2, 4) if dtype == "float32" else (2, 4, 8):
                for rpt in (2, 4, 8):
                    plain = cfg(tile, vec, rpt, 0)
                    if SPEC.check(plain, (64, 64), dtype):
                        continue
                    assert max(bank_conflicts(plain, dtype)) >= 4
                    for smem in (1, 2):
                        ways = bank_conflicts(cfg(tile, vec, rpt, smem), dtype)
                        assert max(ways) <= 2, (tile, vec, rpt, smem, dtype, ways)
                        if dtype == "float32" and tile == 32:
                            assert ways == (1, 1)


def test_half_packing_round_trips_bits() -> None:
    """The __byte_perm selectors 0x5410 / 0x7632 build (a.lo, b.lo) and (a.hi, b.hi)."""

    def byte_perm(a: int, b: int, s: int) -> int:
        data = a | (b << 32)
        return sum(((data >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))

    pair_a = np.array([1.5, -2.0], dtype=np.float16)  # row 2p, columns c, c+1
    pair_b = np.array([3.25, 4.0], dtype=np.float16)  # row 2p+1
    a, b = int(pair_a.view(np.uint32)[0]), int(pair_b.view(np.uint32)[0])
    u0 = np.array([byte_perm(a, b, 0x5410)], np.uint32).view(np.float16)
    u1 = np.array([byte_perm(a, b, 0x7632)], np.uint32).view(np.float16)
    np.testing.assert_array_equal(u0, [1.5, 3.25])  # output row c: x[2p][c], x[2p+1][c]
    np.testing.assert_array_equal(u1, [-2.0, 4.0])
    assert ml_dtypes.bfloat16  # bfloat16 uses the same 16-bit path
