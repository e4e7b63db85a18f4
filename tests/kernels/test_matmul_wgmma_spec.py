"""The wgmma path of the matmul specs (``ENGINE="wgmma"``): its space and constraints, the arch
it asks for, its rendering, launch and the TMA tensor maps its step declares; and that the
mma.sync configs are untouched by it."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from kato.kernels import get_operator
from kato.kernels.matmul import (
    MMA_PARAMS,
    PERSISTENT_CTAS,
    WGMMA_PINNED,
    WGMMA_STATIC_SHARED,
    WGMMA_TEMPLATE,
    threads_per_block,
    wgmma_accumulators,
    wgmma_shared_bytes,
)
from kato.kernels.spec import TensorMap
from kato.tuner.backends.pycuda import check_on_gpu, operator_space
from kato.tuner.space import SearchSpace

from kato.shared.gpus import find_gpu

SPEC = get_operator("matmul")
NT = get_operator("matmul_nt")
TN = get_operator("matmul_tn")
SPECS = (SPEC, NT, TN)
SHAPE = (4096, 4096, 4096)


def wgmma_cfg(**kw):
    base = {
        **WGMMA_PINNED,
        "BM": 128,
        "BN": 256,
        "BK": 64,
        "STAGES": 4,
        "ENGINE": "wgmma",
        "CLUSTER_M": 1,
        "PERSISTENT": 0,
        "EPILOGUE": 0,
        "SPLIT_K": 1,
        "PINGPONG": 0,
        "STREAM_K": 0,
    }
    return {**base, **kw}


@functools.cache
def wgmma_valid(spec, shape, dtype) -> list[dict]:
    return [
        c
        for c in spec.candidates(shape, dtype)
        if c["ENGINE"] == "wgmma" and spec.check(c, shape, dtype) is None
    ]


def test_candidates_hold_every_valid_config_of_a_sample_of_the_product():
    """No valid config among 200,000 random combinations of the whole product and every
    one-parameter change of each listed valid config (where a config the list misses would
    sit) is missing from the spec's candidates list (what the backends enumerate). The whole
    product (12 million; a full walk takes minutes) is ``-m slow``'s."""
    shape, dtype = (1000, 1000, 1000), "bfloat16"
    space = SearchSpace(SPEC.params)
    valid = [c for c in SPEC.candidates(shape, dtype) if SPEC.check(c, shape, dtype) is None]
    listed = {space.key(c) for c in valid}
    rng = np.random.default_rng(2026)
    names = list(SPEC.params)
    picks = [rng.integers(0, len(SPEC.params[n]), 200_000) for n in names]
    sample = [
        {n: SPEC.params[n][i] for n, i in zip(names, row, strict=True)}
        for row in zip(*picks, strict=True)
    ]
    sample += [{**c, n: v} for c in valid for n in names for v in SPEC.params[n] if v != c[n]]
    found = [c for c in sample if SPEC.check(c, shape, dtype) is None]
    assert len(found) > 1000
    missing = [c for c in found if space.key(c) not in listed]
    assert not missing, missing[:3]


@pytest.mark.slow
def test_candidates_hold_exactly_the_valid_configs_of_the_whole_product():
    """The spec's candidates list (what the backends enumerate) misses no valid config of the
    whole product, in its order."""
    shape, dtype = (1000, 1000, 1000), "bfloat16"
    whole = SearchSpace(SPEC.params, lambda c: SPEC.check(c, shape, dtype)).valid_configs()
    listed = [c for c in SPEC.candidates(shape, dtype) if SPEC.check(c, shape, dtype) is None]
    assert listed == whole
    assert {c["ENGINE"] for c in whole} == {"mma", "wgmma"}
    space = operator_space(SPEC, shape, dtype, lambda c: SPEC.check(c, shape, dtype))
    assert space.valid_configs() == whole


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_valid_wgmma_config_fits(spec, dtype):
    configs = wgmma_valid(spec, SHAPE, dtype)
    tiles = {(c["BM"], c["BN"]) for c in configs}
    assert tiles == {(m, n) for m in (64, 128, 256) for n in (64, 128, 256)} - {(256, 256)}
    assert {c["STAGES"] for c in configs} == {2, 3, 4, 5, 6}
    assert {(c["CLUSTER_M"], c["PERSISTENT"]) for c in configs} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert {c["EPILOGUE"] for c in configs} == {0, 1}
    assert {c["SPLIT_K"] for c in configs} == {1}  # 512 tiles of 128 x 256: no split
    assert {c["PINGPONG"] for c in configs} == {0, 1}
    for c in configs:
        assert {k: c[k] for k in WGMMA_PINNED} == WGMMA_PINNED and c["BK"] == 64
        assert wgmma_accumulators(c) <= 128
        assert threads_per_block(c) == (256 if c["BM"] == 64 and not c["PINGPONG"] else 384)
        assert wgmma_shared_bytes(c) + WGMMA_STATIC_SHARED <= 227 * 1024
        assert c["CLUSTER_M"] == 1 or c["BN"] >= 128
    # no two valid configs launch the same kernel the same way
    launches = {(spec.render(c, SHAPE, dtype), spec.launch(c, SHAPE, dtype)) for c in configs}
    assert len(launches) == len(configs)


