"""The softmax_backward spec: constraints, defaults, rendering, launch geometry, problems,
references and tolerances."""

from __future__ import annotations

import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, get_operator, list_operators, rowwise
from kato.kernels.softmax_backward import DOT_ERROR, SoftmaxBackwardSpec, softmax_backward_reference

SPEC = get_operator("softmax_backward")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
SHAPES = [
    (1, 1),
    (1, 2),
    (3, 7),
    (5, 33),
    (1000, 1),
    (65536, 128),
    (8192, 4096),
    (3000, 3001),
    (8192, 50257),
    (16, 131072),
    (7, 1000003),
]


def cfg(block=256, vec=4, row_threads=0, cache=0, min_blocks=0):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "ROW_THREADS": row_threads,
        "CACHE": cache,
        "MIN_BLOCKS": min_blocks,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, SoftmaxBackwardSpec) and SPEC in list_operators()
    assert SPEC.kernel_name == "softmax_backward_kernel"
    assert SPEC.rank == 2 and SPEC.shape_names == ("rows", "cols")
    assert SPEC.dtypes == DTYPE_NAMES
    assert list(SPEC.params) == ["BLOCK_SIZE", "VEC", "ROW_THREADS", "CACHE", "MIN_BLOCKS"]
    assert SPEC.space_size() == 4 * 4 * 4 * 3 * 2
    text = SPEC.template.read_text()
    assert 'extern "C" __global__' in text and "namespace KATO_NS" in text
    assert len(SPEC.version) == 12


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (64, 1024), "float32", "32-byte vector"),
        (cfg(block=1024, min_blocks=2), (64, 1024), "float32", "cap registers at 32"),
        (cfg(cache=1, vec=4), (64, 32768), "float32", "shared memory"),  # 2 x 128 KiB
        (cfg(cache=1, row_threads=32, block=1024, vec=8), (64, 2048), "float16", "32 row group"),
        (cfg(cache=2, row_threads=32, vec=4), (64, 4096), "float32", "ITEMS=32"),
        (cfg(cache=2, block=1024, vec=4), (64, 32768), "float32", "would spill"),
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
        (cfg(vec=4), (64, 1022), "float32"),  # any cols with any VEC: head and tail
        (cfg(vec=8), (64, 50257), "bfloat16"),
        (cfg(vec=8, row_threads=8, cache=2), (64, 3), "float16"),  # shorter than a vector
        (cfg(vec=1), (7, 1000003), "float32"),
        (cfg(block=512, min_blocks=2), (64, 1024), "bfloat16"),  # exactly 2048 threads
        (cfg(cache=1, vec=4), (64, 28000), "float32"),  # 2 x 112000 bytes + 64 static
        (cfg(cache=2, row_threads=32, vec=4), (64, 2048), "float16"),  # ITEMS = 16
        (cfg(cache=2, row_threads=8, vec=4), (64, 128), "float32"),
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_check_shared_memory_limit_is_exact() -> None:
    """CACHE=1, one row per block of 1024: 2 rows of cols // VEC vectors + 2 x 32 x 4 static."""
    vectors = (227 * 1024 - 256) // (2 * 16)
    cols = vectors * 4 + 3  # the odd tail does not take shared memory
    assert SPEC.check(cfg(block=1024, cache=1), (8, cols), "float32") is None
    assert "shared memory" in SPEC.check(cfg(block=1024, cache=1), (8, cols + 4), "float32")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid_for_every_shape(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert set(config) == set(SPEC.params)
    assert SPEC.check(config, shape, dtype) is None
    launch = SPEC.launch(config, shape, dtype)
    assert launch.grid[0] >= 1 and launch.shared_bytes <= 227 * 1024


def test_default_config_choices() -> None:
    short = SPEC.default_config((65536, 128), "float32")
    assert (short["VEC"], short["ROW_THREADS"], short["CACHE"]) == (4, 16, 2)
    vocab = SPEC.default_config((8192, 50257), "bfloat16")
    assert vocab["VEC"] == 8  # odd widths keep the widest vector
    assert (vocab["ROW_THREADS"], vocab["CACHE"]) == (0, 1)
    assert SPEC.default_config((8192, 50257), "float32")["CACHE"] == 0  # 2 x 200 KB rows
    assert SPEC.default_config((4, 1), "float16")["VEC"] == 1
    with pytest.raises(InvalidInput):
        SPEC.default_config((0, 4), "float32")


def test_render_defines_first_and_warp_mode_sources_depend_on_the_cap_only() -> None:
    source = SPEC.render(cfg(block=128, vec=8, row_threads=16, cache=2), (10, 1000), "float16")
    assert source.splitlines()[:9] == [
        "#define VEC 8",
        "#define ROW_THREADS 16",
        "#define CACHE 2",
        "#define LB_THREADS 256",
        "#define LB_MIN_BLOCKS 0",
        "#define DTYPE __half",
        "#define IS_HALF 1",
        "#define IS_BF16 0",
        "#define ITEMS 8",  # ceil(1000 // 8 / 16)
    ]
    same = [cfg(block=128, row_threads=32), cfg(block=256, row_threads=32)]
    assert len({SPEC.render(c, (4, 1024), "float32") for c in same}) == 1
    assert SPEC.render(cfg(cache=0), (4, 1024), "float32") == SPEC.render(
        cfg(cache=0), (99, 77), "float32"
    )  # streaming sources do not depend on the shape


def test_launch_geometry() -> None:
    warp = SPEC.launch(cfg(block=256, row_threads=16), (1000, 128), "float32")
    assert warp == Launch(grid=(63, 1, 1), block=(256, 1, 1))  # 16 rows per block
    block = SPEC.launch(cfg(block=512, cache=1, vec=8), (70, 4100), "float16")
    assert block == Launch(grid=(70, 1, 1), block=(512, 1, 1), shared_bytes=2 * 512 * 16)
    assert SPEC.launch(cfg(block=128), (2**31 - 1, 1), "float32").grid[0] == 2**31 - 1


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((37, 301), dtype, np.random.default_rng(1))
    y, dy, dx, rows, cols = problem.args
    assert y.dtype == dy.dtype == dx.dtype == DTYPES[dtype][0]
    assert y.shape == dy.shape == dx.shape == (37, 301) and (rows, cols) == (37, 301)
    assert problem.outputs == [2] and np.isnan(dx.astype(np.float64)).all()
    y64 = y.astype(np.float64)
    assert np.all(y64 > 0) and np.allclose(y64.sum(axis=1), 1, atol=301 * 2e-3)
    assert y64.max() / y64.min() < np.exp(12)  # logits of spread 1: no element is negligible
    dots = (y64 * dy.astype(np.float64)).sum(axis=1)
    assert np.all(dots[0::4] > 2) and np.all(dots[2::4] < -2)
    [(atol, rtol)] = problem.tolerances
    assert rtol == SPEC.tolerance(dtype)[1]
    _, scale = softmax_backward_reference(y, dy)
    assert atol == max(SPEC.tolerance(dtype)[0], DOT_ERROR * scale.max())
    # Every element's |dx| is far above atol except where dy nearly equals the dot.
    ref = problem.references[0]
    assert np.mean(np.abs(ref) > 10 * atol) > 0.95


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((5, 9), "bfloat16", np.random.default_rng(2))
    y, dy = (a.astype(np.float64) for a in problem.args[:2])
    for r in range(5):
        dot = sum(y[r, c] * dy[r, c] for c in range(9))
        for c in range(9):
            assert problem.references[0][r, c] == pytest.approx(y[r, c] * (dy[r, c] - dot))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_rounded_reference_is_within_tolerance(dtype) -> None:
    problem = SPEC.make_problem((16, 1000), dtype, np.random.default_rng(8))
    [(atol, rtol)] = problem.tolerances
    ref = problem.references[0]
    ideal = ref.astype(DTYPES[dtype][0]).astype(np.float64)
    np.testing.assert_allclose(ideal, ref, atol=atol, rtol=rtol)
    assert not np.allclose(ref * (1 + 4 * rtol), ref, atol=atol, rtol=rtol)
    assert not np.allclose(np.zeros_like(ref), ref, atol=atol, rtol=rtol)


def test_bytes_moved_and_buffers() -> None:
    assert SPEC.bytes_moved((8192, 50257), "bfloat16") == 3 * 8192 * 50257 * 2
    problem = SPEC.make_problem((3, 5), "float32", np.random.default_rng(0))
    assert problem.nbytes == SPEC.buffer_bytes((3, 5), "float32")


def test_rowwise_head_split_matches_the_kernels_rule() -> None:
    """The template's head is (-address / itemsize) mod VEC; for cudaMalloc'd rows that is
    (-row * cols) mod VEC. Every (row, VEC) of an odd width gets a head of its own."""
    cols = 1031
    heads = {(-row * cols) % 8 for row in range(8)}
    assert heads == set(range(8))
    assert rowwise.body_vectors(cols, 8) == 128
