"""The layernorm spec: constraints, defaults, rendering, launch geometry, problems, references,
and the kernel's statistics algorithm replayed in float32 numpy (Welford/Chan with a pivot)."""

from __future__ import annotations

import math
import re

import kato.kernels.layernorm as ln
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, list_operators
from kato.kernels.layernorm import LayerNormSpec, layernorm_reference
from kato.kernels.spec import template_source
from kato.tuner.space import SearchSpace

SPEC = get_operator("layernorm")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 2),
    (3, 7),
    (5, 33),
    (1048576, 128),
    (65536, 1024),
    (128, 128),
    (3000, 3001),
    (4096, 4096),
    (32768, 4096),
    (8192, 32768),
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


# --- identity ---------------------------------------------------------------------------------


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, LayerNormSpec)
    assert SPEC in list_operators()
    assert SPEC.kernel_name == "layernorm_fwd"
    assert SPEC.rank == 2 and SPEC.shape_names == ("rows", "cols")
    assert SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == [
        "BLOCK_SIZE",
        "VEC",
        "ROW_THREADS",
        "CACHE",
        "MIN_BLOCKS",
        "GROUP_ROWS",
    ]
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2 * 4
    text = SPEC.template.read_text()
    assert 'extern "C" __global__' in text and "namespace KATO_NS" in text
    assert "#pragma once" not in text
    assert len(SPEC.version) == 12


# --- check ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(block=1024, min_blocks=4), (64, 1024), "float32", "not one of"),
        (cfg(cache=1, vec=4), (64, 65536), "float32", "shared memory"),
        (cfg(cache=1, row_threads=32, block=1024, vec=8), (64, 4096), "float16", "32 row(s)"),
        (cfg(cache=2, row_threads=32, vec=4), (64, 4096), "float32", "ITEMS=32"),
        (cfg(cache=2, row_threads=8, vec=8), (64, 2048), "float16", "ITEMS=32"),
        (cfg(cache=2, block=1024, vec=4), (64, 65536), "float32", "would spill"),
        (cfg(cache=2, block=512, vec=8, min_blocks=2), (64, 32768), "float16", "would spill"),
        (cfg(), (64, 1024), "int32", "does not support dtype"),
        (cfg(), (64, 0), "float32", "at least 1"),
        (cfg(), (64, 2**31 - 2**16 + 1), "float32", "2**31-2**16 columns"),
        (cfg(), (2**31, 64), "float32", "2**31-1 rows"),
        (cfg(), (64, 1024, 1), "float32", "rank 2"),
        (cfg(row_threads=4), (64, 1024), "float32", "not one of"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["VEC"]
    assert "missing parameter VEC" in SPEC.check(partial, (4, 64), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "TILE": 4}, (4, 64), "float32")


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=8), (64, 1024), "float16"),
        (cfg(vec=1), (7, 1000003), "float32"),  # streaming: no limit on cols
        (cfg(block=1024, min_blocks=2), (64, 1024), "bfloat16"),  # exactly 2048 threads
        (cfg(cache=1, vec=4), (64, 58000), "float32"),  # 232000 + 768 static bytes fit
        (cfg(cache=1, row_threads=32, block=128, vec=8), (64, 16384), "float16"),  # 4 x 32 KiB
        (cfg(cache=2, row_threads=32, vec=8), (64, 4096), "float16"),  # ITEMS = 16 exactly
        (cfg(cache=2, row_threads=8, vec=4), (64, 128), "float32"),  # 4 vectors per lane
        (cfg(cache=2, row_threads=16, vec=8), (64, 128), "bfloat16"),  # 1 vector per lane
        (cfg(cache=2, block=1024, vec=4), (64, 16384), "float32"),  # 16 data registers
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_check_shared_memory_limit_is_exact() -> None:
    """CACHE=1, a block of 1024 per row: static 2 x 32 x 12 bytes + cols * 4 <= 227 KiB."""
    limit_cols = (227 * 1024 - 768) // 4
    assert SPEC.check(cfg(block=1024, cache=1), (8, limit_cols), "float32") is None
    assert "shared memory" in SPEC.check(cfg(block=1024, cache=1), (8, limit_cols + 4), "float32")


