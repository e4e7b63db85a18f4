"""reduce_sum variants compile for sm_90 and sm_80 (a covering sample; every distinct one with
``KATO_COMPILE_FULL=1``) with sane resources.

The source depends on the shape only through ALIGNED_ROWS, so three shapes per dtype reach
every variant: cols divisible by every VEC (whole-vector rows), odd cols (rows with a scalar
head and tail) and 4 rows of 2**24 (split rows); defaults of awkward sizes are compiled too. See
reduce_compile_common.
"""

from __future__ import annotations

import pytest
from kato.kernels import DTYPES, get_operator
from kato.kernels.reduce_sum import static_shared_bytes
from kato.tuner.nvcc import nvcc_available
from reduce_compile_common import (
    compile_all,
    failures,
    resource_problems,
    source_counts,
)

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("reduce_sum")
SHAPE = (4096, 4096)
#: Rows with a scalar head and tail; split rows (every SPLIT value is valid there).
MORE_SHAPES = ((4096, 4097), (4, 2**24))
AWKWARD = (
    (1, 1),
    (3, 7),
    (3000, 3001),
    (1048576, 128),
    (8192, 32768),
    (2, 1000003),
    (1, 2**26 + 3),
    (100000, 7),
)


def static_shared(kernel: str, config) -> int:
    return static_shared_bytes(config)


@pytest.fixture(scope="module")
def compiled(cubin_cache, sample_pairs):
    return compile_all(SPEC, SHAPE, AWKWARD, cubin_cache, MORE_SHAPES, pairs=sample_pairs)


@pytest.mark.parametrize("shape", [SHAPE, MORE_SHAPES[0]], ids=str)
def test_distinct_sources_per_dtype_are_bounded(shape) -> None:
    """At most one source per (BLOCK_SIZE, ROW_THREADS, VEC, UNROLL) of an unsplit row (336
    with the 7 row groups of issue 31's short rows; the covering sample compiles a few)."""
    counts = source_counts(SPEC, shape)
    bound = len(SPEC.params["BLOCK_SIZE"]) * len(SPEC.params["ROW_THREADS"]) * 4 * 3
    assert all(10 < c <= bound for c in counts.values()), counts


def test_every_split_value_shares_one_source() -> None:
    """SPLIT's value is launch geometry: the split sources are one per (BLOCK_SIZE, VEC,
    UNROLL) less the one that spills, not one per SPLIT value."""
    counts = source_counts(SPEC, MORE_SHAPES[1])
    unsplit = source_counts(SPEC, (4096, 4096))
    for dtype, count in counts.items():
        vecs = len([v for v in SPEC.params["VEC"] if v * DTYPES[dtype][2] <= 16])
        assert count == unsplit[dtype] + 4 * vecs * 3 - 1, (dtype, count)


def test_every_variant_compiles(compiled) -> None:
    outcomes = compiled
    bad = failures(outcomes)
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_resources(compiled) -> None:
    outcomes = compiled
    bad = resource_problems(outcomes, static_shared)
    assert not bad, "\n".join(bad[:10])
