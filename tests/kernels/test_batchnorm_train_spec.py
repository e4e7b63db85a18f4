"""The training batchnorm specs (``batchnorm`` forward, ``batchnorm_backward``): constraints,
defaults, steps, problems, and the float64 references against torch's own float64 batch_norm and
its autograd (torch's formula, independently)."""

from __future__ import annotations

import re

import kato.kernels.batchnorm as bn
import kato.kernels.batchnorm_backward as bnb
import numpy as np
import pytest
from kato.kernels import DTYPES, InvalidInput, Launch, Step, get_operator, list_operators
from kato.kernels.batchnorm.channelwise import apply_split
from kato.kernels.spec import COMMON_HEADERS, included_headers, template_source
from kato.tuner.space import SearchSpace

FORWARD = get_operator("batchnorm")
BACKWARD = get_operator("batchnorm_backward")
SPECS = [FORWARD, BACKWARD]
STATS = get_operator("batchnorm_stats")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
BENCH = [(256, 64, 56, 56), (256, 256, 14, 14), (128, 512, 7, 7), (32, 256, 56, 56)]
SHAPES = [
    *BENCH,
    (1, 1, 1, 2),
    (2, 3, 5, 7),
    (1, 1, 1, 1000003),
    (1000, 3, 1, 1),
    (8, 1, 64, 64),
    (1, 7, 13, 1),
    (16, 2048, 7, 7),
    (2, 5, 1, 1000003),
]


def cfg(block=256, vec=4, unroll=4, strategy=1, split=8, min_blocks=0, apply=0, ablock=256,
        avec=4):  # fmt: skip
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "UNROLL": unroll,
        "STRATEGY": strategy,
        "SPLIT": split,
        "MIN_BLOCKS": min_blocks,
        "APPLY": apply,
        "APPLY_BLOCK": ablock,
        "APPLY_VEC": avec,
    }


def test_registered_with_the_contract_attributes() -> None:
    for spec in SPECS:
        assert spec in list_operators()
        assert spec.rank == 4 and spec.shape_names == ("N", "C", "H", "W")
        assert spec.kernel_name in spec.kernel_names and len(spec.kernel_names) == 4
        text = spec.template.read_text()
        for name in spec.kernel_names:
            assert 'extern "C" __global__ void' in text and f" {name}(" in text
        assert "namespace KATO_NS" in text and "#pragma once" not in text
        assert spec.space_size() == 1152 * 2 * 3 * 4
    assert FORWARD.version != BACKWARD.version != STATS.version


def test_the_forward_and_batchnorm_stats_share_the_welford_code() -> None:
    """batchnorm.cu's statistics are batchnorm_stats.cu's device code (Stats, merge, the
    butterfly, vector_stats: kernels/common/kato_welford.cuh; block_partial:
    kato_channel_stats.cuh); only x's load differs (__ldg: the normalise pass reads x again)."""
    welford = COMMON_HEADERS / "kato_welford.cuh"
    channel_stats = COMMON_HEADERS / "kato_channel_stats.cuh"
    assert "block_partial(" in channel_stats.read_text()
    loads = {}
    for spec in (FORWARD, STATS):
        headers = included_headers(spec.template)
        assert headers.index(welford) + 1 == headers.index(channel_stats)
        text = template_source(spec.template)
        assert "struct Stats {" in text and "block_partial(" in text
        loads[spec.name] = re.search(r"#define KATO_STATS_LOAD (\w+)", text).group(1)
    assert loads == {FORWARD.name: "__ldg", STATS.name: "__ldcs"}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("config", "shape", "dtype", "reason"),
    [
        (cfg(vec=8), (2, 3, 4, 4), "float32", "32-byte vector"),
        (cfg(avec=8, vec=1), (2, 3, 4, 4), "float32", "APPLY_VEC: VEC=8"),
        (cfg(vec=8), (2, 3, 7, 7), "float32", "32-byte vector"),  # split planes too
        (cfg(avec=8, vec=1), (2, 3, 7, 7), "float32", "APPLY_VEC: VEC=8"),
        (cfg(block=1024, min_blocks=4), (2, 3, 4, 4), "float32", "not one of"),
        (cfg(vec=1, avec=1, split=256), (2, 2**23, 1, 1), "float32", "grid limit"),
        (cfg(apply=1, strategy=0, split=4), (2, 3, 4, 4), "float32", "STRATEGY=0 with SPLIT"),
        (cfg(apply=1, ablock=512), (2, 3, 4, 4), "float32", "only APPLY_BLOCK=256"),
        (cfg(block=1024, vec=2, unroll=4, min_blocks=2), (2, 3, 8, 8), "float16", "spill"),
        (cfg(split=3), (2, 3, 4, 4), "float32", "not one of"),
        (cfg(), (2, 3, 4, 4), "int32", "does not support dtype"),
        (cfg(), (2, 0, 4, 4), "float32", "at least 1"),
        (cfg(), (2, 3, 2**15, 2**15 + 1), "float32", "2**30"),
        (cfg(), (2, 3, 4), "float32", "rank 4"),
    ],
)
def test_check_rejects_with_a_reason(spec, config, shape, dtype, reason) -> None:
    why = spec.check(config, shape, dtype)
    assert why is not None and reason in why, why