def test_register_model() -> None:
    assert ln.register_cap(cfg(block=1024)) == 64
    assert ln.register_cap(cfg(block=1024, min_blocks=2)) == 32
    assert ln.register_cap(cfg(block=128, min_blocks=2)) == 255
    assert ln.effective_min_blocks(cfg(block=128, min_blocks=2)) == 0  # cap unchanged
    assert ln.effective_min_blocks(cfg(block=512, min_blocks=2)) == 2
    # Weight and bias join the row in registers only where all three fit.
    assert ln.wb_regs(cfg(cache=2, row_threads=32, vec=4), 128, 4) == 1
    assert ln.wb_regs(cfg(cache=2, row_threads=32, vec=8), 4096, 2) == 0  # 128 + 128 regs
    assert ln.wb_regs(cfg(cache=0), 128, 4) == 0


def test_valid_variants_for_the_benchmark_shapes() -> None:
    counts = {}
    for shape in ((32768, 4096), (8192, 32768), (65536, 1024), (1048576, 128)):
        for dtype in ("float32", "float16"):
            space = SearchSpace(SPEC.params, lambda c, s=shape, d=dtype: SPEC.check(c, s, d))
            counts[(shape, dtype)] = len(space.valid_configs())
    assert all(n > 300 for n in counts.values()), counts


# --- default config ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert set(config) == set(SPEC.params)
    assert SPEC.check(config, shape, dtype) is None
    launch = SPEC.launch(config, shape, dtype)
    assert launch.grid[0] >= 1 and launch.shared_bytes <= 227 * 1024


def test_default_config_choices() -> None:
    short = SPEC.default_config((1048576, 128), "float32")
    assert (short["VEC"], short["ROW_THREADS"], short["CACHE"]) == (4, 16, 2)
    assert short["GROUP_ROWS"] == 4  # weight and bias registers reused over 4 rows
    assert SPEC.defines(short, (1048576, 128), "float32")["WB_REGS"] == 1
    half_short = SPEC.default_config((65536, 128), "float16")
    # At least 16 lanes per row: fewer rows per warp, more registers per row (data/spaces).
    assert (half_short["VEC"], half_short["ROW_THREADS"], half_short["CACHE"]) == (8, 16, 2)
    assert SPEC.default_config((1048576, 128), "float16")["GROUP_ROWS"] == 4
    assert half_short["GROUP_ROWS"] == 1  # 2048 blocks: too few to group
    # The fewest lanes that hold the row in <= 16 vectors each: 256 vectors over 16 lanes.
    assert SPEC.default_config((65536, 1024), "float32")["ROW_THREADS"] == 16
    medium = SPEC.default_config((32768, 4096), "float16")
    assert (medium["ROW_THREADS"], medium["CACHE"], medium["MIN_BLOCKS"]) == (32, 2, 2)
    long = SPEC.default_config((8192, 32768), "float32")  # a block of 512, 16 vectors each
    assert (long["ROW_THREADS"], long["BLOCK_SIZE"], long["CACHE"]) == (0, 512, 2)
    # Rows that are not whole vectors split (head, vectors, tail) at the widest vector too.
    odd = SPEC.default_config((3000, 3001), "float32")
    assert odd["VEC"] == 4
    assert SPEC.defines(odd, (3000, 3001), "float32")["ROW_SPLIT"] == 1
    assert SPEC.defines(odd, (3000, 3001), "float32")["WB_REGS"] == 0
    assert SPEC.default_config((8192, 50257), "bfloat16")["VEC"] == 8
    huge = SPEC.default_config((7, 1000003), "float32")  # few long rows: cut into pieces
    assert (huge["ROW_THREADS"], huge["CACHE"], huge["GROUP_ROWS"]) == (0, 0, 0)
    assert SPEC.default_config((4, 4), "float32")["GROUP_ROWS"] == 1


def test_default_config_rejects_invalid_shapes() -> None:
    for shape, dtype in (((0, 4), "float32"), ((4, 4), "int32"), ((4, 2**31), "float32")):
        with pytest.raises(InvalidInput):
            SPEC.default_config(shape, dtype)


# --- rendering and launch ---------------------------------------------------------------------


