"""Shared body of the compile tests of the row-wise operators (rmsnorm, add_rmsnorm,
add_layernorm, rmsnorm_backward, layernorm_backward, softmax_backward, cross_entropy and its
backward; one test module each).

Their spaces have 440 to 880 distinct sources per operator over the two representative shapes
(an odd width, where every row's head differs, and a multiple of every VEC, where register
caches of the weight and of dweight apply), more than CI's 2 cores can compile in a minute. CI
therefore compiles ``compile_harness.covering_sample`` of them (every shape and parameter value
in every dtype, every rendered macro's value; ``-m slow``: every pair of values) plus, per
module, the variants of
its ``heaviest`` key (:func:`register_boundary`: per dtype, register cap and WB_REGS, the
variant holding the most registers, where a spill would show), plus the default configs of
awkward shapes; for sm_90, and every other one of them for sm_80. ``KATO_COMPILE_FULL=1``
compiles every distinct variant instead (the H200 session does: benchmarks/h200_training_ops.sh),
and ``KATO_COMPILE_TEST_ARCHS`` overrides the archs.

The norms' modules share their checks: each subclasses :class:`NormCompileChecks` (or
:class:`BackwardCompileChecks`) as ``Test<Operator>Compile``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import pytest
from compile_harness import (
    ARCHS,
    FULL,
    Outcome,
    Variant,
    compile_covering,
    distinct_variants,
    sample_with_extra,
)
from kato.kernels import get_operator, rowwise
from kato.kernels.spec import DTYPES, OperatorSpec

SHAPES = ((37, 1031), (64, 4096))
AWKWARD = (
    (1, 1),
    (3000, 3001),
    (7, 1000003),
    (262144, 128),
    (8192, 768),
    (8192, 4096),
    (8192, 50257),
    (64, 32768),
)

#: ``heaviest`` of ``compile_harness.covering_sample``: ``(key, score)`` or ``None``.
Heaviest = Callable[[Variant], tuple[Hashable, float] | None]


@functools.cache
def _variants(name: str) -> tuple[Variant, ...]:
    spec = get_operator(name)
    return tuple(distinct_variants(spec, [(s, d) for s in SHAPES for d in spec.dtypes]))


def awkward_defaults(spec: OperatorSpec) -> list[Variant]:
    """The default config of every :data:`AWKWARD` shape and dtype."""
    return [Variant(spec, spec.default_config(s, d), s, d) for d in spec.dtypes for s in AWKWARD]


def register_boundary(holds_registers: Callable[[Variant], bool]) -> Heaviest:
    """``heaviest`` for operators that keep rows or accumulators in registers
    (``holds_registers``): per dtype, register cap and whether the weight sits in registers
    too (WB_REGS), the variant with the most registers per array, where a spill would show."""

    def heaviest(v: Variant) -> tuple[Hashable, float] | None:
        if not holds_registers(v):
            return None
        c = v.config
        weight = v.spec.defines(c, v.shape, v.dtype).get("WB_REGS", 0)
        key = (v.dtype, rowwise.register_cap(c), weight)
        return key, rowwise.vector_registers(c, v.shape[1], itemsize(v))

    return heaviest


def sample(spec: OperatorSpec, heaviest: Heaviest | None, pairs: bool = False) -> list[Variant]:
    """The variants :func:`compile_sample` compiles (every distinct one with FULL)."""
    return sample_with_extra(
        _variants(spec.name), heaviest=heaviest, extra=awkward_defaults(spec), pairs=pairs
    )


def compile_sample(
    spec: OperatorSpec,
    heaviest: Heaviest | None,
    cache_dir: Path,
    archs: Sequence[str] = ARCHS,
    pairs: bool = False,
) -> list[Outcome]:
    """Compile :func:`sample` for the first of ``archs``, and every other one of it (all with
    FULL) for the rest."""
    return compile_covering(
        spec.name,
        _variants(spec.name),
        cache_dir,
        heaviest=heaviest,
        extra=awkward_defaults(spec),
        archs=archs,
        pairs=pairs,
    )


def coverage(variants: Sequence[Variant]) -> dict[str, set]:
    """What a sample reaches: VEC per dtype, register caps, ROW_THREADS, CACHE."""
    return {
        "vec": {(v.dtype, v.config["VEC"]) for v in variants},
        "cap": {rowwise.register_cap(v.config) for v in variants},
        "row_threads": {v.config["ROW_THREADS"] for v in variants},
        "cache": {v.config["CACHE"] for v in variants},
    }


def errors(outcomes: Sequence[Outcome]) -> list[str]:
    return [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]


def over_cap(outcomes: Sequence[Outcome]) -> list[str]:
    """Variants whose main kernel uses more registers than its launch bounds allow."""
    bad = []
    for o in outcomes:
        if o.error is None:
            regs = o.resources[o.variant.spec.kernel_name].registers
            cap = rowwise.register_cap(o.variant.config)
            if not 1 <= regs <= cap:
                bad.append(f"{o.arch} {o.variant}: {regs} > {cap}")
    return bad


#: Spill bytes a register-cache variant may show: ptxas now and then keeps fewer registers than
#: the cap allows (64 of 128 or 255, for occupancy) and spills a few words (8 to 64 bytes seen on
#: sm_90); a cache that does not fit spills 100 to 850 bytes.
QUIRK_SPILL_BYTES = 64


def spills(outcomes: Sequence[Outcome], holds_registers: Callable[[Variant], bool]) -> list[str]:
    """Variants that keep rows or accumulators in registers (``holds_registers``) and spill
    more than :data:`QUIRK_SPILL_BYTES`: check() must have rejected them."""
    return [
        f"{o.arch} {o.variant}: {r.spill_bytes} spill bytes, {r.registers} registers"
        for o in outcomes
        if o.error is None
        and holds_registers(o.variant)
        and (r := o.resources[o.variant.spec.kernel_name]).spill_bytes > QUIRK_SPILL_BYTES
    ]


def streaming_spills(outcomes: Sequence[Outcome], limit: int = 64) -> list[str]:
    """Streaming variants may spill under a tight register cap (the tuner measures them);
    with a cap of 128 or more, at most ``limit`` bytes (ptxas keeps 64 registers under
    ``__launch_bounds__(512)`` and spills a few words rather than use 70)."""
    return [
        f"{o.arch} {o.variant}: {r.spill_bytes} spill bytes"
        for o in outcomes
        if o.error is None
        and rowwise.register_cap(o.variant.config) >= 128
        and (r := o.resources[o.variant.spec.kernel_name]).spill_bytes > limit
    ]


def static_shared(
    outcomes: Sequence[Outcome], expected: Callable[[Variant, str], int]
) -> list[str]:
    """Entry points whose static shared memory differs from ``expected(variant, kernel)``."""
    bad = []
    for o in outcomes:
        if o.error is None:
            for name, r in o.resources.items():
                want = expected(o.variant, name)
                if r.shared_static_bytes != want:
                    bad.append(f"{o.arch} {o.variant} {name}: {r.shared_static_bytes} != {want}")
    return bad


def itemsize(v: Variant) -> int:
    return DTYPES[v.dtype][2]


class NormCompileChecks:
    """The checks of a row-wise operator that may keep rows in registers: a module subclasses
    it as ``Test...`` with :attr:`SPEC`, :attr:`MAX_SAMPLE` and, where they differ,
    :meth:`holds_registers`, :attr:`WEIGHT_IN_REGISTERS` and :meth:`static_shared_bytes`."""

    SPEC: OperatorSpec
    #: The most variants CI's sample may hold (awkward defaults included).
    MAX_SAMPLE: int
    #: Whether the weight (WB_REGS) sits in registers in some variant of every dtype.
    WEIGHT_IN_REGISTERS = True
    #: The archs compiled for (a fused variant's module sets ``compile_harness.FUSED_ARCHS``).
    ARCHS: tuple[str, ...] = ARCHS

    @staticmethod
    def holds_registers(v: Variant) -> bool:
        """Keeps rows (CACHE=2) in registers: check() must reject whatever would spill."""
        return v.config["CACHE"] == 2

    def static_shared_bytes(self, v: Variant, kernel: str) -> int:
        """Static shared memory of ``kernel``: the block-wide row reduction's."""
        return rowwise.reduction_shared_bytes(v.config)

    def sample(self) -> list[Variant]:
        return sample(self.SPEC, register_boundary(self.holds_registers))

    @pytest.fixture(scope="class")
    def outcomes(self, cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
        heaviest = register_boundary(self.holds_registers)
        return compile_sample(self.SPEC, heaviest, cubin_cache, self.ARCHS, sample_pairs)

    def test_the_sample_covers_every_code_path(self) -> None:
        variants = self.sample()
        reached = coverage(variants)
        dtypes = self.SPEC.dtypes
        assert reached["vec"] == {(d, v) for d in dtypes for v in (1, 2, 4, 8)} - {("float32", 8)}
        assert reached["cap"] == {255, 128, 64}
        assert reached["row_threads"] == {8, 16, 32, 0} and reached["cache"] == {0, 1, 2}
        if self.WEIGHT_IN_REGISTERS:
            weight = {v.dtype for v in variants if _defines(v).get("WB_REGS")}
            assert weight == set(dtypes)
        assert len(variants) <= self.MAX_SAMPLE or FULL

    def test_every_variant_compiles(self, outcomes: list[Outcome]) -> None:
        bad = errors(outcomes)
        assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])

    def test_registers_respect_the_launch_bounds(self, outcomes: list[Outcome]) -> None:
        bad = over_cap(outcomes)
        assert not bad, "\n".join(bad[:10])

    def test_register_caches_never_spill(self, outcomes: list[Outcome]) -> None:
        """check() rejects configs whose register-held rows (or columns) cannot stay there, and
        WB_REGS is only set where the weight fits beside them."""
        bad = spills(outcomes, self.holds_registers)
        assert not bad, "\n".join(bad[:10])

    def test_streaming_spills_stay_small(self, outcomes: list[Outcome]) -> None:
        bad = streaming_spills([o for o in outcomes if not self.holds_registers(o.variant)])
        assert not bad, "\n".join(bad[:10])

    def test_static_shared_memory_matches_the_spec(self, outcomes: list[Outcome]) -> None:
        bad = static_shared(outcomes, self.static_shared_bytes)
        assert not bad, "\n".join(bad[:10])


