"""add_rmsnorm variants compile for sm_90 and sm_80 with sane ptxas resources: a covering sample in
CI, every distinct variant with KATO_COMPILE_FULL=1 (tests/kernels/rowwise_compile_common.py
says how the sample is drawn)."""

from __future__ import annotations

from pathlib import Path

import pytest
import rowwise_compile_common as common
from compile_harness import FULL, Outcome, Variant
from kato.kernels import get_operator, rowwise
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("add_rmsnorm")


def holds_registers(v: Variant) -> bool:
    """CACHE=2 keeps the row in registers."""
    return v.config["CACHE"] == 2


HEAVIEST = common.register_boundary(holds_registers)


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path) -> list[Outcome]:
    return common.compile_sample(SPEC, HEAVIEST, cubin_cache)


def _wb_regs(v) -> int:
    return SPEC.defines(v.config, v.shape, v.dtype)["WB_REGS"]


def test_the_sample_covers_every_code_path() -> None:
    variants = common.sample(SPEC, HEAVIEST)
    reached = common.coverage(variants)
    assert reached["vec"] == {(d, v) for d in SPEC.dtypes for v in (1, 2, 4, 8)} - {("float32", 8)}
    assert reached["cap"] == {255, 128, 64}
    assert reached["row_threads"] == {8, 16, 32, 0} and reached["cache"] == {0, 1, 2}
    assert {d for v in variants if _wb_regs(v) for d in [v.dtype]} == set(SPEC.dtypes)
    assert len(variants) <= 80 or FULL


def test_every_variant_compiles(outcomes) -> None:
    bad = common.errors(outcomes)
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_registers_respect_the_launch_bounds(outcomes) -> None:
    bad = common.over_cap(outcomes)
    assert not bad, "\n".join(bad[:10])


def test_register_caches_never_spill(outcomes) -> None:
    """check() rejects CACHE=2 configs whose sum row cannot stay in registers, and WB_REGS is only
    set where the weight fits beside it."""
    bad = common.spills(outcomes, holds_registers)
    assert not bad, "\n".join(bad[:10])


def test_streaming_spills_stay_small(outcomes) -> None:
    bad = common.streaming_spills([o for o in outcomes if o.variant.config["CACHE"] != 2])
    assert not bad, "\n".join(bad[:10])


def test_static_shared_memory_matches_the_spec(outcomes) -> None:
    bad = common.static_shared(outcomes, lambda v, _: rowwise.reduction_shared_bytes(v.config))
    assert not bad, "\n".join(bad[:10])
