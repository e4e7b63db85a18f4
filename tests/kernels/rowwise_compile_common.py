"""Shared body of the compile tests of the row-wise operators (rmsnorm, add_rmsnorm,
add_layernorm, rmsnorm_backward, layernorm_backward, softmax_backward, cross_entropy and its
backward; one test module each).

Their spaces have 440 to 880 distinct sources per operator over the two representative shapes
(an odd width, where every row's head differs, and a multiple of every VEC, where register
caches of the weight and of dweight apply), more than CI's 2 cores can compile in a minute. CI
therefore compiles ``compile_harness.covering_sample`` of them (every dtype, shape and parameter
value and every pair of those, every rendered macro's value) plus, per module, the variants of
its ``heaviest`` key (:func:`register_boundary`: per dtype, register cap and WB_REGS, the
variant holding the most registers, where a spill would show), plus the default configs of
awkward shapes; for sm_90, and every other one of them for sm_80. ``KATO_COMPILE_FULL=1``
compiles every distinct variant instead (the H200 session does: benchmarks/h200_training_ops.sh),
and ``KATO_COMPILE_TEST_ARCHS`` overrides the archs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

from compile_harness import Outcome, Variant, compile_covering, distinct_variants, sample_with_extra
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


def sample(spec: OperatorSpec, heaviest: Heaviest | None) -> list[Variant]:
    """The variants :func:`compile_sample` compiles (every distinct one with FULL)."""
    return sample_with_extra(_variants(spec.name), heaviest=heaviest, extra=awkward_defaults(spec))


def compile_sample(spec: OperatorSpec, heaviest: Heaviest | None, cache_dir: Path) -> list[Outcome]:
    """Compile :func:`sample` for the first arch, and every other one of it (all with FULL) for
    the rest."""
    return compile_covering(
        spec.name, _variants(spec.name), cache_dir, heaviest=heaviest, extra=awkward_defaults(spec)
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