class BackwardCompileChecks(NormCompileChecks):
    """:class:`NormCompileChecks` for the two-kernel backwards (stage 1 and the reduce of
    dweight's partial columns, :attr:`REDUCE_KERNEL`): dweight columns (DW_ACC=0) may sit in
    registers too, and every (warp or block mode, DW_ACC) path is sampled."""

    REDUCE_KERNEL: str

    @staticmethod
    def holds_registers(v: Variant) -> bool:
        """Rows (CACHE=2) or dweight columns (DW_ACC=0) kept in registers."""
        return v.config["CACHE"] == 2 or v.config["DW_ACC"] == 0

    @staticmethod
    def stage1_shared_bytes(config: dict) -> int:
        """Stage 1's static shared memory: the row reduction's array."""
        return rowwise.reduction_shared_bytes(config)

    def static_shared_bytes(self, v: Variant, kernel: str) -> int:
        """Stage 1: :meth:`stage1_shared_bytes`; the reduce: its 32 x 33 float tile."""
        if kernel == self.REDUCE_KERNEL:
            return 32 * 33 * 4
        return self.stage1_shared_bytes(v.config)

    def test_every_dweight_path_is_sampled(self) -> None:
        paths = {(v.config["ROW_THREADS"] == 0, v.config["DW_ACC"]) for v in self.sample()}
        assert paths == {(True, 0), (True, 1), (True, 2), (False, 0), (False, 1)}

    def test_the_reduce_kernel_keeps_registers_low(self, outcomes: list[Outcome]) -> None:
        """The reduce launches up to 32 x 16 threads; it must stay under 64 registers."""
        bad = [
            f"{o.arch} {o.variant}: {r.registers}"
            for o in outcomes
            if o.error is None and (r := o.resources[self.REDUCE_KERNEL]).registers > 64
        ]
        assert not bad, "\n".join(bad[:5])


def _defines(v: Variant) -> dict[str, object]:
    return v.spec.defines(v.config, v.shape, v.dtype)