def test_check_rejects_what_only_one_operator_cannot_do() -> None:
    # The forward needs two values per channel (the unbiased variance divides by n - 1).
    assert "N*H*W >= 2" in FORWARD.check(cfg(vec=1, avec=1), (1, 3, 1, 1), "float32")
    assert BACKWARD.check(cfg(vec=1, avec=1, split=1), (1, 3, 1, 1), "float32") is None
    with pytest.raises(InvalidInput, match="more than one value per channel"):
        FORWARD.validate((1, 1, 1, 1), "float32")
    # Two arrays in flight: the backward's 4 x 16-byte vectors of x and dy under a 64-register
    # cap spill; the forward's one array fits.
    config = cfg(block=1024, vec=8, avec=1)
    assert FORWARD.check(config, (2, 3, 8, 8), "float16") is None
    assert "would spill" in BACKWARD.check(config, (2, 3, 8, 8), "float16")


def test_check_rejects_missing_and_unknown_parameters() -> None:
    partial = cfg()
    del partial["APPLY_VEC"]
    for spec in SPECS:
        assert "missing parameter APPLY_VEC" in spec.check(partial, (2, 3, 4, 4), "float32")
        assert "unknown parameter" in spec.check({**cfg(), "X": 1}, (2, 3, 4, 4), "float32")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("config", "shape", "dtype"),
    [
        (cfg(vec=8, avec=8, unroll=2), (2, 3, 4, 4), "bfloat16"),
        (cfg(vec=1, avec=1, split=256), (1, 1, 1, 7), "float32"),  # blocks without work
        (cfg(apply=1, split=1, strategy=0, vec=1, avec=1), (16, 2048, 7, 7), "float16"),
        (cfg(apply=1, split=64), (2, 3, 4, 4), "float32"),  # the last block normalises
        (cfg(block=512, min_blocks=2, unroll=2), (2, 3, 4, 4), "float32"),  # cap 64
        # Planes that are not whole vectors of VEC and/or APPLY_VEC (the plane splits).
        (cfg(vec=4, avec=4, unroll=2), (2, 3, 7, 7), "float32"),
        (cfg(vec=1, avec=2), (2, 3, 7, 7), "float32"),
        (cfg(vec=8, avec=8, unroll=2), (64, 512, 7, 7), "bfloat16"),
        (cfg(vec=8, avec=8, unroll=2, apply=1, split=1), (64, 256, 14, 14), "bfloat16"),
        (cfg(vec=8, avec=4, unroll=2), (4, 3, 1, 1), "float16"),
    ],
)
def test_check_accepts(spec, config, shape, dtype) -> None:
    assert spec.check(config, shape, dtype) is None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_plane_splits_render_only_where_planes_are_not_whole_vectors(spec) -> None:
    """PLANE_SPLIT=1 where VEC does not divide H*W, APPLY_PLANE_SPLIT=1 where APPLY_VEC does
    not, each only then: a shape of whole vectors defines what it always did."""
    config = cfg(vec=2, avec=8, unroll=2)
    base = spec.defines(config, (4, 3, 16, 16), "float16")
    assert "PLANE_SPLIT" not in base and "APPLY_PLANE_SPLIT" not in base
    assert spec.defines(config, (4, 3, 14, 14), "float16") == {**base, "APPLY_PLANE_SPLIT": 1}
    both = spec.defines(config, (4, 3, 7, 7), "float16")
    assert both == {**base, "PLANE_SPLIT": 1, "APPLY_PLANE_SPLIT": 1}
    assert spec.defines(cfg(vec=8, avec=2, unroll=2), (4, 3, 1, 7), "float16")["PLANE_SPLIT"] == 1


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_valid_variants_for_the_benchmark_shapes(spec) -> None:
    for shape in BENCH:
        for dtype in ("float32", "bfloat16"):
            space = SearchSpace(spec.params, lambda c, s=shape, d=dtype: spec.check(c, s, d))
            valid = space.valid_configs()
            assert len(valid) >= 500, (shape, dtype, len(valid))
            assert {c["APPLY"] for c in valid} == {0, 1}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_default_config_is_valid(spec, shape, dtype) -> None:
    config = spec.default_config(shape, dtype)
    assert spec.check(config, shape, dtype) is None
    assert set(config) == set(spec.params)


