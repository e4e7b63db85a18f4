"""The radix sort kernels (kernels/sort/radix.cu) run on the CPU (tests/kernels/cuda_emulation.py):
sort_1d with ALGO=radix and sort_1d_pairs, every digit width, tiles of 2048 and more keys, n
from 1 to several tiles with a short last tile, both key types, all-equal keys and a -0.0/+0.0
mix, every ranking method (RANK), every histogram method (HIST: the vector ones also on lengths
that are no multiple of 4, on arrays 4 to 12 bytes past a 16-byte boundary with every vector
load checked to fall inside its array, and with one histogram block, so that each thread runs
the unrolled loop more than once); outputs compared exactly with the references (the pairs'
values in stable order).

Blocks run one after another in the emulation, so a tile's look-back always finds its
predecessors done: this checks the indexing, the ranking and the prefix arithmetic, not the
concurrency (that is the GPU tests' part). Each block gets exactly its launch's dynamic shared
memory, so a kernel that indexes more than the spec launches fails here too."""

from __future__ import annotations

import shutil
from dataclasses import replace
from itertools import product
from pathlib import Path

import cuda_emulation
import numpy as np
import pytest
from cuda_emulation import Case, run_cases
from kato.kernels import get_operator
from kato.kernels.sort import Sort1dPairsSpec, Sort1dSpec, radix
from kato.kernels.spec import Problem

SORT_1D = get_operator("sort_1d")
PAIRS = get_operator("sort_1d_pairs")

#: What radix.cu needs beyond the emulation's header. Lanes of a warp are host threads that
#: run at once, so the atomics are real ones.
EXTRA = r"""
inline void __syncwarp(unsigned = 0xffffffffu) { this_warp->sync.arrive_and_wait(); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __trap() { std::abort(); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned __match_any_sync(unsigned, unsigned v) {
  const unsigned lane = lane_id();
  this_warp->lanes[lane] = v;
  this_warp->sync.arrive_and_wait();
  unsigned peers = 0;
  for (int l = 0; l < 32; ++l) {
    if (static_cast<unsigned>(this_warp->lanes[l]) == v) peers |= 1u << l;
  }
  this_warp->sync.arrive_and_wait();
  return peers;
}
inline unsigned __ballot_sync(unsigned, int predicate) {
  const unsigned lane = lane_id();
  this_warp->lanes[lane] = predicate != 0;
  this_warp->sync.arrive_and_wait();
  unsigned votes = 0;
  for (int l = 0; l < 32; ++l) {
    if (this_warp->lanes[l]) votes |= 1u << l;
  }
  this_warp->sync.arrive_and_wait();
  return votes;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}
inline unsigned __shfl_up_sync(unsigned, unsigned v, int delta) {
  const unsigned lane = lane_id();
  this_warp->lanes[lane] = v;
  this_warp->sync.arrive_and_wait();
  const unsigned out = lane >= static_cast<unsigned>(delta)
      ? static_cast<unsigned>(this_warp->lanes[lane - delta]) : v;
  this_warp->sync.arrive_and_wait();
  return out;
}
"""


class _TiedKeys:
    """Keys with ties only: all equal, or (floats) -0.0 and +0.0 interleaved, so that every
    digit pass moves nothing or only the sign split, and a pair's values must stay in order."""

    def _keys(self, n: int, dtype: str) -> np.ndarray:
        if dtype == "float32":
            keys = np.zeros(n, np.float32)
            keys[::3] = -0.0
            return keys
        return np.full(n, -(2**31), np.int32)


class TiedSort1d(_TiedKeys, Sort1dSpec):
    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        problem.args[0] = self._keys(shape[0], dtype)
        problem.references = [np.sort(problem.args[0].astype(np.float64))]
        return problem


class TiedPairs(_TiedKeys, Sort1dPairsSpec):
    def make_problem(self, shape, dtype, rng) -> Problem:
        problem = super().make_problem(shape, dtype, rng)
        x = problem.args[0] = self._keys(shape[0], dtype)
        order = radix.stable_order(x)
        problem.references = [np.sort(x.astype(np.float64)), order.astype(np.int64)]
        return problem


