"""The layernorm kernel's logic on the CPU: the real template compiled as host C++ against
tests/kernels/cuda_emulation.py (one std::thread per CUDA thread, barriers for __syncthreads and
shuffles), run on awkward shapes for every (dtype, ROW_THREADS, CACHE) with several vector
widths, block sizes and capped grids (grid-stride loops over rows, empty row groups in a warp),
and verified with the spec's per-output tolerances exactly as the GPU backend verifies."""

from __future__ import annotations

import itertools
import shutil

import cuda_emulation
import numpy as np
import pytest
from cuda_emulation import Case, cuda_include_dir, run_cases

from kernels import get_operator

SPEC = get_operator("layernorm")

#: Device functions the layernorm/batchnorm templates use beyond the base emulation.
EXTRA = r"""
#include <cmath>
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
template <class V> inline V __ldcg(const V* p) { return *p; }
template <class V> inline void __stcg(V* p, V v) { *p = v; }
inline void __threadfence() {}
inline unsigned atomicInc(unsigned* p, unsigned val) {
  const unsigned old = *p;
  *p = old >= val ? 0u : old + 1u;
  return old;
}
"""

SHAPES = ((7, 31), (6, 202), (3, 1000), (2, 4104), (40, 8), (1, 1), (33, 128), (5, 96))


def _literal(value: np.generic) -> str:
    if isinstance(value, np.floating):
        return f"{float(value)!r}f"
    return _original_literal(value)


_original_literal = cuda_emulation._literal


def emulated_cases() -> list[Case]:
    blocks = SPEC.params["BLOCK_SIZE"]
    cases: list[Case] = []
    for dtype, row_threads, cache in itertools.product(SPEC.dtypes, (8, 16, 32, 0), (0, 1, 2)):
        found = 0
        for k, shape in enumerate(SHAPES[len(cases) % 3 :] + SHAPES[: len(cases) % 3]):
            if found == 2:
                break
            for vec in (8, 4, 2, 1):
                config = {
                    "BLOCK_SIZE": blocks[(len(cases) + k) % len(blocks)],
                    "VEC": vec,
                    "ROW_THREADS": row_threads,
                    "CACHE": cache,
                    "MIN_BLOCKS": 0,
                    "GROUP_ROWS": (1, 4)[len(cases) % 2],
                }
                if SPEC.check(config, shape, dtype) is None:
                    cap = 2 if len(cases) % 3 == 0 else None
                    cases.append(Case(SPEC, config, shape, dtype, cap))
                    found += 1
                    break
    return cases


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_kernel_logic_on_the_cpu(tmp_path, monkeypatch) -> None:
    include = cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    monkeypatch.setattr(cuda_emulation, "HEADER", cuda_emulation.HEADER + EXTRA)
    monkeypatch.setattr(cuda_emulation, "_literal", _literal)
    cases = emulated_cases()
    covered = {(c.dtype, c.config["ROW_THREADS"], c.config["CACHE"]) for c in cases}
    assert len(covered) == 3 * 4 * 3
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    failures = run_cases(cases, tmp_path, np.random.default_rng(2026))
    assert not failures, "\n".join(failures[:20])
