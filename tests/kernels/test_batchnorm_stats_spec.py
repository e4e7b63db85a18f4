"""The batchnorm_stats spec: constraints, defaults, steps, problems, references, and the
kernel's per-block Welford/Chan statistics replayed in float32 numpy."""

from __future__ import annotations

import kato.kernels.batchnorm_stats as bn
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, Step, get_operator, list_operators
from kato.kernels.batchnorm_stats import BatchNormStatsSpec, batchnorm_stats_reference
from kato.tuner.space import SearchSpace

SPEC = get_operator("batchnorm_stats")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
BENCH = [(32, 256, 56, 56), (256, 64, 112, 112), (64, 512, 28, 28), (16, 2048, 7, 7)]
SHAPES = [*BENCH, (1, 1, 1, 1), (2, 3, 5, 7), (1, 1, 1, 1000003), (1000, 3, 1, 1), (8, 1, 64, 64)]


def cfg(block=256, vec=4, unroll=4, strategy=1, split=8, min_blocks=0):
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "UNROLL": unroll,
        "STRATEGY": strategy,
        "SPLIT": split,
        "MIN_BLOCKS": min_blocks,
    }


def test_registered_with_the_contract_attributes() -> None:
    assert isinstance(SPEC, BatchNormStatsSpec)
    assert SPEC in list_operators()
    assert SPEC.rank == 4 and SPEC.shape_names == ("N", "C", "H", "W")
    assert SPEC.kernel_name in SPEC.kernel_names
    text = SPEC.template.read_text()
    for name in SPEC.kernel_names:
        assert 'extern "C" __global__ void' in text and name in text
    assert "namespace KATO_NS" in text and "#pragma once" not in text
    assert SPEC.space_size() == 4 * 4 * 2 * 2 * 9 * 2  # 1152


@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (2, 3, 4, 4), "float32", "32-byte vector"),
        (cfg(vec=8), (2, 3, 7, 7), "float32", "32-byte vector"),  # split planes too
        (cfg(block=1024, min_blocks=4), (2, 3, 4, 4), "float32", "not one of"),
        (cfg(vec=1, split=256), (1, 2**23, 1, 1), "float32", "grid limit"),
        (cfg(block=1024, vec=1, unroll=2, min_blocks=2), (2, 3, 8, 8), "float16", "spill"),
        (cfg(split=3), (2, 3, 4, 4), "float32", "not one of"),
        (cfg(), (2, 3, 4, 4), "int32", "does not support dtype"),
        (cfg(), (2, 0, 4, 4), "float32", "at least 1"),
        (cfg(), (2, 3, 2**15, 2**15 + 1), "float32", "2**30"),
        (cfg(), (2, 3, 4), "float32", "rank 4"),
    ],
)
def test_check_rejects_with_a_reason(config, shape, dtype, reason) -> None:
    why = SPEC.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["SPLIT"]
    assert "missing parameter SPLIT" in SPEC.check(partial, (2, 3, 4, 4), "float32")
    assert "unknown parameter" in SPEC.check({**cfg(), "X": 1}, (2, 3, 4, 4), "float32")


@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=8), (2, 3, 4, 4), "bfloat16"),
        (cfg(vec=1, split=256), (1, 1, 1, 7), "float32"),  # blocks without work are fine
        (cfg(block=512, min_blocks=2, unroll=4, vec=4), (2, 3, 4, 4), "float32"),  # cap 64
        (cfg(vec=1, split=1, strategy=0), (16, 2048, 7, 7), "float16"),
        # Planes that are not whole vectors (PLANE_SPLIT): any VEC up to 16 bytes.
        (cfg(vec=4), (2, 3, 7, 7), "float32"),
        (cfg(vec=8), (16, 2048, 7, 7), "bfloat16"),
        (cfg(vec=8), (16, 256, 14, 14), "float16"),
        (cfg(vec=8, split=1), (4, 3, 1, 1), "bfloat16"),
        (cfg(vec=2), (2, 3, 3, 5), "float32"),
    ],
)
def test_check_accepts(config, shape, dtype) -> None:
    assert SPEC.check(config, shape, dtype) is None


def test_plane_split_renders_only_where_planes_are_not_whole_vectors() -> None:
    """PLANE_SPLIT=1 where H*W % VEC != 0, nothing new where it divides (the source stays
    the one recorded results were measured with); the split's registers are counted."""
    aligned = SPEC.defines(cfg(vec=8), (16, 256, 16, 16), "float16")
    assert "PLANE_SPLIT" not in aligned
    assert "#define PLANE_SPLIT 1" not in SPEC.render(cfg(vec=8), (16, 256, 16, 16), "float16")
    assert "PLANE_SPLIT" not in SPEC.defines(cfg(vec=4), (16, 256, 14, 14), "float16")
    for shape in ((16, 256, 14, 14), (16, 2048, 7, 7), (4, 3, 1, 1), (2, 3, 3, 5)):
        split = SPEC.defines(cfg(vec=8), shape, "float16")
        assert split == {**aligned, "PLANE_SPLIT": 1}
        assert "#define PLANE_SPLIT 1\n" in SPEC.render(cfg(vec=8), shape, "float16")
    # One register more per vector in flight: cap 64 (512 threads, 2 blocks) takes UNROLL 4 of
    # 16-byte vectors at H*W 64 (24 + 32 = 56) and at 49 (28 + 32 = 60).
    tight = cfg(block=512, min_blocks=2, unroll=4, vec=8)
    assert SPEC.check(tight, (16, 64, 8, 8), "float16") is None
    assert SPEC.check(tight, (16, 64, 7, 7), "float16") is None