def test_render_defines_first() -> None:
    config = cfg(block=128, vec=8, row_threads=16, cache=2, min_blocks=2)
    source = SPEC.render(config, (100, 1000), "float16")
    assert source.splitlines()[:10] == [
        "#define VEC 8",  # warp mode: no BLOCK_SIZE (rows per block come from blockDim)
        "#define ROW_THREADS 16",
        "#define CACHE 2",
        "#define LB_THREADS 256",  # 2 x 128 threads leave the cap at 255: canonical bounds
        "#define LB_MIN_BLOCKS 0",
        "#define DTYPE __half",
        "#define IS_HALF 1",
        "#define IS_BF16 0",
        "#define ITEMS 8",  # ceil(1000 / (16 * 8))
        "#define WB_REGS 1",
    ]
    assert source.endswith(template_source(SPEC.template))
    # kato_vec.cuh inlined (the namespace line itself: kato_dtype.cuh's comment names it too)
    assert not re.search(r"^\s*#\s*include", source.split("\nnamespace KATO_NS {\n")[1], re.M)
    block = SPEC.render(cfg(block=512, min_blocks=2), (100, 1000), "float32").splitlines()
    assert block[:6] == [
        "#define BLOCK_SIZE 512",
        "#define VEC 4",
        "#define ROW_THREADS 0",
        "#define CACHE 0",
        "#define LB_THREADS 512",
        "#define LB_MIN_BLOCKS 2",
    ]


def test_warp_mode_sources_depend_only_on_the_register_cap() -> None:
    shape = (100, 1024)
    same = [cfg(block=128, row_threads=32), cfg(block=256, row_threads=32, min_blocks=0)]
    same.append(cfg(block=128, row_threads=32, min_blocks=2))
    assert len({SPEC.render(c, shape, "float32") for c in same}) == 1
    cap128 = [cfg(block=512, row_threads=32), cfg(block=256, row_threads=32, min_blocks=2)]
    assert len({SPEC.render(c, shape, "float32") for c in cap128}) == 1
    assert ln.launch_bounds(cfg(block=1024, row_threads=8, min_blocks=2)) == (1024, 2)
    for block in SPEC.params["BLOCK_SIZE"]:
        for min_blocks in SPEC.params["MIN_BLOCKS"]:
            c = cfg(block=block, row_threads=16, min_blocks=min_blocks)
            threads, lb_min = ln.launch_bounds(c)
            assert threads >= block
            assert ln.register_cap({**c, "BLOCK_SIZE": threads, "MIN_BLOCKS": lb_min}) == (
                ln.register_cap(c)
            )


def test_streaming_sources_do_not_depend_on_the_shape_or_group_rows() -> None:
    a = SPEC.render(cfg(block=128, cache=0), (4, 1024), "float32")
    assert a == SPEC.render(cfg(block=128, cache=0, group_rows=16), (99, 8192), "float32")
    # 2 x 128 threads leave the register cap at 255: the same source as no clause.
    assert a == SPEC.render(cfg(block=128, cache=0, min_blocks=2), (99, 8192), "float32")
    assert a != SPEC.render(cfg(block=128, cache=1), (4, 1024), "float32")


def test_launch_geometry() -> None:
    warp = SPEC.launch(cfg(block=256, row_threads=16, cache=2), (1000, 128), "float32")
    assert warp == Launch(grid=(63, 1, 1), block=(256, 1, 1))  # 16 rows per block
    grouped = SPEC.launch(cfg(block=256, row_threads=32, group_rows=4), (1000, 128), "float32")
    assert grouped.grid == (math.ceil(1000 / 32), 1, 1)
    block = SPEC.launch(cfg(block=512, cache=1), (70, 4096), "float16")
    assert block == Launch(grid=(70, 1, 1), block=(512, 1, 1), shared_bytes=4096 * 2)
    rows = SPEC.launch(cfg(block=128, row_threads=8, cache=1), (10, 100), "float32")
    assert rows.shared_bytes == 16 * 100 * 4
    assert SPEC.launch(cfg(block=128), (2**31 - 1, 1), "float32").grid[0] == 2**31 - 1


