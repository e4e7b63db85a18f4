"""The CPU emulation (tests/kernels/cuda_emulation.py) set up for the row-wise templates
(rmsnorm, rmsnorm_backward, softmax_backward), and the cases their emulation tests run.

Beyond the layernorm set-up (``norm_emulation``: rsqrtf, float scalar arguments) they need
``__syncwarp`` (every lane of the warp calls it, as the emulated shuffles require). Cases: for
every (dtype, ROW_THREADS, CACHE and the operator's own switches) a valid config at an awkward
shape (odd and prime widths, a single column, fewer columns than a vector, rows of the same head
and rows whose head moves), the vector widths, block sizes and launch parameters rotating, a
third of them on a grid capped at 2 blocks (grid-stride loops, empty row groups in a warp)."""

from __future__ import annotations

import itertools
import random
import shutil
from collections.abc import Sequence

import cuda_emulation
import pytest
from cuda_emulation import Case
from kato.kernels.spec import OperatorSpec

SYNCWARP = (
    "\ninline void __syncwarp(unsigned = 0xffffffffu) { this_warp->sync.arrive_and_wait(); }\n"
    # A product kept out of fma contraction (layernorm_backward): the host compiler does not
    # contract a * b here.
    "inline float __fmul_rn(float a, float b) { return a * b; }\n"
    "inline float __fsub_rn(float a, float b) { return a - b; }\n"
)
SHAPES = ((7, 31), (6, 203), (3, 1031), (40, 9), (1, 1), (5, 3), (33, 128), (9, 264), (2, 4104))


def set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    include = cuda_emulation.cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    extra = cuda_emulation.HEADER + cuda_emulation.NORM_EXTRA + SYNCWARP
    monkeypatch.setattr(cuda_emulation, "HEADER", extra)
    monkeypatch.setattr(cuda_emulation, "_literal", cuda_emulation.float_literal)


def cases(spec: OperatorSpec, switches: dict[str, Sequence[int]], seed: int = 0) -> list[Case]:
    """One valid case per (dtype, ROW_THREADS, CACHE, switches...), where one exists among
    :data:`SHAPES` (rotated per case) and the vector widths; the other parameters seeded."""
    rnd = random.Random(seed)
    found: list[Case] = []
    names = ["ROW_THREADS", "CACHE", *switches]
    values = [spec.params["ROW_THREADS"], spec.params["CACHE"], *switches.values()]
    for dtype in spec.dtypes:
        for combo in itertools.product(*values):
            fixed = dict(zip(names, combo, strict=True))
            start = len(found) % len(SHAPES)
            for shape in SHAPES[start:] + SHAPES[:start]:
                config = None
                for vec in rnd.sample([8, 4, 2, 1], 4):
                    trial = {name: rnd.choice(v) for name, v in spec.params.items()}
                    trial.update(fixed, VEC=vec, MIN_BLOCKS=0)
                    trial["BLOCK_SIZE"] = rnd.choice((128, 256))  # threads are host threads
                    if spec.check(trial, shape, dtype) is None:
                        config = trial
                        break
                if config is not None:
                    cap = 2 if len(found) % 3 == 0 else None
                    found.append(Case(spec, config, shape, dtype, cap))
                    break
    return found
