"""Shared body of the compile tests of the row-wise operators (rmsnorm, rmsnorm_backward,
softmax_backward; one test module each).

Their spaces have 300 to 1700 distinct sources per operator over the two representative shapes
(an odd width, where every row's head differs, and a multiple of every VEC, where register
caches of the weight and of dweight apply), more than CI's 2 cores can compile in a minute. CI
therefore compiles a covering sample: for every (dtype, ROW_THREADS, CACHE and the operator's own
source switches) one variant, the variants drawn in a seeded order so that every VEC and every
register cap appears (:func:`coverage` checks it), plus the default configs of awkward shapes; for
sm_90, and every other one of them for sm_80. ``KATO_COMPILE_FULL=1`` compiles every distinct
variant instead (the H200 session does: benchmarks/h200_training_ops.sh), and
``KATO_COMPILE_TEST_ARCHS`` overrides the archs.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from compile_harness import Outcome, Variant, compile_variants, distinct_variants
from kato.kernels import rowwise
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
FULL = os.environ.get("KATO_COMPILE_FULL") == "1"
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_90,sm_80").split(","))

#: What distinguishes one code path of a variant from another: its dtype and rendered switches.
KeyFn = Callable[[Variant], tuple]


def base_key(v: Variant) -> tuple:
    macros = v.spec.defines(v.config, v.shape, v.dtype)
    return (v.dtype, v.config["ROW_THREADS"], v.config["CACHE"], macros.get("WB_REGS", 0))


def sample(spec: OperatorSpec, key: KeyFn = base_key) -> list[Variant]:
    """The variants to compile: every distinct one with FULL, else one per ``key`` (seeded
    order), plus the defaults of :data:`AWKWARD`."""
    every = distinct_variants(spec, [(s, d) for s in SHAPES for d in spec.dtypes])
    if FULL:
        chosen = list(every)
    else:
        order = list(every)
        random.Random(2026).shuffle(order)
        chosen, seen = [], set()
        for variant in order:
            k = key(variant)
            if k not in seen:
                seen.add(k)
                chosen.append(variant)
        # Top up: a variant for every (dtype, VEC) and every register cap the sample missed.
        for aspect in (
            lambda v: (v.dtype, v.config["VEC"]),
            lambda v: rowwise.register_cap(v.config),
        ):
            reached = {aspect(v) for v in chosen}
            for variant in order:
                if aspect(variant) not in reached:
                    reached.add(aspect(variant))
                    chosen.append(variant)
    sources = {v.source() for v in chosen}
    for dtype in spec.dtypes:
        for shape in AWKWARD:
            v = Variant(spec, spec.default_config(shape, dtype), shape, dtype)
            if v.source() not in sources:
                sources.add(v.source())
                chosen.append(v)
    return chosen


def coverage(variants: Sequence[Variant]) -> dict[str, set]:
    """What a sample reaches: VEC per dtype, register caps, ROW_THREADS, CACHE."""
    return {
        "vec": {(v.dtype, v.config["VEC"]) for v in variants},
        "cap": {rowwise.register_cap(v.config) for v in variants},
        "row_threads": {v.config["ROW_THREADS"] for v in variants},
        "cache": {v.config["CACHE"] for v in variants},
    }


def compile_sample(
    spec: OperatorSpec, variants: Sequence[Variant], cache_dir: Path
) -> list[Outcome]:
    """Compile ``variants`` for the first arch, and every other one (all with FULL) for the
    rest."""
    start = time.perf_counter()
    outcomes = compile_variants(variants, ARCHS[:1], cache_dir, batch=48, workers=2)
    rest = (list(variants) if FULL else list(variants)[::2]) if ARCHS[1:] else []
    if rest:
        outcomes += compile_variants(rest, ARCHS[1:], cache_dir, batch=48, workers=2)
    print(
        f"\n{spec.name}: {len(variants)} variants on {ARCHS[0]}, {len(rest)} on "
        f"{','.join(ARCHS[1:]) or '-'} in {time.perf_counter() - start:.0f} s"
    )
    return outcomes


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