def test_float32_has_no_wgmma_config():
    assert wgmma_valid(SPEC, SHAPE, "float32") == []
    assert "float16 or bfloat16" in SPEC.check(wgmma_cfg(), SHAPE, "float32")


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (wgmma_cfg(BM=256, BN=256), "accumulators"),
        (wgmma_cfg(BN=64, CLUSTER_M=2), "BN 128 or 256"),
        (wgmma_cfg(BK=32), "BK 64"),
        (wgmma_cfg(STAGES=1), "STAGES 2..6"),
        (wgmma_cfg(STAGES=5), "shared memory"),  # 5 x 48 KiB
        (wgmma_cfg(STAGES=4, EPILOGUE=1), "shared memory"),  # 4 x 48 KiB + the 64 KiB C tile
        (wgmma_cfg(VEC=4), "VEC is unused"),
        (wgmma_cfg(WM=32), "WM is unused"),
        (wgmma_cfg(MIN_BLOCKS=2), "MIN_BLOCKS is unused"),
    ],
)
def test_check_rejects_what_the_wgmma_template_cannot_build(config, reason):
    assert reason in SPEC.check(config, SHAPE, "float16")


def test_mma_configs_pin_the_wgmma_tunables():
    config = SPEC.default_config(SHAPE, "float16")
    assert config["ENGINE"] == "mma"
    assert "CLUSTER_M" in SPEC.check({**config, "CLUSTER_M": 2}, SHAPE, "float16")
    assert "PERSISTENT" in SPEC.check({**config, "PERSISTENT": 1}, SHAPE, "float16")
    assert "EPILOGUE" in SPEC.check({**config, "EPILOGUE": 1}, SHAPE, "float16")
    assert "STAGES 2, 3 or 4" in SPEC.check({**config, "STAGES": 5}, SHAPE, "float16")
    assert "SPLIT_K" in SPEC.check({**config, "SPLIT_K": 2}, SHAPE, "float16")
    assert "PINGPONG" in SPEC.check({**config, "PINGPONG": 1}, SHAPE, "float16")


@pytest.mark.parametrize(
    ("spec", "shape", "valid"),
    [
        (SPEC, (8192, 50257, 768), False),  # B (K, N): pitch N = 50257
        (NT, (8192, 50257, 768), True),  # B (N, K): pitch K = 768, C's pitch may be odd
        (SPEC, (8192, 768, 3071), False),  # A's pitch K
        (TN, (4095, 4096, 4096), False),  # A (K, M): pitch M
        (TN, (4096, 4095, 4096), False),  # B (K, N): pitch N
        (NT, (4096, 4096, 4095), False),  # both pitches K
        (SPEC, (1, 8, 8), True),  # smaller than every tile: TMA zero-fills the rest
        (SPEC, (1001, 1000, 1000), True),  # M is nobody's pitch in matmul
    ],
)
def test_tma_pitches_decide_whether_a_shape_has_wgmma_configs(spec, shape, valid):
    for dtype in ("float16", "bfloat16"):
        assert bool(wgmma_valid(spec, shape, dtype)) == valid, (spec.name, shape, dtype)
    reason = spec.check(wgmma_cfg(), shape, "bfloat16")
    assert (reason is None) == valid
    if not valid:
        assert "multiple of 8" in reason


