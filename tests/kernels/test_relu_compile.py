"""relu variants compile for sm_90 and sm_80 (a covering sample; every distinct one with
``KATO_COMPILE_FULL=1``) with sane resources.

The source does not depend on n (BLOCKS_PER_SM is launch geometry only), so one shape per dtype
reaches every variant; defaults of awkward sizes are compiled too. See reduce_compile_common.
"""

from __future__ import annotations

import pytest
from kato.kernels import get_operator
from kato.tuner.nvcc import nvcc_available
from reduce_compile_common import (
    MAX_SOURCES_PER_DTYPE,
    compile_all,
    failures,
    resource_problems,
    source_counts,
)

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("relu")
SHAPE = (1 << 20,)
AWKWARD = ((1,), (33,), (1000003,), (1 << 28,))


def static_shared(kernel: str, config) -> int:
    return 0  # no shared memory: warp shuffles and ballots only


@pytest.fixture(scope="module")
def compiled(cubin_cache, sample_pairs):
    return compile_all(SPEC, SHAPE, AWKWARD, cubin_cache, pairs=sample_pairs)


def test_distinct_sources_per_dtype_are_bounded() -> None:
    counts = source_counts(SPEC, SHAPE)
    assert all(10 < c <= MAX_SOURCES_PER_DTYPE for c in counts.values()), counts


def test_every_variant_compiles(compiled) -> None:
    outcomes = compiled
    bad = failures(outcomes)
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_resources(compiled) -> None:
    outcomes = compiled
    bad = resource_problems(outcomes, static_shared)
    assert not bad, "\n".join(bad[:10])
