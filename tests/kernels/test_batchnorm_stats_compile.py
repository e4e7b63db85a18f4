"""batchnorm_stats variants compile for sm_90 and sm_80 (a covering sample; every distinct one with
``KATO_COMPILE_FULL=1``) with sane resources.

The source depends neither on the shape nor on STRATEGY and SPLIT (launch choices), so one
representative shape per dtype (VEC up to 16 bytes valid) reaches every variant; each variant
holds all three kernels (partial, finalize, fused). Batched through compile_harness.py
(``compile_covering``; per dtype and register cap the variant with the most bytes a step), and
the plane split's heaviest variants (plane_split_sample.py: H*W = 49, not a multiple of VEC).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_harness import Outcome, Variant, compile_covering, distinct_variants
from kato.kernels import DTYPES, get_operator
from kato.kernels.batchnorm_stats import FINALIZE_THREADS, register_cap, static_shared_bytes
from kato.tuner.nvcc import nvcc_available
from plane_split_sample import plane_split_sample

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("batchnorm_stats")
SHAPE = (32, 256, 56, 56)
AWKWARD = ((1, 1, 1, 1), (16, 2048, 7, 7), (2, 5, 1, 1000003), (256, 64, 112, 112))


def heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, register cap): the most bytes a thread loads per step."""
    c = v.config
    return (v.dtype, register_cap(c)), c["UNROLL"] * c["VEC"] * DTYPES[v.dtype][2]


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    defaults = [
        Variant(SPEC, SPEC.default_config(shape, dtype), shape, dtype)
        for dtype in SPEC.dtypes
        for shape in AWKWARD
    ]
    every = distinct_variants(SPEC, [(SHAPE, d) for d in SPEC.dtypes])
    # Planes that are not whole vectors (H*W = 49): per dtype and cap the heaviest split.
    split = plane_split_sample(SPEC)
    return compile_covering(
        "batchnorm_stats",
        every,
        cubin_cache,
        heaviest=heaviest,
        extra=defaults + split,
        pairs=sample_pairs,
    )


def test_distinct_sources_per_dtype_are_bounded() -> None:
    for dtype in SPEC.dtypes:
        n = len(distinct_variants(SPEC, [(SHAPE, dtype)]))
        assert 20 < n <= 150, (dtype, n)


def test_the_plane_split_is_compiled(outcomes: list[Outcome]) -> None:
    split = [
        o
        for o in outcomes
        if "PLANE_SPLIT" in SPEC.defines(o.variant.config, o.variant.shape, o.variant.dtype)
    ]
    assert {(o.variant.dtype, register_cap(o.variant.config)) for o in split} >= {
        (d, 64) for d in SPEC.dtypes
    }


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
