"""The batchnorm_stats kernels' logic on the CPU: the real template compiled as host C++ against
tests/kernels/cuda_emulation.py (blocks one after another, a fiber per CUDA thread), every
step of spec.steps() launched with its real grid: two-phase and single-pass (last-block merge,
counter reset) with several SPLITs, vector widths, unrolls and block sizes, on awkward shapes;
verified with the spec's tolerance exactly as the GPU backend verifies. Blocks that get no
vectors (SPLIT larger than the work) are included."""

from __future__ import annotations

import numpy as np
import pytest
from ci_sample import EVERY_DTYPE, rotated
from cuda_emulation import Case, run_cases, stored_values
from kato.kernels import get_operator

SPEC = get_operator("batchnorm_stats")

#: (shape, dtype, BLOCK_SIZE, VEC, UNROLL, STRATEGY, SPLIT)
CASES = [
    ((2, 3, 5, 7), "float32", 128, 1, 2, 0, 1),
    ((2, 3, 5, 7), "float16", 128, 1, 4, 1, 4),
    ((2, 3, 5, 7), "bfloat16", 256, 1, 2, 0, 8),
    ((3, 5, 4, 8), "float32", 128, 4, 2, 1, 2),
    ((3, 5, 4, 8), "float16", 128, 8, 2, 0, 2),
    ((3, 5, 4, 8), "bfloat16", 128, 2, 4, 1, 16),
    ((1, 2, 1, 1), "float32", 128, 1, 4, 1, 32),  # 1 element per channel, 31 empty blocks
    ((1, 2, 1, 1), "float16", 128, 1, 2, 0, 64),
    ((4, 2, 16, 16), "float32", 128, 4, 4, 0, 4),  # several steps per thread
    ((4, 2, 16, 16), "float16", 128, 8, 2, 1, 1),
    ((4, 2, 16, 16), "bfloat16", 512, 4, 2, 1, 8),
    ((9, 3, 3, 3), "float32", 128, 1, 2, 1, 2),  # q = 128 // 27, r = 128 % 27
    ((9, 1, 3, 3), "bfloat16", 128, 1, 4, 0, 128),
    ((2, 1, 1, 1000), "float16", 1024, 8, 4, 1, 2),  # the only 1024-thread case
    ((5, 1, 2, 2), "float32", 128, 2, 2, 0, 256),
]

#: Planes that are not whole vectors (PLANE_SPLIT): H*W of 49 (ResNet's 7x7), 196 (14x14: half a
#: bfloat16 vector over), 7, 1 (every plane inside one vector) and 15, at VEC 2, 4 and 8, with
#: the two strategies and SPLITs that cut planes between blocks.
PLANE_SPLIT_CASES = [
    ((2, 3, 7, 7), "float32", 128, 4, 2, 1, 2),
    ((2, 3, 7, 7), "float16", 128, 8, 2, 0, 4),
    ((2, 3, 7, 7), "bfloat16", 128, 8, 4, 1, 1),
    ((3, 2, 7, 7), "float32", 128, 2, 4, 0, 1),
    ((2, 3, 14, 14), "bfloat16", 128, 8, 2, 1, 2),
    ((2, 3, 14, 14), "float16", 256, 8, 4, 0, 1),
    ((3, 2, 1, 7), "float32", 128, 2, 2, 0, 2),
    ((3, 2, 1, 7), "float16", 128, 8, 4, 1, 8),
    ((5, 3, 1, 1), "float32", 128, 4, 2, 1, 2),
    ((5, 3, 1, 1), "bfloat16", 128, 8, 2, 0, 1),
    ((2, 3, 3, 5), "float16", 128, 4, 2, 1, 1),
    ((2, 3, 3, 5), "float32", 128, 2, 4, 0, 4),
    ((4, 3, 3, 5), "bfloat16", 128, 8, 2, 1, 16),
]


def emulated_cases(table=CASES) -> list[Case]:
    cases = []
    for shape, dtype, block, vec, unroll, strategy, split in table:
        config = {
            "BLOCK_SIZE": block,
            "VEC": vec,
            "UNROLL": unroll,
            "STRATEGY": strategy,
            "SPLIT": split,
            "MIN_BLOCKS": 0,
        }
        assert SPEC.check(config, shape, dtype) is None, (shape, dtype, config)
        cases.append(Case(SPEC, config, shape, dtype, bounds=True))
    return cases


def test_kernel_logic_on_the_cpu(tmp_path, norm_emulation) -> None:
    cases = emulated_cases()
    failures = run_cases(cases, tmp_path, np.random.default_rng(7))
    assert not failures, "\n".join(failures[:20])


