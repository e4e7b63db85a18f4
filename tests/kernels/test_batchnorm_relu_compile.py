"""The fused batchnorm + relu variants (``batchnorm_relu``, ``batchnorm_add_relu`` and their
backwards: batchnorm.cu / batchnorm_backward.cu with BN_RELU 1 and 2; all four kernels of each)
compile for sm_90 and sm_80 with sane ptxas resources: registers within each kernel's launch
bounds, no spills (check() rejects what would spill), static shared memory as modelled. (With
APPLY=1 the apply kernel is compiled empty: it is never launched.) As
test_batchnorm_train_compile.py, with a smaller sample: the epilogue adds a stream (the
residual, y) or a few registers (the recomputed mask) to the same kernels, so per (dtype, APPLY,
register cap of the reduction kernels) only the variant with the most registers in flight, plus
every VEC and APPLY_VEC in every dtype (every triple under ``-m slow``) and the defaults of
awkward shapes, plus the plane splits' heaviest variants (plane_split_sample.py: H*W = 49, not
a multiple of the vector width).

The source depends neither on the shape nor on STRATEGY, SPLIT and APPLY_BLOCK (launch
choices), so one shape per dtype whose H*W every VEC divides reaches every variant: 150 to 300
distinct sources per operator and dtype, more than CI's 2 cores compile in a minute. CI compiles
a covering sample as test_batchnorm_train_compile.py does (``-m slow``: per group the heaviest
variant and every (dtype, VEC, APPLY_VEC) triple), plus the default configs of awkward shapes;
``KATO_COMPILE_FULL=1`` compiles every distinct variant for sm_90 and sm_80
(benchmarks/h200_training_ops.sh does), CI for sm_90 only; ``KATO_COMPILE_TEST_ARCHS`` overrides
the archs.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
from compile_harness import (
    Outcome,
    Variant,
    compile_variants,
    covering_sample,
    distinct_variants,
    with_every_value,
)
from kato.kernels import DTYPES, get_operator
from kato.kernels.batchnorm.channelwise import APPLY_REGISTER_CAP, FINALIZE_THREADS
from kato.kernels.batchnorm_stats import register_cap
from kato.kernels.limits import launch_bounds_register_cap
from kato.tuner.nvcc import nvcc_available
from plane_split_sample import plane_split_sample, split_coverage

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPECS = tuple(
    get_operator(name)
    for name in (
        "batchnorm_relu",
        "batchnorm_add_relu",
        "batchnorm_relu_backward",
        "batchnorm_add_relu_backward",
    )
)
FORWARDS = ("batchnorm_relu", "batchnorm_add_relu")
SHAPE = (32, 256, 56, 56)
AWKWARD = (
    (1, 1, 1, 2),
    (16, 2048, 7, 7),
    (2, 5, 1, 1000003),
    (256, 64, 56, 56),
    (128, 512, 7, 7),
    (1000, 3, 1, 1),
)
FULL = os.environ.get("KATO_COMPILE_FULL") == "1"
# The epilogue is the same code on every arch, and test_batchnorm_train_compile.py compiles the
# templates for both: CI compiles the fused sample for sm_90 only (KATO_COMPILE_FULL: both).
ARCHS = tuple(
    os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_90,sm_80" if FULL else "sm_90").split(",")
)


def pressure(v: Variant) -> int:
    itemsize = DTYPES[v.dtype][2]
    return v.spec.reduction_registers(v.config, itemsize) + v.spec.apply_registers(
        v.config, itemsize
    )


def _heaviest(v: Variant) -> tuple[tuple, int]:
    """Per (dtype, APPLY, register cap of the reduction kernels): the most registers in flight."""
    return (v.dtype, v.config["APPLY"], register_cap(v.config)), pressure(v)


@functools.cache
def sample(spec, pairs: bool = False) -> list[Variant]:
    """The variants compiled for ``spec`` (built once, on first use: not at collection)."""
    every = distinct_variants(spec, [(SHAPE, d) for d in spec.dtypes])
    if FULL:
        chosen = list(every)
    elif not pairs:
        chosen = with_every_value(
            covering_sample(every, heaviest=_heaviest, full=False), every, ("VEC", "APPLY_VEC")
        )
    else:
        groups: dict[tuple, list[Variant]] = {}
        for v in every:
            key = (v.dtype, v.config["APPLY"], register_cap(v.config))
            groups.setdefault(key, []).append(v)
        chosen = []
        for members in groups.values():
            members.sort(key=pressure)
            chosen.append(members[-1])
        triples = {(v.dtype, v.config["VEC"], v.config["APPLY_VEC"]) for v in chosen}
        for v in every:
            triple = (v.dtype, v.config["VEC"], v.config["APPLY_VEC"])
            if triple not in triples:
                triples.add(triple)
                chosen.append(v)
    sources = {v.source() for v in chosen}
    for dtype in spec.dtypes:
        for shape in AWKWARD:
            v = Variant(spec, spec.default_config(shape, dtype), shape, dtype)
            if v.source() not in sources:
                sources.add(v.source())
                chosen.append(v)
    # Planes that are not whole vectors (H*W = 49): the plane splits' heaviest variants.
    for v in plane_split_sample(spec):
        if v.source() not in sources:
            sources.add(v.source())
            chosen.append(v)
    return chosen


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    variants = [v for spec in SPECS for v in sample(spec, sample_pairs)]
    start = time.perf_counter()
    found = compile_variants(variants, ARCHS[:1], cubin_cache, batch=32)
    # The other archs: every variant with FULL or -m slow's pairs, every other one by default.
    rest = variants if FULL or sample_pairs else variants[::2]
    if ARCHS[1:]:
        found += compile_variants(rest, ARCHS[1:], cubin_cache, batch=32)
    print(
        f"\nbatchnorm(_add)_relu(_backward): {len(variants)} variants x {len(ARCHS)} archs in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return found


def test_distinct_sources_are_bounded_and_the_sample_covers_them() -> None:
    for spec in SPECS:
        for dtype in spec.dtypes:
            every = distinct_variants(spec, [(SHAPE, dtype)])
            assert 60 < len(every) <= 400, (spec.name, dtype, len(every))
        chosen = sample(spec)
        assert {(v.dtype, v.config["APPLY"]) for v in chosen} == {
            (d, a) for d in spec.dtypes for a in (0, 1)
        }
        assert {register_cap(v.config) for v in chosen} == {64, 128, 255}
        assert len(chosen) <= 100 or FULL, (spec.name, len(chosen))


def test_the_plane_splits_are_compiled() -> None:
    """Both splits, at every register cap of the reduction kernels, in every dtype."""
    for spec in SPECS:
        reduction, apply = split_coverage(spec, sample(spec))
        assert reduction == {(d, cap) for d in spec.dtypes for cap in (64, 128, 255)}, spec.name
        assert apply == set(spec.dtypes), spec.name


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    bad = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def _cap(spec, config, kernel: str) -> int:
    if kernel.endswith("_finalize"):
        return launch_bounds_register_cap(FINALIZE_THREADS, 0)
    if kernel.endswith("_apply"):
        return APPLY_REGISTER_CAP
    return register_cap(config)


def test_resources(outcomes: list[Outcome]) -> None:
    """Registers within the launch bounds and no spills for every kernel of every variant; static
    shared memory: the reduction's per-warp partials (12 bytes per warp for the forward's Welford
    triples, 8 for the backward's two sums) plus at most 16 bytes of flags and coefficients,
    nothing in the apply kernels."""
    bad = []
    for o in outcomes:
        if o.error is not None:
            continue
        spec, config = o.variant.spec, o.variant.config
        per_warp = 12 if spec.name in FORWARDS else 8
        for name in spec.kernel_names:
            r = o.resources[name]
            cap = _cap(spec, config, name)
            if not 1 <= r.registers <= cap:
                bad.append(f"{o.arch} {o.variant} {name}: {r.registers} registers, cap {cap}")
            if r.spill_bytes:
                bad.append(f"{o.arch} {o.variant} {name}: {r.spill_bytes} spill bytes")
            if name.endswith(("_partial", "_fused")):
                base = per_warp * (config["BLOCK_SIZE"] // 32)
                if not base <= r.shared_static_bytes <= base + 16:
                    bad.append(f"{o.arch} {o.variant} {name}: {r.shared_static_bytes} B static")
            elif r.shared_static_bytes:
                bad.append(f"{o.arch} {o.variant} {name}: {r.shared_static_bytes} B static")
    assert not bad, "\n".join(bad[:10])
