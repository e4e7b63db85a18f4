"""Every valid matmul variant compiles for sm_80 and sm_90, with the resources the spec models.

The rendered source does not depend on the shape (M, N, K are kernel arguments), so "every
variant" is every config ``check`` accepts at 4096^3 (VEC 4/8 and the scalar VEC=1 fallback are
both valid there) plus the default configs of a few awkward shapes; they are compiled in batches
through ``tests/kernels/compile_harness.py``. Checked: no compile errors, registers within the
``__launch_bounds__`` cap, no spills at all (check() rejects tiles that would spill), no static
shared memory (every buffer is dynamic, as ``shared_bytes`` models it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from compile_harness import Outcome, compile_variants, distinct_variants

from kernels import get_operator
from kernels.matmul import register_cap, registers_needed, static_shared_bytes, threads_per_block
from tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("matmul")
SHAPE = (4096, 4096, 4096)
AWKWARD_SHAPES = ((1, 1, 1), (127, 131, 257), (70000, 64, 64), (1, 4096, 4096))
#: Override with e.g. KATO_COMPILE_TEST_ARCHS=sm_90 to halve the time.
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_80,sm_90").split(","))
BATCH = 16  # tensor-core variants are large: small batches keep both workers busy to the end
WORKERS = 2


def cases() -> list[tuple[tuple[int, ...], str]]:
    return [(SHAPE, d) for d in SPEC.dtypes] + [(s, d) for d in SPEC.dtypes for s in AWKWARD_SHAPES]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    variants = distinct_variants(SPEC, cases())
    # Tensor-core variants first (the slowest to build), so that the workers finish together.
    variants.sort(key=lambda v: v.dtype == "float32")
    start = time.perf_counter()
    found = compile_variants(
        variants, ARCHS, tmp_path_factory.mktemp("cubin-cache"), batch=BATCH, workers=WORKERS
    )
    print(
        f"\ncompiled {len(variants)} variants x {len(ARCHS)} archs in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return found


def test_space_has_variants_for_every_dtype_and_arch(outcomes: list[Outcome]) -> None:
    for dtype in SPEC.dtypes:
        for arch in ARCHS:
            got = [o for o in outcomes if o.variant.dtype == dtype and o.arch == arch]
            assert 60 <= len(got) <= 160, (dtype, arch, len(got))


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    failed = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]
    assert not failed, f"{len(failed)} variant(s) failed to compile:\n" + "\n".join(failed[:5])


def test_registers_respect_launch_bounds(outcomes: list[Outcome]) -> None:
    bad = []
    for o in outcomes:
        if o.error:
            continue
        regs, config = o.resources[SPEC.kernel_name].registers, o.variant.config
        if not 1 <= regs <= register_cap(config):
            bad.append(f"{o.arch} {o.variant}: {regs} registers, cap {register_cap(config)}")
        if config["MIN_BLOCKS"] and regs * threads_per_block(config) * config["MIN_BLOCKS"] > 65536:
            bad.append(f"{o.arch} {o.variant}: {regs} registers x MIN_BLOCKS blocks > 64 Ki")
    assert not bad, "\n".join(bad[:10])


def test_nothing_spills(outcomes: list[Outcome]) -> None:
    """check() rejects register tiles that cannot fit the cap; the accepted ones must not spill
    (a spilling accumulator tile would run at local-memory speed)."""
    spills = []
    for o in outcomes:
        if o.error:
            continue
        res = o.resources[SPEC.kernel_name]
        if res.spill_bytes:
            model = registers_needed(o.variant.config, o.variant.dtype)
            spills.append(
                f"{o.arch} {o.variant}: {res.spill_bytes} spill bytes, {res.registers} registers "
                f"(model {model}, cap {register_cap(o.variant.config)})"
            )
    assert not spills, "\n".join(spills[:10])


def test_no_static_shared_memory(outcomes: list[Outcome]) -> None:
    bad = [
        f"{o.arch} {o.variant}: {o.resources[SPEC.kernel_name].shared_static_bytes} bytes"
        for o in outcomes
        if not o.error
        and o.resources[SPEC.kernel_name].shared_static_bytes
        != static_shared_bytes(o.variant.config)
    ]
    assert not bad, "\n".join(bad[:10])


def test_standalone_compile_matches_the_batch(outcomes: list[Outcome], tmp_path: Path) -> None:
    """A few variants compiled alone from the exact source the tuner compiles report the same
    registers and spills as in the batch."""
    from tuner.nvcc import compile_many

    by_dtype: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.arch == ARCHS[-1] and not o.error:
            by_dtype.setdefault(o.variant.dtype, []).append(o)
    sample = [group[len(group) // 2] for group in by_dtype.values()]
    jobs = [(o.variant.source(), SPEC.kernel_name, o.arch, ()) for o in sample]
    for o, result in zip(sample, compile_many(jobs, WORKERS, tmp_path), strict=True):
        alone = result.resources(SPEC.kernel_name)
        batched = o.resources[SPEC.kernel_name]
        assert (alone.registers, alone.spill_bytes) == (batched.registers, batched.spill_bytes)