def test_planes_off_vector_boundaries(tmp_path, norm_emulation) -> None:
    """H*W not a multiple of VEC renders PLANE_SPLIT; every element counted once (the
    reference's mean and variance), no access misaligned or outside x."""
    cases = emulated_cases(PLANE_SPLIT_CASES)
    assert all("PLANE_SPLIT" in SPEC.defines(c.config, c.shape, c.dtype) for c in cases)
    failures = run_cases(cases, tmp_path, np.random.default_rng(11))
    assert not failures, "\n".join(failures[:20])


#: The sweep's planes: H*W of 49, 196, 7, 1 and 15.
SWEEP_SHAPES = ((2, 3, 7, 7), (2, 3, 14, 14), (3, 2, 1, 7), (5, 3, 1, 1), (2, 3, 3, 5))
#: The sweep's (STRATEGY, SPLIT): the block writes the outputs; two kernels over 4 blocks; the
#: last of 8 blocks merges.
SWEEP_MERGES = ((1, 1), (0, 4), (1, 8))


def sweep_cases() -> list[Case]:
    """Every (shape, dtype, VEC up to 16 bytes, merge) whose planes are not whole vectors."""
    cases = []
    for shape in SWEEP_SHAPES:
        for dtype in SPEC.dtypes:
            for vec in (2, 4, 8):
                for strategy, split in SWEEP_MERGES:
                    config = {
                        "BLOCK_SIZE": 128,
                        "VEC": vec,
                        "UNROLL": 2,
                        "STRATEGY": strategy,
                        "SPLIT": split,
                        "MIN_BLOCKS": 0,
                    }
                    if SPEC.check(config, shape, dtype) is None and shape[2] * shape[3] % vec:
                        cases.append(Case(SPEC, config, shape, dtype, bounds=True))
    return cases


# CI runs the plane tables above (every sweep shape); the sweep's hundreds of emulated
# launches are for -m slow.
@pytest.mark.slow
@EVERY_DTYPE
def test_plane_split_sweep(tmp_path, norm_emulation, every_dtype) -> None:
    """Every split plane shape at every VEC that splits it and every merge, each (VEC, SPLIT)
    in one dtype (rotated) or every dtype; both under ``-m slow``."""
    cases = sweep_cases()
    if not every_dtype:
        cases = rotated(cases, ("VEC", "SPLIT"))
    assert {c.shape for c in cases} == set(SWEEP_SHAPES)
    assert {c.config["VEC"] for c in cases} == {2, 4, 8}
    failures = run_cases(cases, tmp_path, np.random.default_rng(19))
    assert not failures, "\n".join(failures[:20])


def test_single_pass_leaves_the_counters_at_zero(tmp_path, norm_emulation, monkeypatch) -> None:
    """Run the fused kernel twice on the same buffers: the second call must be right too (the
    last block reset its channel's counter); the emulation writes the buffers back, so the
    counters after the run are checked directly."""
    config = {
        "BLOCK_SIZE": 128,
        "VEC": 1,
        "UNROLL": 2,
        "STRATEGY": 1,
        "SPLIT": 4,
        "MIN_BLOCKS": 0,
    }
    shape = (2, 3, 5, 7)
    twice = type(SPEC).steps

    def steps(self, c, s, d):
        return twice(self, c, s, d) * 2  # the same call twice in a row

    monkeypatch.setattr(type(SPEC), "steps", steps)
    failures = run_cases([Case(SPEC, config, shape, "float32")], tmp_path, np.random.default_rng(1))
    assert not failures, failures
    counters = np.fromfile(tmp_path / "case0" / "a5.bin", dtype=np.uint32)
    assert counters.size == 4 and not counters.any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_thread_streams_keep_the_variance(tmp_path, norm_emulation, dtype) -> None:
    """One channel of the (256, 64, 112, 112) layout (3.2M elements, the generator's offset
    channel: 1e3 + 8 N(0, 1) stored as float16) with 128 threads and SPLIT 1: each thread merges
    3136 vectors of 8. Adding each vector's M2 to the running M2 alone rounded with a bias on
    these quantized inputs (1.06e-5 of the variance, outside the spec's rtol of 1e-5: 8 variants
    failed verification on the H200); adding the small terms first keeps it near 2.5e-7. The
    bound here is 2e-6, well inside the tolerance, so a regression shows before it fails."""
    config = {
        "BLOCK_SIZE": 128,
        "VEC": 8,
        "UNROLL": 2,
        "STRATEGY": 1,
        "SPLIT": 1,
        "MIN_BLOCKS": 0,
    }
    shape = (256, 1, 112, 112)
    failures = run_cases([Case(SPEC, config, shape, dtype)], tmp_path, np.random.default_rng(3))
    assert not failures, failures
    values = stored_values(tmp_path / "case0" / "a0.bin", dtype)
    var = np.fromfile(tmp_path / "case0" / "a2.bin", dtype=np.float32)
    assert values.size == 256 * 112 * 112 and var.size == 1
    assert abs(var[0] / values.var() - 1.0) < 2e-6, (var[0], values.var())