def test_persistent_is_valid_only_where_it_changes_the_grid():
    # 1000^2 in 128 x 256 tiles: 8 x 4 = 32 tiles, fewer than the 132 CTAs
    assert "PERSISTENT=1 launches what" in SPEC.check(
        wgmma_cfg(PERSISTENT=1), (1000, 1000, 1000), "float16"
    )
    assert SPEC.check(wgmma_cfg(PERSISTENT=1), SHAPE, "float16") is None


def test_the_wgmma_engine_is_in_the_sm_90_space_with_the_mma_sync_one():
    """On an H200 the backend's space holds both engines' configs for 16-bit dtypes."""
    wgmma, mma = wgmma_cfg(), SPEC.default_config(SHAPE, "float16")
    h200 = find_gpu("H200")
    assert check_on_gpu(SPEC, SHAPE, "float16", h200, wgmma) is None
    assert check_on_gpu(SPEC, SHAPE, "float16", h200, mma) is None


def test_the_arch_hooks_keep_wgmma_to_sm_90_and_build_it_for_sm_90a():
    wgmma, mma = wgmma_cfg(), SPEC.default_config(SHAPE, "float16")
    assert SPEC.check_arch(wgmma, "sm_90") is None
    for arch in ("sm_80", "sm_86", "sm_89", "sm_100"):
        assert "needs sm_90" in SPEC.check_arch(wgmma, arch)
        assert SPEC.check_arch(mma, arch) is None
    assert SPEC.arch_for(wgmma, "sm_90") == "sm_90a"
    assert SPEC.arch_for(mma, "sm_90") == "sm_90" and SPEC.arch_for(mma, "sm_80") == "sm_80"
    # the backends' device check applies it, from the catalog's arch or the device's own
    h200, a100 = find_gpu("H200"), find_gpu("A100 80GB")
    assert check_on_gpu(SPEC, SHAPE, "float16", h200, wgmma) is None
    assert "needs sm_90" in check_on_gpu(SPEC, SHAPE, "float16", a100, wgmma)
    assert "needs sm_90" in check_on_gpu(SPEC, SHAPE, "float16", None, wgmma, "sm_80")
    assert check_on_gpu(SPEC, SHAPE, "float16", a100, mma) is None


def test_wgmma_render_is_the_wgmma_template_with_its_macros_and_no_shape():
    config = wgmma_cfg(CLUSTER_M=2)
    src = SPEC.render(config, SHAPE, "bfloat16")
    assert SPEC.template_for(config) == WGMMA_TEMPLATE
    assert SPEC.main_kernel(config) == "kato_matmul_wgmma"
    assert src.endswith(WGMMA_TEMPLATE.read_text())
    head = src[: len(src) - len(WGMMA_TEMPLATE.read_text())]
    macros = dict(line.split()[1:3] for line in head.splitlines())
    want = {"BM": "128", "BN": "256", "BK": "64", "STAGES": "4", "CONSUMERS": "2",
            "CLUSTER_M": "2", "INFLIGHT": "1", "PRODUCER_REGS": "40", "CONSUMER_REGS": "232",
            "IS_BF16": "1", "TRANS_A": "0", "TRANS_B": "0"}  # fmt: skip
    assert {k: macros[k] for k in want} == want
    assert "DTYPE" not in src.split("#include")[0]  # the template typedefs it
    # one consumer warpgroup: no setmaxnreg
    one = SPEC.render(wgmma_cfg(BM=64), SHAPE, "float16")
    assert "#define CONSUMERS 1" in one and "#define CONSUMER_REGS 0" in one
    # the shape and PERSISTENT change only the launch
    assert src == SPEC.render(config, (8, 16, 8), "bfloat16")
    assert src == SPEC.render({**config, "PERSISTENT": 1}, SHAPE, "bfloat16")
    assert "#define EPILOGUE 0" in src
    assert "#define EPILOGUE 1" in SPEC.render({**config, "EPILOGUE": 1}, SHAPE, "bfloat16")
    assert "#define TRANS_A 1" in TN.render(config, SHAPE, "bfloat16")
    assert "#define TRANS_B 1" in NT.render(config, SHAPE, "bfloat16")


def test_mma_sources_render_only_the_mma_tunables():
    for dtype in ("float32", "float16"):
        config = SPEC.default_config(SHAPE, dtype)
        src = SPEC.render(config, SHAPE, dtype)
        names = [line.split()[1] for line in src.splitlines() if line.startswith("#define ")]
        assert names[: len(MMA_PARAMS)] == list(MMA_PARAMS)
        assert not {"ENGINE", "CLUSTER_M", "PERSISTENT", "EPILOGUE"} & set(
            names[: len(MMA_PARAMS) + 8]
        )


