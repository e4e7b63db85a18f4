"""Every distinct batchnorm_stats variant compiles for sm_80 and sm_90 with sane resources.

The source depends neither on the shape nor on STRATEGY and SPLIT (launch choices), so one
representative shape per dtype (VEC up to 16 bytes valid) reaches every variant; each variant
holds all three kernels (partial, finalize, fused). Batched through compile_harness.py;
``KATO_COMPILE_TEST_ARCHS=sm_90`` halves it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from compile_harness import Outcome, Variant, compile_variants, distinct_variants
from kato.kernels import get_operator
from kato.kernels.batchnorm_stats import FINALIZE_THREADS, register_cap, static_shared_bytes
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("batchnorm_stats")
SHAPE = (32, 256, 56, 56)
AWKWARD = ((1, 1, 1, 1), (16, 2048, 7, 7), (2, 5, 1, 1000003), (256, 64, 112, 112))
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_80,sm_90").split(","))


def all_variants() -> list[Variant]:
    variants = distinct_variants(SPEC, [(SHAPE, d) for d in SPEC.dtypes])
    seen = {v.source() for v in variants}
    for dtype in SPEC.dtypes:
        for shape in AWKWARD:
            v = Variant(SPEC, SPEC.default_config(shape, dtype), shape, dtype)
            if v.source() not in seen:
                seen.add(v.source())
                variants.append(v)
    return variants


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path) -> list[Outcome]:
    variants = all_variants()
    start = time.perf_counter()
    found = compile_variants(variants, ARCHS, cubin_cache, batch=48)
    print(
        f"\nbatchnorm_stats: {len(variants)} variants x {len(ARCHS)} archs in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return found


def test_distinct_sources_per_dtype_are_bounded() -> None:
    for dtype in SPEC.dtypes:
        n = len(distinct_variants(SPEC, [(SHAPE, dtype)]))
        assert 20 < n <= 150, (dtype, n)


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    bad = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_resources(outcomes: list[Outcome]) -> None:
    """Registers within the launch bounds, no spills (check() rejects what would spill),
    static shared memory as modelled, for every kernel of every variant."""
    bad = []
    for o in outcomes:
        if o.error is not None:
            continue
        for name in SPEC.kernel_names:
            r = o.resources[name]
            if name == "batchnorm_stats_finalize":
                cap = 65536 // FINALIZE_THREADS // 8 * 8
            else:
                cap = register_cap(o.variant.config)
            if not 1 <= r.registers <= min(cap, 255):
                bad.append(f"{o.arch} {o.variant} {name}: {r.registers} registers > {cap}")
            if r.spill_bytes:
                bad.append(f"{o.arch} {o.variant} {name}: {r.spill_bytes} spill bytes")
            want = static_shared_bytes(o.variant.config, name)
            if r.shared_static_bytes != want:
                bad.append(f"{o.arch} {o.variant} {name}: {r.shared_static_bytes} B, model {want}")
    assert not bad, "\n".join(bad[:10])
