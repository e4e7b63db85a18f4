"""transpose variants compile for sm_90 and sm_80 (a covering sample, ``compile_covering``;
every valid one with ``KATO_COMPILE_FULL=1``) with the resources the spec models (the
kernel's logic runs on the CPU in test_transpose_emulation.py).

The source depends on the shape only through ALIGNED, so the valid configs of one shape per
dtype whose sizes are multiples of every vector width (8192 x 8192) and of one no vector width
divides (37 x 5: rows split at vector boundaries, ALIGNED=0) are every variant there is. ~150
variants per dtype and path, batched by the compile harness.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_harness import Outcome, Variant, compile_covering, distinct_variants
from kato.kernels import get_operator
from kato.kernels.transpose import (
    aligned,
    data_registers,
    register_cap,
    static_shared_bytes,
    threads,
)
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("transpose")
CASES = [((8192, 8192), d) for d in SPEC.dtypes] + [((37, 5), d) for d in SPEC.dtypes]


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    every = distinct_variants(SPEC, CASES)
    return compile_covering(
        "transpose", every, cubin_cache, heaviest=heaviest, batch=40, pairs=sample_pairs
    )


def heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, path, register cap, SMEM): the most data registers a thread holds."""
    is_aligned = aligned(v.config, v.shape)
    key = (v.dtype, is_aligned, register_cap(v.config), v.config["SMEM"])
    return key, data_registers(v.config, v.dtype, is_aligned)


def test_the_space_holds_every_variant() -> None:
    every = distinct_variants(SPEC, CASES)
    assert len(every) >= 3 * 100
    split = [v for v in every if not aligned(v.config, v.shape)]
    assert {(v.dtype, v.config["VEC"]) for v in split} >= {
        ("float32", 2),
        ("float32", 4),
        ("float16", 2),
        ("float16", 4),
        ("float16", 8),
    }


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