def test_defaults_follow_batchnorm_stats_and_apply_where_a_channel_is_one_block() -> None:
    for spec in SPECS:
        for shape in BENCH:
            for dtype in DTYPE_NAMES:
                config = spec.default_config(shape, dtype)
                stats = STATS.default_config(shape, dtype)
                same = ("BLOCK_SIZE", "VEC", "STRATEGY", "SPLIT", "MIN_BLOCKS")
                assert {k: config[k] for k in same} == {k: stats[k] for k in same}
                assert config["APPLY"] == (1 if config["SPLIT"] == 1 else 0)
                assert config["APPLY_VEC"] == config["VEC"] or spec is BACKWARD
    big = FORWARD.default_config((256, 64, 56, 56), "float32")
    assert (big["SPLIT"], big["APPLY"], big["APPLY_BLOCK"], big["VEC"]) == (4, 0, 512, 4)
    small = FORWARD.default_config((128, 512, 7, 7), "bfloat16")
    assert (small["SPLIT"], small["APPLY"], small["VEC"]) == (1, 1, 1)
    # The backward streams two arrays: its 16-byte vectors run two at a time, or narrower.
    wide = BACKWARD.default_config((256, 64, 56, 56), "bfloat16")
    assert wide["UNROLL"] * wide["APPLY_VEC"] * 2 <= 32


def test_sources_depend_on_neither_shape_nor_launch_parameters() -> None:
    for spec in SPECS:
        a = spec.render(cfg(strategy=0, split=1, ablock=256), (2, 3, 4, 4), "float32")
        b = spec.render(cfg(strategy=1, split=64, ablock=1024), (64, 512, 28, 28), "float32")
        assert a == b
        for name in ("STRATEGY", "SPLIT", "APPLY_BLOCK"):
            assert f"#define {name} " not in a
        assert a != spec.render(cfg(apply=1), (2, 3, 4, 4), "float32")
        assert a != spec.render(cfg(avec=2), (2, 3, 4, 4), "float32")
        # MIN_BLOCKS that leaves the register cap alone renders as 0.
        assert spec.render(cfg(block=128, min_blocks=2), (2, 3, 4, 4), "float16") == spec.render(
            cfg(block=128), (2, 3, 4, 4), "float16"
        )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_steps(spec) -> None:
    p = spec.prefix
    shape = (8, 100, 4, 4)
    main = Launch(grid=(800, 1, 1), block=(256, 1, 1))
    apply = Step(f"{p}_apply", Launch((100 * apply_split(cfg(), shape), 1, 1), (256, 1, 1)))
    assert spec.steps(cfg(strategy=1), shape, "float32") == [Step(f"{p}_fused", main), apply]
    assert spec.steps(cfg(strategy=1, apply=1), shape, "float32") == [Step(f"{p}_fused", main)]
    assert spec.steps(cfg(strategy=0), shape, "float32") == [
        Step(f"{p}_partial", main),
        Step(f"{p}_finalize", Launch(grid=(13, 1, 1), block=(256, 1, 1))),
        apply,
    ]
    one = Launch(grid=(100, 1, 1), block=(256, 1, 1))
    for strategy in (0, 1):
        steps = spec.steps(cfg(strategy=strategy, split=1, apply=1), shape, "float32")
        assert steps == [Step(f"{p}_partial", one)]


