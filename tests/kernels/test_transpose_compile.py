"""transpose variants compile for sm_90 and sm_80 (a covering sample, ``compile_covering``;
every valid one with ``KATO_COMPILE_FULL=1``) with the resources the spec models (the
kernel's logic runs on the CPU in test_transpose_emulation.py).

The source depends on the shape only through ALIGNED, so the valid configs of one shape per
dtype whose sizes are multiples of every vector width (8192 x 8192) and of one no vector width
divides (37 x 5: rows split at vector boundaries, ALIGNED=0; output rows mid sector, so SKEW=1
too) are every variant there is. ~150 variants per dtype, path and cache hint (``HINTS``),
batched by the compile harness; besides the covering sample, the SKEW=1 configs the issue's
shape is timed with (:data:`SKEW_TIMED`). The PTX of each ``HINTS`` has its cache qualifiers on
every global load and store, and otherwise the same accesses.
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

import pytest
from compile_harness import ARCHS, FULL, Outcome, Variant, compile_covering, distinct_variants
from kato.kernels import get_operator
from kato.kernels.transpose import (
    aligned,
    data_registers,
    register_cap,
    static_shared_bytes,
    threads,
)
from kato.tuner.nvcc import BASE_OPTIONS, nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("transpose")
CASES = [((8192, 8192), d) for d in SPEC.dtypes] + [((37, 5), d) for d in SPEC.dtypes]


#: SKEW=1 configs of the issue's odd shape (8191 x 8193) that the GPU session times against
#: their SKEW=0 twins: 64-wide tiles at every vector width, 4 and 8 vectors per thread.
SKEW_TIMED = [
    {"TILE": 64, "VEC": vec, "RPT": rpt, "SMEM": 1, "MIN_BLOCKS": mb, "HINTS": 2, "SKEW": 1}
    for vec in (1, 2, 4, 8)
    for rpt in (4, 8)
    for mb in (0, 4)
]


def skew_timed() -> list[Variant]:
    return [
        Variant(SPEC, c, (8191, 8193), dtype)
        for dtype in ("float32", "float16")
        for c in SKEW_TIMED
        if SPEC.check(c, (8191, 8193), dtype) is None
    ]


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    every = distinct_variants(SPEC, CASES)
    extra = [] if FULL else skew_timed()
    return compile_covering(
        "transpose",
        every,
        cubin_cache,
        heaviest=heaviest,
        extra=extra,
        batch=40,
        pairs=sample_pairs,
    )


def heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, path, register cap, SMEM, SKEW): the most data registers a thread holds."""
    is_aligned = aligned(v.config, v.shape)
    key = (v.dtype, is_aligned, register_cap(v.config), v.config["SMEM"], v.config["SKEW"])
    return key, data_registers(v.config, v.dtype, is_aligned)


def test_the_space_holds_every_variant() -> None:
    every = distinct_variants(SPEC, CASES)
    assert len(every) >= 3 * 100
    split = [v for v in every if not aligned(v.config, v.shape) and not v.config["SKEW"]]
    assert {(v.dtype, v.config["VEC"]) for v in split} >= {
        ("float32", 2),
        ("float32", 4),
        ("float16", 2),
        ("float16", 4),
        ("float16", 8),
    }
    # bfloat16 renders float16's sources (bits only).
    skewed = {(v.dtype, v.config["VEC"]) for v in every if v.config["SKEW"]}
    assert skewed == {("float32", 1), ("float32", 2), ("float32", 4)} | {
        ("float16", vec) for vec in (1, 2, 4, 8)
    }
    assert len(skew_timed()) >= 12


def test_the_sample_compiles_skewed_variants(outcomes: list[Outcome]) -> None:
    """SKEW=1 variants of every dtype and vector width, and the timed ones, on the first arch;
    some on every other arch."""
    skewed = [o for o in outcomes if o.variant.config["SKEW"]]
    for dtype in ("float32", "float16"):  # bfloat16 renders float16's sources
        widths = {o.variant.config["VEC"] for o in skewed if o.variant.dtype == dtype}
        assert widths == ({1, 2, 4} if dtype == "float32" else {1, 2, 4, 8}), (dtype, widths)
    assert {o.arch for o in skewed} == set(ARCHS)
    timed = {(v.dtype, tuple(v.config.items())) for v in skew_timed()}
    first = {
        (o.variant.dtype, tuple(o.variant.config.items())) for o in skewed if o.arch == ARCHS[0]
    }
    assert timed <= first


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    failed = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error]
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:5])