@pytest.mark.parametrize(
    ("config", "shape", "grid", "threads"),
    [
        (wgmma_cfg(), (1000, 1000, 1000), 8 * 4, 384),
        (wgmma_cfg(CLUSTER_M=2), (1000, 1000, 1000), 4 * 4 * 2, 384),
        (wgmma_cfg(CLUSTER_M=2), (1100, 1000, 1000), 5 * 4 * 2, 384),  # last cluster half out
        (wgmma_cfg(PERSISTENT=1), SHAPE, PERSISTENT_CTAS, 384),
        (wgmma_cfg(PERSISTENT=1, CLUSTER_M=2), SHAPE, PERSISTENT_CTAS // 2 * 2, 384),
        (wgmma_cfg(BM=64, BN=64), (8, 16, 8), 1, 256),
        (wgmma_cfg(STAGES=3, EPILOGUE=1, PERSISTENT=1), SHAPE, PERSISTENT_CTAS, 384),
        (wgmma_cfg(SPLIT_K=3), (768, 3072, 8192), 6 * 12 * 3, 384),  # a cluster of 3 per tile
    ],
)
def test_wgmma_launch(config, shape, grid, threads):
    launch = SPEC.launch(config, shape, "float16")
    assert launch.grid == (grid, 1, 1) and launch.block == (threads, 1, 1)
    assert launch.grid[0] % config["CLUSTER_M"] == 0
    stages = config["STAGES"] * (config["BM"] + config["BN"]) * 64 * 2
    c_tile = config["BM"] * config["BN"] * 2 * config["EPILOGUE"]
    assert launch.shared_bytes == stages + c_tile + 1024
    (step,) = SPEC.steps(config, shape, "float16")
    assert step.kernel == "kato_matmul_wgmma" and step.launch == launch


@pytest.mark.parametrize(
    ("spec", "map_a", "map_b"),
    [
        # K-major A (M, K): boxes of 64 k x BM rows; MN-major B (K, N): 64 n x 64 k
        (SPEC, (296, 200, 128, 64), (200, 136, 64, 64)),
        # B (N, K) K-major: a cluster's CTA loads half of the BN rows
        (NT, (296, 200, 128, 64), (136, 200, 128, 64)),
        # A (K, M) MN-major
        (TN, (200, 296, 64, 64), (200, 136, 64, 64)),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_steps_declare_the_tensor_maps_of_a_and_b(spec, map_a, map_b):
    shape = (296, 136, 200)
    config = wgmma_cfg(CLUSTER_M=2)
    (step,) = spec.steps(config, shape, "bfloat16")
    a, b, *rest = step.args
    assert rest == [2, 3, 4, 5]  # C, M, N, K as the problem holds them
    assert step.tensor_maps == (a, b)
    assert (a.array, b.array) == (0, 1)
    for got, want in ((a, map_a), (b, map_b)):
        assert (got.rows, got.cols, got.box_rows, got.box_cols) == want
        assert got.dtype == "bfloat16" and got.swizzle == 128
    # the maps describe the arrays the problem makes
    problem = spec.make_problem(shape, "bfloat16", __import__("numpy").random.default_rng(0))
    assert problem.args[0].shape == (a.rows, a.cols) and problem.args[1].shape == (b.rows, b.cols)


def test_tensor_map_declarations_are_checked():
    TensorMap(0, "float16", rows=3, cols=8, box_rows=64, box_cols=64)
    with pytest.raises(ValueError, match="16 bytes"):
        TensorMap(0, "float16", rows=3, cols=50257, box_rows=64, box_cols=64)
    with pytest.raises(ValueError, match="swizzle"):
        TensorMap(0, "float32", rows=8, cols=64, box_rows=8, box_cols=64)  # 256-byte box rows
    with pytest.raises(ValueError, match="1..256"):
        TensorMap(0, "float16", rows=8, cols=64, box_rows=512, box_cols=64)
    with pytest.raises(ValueError, match="dtype"):
        TensorMap(0, "float64", rows=8, cols=64, box_rows=8, box_cols=8)


def test_the_wgmma_template_is_part_of_the_version(tmp_path, monkeypatch):
    before = SPEC.version
    copy = tmp_path / "matmul_wgmma.cu"
    copy.write_text(WGMMA_TEMPLATE.read_text() + "\n// changed\n")
    other = type(SPEC)()
    monkeypatch.setattr(type(other), "extra_templates", (copy,))
    assert other.version != before


def test_default_configs_stay_on_mma_sync():
    """The default must run on every GPU: it never takes the sm_90-only path."""
    for spec in SPECS:
        for shape in ((1, 1, 1), SHAPE, (8192, 768, 3072), (8192, 50257, 768)):
            for dtype in spec.dtypes:
                assert spec.default_config(shape, dtype)["ENGINE"] == "mma"
    assert math.ceil(4096 / 128) ** 2 > PERSISTENT_CTAS


@pytest.mark.parametrize(
    ("spec", "config", "box_rows"),
    [
        (SPEC, wgmma_cfg(STAGES=3, EPILOGUE=1), 64),  # 2 consumers of 64 rows
        (NT, wgmma_cfg(BM=256, BN=128, STAGES=3, EPILOGUE=1), 128),  # 2 consumers of 128
        (TN, wgmma_cfg(BM=64, BN=256, EPILOGUE=1, CLUSTER_M=2), 64),  # 1 consumer
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_the_tma_store_epilogue_declares_a_map_of_c(spec, config, box_rows):
    """EPILOGUE=1: the kernel takes C's map after A's and B's (C, M, N, K still follow); its
    boxes are 64 columns (one 128-byte swizzle row) by one consumer's rows."""
    shape = (296, 136, 200)
    assert spec.check(config, shape, "float16") is None
    (step,) = spec.steps(config, shape, "float16")
    a, b, c, *rest = step.args
    assert rest == [2, 3, 4, 5]
    assert step.tensor_maps == (a, b, c)
    assert (c.array, c.rows, c.cols, c.box_rows, c.box_cols, c.swizzle) == (
        2, 296, 136, box_rows, 64, 128,
    )  # fmt: skip
    problem = spec.make_problem(shape, "float16", __import__("numpy").random.default_rng(0))
    assert problem.args[2].shape == (c.rows, c.cols)


def test_the_tma_store_epilogue_needs_a_16_byte_pitch_of_c():
    """C's pitch is N: NT with N = 50257 keeps its register-epilogue configs only."""
    shape = (8192, 50257, 768)
    configs = wgmma_valid(NT, shape, "bfloat16")
    assert configs and {c["EPILOGUE"] for c in configs} == {0}
    assert "C's is 50257" in NT.check(wgmma_cfg(STAGES=3, EPILOGUE=1), shape, "bfloat16")
    assert NT.check(wgmma_cfg(STAGES=3, EPILOGUE=1), (8192, 50264, 768), "bfloat16") is None


def test_the_output_tile_counts_against_shared_memory():
    """The staged C tile takes stages away: 128 x 256 keeps 3 of 48 KiB beside its 64 KiB,
    128 x 128 all 6 of 32 KiB beside its 32 KiB."""

    def most_stages(**kw):
        ok = [s for s in range(2, 7) if SPEC.check(wgmma_cfg(STAGES=s, **kw), SHAPE, "float16")
              is None]  # fmt: skip
        return max(ok)

    assert most_stages() == 4 and most_stages(EPILOGUE=1) == 3
    assert most_stages(BN=128) == 6 and most_stages(BN=128, EPILOGUE=1) == 6
    assert most_stages(BM=256, BN=128, EPILOGUE=1) == 3


SPLIT_SHAPE = (768, 3072, 8192)  # 72 tiles of 128 x 256: under one wave of 132 SMs


@pytest.mark.parametrize(
    ("config", "shape", "reason"),
    [
        (wgmma_cfg(SPLIT_K=2, CLUSTER_M=2), SPLIT_SHAPE, "CLUSTER_M 1, PERSISTENT 0"),
        (wgmma_cfg(SPLIT_K=2, EPILOGUE=1, STAGES=3), SPLIT_SHAPE, "EPILOGUE 0"),
        (wgmma_cfg(SPLIT_K=2, PERSISTENT=1), (8192, 3072, 768), "PERSISTENT 0"),
        (wgmma_cfg(SPLIT_K=2), SHAPE, "two waves"),  # 512 tiles
        (wgmma_cfg(SPLIT_K=4), (768, 3072, 192), "a CTA would get none"),  # 3 k blocks
    ],
)
def test_check_rejects_split_k_where_it_cannot_run_or_add(config, shape, reason):
    assert reason in SPEC.check(config, shape, "bfloat16")


def test_split_k_configs_of_an_under_one_wave_shape():
    """matmul_tn 768 x 3072 x 8192 (a weight gradient): every tile class with fewer than two
    waves of tiles splits 2, 3 and 4 ways; splits render their own source."""
    configs = wgmma_valid(TN, SPLIT_SHAPE, "bfloat16")
    split = [c for c in configs if c["SPLIT_K"] > 1]
    assert {c["SPLIT_K"] for c in split} == {2, 3, 4}
    assert all(c["CLUSTER_M"] == 1 and not c["PERSISTENT"] and not c["EPILOGUE"] for c in split)
    # the tiles that leave fewer than two waves: 72 or 144 of them (64 x 128 has 288)
    tiles = {(c["BM"], c["BN"]) for c in split}
    assert tiles == {(128, 256), (256, 128), (64, 256), (128, 128), (256, 64)}
    c = wgmma_cfg(SPLIT_K=3)
    assert "#define SPLIT_K 3" in TN.render(c, SPLIT_SHAPE, "bfloat16")
    assert TN.render(c, SPLIT_SHAPE, "bfloat16") != TN.render(
        {**c, "SPLIT_K": 1}, SPLIT_SHAPE, "bfloat16"
    )


def test_the_split_k_receive_buffer_fits_the_stages_of_every_tile():
    """The template reuses the stage memory for the partial sums (its static_assert): the
    largest, 3 others' 256 x 128 halves (96 KiB), fills 2 stages of 48 KiB exactly."""
    from kato.kernels.matmul import wgmma_split_buffer_bytes

    assert wgmma_split_buffer_bytes(wgmma_cfg(BM=256, BN=128, SPLIT_K=4)) == 2 * 48 * 1024
    for c in wgmma_valid(TN, SPLIT_SHAPE, "bfloat16"):
        stages = c["STAGES"] * (c["BM"] + c["BN"]) * 128
        assert wgmma_split_buffer_bytes(c) <= stages
    with pytest.raises(KeyError):
        wgmma_split_buffer_bytes({"BN": 128, "SPLIT_K": 2})  # BM missing: no silent default


def test_pingpong_gives_each_consumer_whole_tiles():
    """PINGPONG=1: two consumers (also for BM 64) each holding a whole BM x BN tile, so the
    tiles are those of at most 128 accumulators; persistent only (a CTA needs several tiles);
    with EPILOGUE 1 a staged C tile per consumer, stored in boxes of BM rows."""
    from kato.kernels.matmul import wgmma_rows_per_consumer

    configs = [c for c in wgmma_valid(SPEC, SHAPE, "bfloat16") if c["PINGPONG"]]
    tiles = {(c["BM"], c["BN"]) for c in configs}
    assert tiles == {(64, 64), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64)}
    assert all(c["PERSISTENT"] and c["SPLIT_K"] == 1 for c in configs)
    assert "accumulators" in SPEC.check(wgmma_cfg(PINGPONG=1, PERSISTENT=1), SHAPE, "bfloat16")
    assert "PERSISTENT 1" in SPEC.check(wgmma_cfg(BN=128, PINGPONG=1), SHAPE, "bfloat16")
    pp = wgmma_cfg(BM=64, BN=256, PINGPONG=1, PERSISTENT=1, EPILOGUE=1)
    assert SPEC.check(pp, SHAPE, "bfloat16") is None
    assert threads_per_block(pp) == 384 and wgmma_accumulators(pp) == 128
    assert wgmma_rows_per_consumer(pp) == 64
    assert wgmma_shared_bytes(pp) == 4 * (64 + 256) * 128 + 2 * 64 * 256 * 2 + 1024
    (step,) = SPEC.steps(pp, SHAPE, "bfloat16")
    assert step.tensor_maps[2].box_rows == 64
    big = wgmma_cfg(BM=128, BN=128, STAGES=3, PINGPONG=1, PERSISTENT=1, EPILOGUE=1)
    assert SPEC.steps(big, SHAPE, "bfloat16")[0].tensor_maps[2].box_rows == 128
    src = SPEC.render(pp, SHAPE, "bfloat16")
    assert "#define PINGPONG 1" in src and "#define CONSUMERS 2" in src
    assert "#define CONSUMER_REGS 232" in src


# --- stream-K (STREAM_K 1) ---------------------------------------------------------------------

#: Issue 32's shape: 72 tiles of 128 x 256 (144 of 128 x 128) for 132 SMs, 128 k blocks.
STREAM_K_SHAPE = (768, 3072, 8192)


def stream_k_cfg(**kw):
    return wgmma_cfg(STREAM_K=1, PERSISTENT=1, **kw)


@pytest.mark.parametrize(
    ("config", "shape", "reason"),
    [
        (wgmma_cfg(STREAM_K=1), STREAM_K_SHAPE, "STREAM_K=1 takes PERSISTENT 1"),
        (stream_k_cfg(CLUSTER_M=2), STREAM_K_SHAPE, "CLUSTER_M 1, SPLIT_K 1 and PINGPONG 0"),
        (stream_k_cfg(SPLIT_K=2), STREAM_K_SHAPE, "CLUSTER_M 1, SPLIT_K 1 and PINGPONG 0"),
        (stream_k_cfg(BN=128, PINGPONG=1), STREAM_K_SHAPE, "SPLIT_K 1 and PINGPONG 0"),
        # 12 x 11 tiles of 128 x 256: one whole wave, nothing to balance
        (stream_k_cfg(), (1536, 2816, 8192), "132 tiles are whole waves"),
        (stream_k_cfg(), (3072, 2816, 64), "264 tiles are whole waves"),
        # 4096^2 in 128 x 128: 1024 tiles, past STREAM_K_MAX_TILES (528)
        (stream_k_cfg(BN=128), (4096, 4096, 4096), "1024 tiles make 4 waves or more"),
        (stream_k_cfg(BM=64, BN=64), STREAM_K_SHAPE, "576 tiles make 4 waves"),
        # 72 tiles x 1 k block for 132 CTAs
        (stream_k_cfg(), (768, 3072, 64), "72 tile k blocks for 132 CTAs"),
    ],
)
def test_check_rejects_stream_k_where_it_cannot_run_or_help(config, shape, reason):
    assert reason in (SPEC.check(config, shape, "bfloat16") or "")


def test_stream_k_is_a_wgmma_tunable():
    mma = SPEC.default_config(STREAM_K_SHAPE, "bfloat16")
    assert mma["ENGINE"] == "mma" and mma["STREAM_K"] == 0
    reason = SPEC.check({**mma, "STREAM_K": 1}, STREAM_K_SHAPE, "bfloat16")
    assert "STREAM_K is a wgmma tunable, pinned to 0" in reason
    assert "float16 or bfloat16" in SPEC.check(stream_k_cfg(), STREAM_K_SHAPE, "float32")
    assert "missing parameter STREAM_K" in SPEC.check(
        {k: v for k, v in wgmma_cfg().items() if k != "STREAM_K"}, SHAPE, "bfloat16"
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_stream_k_configs_of_the_issue_shape(spec):
    """Every tile but 64 x 64 (576 tiles) at 768 x 3072 x 8192, with either epilogue, only
    persistent, unclustered, unsplit and without ping-pong; 128 x 256 too although its 72
    tiles make PERSISTENT alone invalid (a grid of one CTA per tile is the same launch)."""
    configs = [c for c in wgmma_valid(spec, STREAM_K_SHAPE, "bfloat16") if c["STREAM_K"]]
    tiles = {(c["BM"], c["BN"]) for c in configs}
    assert tiles == {(m, n) for m in (64, 128, 256) for n in (64, 128, 256)} - {
        (256, 256),
        (64, 64),
    }
    assert {c["EPILOGUE"] for c in configs} == {0, 1}
    for c in configs:
        assert (c["PERSISTENT"], c["CLUSTER_M"], c["SPLIT_K"], c["PINGPONG"]) == (1, 1, 1, 0)
    wide = stream_k_cfg()
    assert spec.check(wide, STREAM_K_SHAPE, "bfloat16") is None
    assert "PERSISTENT=1 launches what" in spec.check(
        {**wide, "STREAM_K": 0}, STREAM_K_SHAPE, "bfloat16"
    )
    # two k blocks per tile: 144 iterations, one or two per CTA
    assert spec.check(wide, (768, 3072, 104), "bfloat16") is None


@pytest.mark.parametrize(
    ("config", "shape", "grid"),
    [
        (stream_k_cfg(), STREAM_K_SHAPE, PERSISTENT_CTAS),
        (stream_k_cfg(BN=128, EPILOGUE=1, STAGES=3), STREAM_K_SHAPE, PERSISTENT_CTAS),
        (stream_k_cfg(), (128, 256, 64 * 131), 131),  # one tile of 131 k blocks
        (stream_k_cfg(), (768, 3072, 64), 72),  # fewer iterations than SMs (check refuses)
    ],
)
def test_stream_k_launch_is_one_cta_per_sm(config, shape, grid):
    """STREAM_K=1 launches PERSISTENT_CTAS CTAs (fewer only where there are fewer tile k
    blocks, which check() refuses) of the config's threads and shared memory: its workspace
    is the module's, not shared memory; the arguments are every config's."""
    launch = SPEC.launch(config, shape, "bfloat16")
    plain = SPEC.launch({**config, "STREAM_K": 0, "PERSISTENT": 0}, shape, "bfloat16")
    assert launch.grid == (grid, 1, 1)
    assert (launch.block, launch.shared_bytes) == (plain.block, plain.shared_bytes)
    (step,) = SPEC.steps(config, shape, "bfloat16")
    (plain_step,) = SPEC.steps({**config, "STREAM_K": 0}, shape, "bfloat16")
    assert step.args == plain_step.args and step.launch == launch


def test_stream_k_renders_its_macros_only_when_on():
    """STREAM_K=1 defines STREAM_K and its workspace's capacity (PERSISTENT_CTAS slots,
    STREAM_K_MAX_TILES counters); STREAM_K=0 renders what the configs before the parameter
    did: no macro at all."""
    from kato.kernels.matmul import STREAM_K_MAX_TILES, stream_k_workspace_bytes

    off = wgmma_cfg(PERSISTENT=1)
    on = {**off, "STREAM_K": 1}
    src_off = TN.render(off, STREAM_K_SHAPE, "bfloat16")
    src_on = TN.render(on, STREAM_K_SHAPE, "bfloat16")
    head_off, template = src_off.split("\n// Hopper GEMM", 1)
    head_on, template_on = src_on.split("\n// Hopper GEMM", 1)
    assert template_on == template and "STREAM_K" not in head_off
    assert head_on.splitlines() == [
        *head_off.splitlines(),
        "#define STREAM_K 1",
        f"#define STREAM_K_CTAS {PERSISTENT_CTAS}",
        f"#define STREAM_K_MAX_TILES {STREAM_K_MAX_TILES}",
    ]
    assert STREAM_K_MAX_TILES == 4 * PERSISTENT_CTAS
    # 132 slots of 128 x 256 floats and 528 tiles x 2 consumers' counters
    assert stream_k_workspace_bytes(on) == 132 * 128 * 256 * 4 + 528 * 2 * 4
    assert stream_k_workspace_bytes(off) == 0


def test_stream_k_doubles_only_the_wgmma_candidates():
    """The candidates list STREAM_K 0 for every mma.sync config and both values for wgmma."""
    found = SPEC.candidates(STREAM_K_SHAPE, "bfloat16")
    assert {c["STREAM_K"] for c in found if c["ENGINE"] == "mma"} == {0}
    wgmma = [c for c in found if c["ENGINE"] == "wgmma"]
    assert sum(c["STREAM_K"] for c in wgmma) * 2 == len(wgmma)


def test_stream_k_needs_a_gpu_with_an_sm_for_each_of_its_ctas():
    """Stream-K's owners wait on later CTAs' partial sums, so its whole grid must be resident:
    a GPU of fewer SMs than PERSISTENT_CTAS (the catalog's H100 PCIe, 114) refuses it before
    compiling, through the backends' device check, while the same config runs on an H100 SXM;
    configs without stream-K are the spec's business alone."""
    config = stream_k_cfg()
    assert SPEC.check(config, STREAM_K_SHAPE, "bfloat16") is None
    assert SPEC.check_sms(config, PERSISTENT_CTAS) is None
    assert "114 SMs" in SPEC.check_sms(config, 114)
    assert SPEC.check_sms({**config, "STREAM_K": 0}, 114) is None
    pcie, sxm = find_gpu("H100 PCIe"), find_gpu("H100 SXM")
    assert "resident" in check_on_gpu(SPEC, STREAM_K_SHAPE, "bfloat16", pcie, config)
    assert check_on_gpu(SPEC, STREAM_K_SHAPE, "bfloat16", sxm, config) is None