def test_apply_split() -> None:
    # Two waves of 512-thread blocks (132 SMs x 4 x 2) over 64 channels: 17 blocks each.
    assert apply_split(cfg(ablock=512, avec=4), (256, 64, 56, 56)) == 17
    # 2112 resident blocks of 256 threads over 512 channels: 5 each (7 would give every thread
    # a full step of 4 vectors); a tiny channel gets one block.
    assert apply_split(cfg(ablock=256, avec=1), (128, 512, 7, 7)) == 5
    assert apply_split(cfg(ablock=256, avec=1, unroll=2), (2, 512, 7, 7)) == 1
    assert apply_split(cfg(ablock=1024, avec=1), (1, 3, 1, 2)) == 1
    # One long channel: 2112 resident blocks of 256 threads, capped at one per 256 x 4 vectors.
    assert apply_split(cfg(ablock=256, avec=1), (1, 1, 1, 1000003)) == 977


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem_forward(dtype) -> None:
    shape = (3, 10, 5, 7)
    problem = FORWARD.make_problem(shape, dtype, np.random.default_rng(1))
    x, w, b, rm_in, rv_in, y, mean, invstd, rm, rv, ws, counters, n, c, hw, eps, mom = problem.args
    assert x.dtype == y.dtype == DTYPES[dtype][0] and x.shape == y.shape == shape
    for a in (w, b, rm_in, rv_in, mean, invstd, rm, rv):
        assert a.dtype == np.float32 and a.shape == (10,)
    assert all(np.isnan(a).all() for a in (y, mean, invstd, rm, rv))
    assert np.isfinite(x.astype(np.float64)).all() and np.count_nonzero(x) > 0.99 * x.size
    assert (np.abs(w) >= 0.5).all() and (rv_in > 0).all()
    assert ws.dtype == np.float32 and ws.size == 10 * (2 + 3 * 256)
    assert counters.dtype == np.uint32 and counters.size == 11 and not counters.any()
    assert (n, c, hw) == (3, 10, 35) and isinstance(hw, np.int32)
    assert isinstance(eps, np.float32) and isinstance(mom, np.float32)
    assert float(mom) == pytest.approx(0.1) and float(eps) == pytest.approx(1e-5)
    assert problem.outputs == [5, 6, 7, 8, 9]
    assert len(problem.tolerances) == 5 and problem.tolerances[0] == FORWARD.tolerance(dtype)
    big = 1e4 if dtype == "float32" else 1e3
    assert np.all(np.abs(x.astype(np.float64)[:, 0::4].mean(axis=(0, 2, 3)) - big) < 10)
    assert problem.nbytes == FORWARD.buffer_bytes(shape, dtype)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_problem_backward(dtype) -> None:
    shape = (3, 10, 5, 7)
    problem = BACKWARD.make_problem(shape, dtype, np.random.default_rng(1))
    x, dy, mean, invstd, w, dx, dw, db, ws, counters, n, c, hw = problem.args
    assert x.dtype == dy.dtype == dx.dtype == DTYPES[dtype][0] and dx.shape == shape
    for a in (mean, invstd, w, dw, db):
        assert a.dtype == np.float32 and a.shape == (10,)
    assert all(np.isnan(a).all() for a in (dx, dw, db))
    assert ws.size == 10 * 2 * 256 and counters.size == 11 and not counters.any()
    assert (n, c, hw) == (3, 10, 35)
    assert problem.outputs == [5, 6, 7]
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5), rtol=1e-6)
    # Channels 1, 5, ...: dy correlated with xhat; 2, 6, ...: shifted by +-1.
    dy64 = dy.astype(np.float64)
    xhat = (x64 - mean[None, :, None, None]) * invstd[None, :, None, None]
    corr = (dy64 * xhat).mean(axis=(0, 2, 3))
    assert np.all(np.abs(corr[1::4]) > 0.5) and np.all(
        np.abs(dy64.mean(axis=(0, 2, 3))[2::4]) > 0.5
    )
    atol_dx = problem.tolerances[0][0]
    assert atol_dx == pytest.approx(bnb.DX_ERROR * np.max(np.abs(w * invstd)), rel=1e-6)
    assert problem.nbytes == BACKWARD.buffer_bytes(shape, dtype)