def test_valid_variants_for_the_benchmark_shapes() -> None:
    for shape in BENCH:
        for dtype in ("float32", "float16"):
            space = SearchSpace(SPEC.params, lambda c, s=shape, d=dtype: SPEC.check(c, s, d))
            assert len(space.valid_configs()) >= 200, (shape, dtype)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid(shape, dtype) -> None:
    config = SPEC.default_config(shape, dtype)
    assert SPEC.check(config, shape, dtype) is None
    assert set(config) == set(SPEC.params)


def test_default_split_fills_the_gpu() -> None:
    # channels x SPLIT x 512 threads within 132 x 1024: 64 x 4 x 512 = 131072.
    big = SPEC.default_config((256, 64, 112, 112), "float32")
    assert (big["SPLIT"], big["BLOCK_SIZE"]) == (4, 512)
    assert SPEC.default_config((32, 256, 56, 56), "float16")["SPLIT"] == 1
    assert SPEC.default_config((16, 2048, 7, 7), "float16")["SPLIT"] == 1
    assert SPEC.default_config((16, 2048, 7, 7), "float16")["VEC"] == 1
    assert SPEC.default_config((32, 256, 56, 56), "float16")["VEC"] == 8
    assert SPEC.default_config((1, 1, 1, 1), "float32")["SPLIT"] == 1


def test_sources_depend_on_neither_shape_nor_strategy_nor_split() -> None:
    a = SPEC.render(cfg(strategy=0, split=1), (2, 3, 4, 4), "float32")
    assert a == SPEC.render(cfg(strategy=1, split=64), (64, 512, 28, 28), "float32")
    assert "#define STRATEGY" not in a and "#define SPLIT" not in a
    assert a != SPEC.render(cfg(unroll=2), (2, 3, 4, 4), "float32")  # default 4
    # MIN_BLOCKS that leaves the register cap alone renders as 0.
    assert SPEC.render(cfg(block=128, min_blocks=2), (2, 3, 4, 4), "float16") == SPEC.render(
        cfg(block=128), (2, 3, 4, 4), "float16"
    )


def test_steps() -> None:
    shape = (8, 100, 4, 4)
    main = Launch(grid=(800, 1, 1), block=(256, 1, 1))
    assert SPEC.steps(cfg(strategy=1), shape, "float32") == [Step("batchnorm_stats_fused", main)]
    two = SPEC.steps(cfg(strategy=0), shape, "float32")
    assert two == [
        Step("batchnorm_stats_partial", main),
        Step("batchnorm_stats_finalize", Launch(grid=(13, 1, 1), block=(256, 1, 1))),
    ]
    one = Launch(grid=(100, 1, 1), block=(256, 1, 1))
    for strategy in (0, 1):
        steps = SPEC.steps(cfg(strategy=strategy, split=1), shape, "float32")
        assert steps == [Step("batchnorm_stats_partial", one)]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem(dtype) -> None:
    problem = SPEC.make_problem((3, 10, 5, 7), dtype, np.random.default_rng(1))
    x, mean, var, invstd, ws, counters, n, c, hw, eps = problem.args
    assert x.dtype == DTYPES[dtype][0] and x.shape == (3, 10, 5, 7)
    assert mean.dtype == var.dtype == invstd.dtype == np.float32
    assert all(np.isnan(a).all() for a in (mean, var, invstd))
    assert ws.dtype == np.float32 and ws.size == 10 * bn.MAX_SPLIT * 3
    assert counters.dtype == np.uint32 and counters.size == 11 and not counters.any()
    assert (n, c, hw) == (3, 10, 35) and isinstance(hw, np.int32)
    assert isinstance(eps, np.float32)
    assert problem.outputs == [1, 2, 3]
    xs = x.astype(np.float64)
    assert np.count_nonzero(xs) > 0.99 * xs.size
    big = 1e4 if dtype == "float32" else 1e3
    assert np.all(np.abs(xs[:, 0::4].mean(axis=(0, 2, 3)) - big) < 10)
    assert problem.nbytes == SPEC.buffer_bytes((3, 10, 5, 7), dtype)