# --- problems and references ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 300), dtype, np.random.default_rng(1))
    x, w, b, y, mean, rstd, rows, cols, eps = problem.args
    t = DTYPES[dtype][0]
    assert x.dtype == w.dtype == b.dtype == y.dtype == t
    assert mean.dtype == rstd.dtype == np.float32
    assert x.shape == y.shape == (37, 300) and w.shape == b.shape == (300,)
    assert (rows, cols) == (37, 300) and isinstance(rows, np.int32)
    assert isinstance(eps, np.float32) and eps == np.float32(1e-5)
    assert problem.outputs == [3, 4, 5]
    assert all(np.isnan(a.astype(np.float64)).all() for a in (y, mean, rstd))
    assert [r.shape for r in problem.references] == [(37, 300), (37,), (37,)]
    assert problem.tolerances == [SPEC.tolerance(dtype), ln.STATS_TOLERANCE, ln.STATS_TOLERANCE]
    xs = x.astype(np.float64)
    assert np.count_nonzero(xs) > 0.99 * xs.size and np.all(np.abs(w.astype(float)) >= 0.49)
    big = 1e4 if dtype == "float32" else 1e3
    assert np.all(np.abs(xs[0::4].mean(axis=1) - big) < 5)
    assert np.all(np.abs(xs[1::4].mean(axis=1)) < 10)


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((9, 77), "bfloat16", np.random.default_rng(2))
    x, w, b = (a.astype(np.float64) for a in problem.args[:3])
    y_ref, mean_ref, rstd_ref = problem.references
    for r in range(9):
        row = x[r]
        mu = sum(row) / len(row)
        var = sum((v - mu) ** 2 for v in row) / len(row)
        assert mean_ref[r] == pytest.approx(mu, rel=1e-12)
        assert rstd_ref[r] == pytest.approx(1 / math.sqrt(var + 1e-5), rel=1e-12)
        np.testing.assert_allclose(y_ref[r], (row - mu) / math.sqrt(var + 1e-5) * w + b, 1e-12)


def test_reference_of_a_single_column_is_the_bias() -> None:
    x = np.array([[3.0], [-7.0]], dtype=np.float32)
    w = np.array([2.0], dtype=np.float32)
    b = np.array([0.5], dtype=np.float32)
    y, mean, rstd = layernorm_reference(x, w, b, 1e-5)
    np.testing.assert_array_equal(y, [[0.5], [0.5]])
    np.testing.assert_array_equal(mean, [3.0, -7.0])
    np.testing.assert_allclose(rstd, 1 / math.sqrt(1e-5))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_reference_is_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    atol, rtol = SPEC.tolerance(dtype)
    ref = problem.references[0]
    ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
    np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
    assert not np.allclose(ref * 1.01 + 0.01, ref, atol=atol, rtol=rtol)


def test_bytes_moved() -> None:
    assert SPEC.bytes_moved((8192, 32768), "float16") == 2 * 8192 * 32768 * 2 + 4 * 32768 + 8 * 8192
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.bytes_moved((3, 5), "float32")


# --- the kernel's statistics, replayed in float32 ---------------------------------------------


def _merge(a, b):
    """The kernel's Chan merge (float32, fma via an exact float64 product)."""
    na, ma, qa = a
    nb, mb, qb = b
    n = (na + nb).astype(np.float32)
    f = (nb / np.maximum(n, np.float32(1))).astype(np.float32)
    delta = (mb - ma).astype(np.float32)
    mean = (delta.astype(np.float64) * f + ma).astype(np.float32)
    dd = (delta * delta).astype(np.float32)
    naf = (na * f).astype(np.float32)
    m2 = (dd.astype(np.float64) * naf + (qa + qb).astype(np.float32)).astype(np.float32)
    return n, mean, m2


