"""cross_entropy and cross_entropy_backward variants compile for sm_90 and sm_80 with sane ptxas
resources: a covering sample in CI (plus, per dtype, ROW_THREADS and SPLIT == 1 or > 1, the
variant with the widest vector), every distinct variant with KATO_COMPILE_FULL=1
(tests/kernels/rowwise_compile_common.py says how the sample is drawn)."""

from __future__ import annotations

from pathlib import Path

import pytest
import rowwise_compile_common as common
from compile_harness import FULL, Outcome, Variant
from kato.kernels import get_operator, rowwise
from kato.kernels.cross_entropy import model
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

NAMES = ("cross_entropy", "cross_entropy_backward")


def key(v: Variant) -> tuple:
    return (v.dtype, v.config["ROW_THREADS"], v.config["SPLIT"] > 1)


def widest(v: Variant) -> tuple[tuple, float]:
    """Per :func:`key`: the most bytes a thread loads at once, the register boundary of a
    streaming kernel."""
    return key(v), v.config["VEC"] * common.itemsize(v)


@pytest.fixture(scope="module", params=NAMES)
def compiled(request, cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    spec = get_operator(request.param)
    return common.compile_sample(spec, widest, cubin_cache, pairs=sample_pairs)


@pytest.mark.parametrize("name", NAMES)
def test_the_sample_covers_every_code_path(name) -> None:
    spec = get_operator(name)
    variants = common.sample(spec, widest)
    vecs = {(v.dtype, v.config["VEC"]) for v in variants}
    assert vecs == {(d, v) for d in spec.dtypes for v in (1, 2, 4, 8)} - {("float32", 8)}
    assert {rowwise.register_cap(v.config) for v in variants} == {255, 128, 64}
    assert {key(v) for v in variants} >= {
        (d, lanes, split) for d in spec.dtypes for lanes in (8, 16, 32, 0) for split in (0, 1)
    }
    assert len(variants) <= 90 or FULL


def test_every_variant_compiles(compiled) -> None:
    bad = common.errors(compiled)
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])


def test_registers_respect_the_launch_bounds(compiled) -> None:
    bad = common.over_cap(compiled)
    assert not bad, "\n".join(bad[:10])


def test_streaming_kernels_spill_little(compiled) -> None:
    """Both kernels stream their rows (a few vectors in flight per thread): with a register cap
    of 128 or more, at most a few words of spill."""
    bad = common.streaming_spills(compiled)
    assert not bad, "\n".join(bad[:10])


def test_static_shared_memory_matches_the_spec(compiled) -> None:
    """The forward's block-wide merge holds a double-buffered (max, sum) per warp; the combine
    kernel and the backward hold none."""

    def expected(v: Variant, kernel: str) -> int:
        if kernel == "cross_entropy_fwd":
            return model.reduction_shared_bytes(v.config)
        return 0

    bad = common.static_shared(compiled, expected)
    assert not bad, "\n".join(bad[:10])
