"""Shared body of the compile tests of reduce_sum, reduce_sum_all and relu (one module each).

The distinct rendered sources of the operator's space (the sources do not depend on the shape,
so one representative shape per dtype reaches every variant): a covering sample of them
(``compile_harness.covering_sample``: every parameter value in every dtype, every pair of values
under ``-m slow``, every rendered switch, and per dtype and block size the variant with the most
bytes in flight a thread, the register boundary), all with ``KATO_COMPILE_FULL=1``; plus the
defaults of awkward shapes.
Compiled for sm_90 and every other one for sm_80 (all with FULL; ``KATO_COMPILE_TEST_ARCHS``
overrides) in batches through ``tests/kernels/compile_harness.py``. Checks: everything
compiles; at most ~150 distinct sources per dtype; registers within the ``__launch_bounds__``
cap; no spills and no stack frame at all (none of these kernels keeps anything in local
memory); static shared memory as modelled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from compile_harness import Outcome, Variant, compile_covering, distinct_variants, kernel_names
from kato.kernels.spec import DTYPES, Config, OperatorSpec

MAX_SOURCES_PER_DTYPE = 150


def register_cap(block: int) -> int:
    """Registers per thread ptxas may use under ``__launch_bounds__(block)``."""
    return min(255, 65536 // block // 8 * 8)


def compile_all(
    spec: OperatorSpec,
    shape: Sequence[int],
    awkward: Sequence[Sequence[int]],
    cache_dir,
    more_shapes: Sequence[Sequence[int]] = (),
    pairs: bool = False,
) -> list[Outcome]:
    """The valid configs at ``shape`` and at each of ``more_shapes`` (shapes whose sources
    differ: a code path only some shapes take), sampled, plus the defaults at ``awkward``."""
    cases = [(tuple(s), d) for s in (shape, *more_shapes) for d in spec.dtypes]
    defaults = [
        Variant(spec, spec.default_config(s, d), tuple(s), d) for d in spec.dtypes for s in awkward
    ]
    return compile_covering(
        spec.name,
        distinct_variants(spec, cases),
        cache_dir,
        heaviest=_bytes_in_flight,
        extra=defaults,
        pairs=pairs,
    )


def _bytes_in_flight(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, block size, shape): bytes a thread loads per step, the register boundary."""
    c = v.config
    return (v.dtype, c["BLOCK_SIZE"], v.shape), c.get("UNROLL", 1) * c["VEC"] * DTYPES[v.dtype][2]


def source_counts(spec: OperatorSpec, shape: Sequence[int]) -> dict[str, int]:
    return {d: len(distinct_variants(spec, [(tuple(shape), d)])) for d in spec.dtypes}


def failures(outcomes: list[Outcome]) -> list[str]:
    return [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]


def resource_problems(
    outcomes: list[Outcome], static_shared: Callable[[str, Config], int]
) -> list[str]:
    """Registers over the cap, spills or stack frames, static shared memory not as modelled."""
    bad = []
    for o in outcomes:
        block = o.variant.config["BLOCK_SIZE"]
        for name in kernel_names(o.variant.spec):
            r = o.resources.get(name)
            if r is None:
                continue
            if not 1 <= r.registers <= register_cap(block):
                bad.append(f"{o.arch} {o.variant} {name}: {r.registers} registers")
            if r.spill_bytes or r.local_bytes:
                bad.append(
                    f"{o.arch} {o.variant} {name}: {r.spill_bytes} spill, {r.local_bytes} local"
                )
            want = static_shared(name, o.variant.config)
            if r.shared_static_bytes != want:
                bad.append(
                    f"{o.arch} {o.variant} {name}: {r.shared_static_bytes} B static shared, "
                    f"modelled {want}"
                )
    return bad