def replay_register_cache(x: np.ndarray, lanes: int, vec: int):
    """CACHE=2 with `lanes` threads per row: each thread's exact mean/M2 over its vectors
    (t + i * lanes), then the butterfly with the lower lane on the left. Returns the final
    (mean, rstd) every lane agrees on, in float32."""
    rows, cols = x.shape
    x = x.astype(np.float32)
    pivot = x[:, :1]
    d = (x - pivot).astype(np.float32)
    nvec = cols // vec
    vectors = d.reshape(rows, nvec, vec)
    n, mean, m2 = [], [], []
    for t in range(lanes):
        mine = vectors[:, t::lanes, :].reshape(rows, -1)
        s = np.zeros(rows, np.float32)
        for k in range(mine.shape[1]):
            s = (s + mine[:, k]).astype(np.float32)
        c = np.float32(mine.shape[1])
        mu = (s / np.maximum(c, np.float32(1))).astype(np.float32)
        q = np.zeros(rows, np.float32)
        for k in range(mine.shape[1]):
            dev = (mine[:, k] - mu).astype(np.float32)
            q = (dev.astype(np.float64) ** 2 + q).astype(np.float32)
        n.append(np.full(rows, c, np.float32))
        mean.append(mu)
        m2.append(q)
    stats = [(n[t], mean[t], m2[t]) for t in range(lanes)]
    offset = lanes // 2
    while offset:
        stats = [
            _merge(stats[t], stats[t ^ offset])
            if not t & offset
            else _merge(stats[t ^ offset], stats[t])
            for t in range(lanes)
        ]
        offset //= 2
    n, mu, q = stats[0]
    for t in range(1, lanes):  # every lane agrees bitwise
        assert all(np.array_equal(a, b) for a, b in zip(stats[t], stats[0], strict=True))
    var = np.maximum((q / np.float32(cols)).astype(np.float32), 0)
    rstd = (1 / np.sqrt(var.astype(np.float64) + 1e-5)).astype(np.float32)
    return (pivot[:, 0] + mu).astype(np.float32), rstd, mu, pivot[:, 0]


@pytest.mark.parametrize(("lanes", "vec", "cols"), [(32, 4, 1024), (16, 4, 128), (8, 8, 200)])
def test_welford_with_pivot_keeps_offset_rows_accurate(lanes, vec, cols) -> None:
    """Rows at 1e4 + N(0, 1): the replayed kernel statistics are within the tight
    STATS_TOLERANCE, and y computed from them is within y's tolerance, where the naive
    float32 E[x^2] - E[x]^2 loses the variance entirely."""
    problem = SPEC.make_problem((64, cols), "float32", np.random.default_rng(11))
    x, w, b = problem.args[:3]
    y_ref, mean_ref, rstd_ref = problem.references
    mean, rstd, mean_s, pivot = replay_register_cache(x, lanes, vec)
    atol, rtol = ln.STATS_TOLERANCE
    np.testing.assert_allclose(mean, mean_ref, atol=atol, rtol=rtol)
    np.testing.assert_allclose(rstd, rstd_ref, atol=atol, rtol=rtol)
    y = ((x - pivot[:, None]) - mean_s[:, None]).astype(np.float32) * (rstd[:, None] * w) + b
    np.testing.assert_allclose(y, y_ref, *SPEC.tolerance("float32"))
    # The naive formula in float32 on the offset rows (0, 4, ...):
    x32 = x[0::4].astype(np.float32)
    naive_var = (x32 * x32).mean(axis=1, dtype=np.float32) - x32.mean(axis=1, dtype=np.float32) ** 2
    true_var = 1 / rstd_ref[0::4].astype(np.float64) ** 2 - 1e-5
    assert np.max(np.abs(naive_var - true_var) / true_var) > 0.5


# --- few long rows: GROUP_ROWS=0 (a block per piece of a row, two launches) -------------------


def split(block=512, vec=4, min_blocks=2, **kw):
    return cfg(block=block, vec=vec, min_blocks=min_blocks, group_rows=0, **kw)


@pytest.mark.parametrize(
    "config, shape, reason",
    [
        (split(row_threads=32), (8, 2**20), "ROW_THREADS=0"),
        (split(cache=1), (8, 2**20), "CACHE=0"),
        (split(cache=2), (8, 2**20), "CACHE=0"),
        (split(block=1024, min_blocks=2), (8, 2**22), "32 registers"),
        (split(), (133, 2**20), "would not be split"),  # 264 // 133 = 1 piece
        (split(min_blocks=0), (67, 2**20), "would not be split"),
        # 264 pieces of 2**17 / 4 / 264 = 124 vectors < 512 threads
        (split(), (1, 2**17), "fewer than BLOCK_SIZE=512"),
        # split rows: (2**17 + 1 - 3) // 4 = 32768 vectors; 33 pieces of 992 < 1024
        (split(block=1024, min_blocks=0), (4, 2**17 + 1), "fewer than BLOCK_SIZE=1024"),
    ],
)
def test_split_error_rejects_what_makes_no_sense(config, shape, reason) -> None:
    assert reason in SPEC.check(config, shape, "float32")
    assert reason in LayerNormSpec.split_error(config, *shape)


