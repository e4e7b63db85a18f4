"""The Hopper wgmma GEMM template (kernels/matmul/matmul_wgmma.cu) builds for sm_90a in the
probe's variants (benchmarks/wgmma_probe.py) without spills or serialised wgmma, within the
register budget of its launch, and its shared memory fits; the probe's checker tells a right
result from a wrong one. No GPU: nvcc and ptxas only (the GPU run is the probe itself)."""

from __future__ import annotations

import pytest
import torch
from kato.tuner.nvcc import CompileError, nvcc_available

from benchmarks import wgmma_probe as probe

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

#: Max dynamic + static shared memory of one sm_90 block (227 KiB).
SM90_SHARED = 232448


def _builds(variants, dtypes, layouts):
    from kato.tuner.nvcc import CompileJob, compile_many

    source = probe.SOURCE.read_text()
    keys, jobs = [], []
    for variant in variants:
        for dtype in dtypes:
            for layout in layouts:
                keys.append((variant, dtype, layout))
                options = probe.compile_options(variant, dtype, layout)
                jobs.append(CompileJob(source, probe.KERNEL, probe.ARCH, options))
    return list(zip(keys, compile_many(jobs), strict=True))


def test_every_probe_variant_builds_without_spills_or_serialisation():
    """float16 nn for every variant, and the 128 x 256 two-consumer variants (with and without
    clusters) in every layout and both dtypes (the transpose immediates, the MN-major
    descriptors and the multicast shares of B change the code)."""
    by_name = {v.name: v for v in probe.VARIANTS}
    builds = _builds(probe.VARIANTS, ["float16"], ["nn"])
    every_layout = [by_name["m2_128x256_s4"], by_name["m2c2_128x256_s4"]]
    builds += _builds(every_layout, probe.DTYPES, ["nt", "tn"])
    for (variant, dtype, layout), result in builds:
        where = f"{variant.name} {dtype} {layout}"
        assert not isinstance(result, CompileError), f"{where}: {result}\n{result.log}"
        assert result.spill_bytes == 0 and result.local_bytes == 0, where
        assert "Performance Loss" not in result.log, f"{where}: {result.log}"
        # __launch_bounds__(threads, 1): 65536 registers shared by 128 * (CONSUMERS + 1).
        assert result.registers <= min(255, 65536 // variant.threads // 8 * 8), where
        assert variant.smem_bytes + result.shared_static_bytes <= SM90_SHARED, where


def test_setmaxnreg_budget_fits_the_register_file():
    """Producer and consumers after setmaxnreg must fit the registers the launch holds."""
    for variant in probe.VARIANTS:
        d = variant.defines
        if d["PRODUCER_REGS"]:
            total = 128 * d["PRODUCER_REGS"] + 128 * d["CONSUMERS"] * d["CONSUMER_REGS"]
            assert total <= 65536, variant.name


def test_template_rejects_a_tile_it_cannot_hold():
    """BN 256 with two m64 slices per consumer would need 256 accumulators per thread."""
    options = ("-DBM=256", "-DBN=256", "-DCONSUMERS=1", "-DSTAGES=2")
    from kato.tuner.nvcc import compile_kernel

    with pytest.raises(CompileError, match="accumulators"):
        compile_kernel(probe.SOURCE.read_text(), probe.KERNEL, probe.ARCH, options)


def test_checker_accepts_rounding_and_rejects_a_wrong_element():
    a = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    b = torch.randn(96, 80, generator=torch.Generator().manual_seed(1)) / 96**0.5
    ref = a @ b
    assert probe._check(torch, ref.to(torch.bfloat16), ref, "bfloat16")["ok"]
    assert probe._check(torch, ref.to(torch.float16), ref, "float16")["ok"]
    wrong = ref.clone()
    wrong[3, 5] += 0.5
    result = probe._check(torch, wrong.to(torch.float16), ref, "float16")
    assert not result["ok"]
    assert [r[:2] for r in result["first_bad"]] == [(3, 5)]
    assert result["bad_row_fraction"] == pytest.approx(1 / 64)


def test_probe_skips_shapes_whose_pitches_tma_cannot_address(tmp_path):
    """TMA needs 16-byte row pitches: nn with N = 50257 is skipped, nt keeps it (B is (N, K))."""
    variant = next(v for v in probe.VARIANTS if v.name == "m1_128x64")
    fake = {(variant.name, "float16", layout): _FakeCompiled() for layout in probe.LAYOUTS}
    shapes = [(8192, 50257, 768), (64, 72, 8)]
    (job,) = probe.build_jobs([variant], fake, tmp_path, shapes, ["float16"])
    kept = {(c["layout"], tuple(c["shape"])) for c in job.cases}
    assert ("nt", (8192, 50257, 768)) in kept
    assert ("nn", (8192, 50257, 768)) not in kept and ("tn", (8192, 50257, 768)) not in kept
    assert {("nn", (64, 72, 8)), ("nt", (64, 72, 8)), ("tn", (64, 72, 8))} <= kept


class _FakeCompiled:
    cubin = b"\0"


def test_cluster_grids_are_whole_clusters_of_cluster_tiles():
    by_name = {v.name: v for v in probe.VARIANTS}
    plain, clustered = by_name["m2_128x256_s4"], by_name["m2c2_128x256_s4"]
    # 1000 x 1000: 8 x 4 tiles of 128 x 256; clusters cover 256 x 256: 4 x 4 cluster tiles.
    assert plain.grid(1000, 1000, "tiles", 132) == 32
    assert clustered.grid(1000, 1000, "tiles", 132) == 32
    assert clustered.grid(1100, 1000, "tiles", 132) == 40  # 5 cluster rows, the last half out
    assert plain.grid(8192, 8192, "persistent", 132) == 132
    assert clustered.grid(8192, 8192, "persistent", 131) == 130


# --- the operator's wgmma configs (kernels/matmul, ENGINE="wgmma") ---------------------------

#: Every (BM, BN, CLUSTER_M) class the spec accepts, and the shape of each layout its configs
#: are taken at (every pitch a multiple of 8: the source does not depend on the shape).
WGMMA_SHAPE = (4096, 4096, 4096)


def _wgmma_classes(pairs: bool = True):
    """(spec, dtype, config): every tile x cluster class at its most stages in float16 for
    matmul, and for every layout and dtype the heaviest classes (128 x 256 and 256 x 128 with
    two consumers, with and without clusters, and the 64 x 256 ping-pong; with ``pairs``, the
    ``-m slow`` sample, also 64 x 256 and 128 x 128 unpaired and the 128 x 128 ping-pong)."""
    from kato.kernels import get_operator

    specs = [get_operator(n) for n in ("matmul", "matmul_nt", "matmul_tn")]

    def valid(spec, dtype):
        return [
            c
            for c in spec.candidates(WGMMA_SHAPE, dtype)
            if c["ENGINE"] == "wgmma" and spec.check(c, WGMMA_SHAPE, dtype) is None
        ]

    picked = {}
    for c in valid(specs[0], "float16"):
        key = (specs[0].name, "float16", c["BM"], c["BN"], c["CLUSTER_M"], c["EPILOGUE"])
        key += (c["PINGPONG"],)
        first = c["PERSISTENT"] == int(c["PINGPONG"])  # ping-pong is persistent only
        if first and c["STAGES"] >= picked.get(key, {"STAGES": 0})["STAGES"]:
            picked[key] = c
    for spec in specs:
        for dtype in ("float16", "bfloat16"):
            every = pairs or (spec.name, dtype) == ("matmul", "float16")
            heavy = {(128, 256), (256, 128)} | ({(64, 256), (128, 128)} if every else set())
            for c in valid(spec, dtype):
                if (c["BM"], c["BN"]) in heavy and c["STAGES"] == 3 and c["PERSISTENT"] == 0:
                    key = (spec.name, dtype, c["BM"], c["BN"], c["CLUSTER_M"], c["EPILOGUE"], 0)
                    picked[key] = c
                pp = (c["BM"], c["BN"], c["PINGPONG"], c["CLUSTER_M"]) in {
                    (64, 256, 1, 1),
                    *([(128, 128, 1, 1)] if every else []),
                }
                if pp and c["STAGES"] == 3:
                    key = (spec.name, dtype, c["BM"], c["BN"], 1, c["EPILOGUE"], 1)
                    picked[key] = c
    by_name = {s.name: s for s in specs}
    return [(by_name[key[0]], key[1], c) for key, c in sorted(picked.items())]


@pytest.fixture(scope="module")
def wgmma_builds(cubin_cache, sample_pairs):
    return _build(_wgmma_classes(sample_pairs), WGMMA_SHAPE, cubin_cache)


def _build(classes, shape, cubin_cache):
    """((spec, dtype, config), CompiledKernel) for each of ``classes``, built for an H200 at
    ``shape`` in parallel."""
    from kato.tuner.nvcc import compile_many

    jobs = [
        (spec.render(c, shape, dtype), spec.main_kernel(c), spec.arch_for(c, "sm_90"), ())
        for spec, dtype, c in classes
    ]
    return list(zip(classes, compile_many(jobs, cache_dir=cubin_cache), strict=True))


def _assert_clean(builds):
    """Every build compiled, without spills, local memory or ptxas's performance warning,
    within its launch's register budget, with the template's static shared memory."""
    from kato.kernels.matmul import WGMMA_STATIC_SHARED, threads_per_block

    for (spec, dtype, config), result in builds:
        where = f"{spec.name} {dtype} {config}"
        assert not isinstance(result, CompileError), f"{where}: {result}\n{result.log}"
        assert result.spill_bytes == 0 and result.local_bytes == 0, where
        assert "Performance Loss" not in result.log, f"{where}: {result.log}"
        assert result.registers <= min(255, 65536 // threads_per_block(config) // 8 * 8), where
        assert result.shared_static_bytes == WGMMA_STATIC_SHARED, where


def test_every_wgmma_config_class_is_built(wgmma_builds):
    classes = {(spec.name, dtype) for (spec, dtype, _), _ in wgmma_builds}
    assert classes == {
        (name, dtype)
        for name in ("matmul", "matmul_nt", "matmul_tn")
        for dtype in ("float16", "bfloat16")
    }
    tiles = {
        (c["BM"], c["BN"], c["CLUSTER_M"], c["EPILOGUE"], c["PINGPONG"])
        for (_, _, c), _ in wgmma_builds
    }
    # 8 tiles (not 256 x 256), 2-CTA clusters of the 5 with BN 128 or 256; each with both
    # epilogues (register stores, TMA stores); ping-pong: 6 tiles, 3 of them in clusters
    assert len(tiles) == (8 + 5) * 2 + (6 + 3) * 2, sorted(tiles)


def test_wgmma_configs_build_for_sm_90a_without_spills_within_their_budget(wgmma_builds):
    from kato.kernels.matmul import wgmma_shared_bytes

    _assert_clean(wgmma_builds)
    for (spec, dtype, config), result in wgmma_builds:
        # the spec's shared-memory model is what ptxas reports
        where = f"{spec.name} {dtype} {config}"
        assert wgmma_shared_bytes(config) + result.shared_static_bytes <= SM90_SHARED, where


def test_wgmma_source_does_not_build_for_plain_sm_90():
    """wgmma and setmaxnreg exist only in sm_90a code: the arch hook is what makes it build."""
    from kato.kernels import get_operator
    from kato.tuner.nvcc import compile_kernel

    spec = get_operator("matmul")
    (_, dtype, config) = next(c for c in _wgmma_classes() if c[0] is spec)
    with pytest.raises(CompileError):
        compile_kernel(spec.render(config, WGMMA_SHAPE, dtype), spec.main_kernel(config), "sm_90")


# --- split-K clusters (SPLIT_K > 1: partial sums through distributed shared memory) ---------

#: Fewer tiles than two waves (72 of 128 x 256), 128 k blocks: every split is valid.
SPLIT_SHAPE = (768, 3072, 8192)


def _split_classes():
    """(spec, dtype, config): every split of every tile that may split, at its fewest stages
    (the receive buffer reuses them: the tightest fit), float16 matmul_tn; and 128 x 256 split
    3 ways in every layout and dtype."""
    from kato.kernels import get_operator

    specs = [get_operator(n) for n in ("matmul", "matmul_nt", "matmul_tn")]
    picked = {}
    for spec in specs:
        for dtype in ("float16", "bfloat16"):
            for c in spec.candidates(SPLIT_SHAPE, dtype):
                if c["ENGINE"] != "wgmma" or c["SPLIT_K"] == 1:
                    continue
                if spec.check(c, SPLIT_SHAPE, dtype) is not None:
                    continue
                key = (spec.name, dtype, c["BM"], c["BN"], c["SPLIT_K"])
                every = spec.name == "matmul_tn" and dtype == "float16"
                wanted = every or (c["BM"], c["BN"], c["SPLIT_K"]) == (128, 256, 3)
                if wanted and (key not in picked or c["STAGES"] < picked[key][2]["STAGES"]):
                    picked[key] = (spec, dtype, c)
    return [picked[k] for k in sorted(picked)]


@pytest.fixture(scope="module")
def split_builds(cubin_cache):
    return _build(_split_classes(), SPLIT_SHAPE, cubin_cache)


def test_split_k_configs_build_for_sm_90a_without_spills(split_builds):
    # 5 tiles x 3 splits in float16 matmul_tn, and 128 x 256 / 3 in the 5 other layouts x dtypes
    assert len(split_builds) == 5 * 3 + 5
    _assert_clean(split_builds)


# --- stream-K (STREAM_K 1: ranges of tiles x k blocks, partial sums through a workspace) -----

#: Issue 32's under-one-wave shape: 72 tiles of 128 x 256 (1.09 waves of 128 x 128), 128 k
#: blocks; every tile but 64 x 64 (576 tiles: four waves or more) takes STREAM_K=1, which
#: 1000^3 adds (256 tiles). The source does not depend on the shape.
STREAM_K_SHAPE = (768, 3072, 8192)
STREAM_K_SHAPES = (STREAM_K_SHAPE, (1000, 1000, 1000))


def _stream_k_classes():
    """(spec, dtype, config): every STREAM_K=1 tile (at :data:`STREAM_K_SHAPES`) with each
    epilogue at its most stages in bfloat16 matmul_tn (the issue's layout), and the tiles of
    128 accumulators per consumer thread (128 x 256, 256 x 128: the reduction's register
    peak) at 3 stages in every other layout and dtype."""
    from kato.kernels import get_operator

    picked = {}
    for name in ("matmul", "matmul_nt", "matmul_tn"):
        spec = get_operator(name)
        for dtype in ("float16", "bfloat16"):
            every = (name, dtype) == ("matmul_tn", "bfloat16")
            found = [
                c
                for shape in STREAM_K_SHAPES
                for c in spec.candidates(shape, dtype)
                if c["ENGINE"] == "wgmma" and c["STREAM_K"] and not spec.check(c, shape, dtype)
            ]
            for c in found:
                key = (name, dtype, c["BM"], c["BN"], c["EPILOGUE"])
                if every and c["STAGES"] > picked.get(key, (0, 0, {"STAGES": 0}))[2]["STAGES"]:
                    picked[key] = (spec, dtype, c)
                heavy = (c["BM"], c["BN"]) in ((128, 256), (256, 128))
                if not every and heavy and c["STAGES"] == 3 and not c["EPILOGUE"]:
                    picked[key] = (spec, dtype, c)
    return [picked[k] for k in sorted(picked)]


@pytest.fixture(scope="module")
def stream_k_builds(cubin_cache):
    return _build(_stream_k_classes(), STREAM_K_SHAPE, cubin_cache)


def test_stream_k_configs_build_for_sm_90a_without_spills(stream_k_builds):
    """Every sampled STREAM_K=1 config builds without spills or local memory within the
    launch's register budget; its workspace is module globals (has_device_globals: kato_torch
    then loads it once per stream), the shared memory that of the same config without it."""
    from kato.tuner.cubin import has_device_globals

    # 8 tiles x 2 epilogues (bfloat16 matmul_tn; 128 x 256 and 256 x 128 with EPILOGUE 1 fit
    # only at fewer stages), and 2 tiles in each of the 5 other layouts x dtypes
    assert len(stream_k_builds) == 8 * 2 + 2 * 5
    _assert_clean(stream_k_builds)
    for (spec, dtype, config), result in stream_k_builds:
        assert has_device_globals(result.cubin), f"{spec.name} {dtype} {config}"


def test_stream_k_off_builds_a_module_without_globals(wgmma_builds):
    """STREAM_K=0 (every other wgmma config) keeps no state in the module: shared freely."""
    from kato.tuner.cubin import has_device_globals

    assert not any(has_device_globals(result.cubin) for _, result in wgmma_builds)