@pytest.fixture
def radix_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    include = cuda_emulation.cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    monkeypatch.setattr(cuda_emulation, "HEADER", cuda_emulation.HEADER + EXTRA)


#: (BLOCK, ITEMS) tiles the emulation can afford (threads are host threads): 2048 to 3072 keys.
TILES = ((128, 16), (256, 8), (128, 24), (256, 12), (128, 20))
LENGTHS = (1, 31, 2047, 2048, 2049, 3 * 2048 + 7, 9001)
#: The length every combination runs besides two of the rotation: several tiles of every size
#: above with a short last one (3 tiles of 2048 to 3072 keys). 9001, one tile more, stays in the
#: rotation only: every combination running it cost a fifth of the test's time.
SEVERAL_TILES = 3 * 2048 + 7


def _case(
    pairs: bool,
    block: int,
    items: int,
    bits: int,
    rank: str,
    n: int,
    dtype: str,
    hist: str = "scalar",
    **extra,
) -> Case:
    config = {"BLOCK": block, "ITEMS": items, "RADIX_BITS": bits, "RANK": rank, "HIST": hist}
    if pairs:
        return Case(extra.pop("spec", PAIRS), config, (n,), dtype, **extra)
    config.update(ALGO="radix", WARP_SHFL=0, SMEM_FUSE=1, FUSE=1)
    return Case(extra.pop("spec", SORT_1D), config, (n,), dtype, **extra)


class OneHistBlock(Sort1dSpec):
    """sort_1d whose histogram kernel runs as one block: each of its threads loops over the keys
    many times (the real grid gives the emulation's lengths one step or none)."""

    def steps(self, config, shape, dtype):
        out = []
        for step in super().steps(config, shape, dtype):
            if step.kernel == "radix_histogram":
                step = replace(step, launch=replace(step.launch, grid=(1, 1, 1)))
            out.append(step)
        return out


#: Lengths for the vector histograms: a few keys (no whole vector, or one), every remainder
#: modulo 4, one block whose threads run the unrolled loop (4093), several tiles.
VEC_LENGTHS = (3, 4093, 2049, SEVERAL_TILES, 6, 9001, 5)