def test_forward_reference_is_torch_batch_norm_in_float64() -> None:
    torch = pytest.importorskip("torch")
    problem = FORWARD.make_problem((4, 6, 3, 5), "float16", np.random.default_rng(2))
    x, w, b, rm_in, rv_in = problem.args[:5]
    y_ref, mean_ref, invstd_ref, rm_ref, rv_ref = problem.references
    rm = torch.tensor(rm_in, dtype=torch.float64)
    rv = torch.tensor(rv_in, dtype=torch.float64)
    xt = torch.tensor(x.astype(np.float64))
    y = torch.nn.functional.batch_norm(
        xt, rm, rv, torch.tensor(w, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
        training=True, momentum=0.1, eps=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(y_ref, y.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rm_ref, rm.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rv_ref, rv.numpy(), rtol=1e-12, atol=1e-12)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean_ref, x64.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(invstd_ref, 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5), rtol=1e-12)


def test_backward_reference_is_torch_autograd_in_float64() -> None:
    """dx, dweight and dbias of the problem (from the float32 mean and invstd it stores) against
    torch's autograd of batch_norm in float64 (which recomputes the statistics from x: they
    agree to the float32 rounding of the saved ones)."""
    torch = pytest.importorskip("torch")
    problem = BACKWARD.make_problem((5, 6, 3, 7), "bfloat16", np.random.default_rng(3))
    x, dy, mean, invstd, w = problem.args[:5]
    dx_ref, dw_ref, db_ref = problem.references
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    bt = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.batch_norm(xt, None, None, wt, bt, training=True, eps=1e-5)
    gx, gw, gb = torch.autograd.grad(y, (xt, wt, bt), torch.tensor(dy.astype(np.float64)))
    np.testing.assert_allclose(db_ref, gb.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw_ref, gw.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx_ref, gx.numpy(), rtol=1e-5, atol=1e-5)
    # From the exact statistics, the reference is torch's to float64 rounding.
    x64 = x.astype(np.float64)
    exact = bnb.batchnorm_backward_reference(
        x, dy, x64.mean(axis=(0, 2, 3)), 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5), w
    )
    np.testing.assert_allclose(exact[0], gx.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(exact[1], gw.numpy(), rtol=1e-10, atol=1e-10)


def test_bytes_and_tolerances() -> None:
    shape = (32, 256, 56, 56)
    assert FORWARD.bytes_moved(shape, "float16") == 2 * 32 * 256 * 56 * 56 * 2 + 32 * 256
    assert BACKWARD.bytes_moved(shape, "float16") == 3 * 32 * 256 * 56 * 56 * 2 + 20 * 256
    assert FORWARD.buffer_bytes(shape, "float32") > FORWARD.bytes_moved(shape, "float32")
    for spec in SPECS:
        atol32, rtol32 = spec.tolerance("float32")
        assert rtol32 <= 1e-5 < spec.tolerance("float16")[1] < spec.tolerance("bfloat16")[1]
        with pytest.raises(InvalidInput):
            spec.tolerance("int32")
    assert bn.EPS == bnb.EPS == 1e-5 and bn.MOMENTUM == 0.1
