"""softmax variants compile for sm_90 and sm_80, with sane ptxas resources.

CI compiles a covering sample of the variants described below (``compile_harness.
covering_sample``: every parameter value in every dtype, every pair under ``-m slow``, every
rendered switch, and per dtype,
register cap, CACHE and LANES the variant holding the most row bytes a thread), every other one
of them for sm_80; ``KATO_COMPILE_FULL=1`` compiles every one. "Every variant" means every
config ``check`` accepts for one representative shape per dtype
(4096 x 4096): the source of a CACHE=0/1 variant does not depend on the shape at all, and a
CACHE=2 variant only through ITEMS, so more shapes would multiply the compile time without
reaching new code paths. Rows that are not whole vectors compile another program (ROW_SPLIT:
scalar head and tail around the aligned vectors), so every VEC > 1 variant of 4096 x 4097 is
compiled too (sm_90 only: the code path is the same on sm_80). The default configs of a few
awkward shapes (odd sizes, 1e6 columns, rows shorter than a warp) are compiled as well.

"Every variant" is the warp-per-row and block-per-row programs (LANES=32). Sub-warp row groups
(LANES 4, 8, 16) differ from them only in the row loop and the shuffle width, so they are
compiled for sm_90 at 256 columns (the register cache up to its 16 vectors per thread) and at
257 (split rows), with two block sizes and two MIN_BLOCKS that give four register caps (255,
128, 64, 32): about 400 variants instead of the whole product's 3000.

Speed: a standalone nvcc run costs ~0.7 s, mostly nvcc start-up and parsing the CUDA headers,
and there are ~1200 variants per arch. The test therefore compiles them in batches: one
translation unit holds ``BATCH`` copies of the template, each with its own macros and with the
kernel and its helper namespace renamed (``softmax_kernel_7``, ``kato_softmax_7``). ptxas
reports every entry function separately and codegen is per kernel, so each variant's registers
and spills are what a standalone compile gives; ``test_batched_resources_match_standalone``
checks exactly that on a sample. Cold, on 2 cores, the whole module takes ~4-6 minutes.

The last test runs the kernel's logic on the CPU (see the section at the end).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from compile_harness import ARCHS as HARNESS_ARCHS
from compile_harness import FULL, compile_covering, covering_sample, distinct_variants
from cuda_emulation import FIBERS, HostBuild
from kato.kernels import DTYPES, Config, get_operator
from kato.kernels.softmax import (
    SPLIT_STATS_KERNEL,
    items_per_thread,
    register_cap,
    static_shared_bytes,
)
from kato.kernels.spec import template_source
from kato.tuner.nvcc import CompileError, KernelResources, compile_many, nvcc_available
from kato.tuner.space import SearchSpace

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("softmax")
SHAPE = (4096, 4096)
#: Rows of an odd length: every VEC > 1 renders ROW_SPLIT=1.
SPLIT_SHAPE = (4096, 4097)
SPLIT_ARCH = "sm_90"
AWKWARD_SHAPES = (
    (1, 1), (3000, 3001), (7, 1000003), (65536, 128), (8192, 32768), (4194304, 7), (99, 24)
)  # fmt: skip
#: Sub-warp row groups: whole-vector rows up to ITEMS=16 at LANES=4, and split rows.
SUB_WARP_SHAPE = (4096, 256)
SUB_WARP_SPLIT_SHAPE = (4096, 257)
#: (BLOCK_SIZE, MIN_BLOCKS) of the sub-warp variants: register caps 255, 128, 64 and 32.
CAPS = ((256, 0), (256, 2), (1024, 0), (1024, 2))
#: Override with e.g. KATO_COMPILE_TEST_ARCHS=sm_90 to halve the time of the exhaustive part.
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_90,sm_80").split(","))
BATCH = 64
#: Every macro a rendered source defines: a batch undefines them between its variants.
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.MULTILINE)
WORKERS = 2  # CI runners have 2 cores


@dataclass(frozen=True)
class Variant:
    config: Config
    dtype: str
    shape: tuple[int, int] = SHAPE

    @property
    def spec(self):
        return SPEC

    def source(self) -> str:
        return SPEC.render(self.config, self.shape, self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype} {self.shape} {self.config}"


@dataclass(frozen=True)
class Outcome:
    variant: Variant
    arch: str
    resources: KernelResources | None
    error: str | None = None


def variants(dtype: str, shape: tuple[int, int] = SHAPE, sub_warp: bool = False) -> list[Variant]:
    """The valid configs for ``shape`` with LANES=32 (or, ``sub_warp``, LANES < 32 with the
    block sizes and MIN_BLOCKS of four register caps), one per distinct rendered source."""
    space = SearchSpace(SPEC.params, lambda config: SPEC.check(config, shape, dtype))
    seen: set[str] = set()
    found = []
    for config in space.valid_configs():
        if sub_warp != (config["LANES"] < 32):
            continue
        if sub_warp and (config["BLOCK_SIZE"], config["MIN_BLOCKS"]) not in CAPS:
            continue
        variant = Variant(config, dtype, shape)
        source = variant.source()
        if source not in seen:
            seen.add(source)
            found.append(variant)
    return found


def split_variants(dtype: str) -> list[Variant]:
    """The valid configs of SPLIT_SHAPE that split rows (VEC > 1), one per distinct source."""
    found = [v for v in variants(dtype, SPLIT_SHAPE) if v.config["VEC"] > 1]
    assert all(SPEC.defines(v.config, v.shape, dtype).get("ROW_SPLIT") == 1 for v in found)
    return found


def sub_warp_variants(dtype: str) -> list[Variant]:
    """LANES < 32 at SUB_WARP_SHAPE, and the split ones (VEC > 1, 256 threads, no MIN_BLOCKS)
    at SUB_WARP_SPLIT_SHAPE."""
    split = [
        v
        for v in variants(dtype, SUB_WARP_SPLIT_SHAPE, sub_warp=True)
        if v.config["VEC"] > 1 and v.config["BLOCK_SIZE"] == 256 and v.config["MIN_BLOCKS"] == 0
    ]
    return variants(dtype, SUB_WARP_SHAPE, sub_warp=True) + split


def awkward_defaults(dtype: str) -> list[Variant]:
    return [Variant(SPEC.default_config(s, dtype), dtype, s) for s in AWKWARD_SHAPES]


def batch_source(batch: list[Variant]) -> str:
    """One translation unit holding every variant of ``batch``, kernel i as softmax_kernel_i
    (and a split variant's softmax_split_stats_i)."""
    parts = []
    for i, variant in enumerate(batch):
        source = variant.source()
        parts += [
            *(f"#define {name} {name}_{i}" for name in SPEC.kernel_names),
            f"#define KATO_NS kato_softmax_{i}",
            source,
            *(f"#undef {name}" for name in SPEC.kernel_names),
            "#undef KATO_NS",
            *(f"#undef {name}" for name in sorted(set(_DEFINE.findall(source)))),
        ]
    return "\n".join(parts) + "\n"


def _heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, register cap, CACHE, LANES): the most bytes of row a thread holds (CACHE=2)
    or loads at once, where a spill would show."""
    c = v.config
    vector = c["VEC"] * DTYPES[v.dtype][2]
    held = items_per_thread(c, v.shape[1]) * vector if c["CACHE"] == 2 else vector
    return (v.dtype, register_cap(c), c["CACHE"], c["LANES"]), held


def sample(found: list[Variant], pairs: bool) -> list[Variant]:
    """What is compiled: ``compile_harness.covering_sample`` (every one with FULL)."""
    return covering_sample(found, heaviest=_heaviest, pairs=pairs)


def _cost(variant: Variant) -> int:
    # Register-cache variants unroll ITEMS x VEC elements and take longer to build.
    return 2 if variant.config["CACHE"] == 2 else 1


def _compile_batches(batches: list[tuple[str, list[Variant]]], cache: Path) -> list[Outcome]:
    jobs = [(batch_source(b), f"{SPEC.kernel_name}_0", arch, ()) for arch, b in batches]
    found: list[Outcome] = []
    results = compile_many(jobs, max_workers=WORKERS, cache_dir=cache)
    for (arch, batch), result in zip(batches, results, strict=True):
        if isinstance(result, CompileError):
            found += _compile_one_by_one(batch, arch, cache)
            continue
        for i, variant in enumerate(batch):
            found.append(Outcome(variant, arch, result.resources(f"{SPEC.kernel_name}_{i}")))
    return found


def _compile_one_by_one(batch: list[Variant], arch: str, cache: Path) -> list[Outcome]:
    """A batch failed: compile its variants alone to name the culprits."""
    jobs = [(v.source(), SPEC.kernel_name, arch, ()) for v in batch]
    found = []
    for variant, result in zip(batch, compile_many(jobs, WORKERS, cache), strict=True):
        if isinstance(result, CompileError):
            found.append(Outcome(variant, arch, None, f"{result}\n{result.log[:1500]}"))
        else:
            found.append(Outcome(variant, arch, result.resources(SPEC.kernel_name)))
    return found


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    """Compile a covering sample of the variants (every one with FULL) plus the awkward
    defaults for sm_90, every other one of them for the other archs (all with FULL)."""
    batches: list[tuple[str, list[Variant]]] = []
    for dtype in SPEC.dtypes:
        todo = sample(variants(dtype), sample_pairs)
        todo = sorted(todo, key=_cost, reverse=True) + awkward_defaults(dtype)
        for arch in ARCHS:
            mine = todo if FULL or arch == SPLIT_ARCH else todo[::2]
            batches += [(arch, mine[i : i + BATCH]) for i in range(0, len(mine), BATCH)]
        if SPLIT_ARCH in ARCHS:
            split = sample(split_variants(dtype) + sub_warp_variants(dtype), sample_pairs)
            split = sorted(split, key=_cost)[::-1]
            batches += [(SPLIT_ARCH, split[i : i + BATCH]) for i in range(0, len(split), BATCH)]
    # Longest jobs first, so that the workers finish together.
    batches.sort(key=lambda job: sum(map(_cost, job[1])), reverse=True)

    start = time.perf_counter()
    found = _compile_batches(batches, cubin_cache)
    elapsed = time.perf_counter() - start

    spilling = [o for o in found if o.resources is not None and o.resources.spill_bytes]
    print(f"\ncompiled {len(found)} variants in {len(batches)} batches in {elapsed:.0f} s;")
    print(f"{len(spilling)} of them spill:")
    for o in spilling:
        regs = o.resources.registers if o.resources else 0
        print(f"  {o.arch} {o.variant}: {regs} regs, {o.resources.spill_bytes} spill bytes")
    return found


def test_space_has_variants_for_every_dtype_and_arch(outcomes: list[Outcome]) -> None:
    for dtype in SPEC.dtypes:
        expected = len(variants(dtype)) + len(AWKWARD_SHAPES)
        assert expected > 100
        split = len(split_variants(dtype))
        assert split > 100
        sub_warp = sub_warp_variants(dtype)
        assert {v.config["LANES"] for v in sub_warp} == {4, 8, 16}
        assert {v.config["CACHE"] for v in sub_warp} == {0, 1, 2}
        assert any(SPEC.defines(v.config, v.shape, dtype).get("ROW_SPLIT") for v in sub_warp)
        split += len(sub_warp)
        for arch in ARCHS:
            got = [o for o in outcomes if o.variant.dtype == dtype and o.arch == arch]
            if FULL:
                assert len(got) == expected + (split if arch == SPLIT_ARCH else 0)
            else:  # a covering sample reaches every LANES and CACHE on sm_90
                assert len(got) >= 10
                if arch == SPLIT_ARCH:
                    reached = {(o.variant.config["LANES"], o.variant.config["CACHE"]) for o in got}
                    assert reached == {(n, c) for n in (4, 8, 16, 32) for c in (0, 1, 2)}


def test_every_variant_compiles(outcomes: list[Outcome]) -> None:
    failed = [f"{o.arch} {o.variant}: {o.error}" for o in outcomes if o.error is not None]
    assert not failed, f"{len(failed)} variant(s) failed to compile:\n" + "\n".join(failed[:5])


def test_registers_are_sane_and_respect_launch_bounds(outcomes: list[Outcome]) -> None:
    bad = []
    for o in outcomes:
        if o.resources is None:
            continue
        regs, config = o.resources.registers, o.variant.config
        block, min_blocks = config["BLOCK_SIZE"], config["MIN_BLOCKS"]
        if not 1 <= regs <= 255:
            bad.append(f"{o.arch} {o.variant}: {regs} registers")
        if regs > register_cap(config):
            bad.append(f"{o.arch} {o.variant}: {regs} registers > cap {register_cap(config)}")
        if min_blocks > 0 and regs * block * min_blocks > 65536:
            bad.append(f"{o.arch} {o.variant}: {regs} registers x {block} x {min_blocks}")
    assert not bad, "\n".join(bad[:10])


def test_static_shared_memory_matches_the_spec(outcomes: list[Outcome]) -> None:
    """The spec adds static shared memory to its 227 KiB check; it must be what ptxas says."""
    bad = [
        f"{o.arch} {o.variant}: ptxas {o.resources.shared_static_bytes} bytes, "
        f"spec {static_shared_bytes(o.variant.config)}"
        for o in outcomes
        if o.resources is not None
        and o.resources.shared_static_bytes != static_shared_bytes(o.variant.config)
    ]
    assert not bad, "\n".join(bad[:10])


def test_register_cache_never_spills(outcomes: list[Outcome]) -> None:
    """check() rejects CACHE=2 configs whose row data cannot stay in registers; the rest must
    not spill, or CACHE=2 would silently be a slower CACHE=1 through local memory."""
    spills = [
        f"{o.arch} {o.variant}: {o.resources.spill_bytes} spill bytes, "
        f"{o.resources.registers} registers"
        for o in outcomes
        if o.resources is not None and o.variant.config["CACHE"] == 2 and o.resources.spill_bytes
    ]
    assert not spills, "\n".join(spills[:10])


def test_batched_resources_match_standalone(outcomes: list[Outcome], tmp_path: Path) -> None:
    """The batching trick is faithful: a sample of variants compiled alone, from the exact
    source the tuner compiles, reports the same registers, spills and shared memory."""
    by_key = {(o.arch, str(o.variant)): o for o in outcomes}
    sample = []
    for dtype in SPEC.dtypes:
        for arch in ARCHS:
            pool = [o.variant for o in outcomes if o.arch == arch and o.variant.dtype == dtype]
            picks = sorted({0, len(pool) // 3, 2 * len(pool) // 3, len(pool) - 1})
            sample += [(pool[i], arch) for i in picks]
        sub_warp = [o.variant for o in outcomes if o.variant.config["LANES"] < 32]
        sample.append((sub_warp[-1], SPLIT_ARCH))
    jobs = [(v.source(), SPEC.kernel_name, arch, ()) for v, arch in sample]
    results = compile_many(jobs, max_workers=WORKERS, cache_dir=tmp_path)
    for (variant, arch), result in zip(sample, results, strict=True):
        assert not isinstance(result, CompileError), f"{variant}: {result}"
        batched = by_key[(arch, str(variant))].resources
        assert batched is not None
        assert (result.registers, result.spill_bytes, result.shared_static_bytes) == (
            batched.registers,
            batched.spill_bytes,
            batched.shared_static_bytes,
        ), f"{arch} {variant}"


# --- few long rows: STRATEGY 2 (a block per piece, two kernels) ------------------------------
#
# Split variants are valid only where rows are few and long, so they are enumerated at two such
# shapes per dtype: whole-vector rows, and rows with a scalar head and tail (ROW_SPLIT). Their
# source depends on the shape only through ROW_SPLIT. compile_harness's covering sample (every
# one with FULL), both kernels of each, for every arch of KATO_COMPILE_TEST_ARCHS.

SPLIT_ROW_SHAPES = ((8, 2**20), (8, 2**20 + 1))


def split_row_variants() -> list:
    """Every distinct STRATEGY 2 source of SPLIT_ROW_SHAPES, every dtype."""
    cases = [(shape, dtype) for dtype in SPEC.dtypes for shape in SPLIT_ROW_SHAPES]
    return [v for v in distinct_variants(SPEC, cases) if v.config["STRATEGY"] == 2]


@pytest.fixture(scope="module")
def split_outcomes(cubin_cache: Path, sample_pairs: bool) -> list:
    variants = split_row_variants()
    return compile_covering("softmax STRATEGY 2", variants, cubin_cache, pairs=sample_pairs)


def test_split_variants_cover_the_space(split_outcomes: list) -> None:
    found = split_row_variants()
    # One source per (dtype, BLOCK_SIZE, VEC, MIN_BLOCKS, ROW_SPLIT) that check() admits.
    assert len(found) > 200
    got = {o.variant.dtype for o in split_outcomes}
    assert got == set(SPEC.dtypes)
    assert {o.arch for o in split_outcomes} == set(HARNESS_ARCHS)
    for key in ("BLOCK_SIZE", "VEC", "MIN_BLOCKS"):
        assert {o.variant.config[key] for o in split_outcomes} == set(SPEC.params[key]), key
    assert {bool(o.variant.shape[1] % o.variant.config["VEC"]) for o in split_outcomes} == {
        True,
        False,
    }


def test_split_variants_compile_both_kernels_within_bounds(split_outcomes: list) -> None:
    """Both kernels of every split variant compile, within the register cap of their launch
    bounds, with the static shared memory the spec counts; spills are printed (a streaming
    pass holds no row data: a few spilled bytes cost little there, as for STRATEGY 1)."""
    bad = [f"{o.arch} {o.variant}: {o.error}" for o in split_outcomes if o.error]
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad[:5])
    for o in split_outcomes:
        assert set(o.resources) == {SPEC.kernel_name, SPLIT_STATS_KERNEL}, o.variant
        for name, res in o.resources.items():
            cap = register_cap(o.variant.config)
            assert 1 <= res.registers <= cap, f"{o.arch} {o.variant} {name}: {res.registers}"
            assert res.shared_static_bytes == static_shared_bytes(o.variant.config), o.variant
            if res.spill_bytes:
                print(f"  {o.arch} {o.variant} {name}: {res.spill_bytes} spill bytes")


# --- the kernel's logic, run on the CPU -------------------------------------------------------
#
# CI has no GPU, so the template is also compiled as host C++ (g++, C++20) against a small emulation
# of the CUDA features it uses: one fiber per CUDA thread (cuda_emulation.FIBERS), its barriers for
# __syncthreads and for warp shuffles, a static array for shared memory. Its output is then verified
# against the float64 reference with the spec's tolerances, as the GPU backend does. This runs the
# real indexing, guards, reductions and grid-stride loops on every code path (strategy x cache x
# vector width x dtype; sub-warp row groups: test_softmax_emulation.py) on awkward shapes; only exp2
# (libm instead of ex2.approx) and the memory hierarchy differ.

EMULATION_HEADER = (
    r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#include <vector_types.h>
#include <vector_functions.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
uint3 threadIdx, blockIdx, blockDim, gridDim;
"""
    + FIBERS
    + r"""
struct Warp { float lanes[32]; EmuBarrier sync{32}; };
Warp* this_warp;
EmuBarrier* this_block;
inline void __syncthreads() { this_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const int lane = threadIdx.x & 31;
  this_warp->lanes[lane] = v;
  this_warp->sync.arrive_and_wait();
  const float other = this_warp->lanes[lane ^ offset];
  this_warp->sync.arrive_and_wait();
  return other;
}
// Global loads and stores fault on a misaligned address, as on the GPU (a vector of 16 bytes
// must be 16-byte aligned): exit 88.
template <class V> inline const V* aligned(const V* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(V) != 0) {
    std::fprintf(stderr, "misaligned %zu-byte access at %p\n", sizeof(V), (const void*)p);
    std::_Exit(88);
  }
  return p;
}
template <class V> inline V __ldg(const V* p) { return *aligned(p); }
template <class V> inline V __ldcs(const V* p) { return *aligned(p); }
template <class V> inline void __stcs(V* p, V v) { *const_cast<V*>(aligned(p)) = v; }
inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
alignas(16) unsigned char kato_smem[232448];
template <class F> void launch(F kernel, unsigned grid, unsigned block) {
  for (unsigned b = 0; b < grid; ++b) {
    std::memset(kato_smem, 0xcd, sizeof kato_smem);  // stale shared memory must not matter
    EmuBarrier sync{block};
    std::vector<Warp> warps(block / 32);
    blockIdx = make_uint3(b, 0, 0);
    blockDim = make_uint3(block, 1, 1);
    gridDim = make_uint3(grid, 1, 1);
    this_block = &sync;
    emu_run_block(kernel, block, b, [&](unsigned t) {
      threadIdx = make_uint3(t, 0, 0);
      this_warp = &warps[t / 32];
    });
  }
}
#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""
)
EMULATED_SHAPES = ((7, 31), (6, 200), (3, 98), (2, 4104), (40, 8), (1, 1))
#: Odd, prime and just-past-a-power-of-two row lengths: with VEC > 1 every row is split into a
#: scalar head, aligned vectors and a scalar tail, each row at another offset (issue 31).
SPLIT_SHAPES = ((5, 3), (4, 127), (3, 1000), (9, 97), (2, 4097), (2, 50257))
#: Element offsets of x and y from a 16-byte boundary that split cases cycle through (a view's
#: data pointer, as kato_torch may pass it; x and y congruent): 0 is cudaMalloc's.
SPLIT_OFFSETS = (0, 1, 3)
_DYNAMIC_SHARED = "extern __shared__ __align__(16) unsigned char kato_smem[];"


def _cuda_include_dir() -> Path | None:
    """Where nvcc finds cuda_fp16.h (from ``nvcc -dryrun``'s INCLUDES line)."""
    proc = subprocess.run(
        ["nvcc", "-dryrun", "-cubin", "-arch=sm_90", "-x", "cu", "-o", "/dev/null", "/dev/null"],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r'INCLUDES="-I([^"]+)"', proc.stdout + proc.stderr)
    return Path(match.group(1).strip()) if match else None


def emulated_cases() -> list[tuple[Variant, int, int]]:
    """``(variant, grid, offset)``: every (dtype, strategy, cache) on every shape, block sizes
    cycling through the space; every other case runs on a 2-block grid to exercise the row
    loops. EMULATED_SHAPES take the widest valid vector at offset 0; SPLIT_SHAPES cycle the
    first vector tried through every VEC and x and y through SPLIT_OFFSETS."""
    blocks = SPEC.params["BLOCK_SIZE"]
    cases = []
    for dtype in SPEC.dtypes:
        for shape in EMULATED_SHAPES + SPLIT_SHAPES:
            split = shape in SPLIT_SHAPES
            for strategy, cache in itertools.product((0, 1), (0, 1, 2)):
                vecs = (8, 4, 2, 1)
                if split:  # a different first VEC for every case
                    vecs = vecs[len(cases) % 4 :] + vecs[: len(cases) % 4]
                for attempt in range(len(blocks) * 4):
                    config = {
                        "BLOCK_SIZE": blocks[(len(cases) + attempt) % len(blocks)],
                        "VEC": vecs[attempt // len(blocks)],
                        "STRATEGY": strategy,
                        "CACHE": cache,
                        "MIN_BLOCKS": 0,
                        "LANES": 32,
                    }
                    if SPEC.check(config, shape, dtype) is None:
                        full_grid = SPEC.launch(config, shape, dtype).grid[0]
                        grid = full_grid if len(cases) % 2 else min(full_grid, 2)
                        # A shifted base is for split rows only: whole-vector rows
                        # (ROW_SPLIT=0) need x and y aligned to the vector.
                        whole = shape[1] % config["VEC"] == 0
                        offset = 0 if whole or not split else SPLIT_OFFSETS[len(cases) % 3]
                        cases.append((Variant(config, dtype, shape), grid, offset))
                        break
    return cases


def emulation_source(cases: list[tuple[Variant, int, int]]) -> str:
    template = template_source(SPEC.template)  # the shared headers inlined
    assert _DYNAMIC_SHARED in template  # the emulation provides kato_smem itself
    host_template = template.replace(_DYNAMIC_SHARED, "").replace("__shared__", "static")
    parts = [EMULATION_HEADER]
    dispatch = []
    template_macros = set(_DEFINE.findall(host_template))
    for i, (variant, grid, _) in enumerate(cases):
        macros = SPEC.defines(variant.config, variant.shape, variant.dtype)
        parts += [
            f"#define {SPEC.kernel_name} {SPEC.kernel_name}_{i}",
            f"#define KATO_NS kato_softmax_{i}",
            *(f"#define {name} {value}" for name, value in macros.items()),
            host_template,
            f"#undef {SPEC.kernel_name}",
            "#undef KATO_NS",
            *(f"#undef {name}" for name in sorted(template_macros | set(macros))),
        ]
        ctype = DTYPES[variant.dtype][1]
        rows, cols = variant.shape
        dispatch.append(
            f"case {i}: launch([&] {{ {SPEC.kernel_name}_{i}(({ctype}*)(x.data() + off), "
            f"({ctype}*)(y.data() + off), {rows}, {cols}); }}, {grid}, "
            f"{variant.config['BLOCK_SIZE']}); "
            "break;"
        )
    parts.append(
        "int main(int argc, char** argv) {\n"
        '  FILE* f = std::fopen(argv[2], "rb");\n'
        "  std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);\n"
        "  const long off = std::atol(argv[4]);  // bytes past a 16-byte boundary (malloc's)\n"
        "  std::vector<unsigned char> x(n + off), y(n + off, 0xff);\n"
        "  if (std::fread(x.data() + off, 1, n, f) != (size_t)n) return 2;\n"
        "  std::fclose(f);\n"
        "  switch (std::atoi(argv[1])) {\n" + "\n".join(dispatch) + "\n  default: return 3;\n  }\n"
        '  f = std::fopen(argv[3], "wb"); std::fwrite(y.data() + off, 1, n, f); std::fclose(f);\n'
        "  return 0;\n}\n"
    )
    return "\n".join(parts)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_kernel_logic_on_the_cpu(tmp_path: Path) -> None:
    include = _cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    cases = emulated_cases()
    # Every code path is covered (not every shape admits every path: 4104 columns do not fit
    # a warp's registers).
    covered = {(v.dtype, v.config["STRATEGY"], v.config["CACHE"]) for v, _, _ in cases}
    assert len(covered) == len(SPEC.dtypes) * 2 * 3
    assert {v.config["VEC"] for v, _, _ in cases} == set(SPEC.params["VEC"])
    assert {v.config["BLOCK_SIZE"] for v, _, _ in cases} == set(SPEC.params["BLOCK_SIZE"])
    # Split rows: every (dtype, VEC > 1) and every (strategy, cache) at a shifted base.
    split = [(v, off) for v, _, off in cases if v.shape[1] % v.config["VEC"]]
    assert {(v.dtype, v.config["VEC"]) for v, _ in split} >= {
        (d, vec) for d in SPEC.dtypes for vec in (2, 4, 8) if vec * DTYPES[d][2] <= 16
    }
    assert {(v.config["STRATEGY"], v.config["CACHE"]) for v, off in split if off} == set(
        itertools.product((0, 1), (0, 1, 2))
    )
    # Two binaries built in parallel (2 cores); each holds every other case.
    halves = [cases[0::2], cases[1::2]]
    builds = []
    for k, half in enumerate(halves):
        (tmp_path / f"emu{k}.cpp").write_text(emulation_source(half))
        builds.append(HostBuild(tmp_path, f"emu{k}.cpp", f"emu{k}", include))
    for build in builds:
        returncode, err = build.wait(timeout=600)
        assert returncode == 0, err[:3000]

    rng = np.random.default_rng(2024)
    failures = []
    for k, half in enumerate(halves):
        for i, (variant, grid, offset) in enumerate(half):
            problem = SPEC.make_problem(variant.shape, variant.dtype, rng)
            x = problem.args[0]
            x.tofile(tmp_path / "x.bin")
            run = subprocess.run(
                [str(tmp_path / f"emu{k}"), str(i), "x.bin", "y.bin", str(offset * x.itemsize)],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if run.returncode != 0:
                failures.append(f"{variant} offset={offset}: exit {run.returncode} {run.stderr}")
                continue
            y = np.fromfile(tmp_path / "y.bin", dtype=x.dtype).reshape(variant.shape)
            atol, rtol = SPEC.tolerance(variant.dtype)
            reference = problem.references[0]
            if not np.allclose(y.astype(np.float64), reference, atol=atol, rtol=rtol):
                error = np.nanmax(np.abs(y.astype(np.float64) - reference))
                failures.append(f"{variant} grid={grid} offset={offset}: max error {error}")
    assert not failures, "\n".join(failures)
