"""Every valid mma.sync variant of matmul, matmul_nt and matmul_tn compiles for sm_80 and
sm_90, with the resources the spec models (the wgmma variants: test_matmul_wgmma_compile.py).

The rendered source depends on the shape only through its alignment class (which of A, B and C
have row pitches that are multiples of VEC: ``MatmulSpec.alignment``). Compiled, in batches
through ``tests/kernels/compile_harness.py``: a covering sample (``covering_sample``, with the
variant of most modelled registers per dtype, register cap and VEC) of the configs ``check``
accepts for matmul at 4096^3 (every matrix aligned; VEC 4/8 and the scalar VEC=1 are both
valid) and at the awkward shapes, for both archs, the default
configs of a few awkward shapes, and for every operator, dtype and alignment class (4096^3,
4096x4095x4096, 4095x4096x4095, 127x129x131 reach all four of each layout) the variants with
the most registers per launch-bounds cap and one per VEC and STAGES, for sm_90.
``KATO_COMPILE_FULL=1`` compiles every distinct variant of every class for both archs instead
(~2000 sources: run it on a machine with many cores; ``KATO_COMPILE_WORKERS``, default the CPU
count there). Checked: no compile errors, registers within the ``__launch_bounds__`` cap, no
spills at all (check() rejects tiles that would spill), no static shared memory (every buffer is
dynamic, as ``shared_bytes`` models it).

The last test runs the template itself on the CPU (see the section at the end).

Time: ~206 + ~150 distinct sources, ~2-3 min of compiler CPU time cold (a warm cubin cache
compiles nothing), plus ~1 min CPU for the emulation's g++ builds and runs.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from compile_harness import Outcome, Variant, compile_variants, covering_sample, distinct_variants
from cuda_emulation import FIBERS, HostBuild
from kato.kernels import get_operator
from kato.kernels.matmul import (
    FP32_TILES,
    MMA_PINNED,
    register_cap,
    registers_needed,
    static_shared_bytes,
    threads_per_block,
)
from kato.kernels.spec import Config, template_source
from kato.tuner.nvcc import nvcc_available

pytestmark = pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")

SPEC = get_operator("matmul")
SPECS = tuple(get_operator(name) for name in ("matmul", "matmul_nt", "matmul_tn"))
SHAPE = (4096, 4096, 4096)
#: With SHAPE, every alignment class of every layout: (K, N) of matmul and matmul_nt, (M, N) of
#: matmul_tn aligned or not, in all four combinations.
CLASS_SHAPES = (SHAPE, (4096, 4095, 4096), (4095, 4096, 4095), (127, 129, 131))
AWKWARD_SHAPES = ((1, 1, 1), (127, 131, 257), (70000, 64, 64), (1, 4096, 4096), (33, 8191, 17))
FULL = os.environ.get("KATO_COMPILE_FULL") == "1"
#: Override with e.g. KATO_COMPILE_TEST_ARCHS=sm_90 to halve the time.
ARCHS = tuple(os.environ.get("KATO_COMPILE_TEST_ARCHS", "sm_80,sm_90").split(","))
BATCH = 16  # tensor-core variants are large: small batches keep both workers busy to the end
WORKERS = int(os.environ.get("KATO_COMPILE_WORKERS", os.cpu_count() if FULL else 2) or 2)


def _by_class(spec, variants: list[Variant]) -> dict[tuple, list[Variant]]:
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        key = (v.dtype, spec.alignment(v.config, v.shape))
        groups.setdefault(key, []).append(v)
    return groups


@functools.cache
def _mma_candidates(spec, dtype: str) -> tuple[Config, ...]:
    """``spec.candidates``' mma.sync configs, listed once per dtype rather than once per shape
    (62,000 configs, seconds a listing): MatmulSpec lists them by dtype alone
    (test_candidates_depend_on_the_dtype_alone)."""
    return tuple(c for c in spec.candidates(SHAPE, dtype) if c["ENGINE"] == "mma")


def mma_variants(spec, cases) -> list[Variant]:
    """The distinct mma.sync variants of the cases (the wgmma ones, sm_90a only, are
    test_matmul_wgmma_compile.py's)."""
    found = distinct_variants(spec, cases, lambda dtype: _mma_candidates(spec, dtype))
    return [v for v in found if v.config["ENGINE"] == "mma"]


def test_candidates_depend_on_the_dtype_alone() -> None:
    """What :func:`_mma_candidates` relies on: the three layouts share MatmulSpec's listing,
    and it is the same list at an awkward shape as at SHAPE."""
    assert all(type(spec).candidates is type(SPEC).candidates for spec in SPECS)
    for dtype in ("float32", "float16"):
        assert SPEC.candidates((127, 129, 131), dtype) == SPEC.candidates(SHAPE, dtype), dtype


def class_sample(spec) -> list[Variant]:
    """Every distinct variant of every alignment class with FULL; else, per (dtype, class), the
    two with the highest modelled registers per cap and one per (VEC, STAGES)."""
    every = mma_variants(spec, [(s, d) for s in CLASS_SHAPES for d in spec.dtypes])
    if FULL:
        return every
    chosen = []
    for group in _by_class(spec, every).values():

        def load(v: Variant) -> float:
            aligned = v.spec.alignment(v.config, v.shape)[:2]
            return registers_needed(v.config, v.dtype, aligned) / register_cap(v.config)

        picks = sorted(group, key=load, reverse=True)[:2]
        seen = {(v.config["VEC"], v.config["STAGES"]) for v in picks}
        for v in group:
            if (v.config["VEC"], v.config["STAGES"]) not in seen:
                seen.add((v.config["VEC"], v.config["STAGES"]))
                picks.append(v)
        chosen += picks
    return chosen


def _heaviest(v: Variant) -> tuple[tuple, float]:
    """Per (dtype, register cap, VEC): the most modelled registers, the spill boundary."""
    aligned = v.spec.alignment(v.config, v.shape)[:2]
    need = registers_needed(v.config, v.dtype, aligned)
    return (v.dtype, register_cap(v.config), v.config["VEC"]), need


def variants_and_archs(pairs: bool) -> list[tuple[Variant, tuple[str, ...]]]:
    """(variant, archs): a covering sample of matmul's aligned space and of its awkward shapes
    (every variant with FULL), and the awkward defaults, for every arch; the class samples
    for sm_90 alone unless FULL. No source twice."""
    out, seen = [], set()

    def add(variants, archs):
        for v in variants:
            if v.source() not in seen:
                seen.add(v.source())
                # float32's SPLIT_K > 1 (clusters) builds for sm_90 and later only
                ok = tuple(a for a in archs if v.spec.check_arch(v.config, a) is None)
                out.append((v, ok))

    cases = [(SHAPE, d) for d in SPEC.dtypes] + [
        (s, d) for d in SPEC.dtypes for s in AWKWARD_SHAPES
    ]
    add(covering_sample(mma_variants(SPEC, cases), heaviest=_heaviest, pairs=pairs), ARCHS)
    for spec in SPECS:
        add(class_sample(spec), ARCHS if FULL else ARCHS[-1:])
        defaults = [
            Variant(spec, spec.default_config(s, d), s, d)
            for s in AWKWARD_SHAPES
            for d in spec.dtypes
        ]
        add(defaults, ARCHS)
    return out


@pytest.fixture(scope="module")
def outcomes(cubin_cache: Path, sample_pairs: bool) -> list[Outcome]:
    planned = variants_and_archs(sample_pairs)
    start = time.perf_counter()
    found = []
    for archs in sorted({a for _, a in planned}):
        variants = [v for v, a in planned if a == archs]
        # Tensor-core variants first (the slowest to build), so that the workers finish together.
        variants.sort(key=lambda v: v.dtype == "float32")
        found += compile_variants(variants, archs, cubin_cache, batch=BATCH, workers=WORKERS)
    print(f"\ncompiled {len(planned)} variants in {time.perf_counter() - start:.0f} s")
    return found


def test_space_has_variants_for_every_dtype_and_arch(
    outcomes: list[Outcome], sample_pairs: bool
) -> None:
    for dtype in SPEC.dtypes:
        assert 60 <= len(mma_variants(SPEC, [(SHAPE, dtype)])) <= 160, dtype
        for arch in ARCHS:
            got = [
                o
                for o in outcomes
                if o.variant.dtype == dtype
                and o.arch == arch
                and o.variant.spec is SPEC
                and o.variant.shape == SHAPE
            ]
            # the rest of the covering sample is at AWKWARD_SHAPES (float32's SPLIT_K there)
            assert len(got) >= (6 if sample_pairs else 4), (dtype, arch, len(got))


def test_every_layout_dtype_and_alignment_class_is_compiled(outcomes: list[Outcome]) -> None:
    """Each operator reaches four alignment classes per dtype; each is compiled, VEC 1 too."""
    for spec in SPECS:
        for dtype in spec.dtypes:
            got = {
                (spec.alignment(o.variant.config, o.variant.shape), o.variant.config["VEC"])
                for o in outcomes
                if o.variant.spec is spec and o.variant.dtype == dtype
            }
            classes = {a for a, vec in got if vec > 1}
            assert len(classes) == 4, (spec.name, dtype, classes)
            assert any(vec == 1 for _, vec in got), (spec.name, dtype)


def test_float32_split_k_is_compiled_for_sm_90_only(outcomes: list[Outcome]) -> None:
    """Every SPLIT_K value of the float32 path reaches the sample (at the awkward shapes, where
    tiles are few) and builds for sm_90; never for an arch without clusters."""
    split = [
        o for o in outcomes if o.variant.dtype == "float32" and o.variant.config["SPLIT_K"] > 1
    ]
    assert {o.variant.config["SPLIT_K"] for o in split if o.arch == "sm_90"} == {2, 3, 4}
    assert not [o for o in split if o.arch == "sm_80"]


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
            aligned = o.variant.spec.alignment(o.variant.config, o.variant.shape)[:2]
            model = registers_needed(o.variant.config, o.variant.dtype, aligned)
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
    from kato.tuner.nvcc import compile_many

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


# --- the kernels' logic on the CPU -------------------------------------------------------------
#
# The template compiled by g++ as C++ with one fiber per CUDA thread (cuda_emulation.FIBERS):
# __syncthreads is a block barrier, and the warp-collective PTX (ldmatrix, mma.sync) is emulated per
# its PTX ISA fragment layouts through per-warp exchange arrays (KATO_EMULATION routes the
# template's PTX helpers to the kato_emu_* functions below; cp.async becomes a synchronous copy).
# Every output element is compared with the float64 reference, with the spec's tolerance, after C
# was poisoned with 0xFF bytes (NaN). This runs exactly the index arithmetic, guards, swizzles and
# barrier placement the GPU runs; what it cannot check is the hardware's own semantics.

EMULATION_HEADER = (
    r"""
#include <cmath>
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
#define __restrict__ __restrict
#define KATO_EMULATION 1
#include <cuda_fp16.h>
#include <cuda_bf16.h>
uint3 threadIdx, blockIdx, blockDim, gridDim;
"""
    + FIBERS
    + r"""
struct Warp {
  unsigned addr[32];
  unsigned a[32][4];
  unsigned b[32][2];
  EmuBarrier sync{32};
};
Warp* this_warp;
EmuBarrier* this_block;
inline void __syncthreads() { this_block->arrive_and_wait(); }
inline int min(int a, int b) { return a < b ? a : b; }
template <class V> inline V __ldg(const V* p) { return *p; }
alignas(16) unsigned char kato_smem[232448];
inline unsigned kato_emu_smem_offset(const void* p) {
  return (unsigned)((const unsigned char*)p - kato_smem);
}
inline void kato_emu_cp_async16(unsigned dst, const void* src, int bytes) {
  if (bytes == 16) std::memcpy(kato_smem + dst, src, 16);
  else std::memset(kato_smem + dst, 0, 16);
}
inline unsigned short kato_emu_u16(unsigned addr, int i) {
  unsigned short v;
  std::memcpy(&v, kato_smem + addr + 2 * i, 2);
  return v;
}
// ldmatrix.x4: lane l gives the row address of row l % 8 of matrix l / 8. Without .trans lane l
// gets, of each matrix, row l / 4, elements 2 (l % 4) and +1; with .trans, column l / 4, rows
// 2 (l % 4) and +1. The first element is the low half of the register.
inline void kato_emu_ldmatrix_x4(unsigned (&r)[4], unsigned addr, bool trans) {
  const int lane = threadIdx.x & 31;
  Warp& w = *this_warp;
  w.addr[lane] = addr;
  w.sync.arrive_and_wait();
  for (int q = 0; q < 4; ++q) {
    unsigned short e[2];
    for (int h = 0; h < 2; ++h) {
      if (!trans) e[h] = kato_emu_u16(w.addr[8 * q + lane / 4], 2 * (lane % 4) + h);
      else e[h] = kato_emu_u16(w.addr[8 * q + 2 * (lane % 4) + h], lane / 4);
    }
    r[q] = (unsigned)e[0] | ((unsigned)e[1] << 16);
  }
  w.sync.arrive_and_wait();
}
template <class T> inline float kato_emu_float(unsigned short bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  return (float)v;
}
// mma.m16n8k16 (row.col): A fragment a0:(g, 2t..) a1:(g+8, 2t..) a2:(g, 2t+8..) a3:(g+8, 2t+8..);
// B fragment b0:(k 2t.., n g) b1:(k 2t+8.., n g); C c0,c1:(g, 2t..) c2,c3:(g+8, 2t..).
template <class T> inline void kato_emu_mma16816(float (&c)[4], const unsigned (&a)[4],
                                                 unsigned b0, unsigned b1) {
  const int lane = threadIdx.x & 31;
  Warp& w = *this_warp;
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.sync.arrive_and_wait();
  auto A = [&](int row, int k) {
    const int reg = (row >= 8) + 2 * (k >= 8);
    const unsigned v = w.a[(row % 8) * 4 + (k % 8) / 2][reg];
    return kato_emu_float<T>((unsigned short)(k % 2 ? v >> 16 : v & 0xffff));
  };
  auto B = [&](int k, int n) {
    const unsigned v = w.b[n * 4 + (k % 8) / 2][k >= 8];
    return kato_emu_float<T>((unsigned short)(k % 2 ? v >> 16 : v & 0xffff));
  };
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    c[e] += sum;
  }
  w.sync.arrive_and_wait();
}
template <class F> void launch(F kernel, unsigned gx, unsigned gy, unsigned block) {
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      std::memset(kato_smem, 0xcd, sizeof kato_smem);  // stale shared memory must not matter
      EmuBarrier sync{block};
      std::vector<Warp> warps(block / 32);
      blockIdx = make_uint3(bx, by, 0);
      blockDim = make_uint3(block, 1, 1);
      gridDim = make_uint3(gx, gy, 1);
      this_block = &sync;
      emu_run_block(kernel, block, by * gx + bx, [&](unsigned t) {
        threadIdx = make_uint3(t, 0, 0);
        this_warp = &warps[t / 32];
      });
    }
}
"""
)
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


def _fp32(bm, bn, wm, wn, tm, tn, bk, vec, stages=2, pad=4):
    return {
        "BM": bm,
        "BN": bn,
        "BK": bk,
        "WM": wm,
        "WN": wn,
        "TM": tm,
        "TN": tn,
        "VEC": vec,
        "STAGES": stages,
        "PAD": pad,
        "MIN_BLOCKS": 0,
        "ENGINE": "mma",
        **MMA_PINNED,
    }


def _tc(bm, bn, wm, wn, bk, vec, stages):
    return {
        "BM": bm,
        "BN": bn,
        "BK": bk,
        "WM": wm,
        "WN": wn,
        "TM": 4,
        "TN": 4,
        "VEC": vec,
        "STAGES": stages,
        "PAD": 0,
        "MIN_BLOCKS": 0,
        "ENGINE": "mma",
        **MMA_PINNED,
    }


NN, NT, TN = (get_operator(name) for name in ("matmul", "matmul_nt", "matmul_tn"))

#: (spec, config, shape, dtype). matmul: every float32 tile layout, both vector widths and both
#: STAGES; every tensor-core stage count, both BK, both vector widths, all warp shapes; shapes
#: with tails in M, N and K (and K shorter than the pipeline depth), a 2-group grid, M = 1.
#: Then every layout with VEC > 1 in each alignment class it has (both operands aligned, one,
#: none; C aligned or not), and VEC = 1, on both paths.
EMULATED = [
    (NN, _fp32(64, 64, 16, 32, 4, 4, 8, 1), (70, 75, 37), "float32"),
    (NN, _fp32(64, 64, 16, 32, 4, 4, 16, 4, 1, 0), (136, 68, 36), "float32"),
    (NN, _fp32(128, 128, 32, 64, 8, 8, 8, 4), (130, 132, 20), "float32"),
    (NN, _fp32(128, 128, 64, 32, 8, 8, 16, 4, 1, 4), (129, 60, 52), "float32"),
    (NN, _fp32(128, 64, 32, 64, 8, 8, 8, 1), (1, 70, 9), "float32"),
    (NN, _fp32(64, 128, 32, 64, 8, 8, 16, 4), (600, 132, 40), "float32"),
    (NN, _fp32(128, 128, 32, 32, 8, 4, 8, 1), (131, 129, 3), "float32"),
    (NN, _fp32(128, 256, 32, 64, 8, 8, 8, 4, 2, 0), (100, 260, 24), "float32"),
    (NN, _fp32(256, 128, 64, 32, 8, 8, 16, 4, 1, 4), (260, 100, 36), "float32"),
    (NN, _tc(128, 128, 64, 64, 32, 8, 3), (136, 136, 104), "float16"),
    (NN, _tc(128, 128, 64, 64, 32, 1, 2), (131, 129, 70), "bfloat16"),
    (NN, _tc(64, 64, 32, 32, 64, 8, 4), (1, 72, 200), "bfloat16"),
    (NN, _tc(64, 64, 32, 32, 32, 1, 2), (600, 65, 33), "float16"),
    (NN, _tc(128, 128, 32, 64, 64, 8, 2), (130, 136, 16), "float16"),
    (NN, _tc(128, 64, 64, 32, 64, 8, 3), (129, 64, 136), "bfloat16"),
    (NN, _tc(64, 128, 32, 64, 32, 8, 4), (70, 200, 264), "float16"),
    (NN, _tc(256, 128, 64, 64, 32, 8, 4), (257, 136, 40), "bfloat16"),
    # matmul, unaligned: K and N odd; K odd, N aligned; K aligned, N odd (C unaligned).
    (NN, _fp32(64, 64, 16, 32, 4, 4, 16, 4), (70, 75, 37), "float32"),
    (NN, _fp32(128, 128, 32, 64, 8, 8, 8, 4, 1, 0), (130, 132, 21), "float32"),
    (NN, _fp32(64, 128, 32, 64, 8, 8, 8, 4), (65, 131, 40), "float32"),
    (NN, _tc(128, 128, 64, 32, 32, 8, 2), (131, 129, 70), "float16"),
    (NN, _tc(64, 128, 32, 64, 32, 8, 3), (130, 136, 33), "bfloat16"),
    (NN, _tc(64, 64, 32, 32, 64, 8, 4), (67, 131, 72), "float16"),
    (NN, _tc(64, 128, 32, 64, 32, 8, 3), (130, 136, 201), "bfloat16"),
    # matmul_nt: B (N, K). Aligned, K odd (both operands), N odd (C), VEC 1.
    (NT, _fp32(128, 128, 64, 32, 8, 8, 16, 4, 1, 4), (129, 60, 52), "float32"),
    (NT, _fp32(64, 64, 16, 32, 4, 4, 8, 4, 2, 0), (136, 68, 36), "float32"),
    (NT, _fp32(128, 64, 32, 64, 8, 8, 16, 4), (67, 131, 97), "float32"),
    (NT, _fp32(64, 128, 32, 64, 8, 8, 8, 4), (65, 66, 40), "float32"),
    (NT, _fp32(128, 128, 32, 32, 8, 4, 8, 1), (130, 129, 9), "float32"),
    (NT, _fp32(128, 128, 32, 64, 8, 8, 8, 4, 1, 0), (130, 132, 21), "float32"),
    (NT, _tc(128, 128, 64, 64, 32, 8, 3), (136, 136, 104), "float16"),
    (NT, _tc(64, 128, 32, 64, 64, 8, 4), (70, 200, 264), "bfloat16"),
    (NT, _tc(64, 64, 32, 32, 32, 8, 2), (67, 131, 97), "float16"),
    (NT, _tc(128, 64, 64, 32, 64, 8, 3), (129, 66, 136), "bfloat16"),
    (NT, _tc(64, 64, 32, 32, 64, 1, 2), (1, 72, 200), "bfloat16"),
    (NT, _tc(128, 128, 64, 32, 32, 8, 2), (130, 136, 65), "bfloat16"),
    # matmul_tn: A (K, M). Aligned, M odd (A), N odd (B and C), neither, VEC 1.
    (TN, _fp32(64, 128, 32, 64, 8, 8, 16, 4, 2, 0), (136, 68, 36), "float32"),
    (TN, _fp32(128, 128, 32, 64, 8, 8, 8, 4, 1, 0), (131, 132, 20), "float32"),
    (TN, _fp32(128, 256, 32, 64, 8, 8, 8, 4, 1, 0), (100, 262, 24), "float32"),
    (TN, _fp32(64, 64, 16, 32, 4, 4, 16, 4, 1, 0), (67, 131, 97), "float32"),
    (TN, _fp32(64, 64, 16, 32, 4, 4, 8, 1, 2, 0), (70, 75, 37), "float32"),
    (TN, _tc(128, 128, 64, 64, 32, 8, 3), (136, 136, 104), "bfloat16"),
    (TN, _tc(256, 64, 64, 64, 32, 8, 4), (264, 64, 40), "float16"),
    (TN, _tc(128, 128, 32, 64, 32, 8, 2), (129, 131, 70), "float16"),
    (TN, _tc(64, 64, 32, 32, 32, 8, 3), (136, 131, 33), "bfloat16"),
    (TN, _tc(64, 64, 32, 32, 32, 8, 4), (136, 131, 170), "float16"),
    (TN, _tc(128, 128, 32, 64, 32, 8, 2), (131, 136, 48), "float16"),
    (TN, _tc(64, 64, 32, 32, 32, 1, 2), (70, 65, 33), "float16"),
]


def emulation_source(cases) -> str:
    template = template_source(SPEC.template)  # the shared headers inlined
    assert all(spec.template == SPEC.template for spec, *_ in cases)
    assert _DYNAMIC_SHARED in template  # the emulation provides kato_smem itself
    host_template = template.replace(_DYNAMIC_SHARED, "")
    parts = [EMULATION_HEADER]
    dispatch = []
    for i, (spec, config, shape, dtype) in enumerate(cases):
        macros = spec.defines(config, shape, dtype)
        parts += [
            f"#define {SPEC.kernel_name} {SPEC.kernel_name}_{i}",
            f"#define KATO_NS kato_ns_{i}",
            *(f"#define {name} {value}" for name, value in macros.items()),
            host_template,
            *(f"#undef {name}" for name in [SPEC.kernel_name, "KATO_NS", *macros]),
            "#undef KATO_THREADS",
            "#undef KATO_LAUNCH_BOUNDS",
        ]
        ctype = macros["DTYPE"]
        launch = spec.launch(config, shape, dtype)
        m, n, k = shape
        dispatch.append(
            f"case {i}: launch([&] {{ {SPEC.kernel_name}_{i}(({ctype}*)a.data(), "
            f"({ctype}*)b.data(), ({ctype}*)c.data(), {m}, {n}, {k}); }}, {launch.grid[0]}, "
            f"{launch.grid[1]}, {launch.block[0]}); break;"
        )
    parts.append(
        "static std::vector<unsigned char> slurp(const char* path) {\n"
        '  FILE* f = std::fopen(path, "rb");\n'
        "  std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);\n"
        "  std::vector<unsigned char> v(n);\n"
        "  if (std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(2);\n"
        "  std::fclose(f);\n  return v;\n}\n"
        "int main(int argc, char** argv) {\n"
        "  std::vector<unsigned char> a = slurp(argv[2]), b = slurp(argv[3]);\n"
        "  std::vector<unsigned char> c(std::atol(argv[5]), 0xff);\n"
        "  switch (std::atoi(argv[1])) {\n" + "\n".join(dispatch) + "\n  default: return 3;\n  }\n"
        '  FILE* f = std::fopen(argv[4], "wb"); std::fwrite(c.data(), 1, c.size(), f);\n'
        "  std::fclose(f);\n  return 0;\n}\n"
    )
    return "\n".join(parts)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_kernel_logic_on_the_cpu(tmp_path: Path) -> None:
    include = _cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    for spec, config, shape, dtype in EMULATED:
        assert spec.check(config, shape, dtype) is None, (spec.name, config, shape, dtype)
    fp32 = [c for spec, c, _, d in EMULATED if d == "float32" and spec is NN]
    assert {(c["BM"], c["BN"], c["WM"], c["WN"], c["TM"], c["TN"]) for c in fp32} == set(FP32_TILES)
    # every layout and path in all four alignment classes with VEC > 1 (C unaligned in some), and
    # with VEC = 1
    for spec in (NN, NT, TN):
        for tc in (False, True):
            got = {
                (spec.alignment(c, shape), c["VEC"])
                for s, c, shape, d in EMULATED
                if s is spec and (d != "float32") == tc
            }
            wide = {a for a, vec in got if vec > 1}
            assert len(wide) == 4 and any(not a[2] for a in wide), (spec.name, tc, got)
            assert any(vec == 1 for _, vec in got), (spec.name, tc)
    halves = [EMULATED[0::2], EMULATED[1::2]]
    builds = []
    for k, half in enumerate(halves):
        (tmp_path / f"emu{k}.cpp").write_text(emulation_source(half))
        builds.append(HostBuild(tmp_path, f"emu{k}.cpp", f"emu{k}", include))
    for build in builds:
        returncode, err = build.wait(timeout=900)
        assert returncode == 0, err[:3000]

    rng = np.random.default_rng(7)
    failures = []
    for k, half in enumerate(halves):
        for i, (spec, config, shape, dtype) in enumerate(half):
            problem = spec.make_problem(shape, dtype, rng)
            a, b, c = problem.args[:3]
            a.tofile(tmp_path / "a.bin")
            b.tofile(tmp_path / "b.bin")
            subprocess.run(
                [str(tmp_path / f"emu{k}"), str(i), "a.bin", "b.bin", "c.bin", str(c.nbytes)],
                cwd=tmp_path,
                check=True,
                timeout=300,
            )
            got = np.fromfile(tmp_path / "c.bin", dtype=c.dtype).reshape(c.shape)
            got = got.astype(np.float64)
            atol, rtol = problem.tolerances[0]
            ref = problem.references[0]
            ok = np.isfinite(got) & (np.abs(got - ref) <= atol + rtol * np.abs(ref))
            if not ok.all():
                bad = np.argwhere(~ok)
                failures.append(
                    f"{spec.name} {dtype} {shape} {config}: {len(bad)} bad, first at "
                    f"{bad[0].tolist()}: {got[tuple(bad[0])]} vs {ref[tuple(bad[0])]}"
                )
    assert not failures, "\n".join(failures)