def test_split_error_accepts_few_long_rows() -> None:
    assert SPEC.check(split(), (8, 2**22), "float32") is None
    assert SPEC.check(split(block=1024, min_blocks=0), (4, 2**18 + 5), "float32") is None
    assert SPEC.check(split(vec=8), (16, 1048573), "bfloat16") is None
    assert SPEC.check(split(), (66, 2**20), "float32") is None  # 2 pieces a row
    # Only GROUP_ROWS=0 is judged by it.
    assert LayerNormSpec.split_error(cfg(row_threads=32, cache=2), 1, 1) is None


def test_split_launches_two_kernels_on_rows_times_parts_blocks() -> None:
    for config, rows, parts in ((split(), 8, 33), (split(min_blocks=0), 8, 16), (split(), 1, 264)):
        assert ln.split_parts(config, rows) == parts
        steps = SPEC.steps(config, (rows, 2**22), "float32")
        assert [s.kernel for s in steps] == ["layernorm_split_stats", "layernorm_fwd"]
        assert steps[0].launch == steps[1].launch
        assert steps[0].args is None and steps[1].args is None  # all nine arguments
        assert steps[0].launch.grid == (rows * parts, 1, 1)
        assert steps[0].launch.block == (config["BLOCK_SIZE"], 1, 1)
        assert steps[0].launch.shared_bytes == 0
        assert rows * parts <= ln.SPLIT_PIECES
    assert ln.split_parts(cfg(), 8) == 1
    assert [s.kernel for s in SPEC.steps(cfg(), (8, 4096), "float32")] == ["layernorm_fwd"]
    assert set(SPEC.kernel_names) == {"layernorm_fwd", "layernorm_split_stats"}


def test_split_workspace_matches_the_template() -> None:
    text = template_source(SPEC.template)
    assert f"constexpr int kSplitPieces = 2 * {ln.limits.NUM_SMS};" in text
    assert max(SPEC.params["MIN_BLOCKS"]) * ln.limits.NUM_SMS == ln.SPLIT_PIECES


def test_split_renders_row_pieces_and_nothing_else_does() -> None:
    macros = SPEC.defines(split(), (8, 2**22), "float32")
    assert macros["ROW_PIECES"] == 1
    assert (macros["ITEMS"], macros["WB_REGS"]) == (0, 0)
    assert "ROW_SPLIT" not in macros
    assert SPEC.defines(split(), (8, 2**22 + 1), "float32")["ROW_SPLIT"] == 1
    for group_rows in (1, 4, 16):
        for row_threads, cache in ((0, 0), (0, 1), (16, 2), (32, 0)):
            config = cfg(row_threads=row_threads, cache=cache, group_rows=group_rows)
            assert "ROW_PIECES" not in SPEC.defines(config, (4096, 4096), "float32")
    # A split source does not depend on the shape beyond ROW_SPLIT.
    assert SPEC.render(split(), (8, 2**22), "float32") == SPEC.render(
        split(), (3, 2**20), "float32"
    )


@pytest.mark.parametrize(
    "shape, dtype, block, vec",
    [
        ((8, 4194304), "float32", 512, 4),
        ((16, 1048573), "bfloat16", 512, 8),
        ((1, 2**20), "float32", 512, 4),  # 264 pieces of 992 vectors
        ((2, 2**18), "float16", 128, 8),  # 132 pieces of 248 vectors: 128 threads, not 256
        ((66, 32768), "float32", 512, 4),  # 128 KiB rows, 2 pieces each
    ],
)
def test_default_splits_few_long_rows(shape, dtype, block, vec) -> None:
    config = SPEC.default_config(shape, dtype)
    expected = {"ROW_THREADS": 0, "CACHE": 0, "MIN_BLOCKS": 2, "GROUP_ROWS": 0}
    assert {k: config[k] for k in expected} == expected, config
    assert (config["BLOCK_SIZE"], config["VEC"]) == (block, vec)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((67, 2**20), "float32"),
        ((8, 32767), "float32"),
        ((8, 65535), "float16"),
        ((1, 1), "float32"),
    ],
)
def test_default_keeps_a_block_per_row_otherwise(shape, dtype) -> None:
    """More than 66 rows, or rows under 128 KiB: no split."""
    assert SPEC.default_config(shape, dtype)["GROUP_ROWS"] != 0
