"""layernorm variants compile for sm_90 and sm_80 (a covering sample; every distinct one with
``KATO_COMPILE_FULL=1``) with sane ptxas resources.

"Every variant": every config ``check`` accepts at one representative shape per dtype
(4096 x 4096), one per distinct rendered source (CACHE=0/1 sources do not depend on the shape,
CACHE=2 ones only through ITEMS/WB_REGS, GROUP_ROWS never reaches the source, and warp-mode
sources depend on BLOCK_SIZE/MIN_BLOCKS only through the register cap), plus the defaults of
awkward shapes (short rows in registers with several rows per warp, odd widths, huge rows).
Batched through tests/kernels/compile_harness.py (``compile_covering``: every parameter value
in every dtype, every pair of values under ``-m slow``, and per dtype, register cap and CACHE
the variant with the largest row cache, the spill boundary).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_harness import ARCHS as HARNESS_ARCHS
from compile_harness import Outcome, Variant, compile_covering, distinct_variants
from kato.kernels import DTYPES, get_operator
from kato.kernels.layernorm import (
    SPLIT_STATS_KERNEL,
    cache_registers,
    register_cap,
    static_shared_bytes,
)
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("layernorm")
SHAPE = (4096, 4096)
AWKWARD = (
    (1, 1),
    (3000, 3001),
    (7, 1000003),
    (1048576, 128),
    (65536, 128),
    (65536, 1024),
    (8192, 32768),
    (64, 200),
)
MAX_SOURCES_PER_DTYPE = 160


def heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, register cap, CACHE): the largest row cache, where a spill would show."""
    cached = cache_registers(v.config, v.shape[1], DTYPES[v.dtype][2])
    return (v.dtype, register_cap(v.config), v.config["CACHE"]), cached


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    defaults = [
        Variant(SPEC, SPEC.default_config(shape, dtype), shape, dtype)
        for dtype in SPEC.dtypes
        for shape in AWKWARD
    ]
    every = distinct_variants(SPEC, [(SHAPE, d) for d in SPEC.dtypes])
    return compile_covering(
        "layernorm", every, cubin_cache, heaviest=heaviest, extra=defaults, pairs=sample_pairs
    )


def test_distinct_sources_per_dtype_are_bounded() -> None:
    for dtype in SPEC.dtypes:
        n = len(distinct_variants(SPEC, [(SHAPE, dtype)]))
        assert 50 < n <= MAX_SOURCES_PER_DTYPE, (dtype, n)


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    bad = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_registers_respect_the_launch_bounds(outcomes: list[Outcome]) -> None:
    bad = []
    for o in outcomes:
        if o.error is None:
            regs = o.resources[SPEC.kernel_name].registers
            if not 1 <= regs <= register_cap(o.variant.config):
                bad.append(f"{o.arch} {o.variant}: {regs} > {register_cap(o.variant.config)}")
    assert not bad, "\n".join(bad[:10])


def test_register_cache_never_spills(outcomes: list[Outcome]) -> None:
    """check() rejects CACHE=2 configs whose row cannot stay in registers and WB_REGS is only
    set where weight and bias fit too; the rest must not spill."""
    bad = [
        f"{o.arch} {o.variant}: {r.spill_bytes} spill bytes, {r.registers} registers"
        for o in outcomes
        if o.error is None
        and o.variant.config["CACHE"] == 2
        and (r := o.resources[SPEC.kernel_name]).spill_bytes
    ]
    assert not bad, "\n".join(bad[:10])


def test_static_shared_memory_matches_the_spec(outcomes: list[Outcome]) -> None:
    bad = [
        f"{o.arch} {o.variant}: {r.shared_static_bytes} vs {static_shared_bytes(o.variant.config)}"
        for o in outcomes
        if o.error is None
        and (r := o.resources[SPEC.kernel_name]).shared_static_bytes
        != static_shared_bytes(o.variant.config)
    ]
    assert not bad, "\n".join(bad[:10])


def test_streaming_spills_stay_small(outcomes: list[Outcome]) -> None:
    """Streaming variants (CACHE 0/1) may spill under a tight MIN_BLOCKS cap (the tuner measures
    them). Without one, ptxas spills at most a few registers' worth (28 bytes seen on sm_90 for
    4-byte half vectors, 8 in flight)."""
    bad = [
        f"{o.arch} {o.variant}: {r.spill_bytes} spill bytes"
        for o in outcomes
        if o.error is None
        and o.variant.config["CACHE"] != 2
        and register_cap(o.variant.config) == 255
        and (r := o.resources[SPEC.kernel_name]).spill_bytes > 64
    ]
    assert not bad, "\n".join(bad[:10])


# --- few long rows: GROUP_ROWS=0 (a block per piece, two kernels) -----------------------------
#
# Split variants are valid only where rows are few and long, so they are enumerated at two such
# shapes per dtype: whole-vector rows, and rows with a scalar head and tail (ROW_SPLIT). Their
# source depends on the shape only through ROW_SPLIT. compile_harness's covering sample (every
# one with FULL), both kernels of each, for every arch of KATO_COMPILE_TEST_ARCHS.

SPLIT_ROW_SHAPES = ((8, 2**20), (8, 2**20 + 1))


def split_row_variants() -> list[Variant]:
    """Every distinct GROUP_ROWS=0 source of SPLIT_ROW_SHAPES, every dtype."""
    cases = [(shape, dtype) for dtype in SPEC.dtypes for shape in SPLIT_ROW_SHAPES]
    return [v for v in distinct_variants(SPEC, cases) if v.config["GROUP_ROWS"] == 0]


@pytest.fixture(scope="module")
def split_outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    variants = split_row_variants()
    return compile_covering("layernorm GROUP_ROWS=0", variants, cubin_cache, pairs=sample_pairs)


def test_split_variants_cover_the_space(split_outcomes: list[Outcome]) -> None:
    found = split_row_variants()
    # One source per (dtype, BLOCK_SIZE, VEC, launch bounds, ROW_SPLIT) that check() admits.
    assert len(found) > 40
    assert {o.variant.dtype for o in split_outcomes} == set(SPEC.dtypes)
    assert {o.arch for o in split_outcomes} == set(HARNESS_ARCHS)
    for key in ("BLOCK_SIZE", "VEC"):
        assert {o.variant.config[key] for o in split_outcomes} == set(SPEC.params[key]), key
    assert {bool(o.variant.shape[1] % o.variant.config["VEC"]) for o in split_outcomes} == {
        True,
        False,
    }


def test_split_variants_compile_both_kernels_within_bounds(split_outcomes: list[Outcome]) -> None:
    """Both kernels of every split variant compile, within the register cap of their launch
    bounds, with the static shared memory the spec counts; spills are printed (a streaming
    pass holds no row data: a few spilled bytes cost little there, as for block mode)."""
    bad = [f"{o.arch} {o.variant}: {o.error}" for o in split_outcomes if o.error]
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])
    for o in split_outcomes:
        assert set(o.resources) == {SPEC.kernel_name, SPLIT_STATS_KERNEL}, o.variant
        for name, res in o.resources.items():
            cap = register_cap(o.variant.config)
            assert 1 <= res.registers <= cap, f"{o.arch} {o.variant} {name}: {res.registers}"
            assert res.shared_static_bytes == static_shared_bytes(o.variant.config), o.variant
            if res.spill_bytes:
                print(f"  {o.arch} {o.variant} {name}: {res.spill_bytes} spill bytes")