def test_reference_matches_an_independent_computation() -> None:
    problem = SPEC.make_problem((4, 6, 3, 5), "float16", np.random.default_rng(2))
    x = problem.args[0].astype(np.float64)
    mean, var, invstd = problem.references
    for c in range(6):
        values = x[:, c].ravel()
        mu = values.sum() / values.size
        v = ((values - mu) ** 2).sum() / values.size
        assert mean[c] == pytest.approx(mu, rel=1e-12)
        assert var[c] == pytest.approx(v, rel=1e-12)
        assert invstd[c] == pytest.approx(1 / np.sqrt(v + 1e-5), rel=1e-12)
    m2, v2, i2 = batchnorm_stats_reference(np.full((2, 1, 1, 1), 3.0, np.float32), 1e-5)
    assert (m2[0], v2[0]) == (3.0, 0.0) and i2[0] == pytest.approx(1 / np.sqrt(1e-5))


def test_bytes_moved() -> None:
    assert SPEC.bytes_moved((32, 256, 56, 56), "float16") == 32 * 256 * 56 * 56 * 2
    assert SPEC.tolerance("bfloat16") == SPEC.tolerance("float32")
    with pytest.raises(InvalidInput):
        SPEC.tolerance("int32")


# --- the kernel's statistics, replayed in float32 ---------------------------------------------


def _merge(a, b):
    na, ma, qa = a
    nb, mb, qb = b
    n = np.float32(na + nb)
    f = np.float32(nb / max(n, np.float32(1)))
    delta = np.float32(mb - ma)
    mean = np.float32(float(delta) * float(f) + float(ma))
    m2 = np.float32(float(np.float32(delta * delta)) * float(np.float32(na * f)) + float(qa + qb))
    return n, mean, m2


def replay_channel(x: np.ndarray, c: int, split: int, block: int, vec: int, unroll: int):
    """The partial kernel's arithmetic for channel c, thread by thread (vector by vector Chan
    merges in the kernel's order, butterflies with the lower lane on the left, the SPLIT
    partials merged by one warp). Returns (mean, var) in float32."""
    n_, _, h, w = x.shape
    hwv = h * w // vec
    vectors = x[:, c].reshape(n_ * hwv, vec).astype(np.float32)
    pivot = np.float32(x[0, c].ravel()[0])
    total = n_ * hwv
    per, extra = divmod(total, split)

    def butterfly(stats):
        offset = len(stats) // 2
        while offset:
            stats = [
                _merge(stats[t], stats[t ^ offset])
                if not t & offset
                else _merge(stats[t ^ offset], stats[t])
                for t in range(len(stats))
            ]
            offset //= 2
        return stats[0]

    zero = (np.float32(0), np.float32(0), np.float32(0))
    partials = []
    for part in range(split):
        start = part * per + min(part, extra)
        end = start + per + (1 if part < extra else 0)
        threads = []
        for t in range(block):
            s = zero
            for v in range(start + t, end, block):
                d = (vectors[v] - pivot).astype(np.float32)
                acc = np.float32(0)
                for k in range(vec):
                    acc = np.float32(acc + d[k])
                mu = np.float32(acc * np.float32(1.0 / vec))
                q = np.float32(0)
                for k in range(vec):
                    e = np.float32(d[k] - mu)
                    q = np.float32(float(e) * float(e) + float(q))
                s = _merge(s, (np.float32(vec), mu, q))
            threads.append(s)
        warps = [butterfly(threads[i : i + 32]) for i in range(0, block, 32)]
        partials.append(butterfly(warps + [zero] * (32 - len(warps))))
    lanes = [zero] * 32
    for p, st in enumerate(partials):
        lanes[p % 32] = _merge(lanes[p % 32], st)
    n, mu, q = butterfly(lanes) if split > 1 else partials[0]
    assert n == n_ * h * w
    return np.float32(pivot + mu), np.float32(q / np.float32(n_ * h * w))


@pytest.mark.parametrize(("split", "block", "vec"), [(1, 128, 4), (4, 128, 2), (8, 256, 1)])
def test_replayed_statistics_are_accurate_on_offset_channels(split, block, vec) -> None:
    """Channel 0 sits at 1e4 + N(0, 1) (naive float32 E[x^2] - E[x]^2 is useless there); the
    replayed kernel arithmetic stays within the tight tolerance on it and on a normal one."""
    problem = SPEC.make_problem((3, 2, 12, 20), "float32", np.random.default_rng(5))
    x = problem.args[0]
    mean_ref, var_ref, _ = problem.references
    atol, rtol = SPEC.tolerance("float32")
    for c in range(2):
        mean, var = replay_channel(x, c, split, block, vec, unroll=4)
        assert abs(mean - mean_ref[c]) <= atol + rtol * abs(mean_ref[c])
        assert abs(var - var_ref[c]) <= atol + rtol * abs(var_ref[c])
    values = x[:, 0].astype(np.float32).ravel()
    naive = (values * values).mean(dtype=np.float32) - values.mean(dtype=np.float32) ** 2
    assert abs(naive - var_ref[0]) > 0.05 * var_ref[0]