def test_resources_match_the_model(outcomes: list[Outcome]) -> None:
    """Registers within the launch bounds, no spills (check() rejects configs whose vectors
    would not fit), static shared memory exactly the modelled tile."""
    bad = []
    for o in outcomes:
        if o.error:
            continue
        res = o.resources["transpose_kernel"]
        config, dtype = o.variant.config, o.variant.dtype
        is_aligned = aligned(config, o.variant.shape)
        if not 1 <= res.registers <= register_cap(config):
            bad.append(f"{o.arch} {o.variant}: {res.registers} regs > {register_cap(config)}")
        if config["MIN_BLOCKS"] and res.registers * threads(config) * config["MIN_BLOCKS"] > 65536:
            bad.append(f"{o.arch} {o.variant}: {res.registers} regs break MIN_BLOCKS")
        if res.spill_bytes:
            bad.append(f"{o.arch} {o.variant}: {res.spill_bytes} spill bytes")
        if res.shared_static_bytes != static_shared_bytes(config, dtype, is_aligned):
            bad.append(
                f"{o.arch} {o.variant}: {res.shared_static_bytes} B shared, "
                f"spec {static_shared_bytes(config, dtype, is_aligned)}"
            )
    assert not bad, "\n".join(bad[:10])


#: A global load or store in PTX: the operation, its qualifiers, the vector and element type.
GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.(?:cs|nc|wb|cg|ca|lu|cv|wt))*)(\.v\d)?\.(\w+)")
#: Qualifiers per HINTS: (loads, stores).
QUALIFIERS = {0: (".cs", ".cs"), 1: (".cs", ""), 2: (".nc", "")}


@pytest.mark.parametrize(
    ("shape", "dtype", "config"),
    [
        ((8192, 8192), "float32", {"TILE": 64, "VEC": 4, "RPT": 4, "SMEM": 1, "MIN_BLOCKS": 4}),
        ((8191, 8193), "float32", {"TILE": 64, "VEC": 1, "RPT": 4, "SMEM": 2, "MIN_BLOCKS": 0}),
        ((8191, 8193), "float32", {"TILE": 64, "VEC": 4, "RPT": 4, "SMEM": 1, "MIN_BLOCKS": 0}),
        ((8192, 8192), "float16", {"TILE": 64, "VEC": 8, "RPT": 8, "SMEM": 1, "MIN_BLOCKS": 0}),
        ((8191, 8193), "bfloat16", {"TILE": 32, "VEC": 8, "RPT": 4, "SMEM": 2, "MIN_BLOCKS": 0}),
        ((8191, 8193), "float32", {"TILE": 64, "VEC": 4, "RPT": 4, "SMEM": 1, "SKEW": 1}),
        ((8191, 8193), "float16", {"TILE": 64, "VEC": 8, "RPT": 8, "SMEM": 2, "SKEW": 1}),
    ],
    ids=[
        "aligned-f32",
        "odd-f32-vec1",
        "split-f32-vec4",
        "aligned-f16",
        "split-bf16",
        "skew-f32-vec4",
        "skew-f16-vec8",
    ],
)
def test_hints_change_only_the_cache_qualifiers(shape, dtype, config, tmp_path: Path) -> None:
    """Per HINTS, every global load and store carries its qualifier (0: ld.cs / st.cs, 1: ld.cs
    / plain st, 2: ld.nc / plain st), and the accesses are otherwise the same: as many, as wide
    (a plain store stays one vector instruction)."""
    shapes = {}
    for hints, (load_q, store_q) in QUALIFIERS.items():
        c = {"MIN_BLOCKS": 0, "SKEW": 0, **config, "HINTS": hints}
        assert SPEC.check(c, shape, dtype) is None
        path = tmp_path / f"k{hints}.cu"
        path.write_text(SPEC.render(c, shape, dtype))
        options = [o for o in BASE_OPTIONS if o not in ("-Xptxas", "-v")]
        ptx = subprocess.run(
            ["nvcc", "-ptx", "-arch=sm_90", *options, "-o", "-", str(path)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        accesses = GLOBAL_ACCESS.findall(ptx)
        assert {op for op, *_ in accesses} == {"ld", "st"}
        for op, qualifiers, _, _ in accesses:
            assert qualifiers == (load_q if op == "ld" else store_q), (hints, op, qualifiers)
        shapes[hints] = collections.Counter((op, v, k) for op, _, v, k in accesses)
    assert shapes[0] == shapes[1] == shapes[2]
