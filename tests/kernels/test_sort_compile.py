"""sort, sort_1d and sort_1d_pairs variants compile for sm_90 and sm_80 (a covering sample,
``compile_covering``; every valid one with ``KATO_COMPILE_FULL=1``) with the resources the
specs model (the kernels' logic runs on the CPU in test_sort_emulation.py and
test_sort_radix_emulation.py).

Sources do not depend on the shape: the valid configs of ``sort`` at one row of a single key
are every bitonic row-kernel variant there is (~100 per key type), at rows longer than MAX_ROW
every radix row variant (radix.cu with SEGMENTED: 95 per RANK and HIST, 855), those of
``sort_1d`` at any n every 1-D variant (bitonic: FUSE only changes the launch sequence, 48
sources; radix: 95 per ranking method RANK and histogram method HIST, 855), those of
``sort_1d_pairs`` every pairs variant (70 per RANK and HIST, 630). Float and int keys share
every source.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_harness import Outcome, Variant, compile_covering, distinct_variants
from kato.kernels import get_operator
from kato.kernels.sort import radix, register_cap
from kato.tuner.nvcc import CompileError, compile_kernel, nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SORT = get_operator("sort")
SORT_1D = get_operator("sort_1d")
PAIRS = get_operator("sort_1d_pairs")
BLOCK_KERNELS = ("sort_rows_kernel", "sort_1d_block", "sort_1d_merge", "radix_pass")
#: Kernels with a static shared buffer: the histogram's per-block digit counts.
STATIC_SHARED = {"radix_histogram"}


def every_variant() -> list[Variant]:
    # One row of one key admits every row-kernel config (the sources ignore the shape).
    variants = distinct_variants(SORT, [((1, 1), d) for d in SORT.dtypes])
    # Rows longer than MAX_ROW admit every radix row config (ALGO=radix).
    variants += distinct_variants(SORT, [((2, 2**20), d) for d in SORT.dtypes])
    variants += distinct_variants(SORT_1D, [((2**24,), d) for d in SORT_1D.dtypes])
    variants += distinct_variants(PAIRS, [((2**24,), d) for d in PAIRS.dtypes])
    return variants


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    return compile_covering(
        "sort", every_variant(), cubin_cache, heaviest=heaviest, batch=24, pairs=sample_pairs
    )


def heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (operator, algorithm, ranking method, block): the most keys a thread holds (HIST
    changes only the histogram kernel, whose registers do not depend on the tile: the sample
    covers each of its values)."""
    c = v.config
    return (v.spec.name, c.get("ALGO"), c.get("RANK"), c["BLOCK"]), c["ITEMS"]


def test_the_spaces_hold_the_modelled_sources() -> None:
    # Float and int keys share sources; every RANK and HIST is a source of its own.
    assert len(every_variant()) == 80 + 3 * 3 * 95 + 48 + 3 * 3 * 95 + 3 * 3 * 70
    rows = [v for v in every_variant() if v.spec is SORT and v.config["ALGO"] == "radix"]
    assert len(rows) == 3 * 3 * 95
    assert all("#define SEGMENTED 1" in v.source() for v in rows)


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    failed = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error]
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:5])


def test_resources_match_the_model(outcomes: list[Outcome]) -> None:
    """Block kernels (and the radix scatter pass): registers within the launch bounds and no
    spills (check() rejects ITEMS that would not fit), no static shared memory (the buffer is
    dynamic); global passes and the radix init and histogram kernels: no spills within their
    256-thread bounds, the histogram's static counters as radix.cu lays them out (a copy of
    them per HIST="vec4_split4" lane group: radix.hist_shared_bytes)."""
    bad = []
    for o in outcomes:
        if o.error:
            continue
        config = o.variant.config
        for name, res in o.resources.items():
            cap = register_cap(config) if name in BLOCK_KERNELS else 255
            if not 1 <= res.registers <= cap:
                bad.append(f"{o.arch} {o.variant} {name}: {res.registers} regs > {cap}")
            if res.spill_bytes or res.local_bytes:
                bad.append(f"{o.arch} {o.variant} {name}: {res.spill_bytes} B spilled")
            static = 0
            if name in STATIC_SHARED:
                static = radix.hist_shared_bytes(config)
                copies = 4 if config.get("HIST") == "vec4_split4" else 1
                bits = config["RADIX_BITS"]
                assert static == 4 * (radix.passes(bits) << bits) * copies
            if res.shared_static_bytes != static:
                bad.append(f"{o.arch} {o.variant} {name}: {res.shared_static_bytes} B static")
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize(
    ("name", "message"),
    [("SMEM_WORDS", "SMEM_TILE: no room"), ("SMEM_TILE", "SMEM_BASE: no room")],
)
def test_a_layout_short_of_what_radix_pass_indexes_does_not_compile(name, message) -> None:
    """radix.cu asserts that the host's layout (the launch's size) holds every region it
    indexes: a layout one word short of the kernel's use fails at compile time."""
    config = {"BLOCK": 256, "ITEMS": 8, "RADIX_BITS": 4}
    layout = radix.shared_layout(config, pairs=True)
    source = PAIRS.render(config, (2**20,), "int32")
    line = f"#define {name} {layout[name]}\n"
    assert line in source
    short = source.replace(line, f"#define {name} {layout[name] - 1}\n")
    with pytest.raises(CompileError) as error:
        compile_kernel(short, "radix_pass", "sm_90", use_cache=False)
    assert message in error.value.log
