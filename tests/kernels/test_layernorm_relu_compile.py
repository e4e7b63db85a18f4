"""layernorm_relu and layernorm_relu_backward variants (layernorm's and layernorm_backward's
templates with ``EPILOGUE_RELU=1``) compile with sane ptxas resources: a covering sample for
sm_90 in CI (the epilogue is the same code on every arch, and test_layernorm_compile.py and
test_layernorm_backward_compile.py build the templates for sm_80 too), every distinct variant
for sm_90 and sm_80 with ``KATO_COMPILE_FULL=1`` (tests/kernels/compile_harness.py:
``FUSED_ARCHS``). The same checks as test_layernorm_compile.py and
test_layernorm_backward_compile.py: the epilogue (the forward's clip, the backward's bias loads
and mask) must fit the register model of the spaces they share (no CACHE=2 spill, registers
within the launch bounds)."""

from __future__ import annotations

from pathlib import Path

import kato.kernels.layernorm_backward as lb
import pytest
import rowwise_compile_common as common
from compile_harness import FUSED_ARCHS, Outcome, Variant, compile_covering, distinct_variants
from kato.kernels import get_operator
from kato.kernels.layernorm import SPLIT_STATS_KERNEL, register_cap, static_shared_bytes
from kato.tuner.nvcc import nvcc_available
from test_layernorm_compile import AWKWARD, SHAPE, SPLIT_ROW_SHAPES, heaviest

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

FORWARD = get_operator("layernorm_relu")


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    defaults = [
        Variant(FORWARD, FORWARD.default_config(shape, dtype), shape, dtype)
        for dtype in FORWARD.dtypes
        for shape in AWKWARD
    ]
    every = distinct_variants(FORWARD, [(SHAPE, d) for d in FORWARD.dtypes])
    split = [
        v
        for v in distinct_variants(
            FORWARD, [(s, d) for d in FORWARD.dtypes for s in SPLIT_ROW_SHAPES]
        )
        if v.config["GROUP_ROWS"] == 0
    ]
    return compile_covering(
        "layernorm_relu",
        every,
        cubin_cache,
        heaviest=heaviest,
        extra=defaults + split[::4],
        archs=FUSED_ARCHS,
        pairs=sample_pairs,
    )


def test_the_sample_covers_every_path(outcomes: list[Outcome]) -> None:
    assert {o.arch for o in outcomes} == set(FUSED_ARCHS)
    assert {o.variant.dtype for o in outcomes} == set(FORWARD.dtypes)
    for key in ("ROW_THREADS", "CACHE", "VEC"):
        values = {o.variant.config[key] for o in outcomes}
        assert values == set(FORWARD.params[key]), key
    # GROUP_ROWS reaches the source only as 0 (ROW_PIECES: the two-launch split path).
    assert any(o.variant.config["GROUP_ROWS"] == 0 for o in outcomes)
    assert any(o.variant.shape[1] % o.variant.config["VEC"] for o in outcomes)  # ROW_SPLIT
    assert all("#define EPILOGUE_RELU 1" in o.variant.source() for o in outcomes)


def test_every_variant_compiles_within_its_bounds(outcomes: list[Outcome]) -> None:
    """Every kernel of every variant compiles within the register cap of its launch bounds
    and with the static shared memory the spec counts; CACHE=2 (the row in registers) never
    spills."""
    bad = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])
    for o in outcomes:
        expected = {FORWARD.kernel_name}
        if o.variant.config["GROUP_ROWS"] == 0:
            expected.add(SPLIT_STATS_KERNEL)
        assert set(o.resources) == expected, o.variant
        for name, res in o.resources.items():
            cap = register_cap(o.variant.config)
            assert 1 <= res.registers <= cap, f"{o.arch} {o.variant} {name}: {res.registers}"
            assert res.shared_static_bytes == static_shared_bytes(o.variant.config), o.variant
            if o.variant.config["CACHE"] == 2:
                assert not res.spill_bytes, f"{o.arch} {o.variant}: {res.spill_bytes} spilled"


class TestLayernormReluBackwardCompile(common.BackwardCompileChecks):
    """Both kernels of layernorm_relu_backward (stage 1 with the mask, and the reduce)."""

    SPEC = get_operator("layernorm_relu_backward")
    MAX_SAMPLE = 80
    ARCHS = FUSED_ARCHS
    REDUCE_KERNEL = "layernorm_bwd_reduce"
    stage1_shared_bytes = staticmethod(lb.reduction_shared_bytes)
