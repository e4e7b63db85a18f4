"""layernorm_backward variants (both kernels: stage 1 and the reduce) compile for sm_90 and sm_80
with sane ptxas resources: a covering sample in CI, every distinct variant with
KATO_COMPILE_FULL=1 (tests/kernels/rowwise_compile_common.py says how the sample is drawn)."""

from __future__ import annotations

from pathlib import Path

import kato.kernels.layernorm_backward as lb
import pytest
import rowwise_compile_common as common
from compile_harness import FULL, Outcome, Variant
from kato.kernels import get_operator
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("layernorm_backward")


def holds_registers(v: Variant) -> bool:
    """Rows (CACHE=2) or dweight columns (DW_ACC=0) kept in registers."""
    return v.config["CACHE"] == 2 or v.config["DW_ACC"] == 0


HEAVIEST = common.register_boundary(holds_registers)


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path) -> list[Outcome]:
    return common.compile_sample(SPEC, HEAVIEST, cubin_cache)


def test_the_sample_covers_every_code_path() -> None:
    variants = common.sample(SPEC, HEAVIEST)
    reached = common.coverage(variants)
    assert reached["vec"] == {(d, v) for d in SPEC.dtypes for v in (1, 2, 4, 8)} - {("float32", 8)}
    assert reached["cap"] == {255, 128, 64}
    assert reached["row_threads"] == {8, 16, 32, 0} and reached["cache"] == {0, 1, 2}
    paths = {(v.config["ROW_THREADS"] == 0, v.config["DW_ACC"]) for v in variants}
    assert paths == {(True, 0), (True, 1), (True, 2), (False, 0), (False, 1)}
    assert len(variants) <= 80 or FULL


def test_every_variant_compiles(outcomes) -> None:
    bad = common.errors(outcomes)
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_registers_respect_the_launch_bounds(outcomes) -> None:
    bad = common.over_cap(outcomes)
    assert not bad, "\n".join(bad[:10])


def test_register_caches_never_spill(outcomes) -> None:
    """check() rejects configs whose rows (CACHE=2) or dweight and dbias columns (DW_ACC=0)
    cannot stay in registers, and WB_REGS is only set where the weight fits beside them."""
    bad = common.spills(outcomes, holds_registers)
    assert not bad, "\n".join(bad[:10])


def test_streaming_spills_stay_small(outcomes) -> None:
    streaming = [
        o for o in outcomes if o.variant.config["CACHE"] != 2 and o.variant.config["DW_ACC"] != 0
    ]
    bad = common.streaming_spills(streaming)
    assert not bad, "\n".join(bad[:10])


def test_static_shared_memory_matches_the_spec(outcomes) -> None:
    """Stage 1: the row reduction's float2 array; the reduce: its 32 x 33 float tile."""

    def expected(v, kernel: str) -> int:
        if kernel == "layernorm_bwd_reduce":
            return 32 * 33 * 4
        return lb.reduction_shared_bytes(v.config)

    bad = common.static_shared(outcomes, expected)
    assert not bad, "\n".join(bad[:10])


def test_the_reduce_kernel_keeps_registers_low(outcomes) -> None:
    """The reduce launches up to 32 x 16 threads; it must stay under 64 registers."""
    bad = [
        f"{o.arch} {o.variant}: {r.registers}"
        for o in outcomes
        if o.error is None and (r := o.resources["layernorm_bwd_reduce"]).registers > 64
    ]
    assert not bad, "\n".join(bad[:5])