def vector_hist_cases() -> list[Case]:
    """HIST vec4 and vec4_split4 on every digit width, keys and pairs (ranking methods and key
    types rotating), at two VEC_LENGTHS each; on arrays 1 to 3 keys past a 16-byte boundary
    (scalar heads of 3 to 1 keys) with every vector load bounds-checked; with one histogram
    block; on all-tied keys (every lane of a warp counting into the same bin)."""
    cases = []
    for h, hist in enumerate(radix.HISTS[1:]):
        for j, (bits, pairs) in enumerate(product(radix.RADIX_BITS, (False, True))):
            dtype = ("float32", "int32")[(j // 2 + h) % 2]
            rank = radix.RANKS[(j + h) % len(radix.RANKS)]
            for k in range(2):
                n = VEC_LENGTHS[(2 * j + k + h) % len(VEC_LENGTHS)]
                block, items = TILES[(j + k + h) % len(TILES)]
                cases.append(_case(pairs, block, items, bits, rank, n, dtype, hist))
        for offset, n in ((1, 2), (1, 4093), (2, 6), (3, SEVERAL_TILES), (2, 5)):
            pairs = offset == 2
            dtype = ("float32", "int32")[offset % 2]
            cases.append(
                _case(pairs, 128, 16, 8, "atomic", n, dtype, hist, offset=offset, bounds=True)
            )
        for dtype, offset in (("float32", 0), ("int32", 3)):
            spec = OneHistBlock()
            cases.append(
                _case(
                    False, 256, 8, 4 + 3 * h, "match", 9001, dtype, hist, spec=spec, offset=offset
                )
            )
        for dtype, tied in (("float32", TiedSort1d()), ("int32", TiedPairs())):
            pairs = isinstance(tied, Sort1dPairsSpec)
            cases.append(_case(pairs, 128, 16, 8, "atomic", 5000, dtype, hist, spec=tied))
    return cases


def emulated_cases() -> list[Case]:
    """With the scalar histogram: the first ranking method (match) on every combination of key
    type, digit width and keys/pairs at three lengths; every other method on every digit width
    and keys/pairs at SEVERAL_TILES and one length of the rotation, the key type alternating
    with the digit width (it changes the key transform of the first and last passes, not the
    ranking); all-tied keys for every method, both key types, keys and pairs. Then
    :func:`vector_hist_cases`."""
    cases = []
    combo = 0
    first, *others = radix.RANKS
    for dtype in ("float32", "int32"):
        for bits in radix.RADIX_BITS:
            for pairs in (False, True):
                combo += 1
                lengths = {LENGTHS[combo % 7], LENGTHS[(combo + 3) % 7], SEVERAL_TILES}
                for k, n in enumerate(sorted(lengths)):
                    block, items = TILES[(combo + k) % len(TILES)]
                    cases.append(_case(pairs, block, items, bits, first, n, dtype))
    for r, rank in enumerate(others):
        for j, (bits, pairs) in enumerate(product(radix.RADIX_BITS, (False, True))):
            dtype = ("float32", "int32")[(j // 2 + r) % 2]
            for k, n in enumerate(sorted({LENGTHS[(j + 3 * r) % 7], SEVERAL_TILES})):
                block, items = TILES[(j + r + k) % len(TILES)]
                cases.append(_case(pairs, block, items, bits, rank, n, dtype))
    # RANK=atomic's peers words (2 x 8 warps x 256 digits) outgrow a tile of 2048 keys: the keys'
    # region grows to hold them, and the values' region follows it.
    cases.append(_case(True, 256, 8, 8, "atomic", SEVERAL_TILES, "float32"))
    for dtype in ("float32", "int32"):
        for rank in radix.RANKS:
            for spec in (TiedSort1d(), TiedPairs()):
                config = {
                    "BLOCK": 128,
                    "ITEMS": 16,
                    "RADIX_BITS": 8,
                    "RANK": rank,
                    "HIST": "scalar",
                }
                if isinstance(spec, Sort1dSpec):
                    config.update(ALGO="radix", WARP_SHFL=0, SMEM_FUSE=1, FUSE=1)
                cases.append(Case(spec, config, (5000,), dtype))
    return cases + vector_hist_cases()


def test_radix_kernels_on_the_cpu(radix_emulation, tmp_path: Path) -> None:
    cases = emulated_cases()
    covered = {(c.spec.name, c.dtype, c.config["RADIX_BITS"]) for c in cases}
    assert len(covered) == 2 * 2 * len(radix.RADIX_BITS)
    assert {c.shape[0] for c in cases} >= set(LENGTHS)
    for rank in radix.RANKS:
        mine = [c for c in cases if c.config["RANK"] == rank]
        several = {(c.spec.name, c.config["RADIX_BITS"]) for c in mine if c.shape[0] >= 3 * 2048}
        assert len(several) == 2 * len(radix.RADIX_BITS), rank  # a short last tile each
        assert {c.dtype for c in mine} == {"float32", "int32"}
        assert {c.shape[0] for c in mine} >= {1, 31, 5000}  # a lone key, a partial warp, ties
    assert any(radix.match_words(c.config) > radix.tile(c.config) for c in cases)
    for hist in radix.HISTS[1:]:
        mine = [c for c in cases if c.config["HIST"] == hist]
        covered = {(c.spec.name, c.config["RADIX_BITS"]) for c in mine}
        assert len(covered) == 2 * len(radix.RADIX_BITS), hist
        assert {c.shape[0] % 4 for c in mine} == {0, 1, 2, 3}, hist
        assert {c.offset for c in mine if c.bounds} == {1, 2, 3}, hist
        assert {c.dtype for c in mine} == {"float32", "int32"}, hist
        assert any(isinstance(c.spec, OneHistBlock) for c in mine), hist
    for case in cases:
        assert case.spec.check(case.config, case.shape, case.dtype) is None, case
    failures = run_cases(cases, tmp_path, np.random.default_rng(5), binaries=2)
    assert not failures, "\n".join(failures[:10])


class ShortShared(Sort1dSpec):
    """sort_1d whose scatter passes are launched with ``short`` bytes less dynamic shared memory
    than radix.cu's layout (issue 32: 8900 of 8964 bytes at BLOCK=256, ITEMS=8, RADIX_BITS=4,
    one per-digit array missing)."""

    def __init__(self, short: int) -> None:
        super().__init__()
        self.short = short

    def steps(self, config, shape, dtype):
        out = []
        for step in super().steps(config, shape, dtype):
            if step.kernel == "radix_pass":
                launch = replace(step.launch, shared_bytes=step.launch.shared_bytes - self.short)
                step = replace(step, launch=launch)
            out.append(step)
        return out


def test_the_emulation_fails_a_launch_short_of_shared_memory(
    radix_emulation, tmp_path: Path
) -> None:
    """The bug class of issue 32 fails on the CPU: an access past the launch's bytes faults
    (64 short: the launch of the H200 failure), and a write into the padding up to the next
    16 bytes trips the canary (2 short)."""
    config = {"BLOCK": 256, "ITEMS": 8, "RADIX_BITS": 4, "RANK": "match", "ALGO": "radix"}
    config.update(WARP_SHFL=0, SMEM_FUSE=1, FUSE=1, HIST="scalar")
    assert radix.shared_bytes(config, pairs=False) == 8964
    cases = [Case(ShortShared(64), config, (1,), "float32")]
    cases.append(Case(ShortShared(2), config, (2049,), "int32"))
    failures = run_cases(cases, tmp_path, np.random.default_rng(1), binaries=1)
    assert len(failures) == 2, failures
    assert "exit 86" in failures[0] and "past the launch's 8900 bytes" in failures[0]
    assert "exit 87" in failures[1] and "8962-byte launch" in failures[1]


#: Bugs planted in radix_histogram's vector path (HIST 1, 2), each with what must catch it.
PLANTED = {
    "tail dropped": (
        "  if (g < n - body_end) hist_count(counts, to_ord(x[body_end + g], fmask));\n",
        "",
    ),
    "head ignored": (
        "const long long head = head_keys < n ? head_keys : n;",
        "const long long head = 0;",
    ),
    "one copy merged": (
        "for (int k = 0; k < kHistCopies; ++k) c += ",
        "for (int k = 0; k < 1; ++k) c += ",
    ),
    "loop bound off by one": (
        "for (; v + (kHistVecs - 1) * threads < vecs; v += kHistVecs * threads) {",
        "for (; v + (kHistVecs - 1) * threads <= vecs; v += kHistVecs * threads) {",
    ),
}


class Planted(OneHistBlock):
    """sort_1d (one histogram block) rendered from radix.cu with one of :data:`PLANTED`."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def template_for(self, config):
        return self.path


def test_the_emulation_fails_planted_histogram_bugs(radix_emulation, tmp_path: Path) -> None:
    """The vector histogram's cases fail when its scalar tail is dropped (4093 keys: one past
    the last whole vector), when it ignores the pointer's misalignment (a 16-byte load 4 bytes
    past a boundary faults, exit 88), when only one of vec4_split4's copies is merged, and when
    the unrolled loop loads one vector too many (a load past the array, exit 89)."""
    template = radix.TEMPLATE.read_text()
    cases = []
    for k, (name, (old, new)) in enumerate(PLANTED.items()):
        assert template.count(old) == 1, name
        path = tmp_path / f"planted{k}.cu"
        path.write_text(template.replace(old, new))
        hist = "vec4_split4" if name == "one copy merged" else "vec4"
        offset = 1 if name == "head ignored" else 0
        spec = Planted(path)
        cases.append(
            _case(False, 128, 16, 8, "match", 4093, "int32", hist, spec=spec, offset=offset)
        )
        cases[-1].bounds = True
    # The same cases from the real template pass.
    cases += [replace(c, spec=OneHistBlock()) for c in cases]
    failures = run_cases(cases, tmp_path, np.random.default_rng(2), binaries=1)
    assert len(failures) == len(PLANTED), failures
    tail, head, merge, bound = failures
    assert "output 1" in tail and "(4093,)" in tail
    assert "exit 88" in head and "misaligned 16-byte access" in head
    assert "output 1" in merge and "vec4_split4" in merge
    assert "exit 89" in bound and "outside every array" in bound
