"""The training batchnorm kernels' logic on the CPU (``batchnorm`` forward and
``batchnorm_backward``): the real templates compiled as host C++ against
tests/kernels/cuda_emulation.py (blocks one after another, a fiber per CUDA thread), every
step of spec.steps() launched with its real grid: both reduction strategies with several SPLITs,
the elementwise pass separate (several blocks per channel) and in the channel's own block,
vector widths of both passes, unrolls and block sizes, on awkward shapes (H*W odd, prime, 1;
C=1; N=1); every output verified with the problem's tolerances exactly as the GPU backend
verifies. Blocks without work (SPLIT larger than a channel) are included."""

from __future__ import annotations

import numpy as np
import pytest
from ci_sample import EVERY_DTYPE, rotated
from cuda_emulation import Case, run_cases, stored_values
from kato.kernels import get_operator

FORWARD = get_operator("batchnorm")
BACKWARD = get_operator("batchnorm_backward")

#: (shape, dtype, BLOCK_SIZE, VEC, UNROLL, STRATEGY, SPLIT, APPLY, APPLY_BLOCK, APPLY_VEC)
CASES = [
    ((2, 3, 5, 7), "float32", 128, 1, 2, 0, 1, 0, 256, 1),
    ((2, 3, 5, 7), "float16", 128, 1, 4, 1, 4, 1, 256, 1),
    ((2, 3, 5, 7), "bfloat16", 256, 1, 2, 0, 8, 0, 512, 1),
    ((3, 5, 4, 8), "float32", 128, 4, 2, 1, 2, 0, 256, 2),
    ((3, 5, 4, 8), "float16", 128, 8, 2, 0, 2, 0, 256, 8),
    ((3, 5, 4, 8), "bfloat16", 128, 2, 4, 1, 16, 1, 256, 4),
    ((1, 2, 1, 2), "float32", 128, 2, 4, 1, 32, 1, 256, 1),  # 2 elements per channel
    ((2, 2, 1, 1), "float16", 128, 1, 2, 0, 64, 0, 256, 1),  # H*W = 1, 63 empty blocks
    ((4, 2, 16, 16), "float32", 128, 1, 2, 0, 4, 0, 256, 1),  # 2 apply blocks per channel
    ((4, 2, 16, 16), "float16", 128, 8, 2, 1, 1, 1, 256, 2),
    ((4, 2, 16, 16), "bfloat16", 512, 4, 2, 1, 8, 0, 256, 8),
    ((9, 3, 3, 3), "float32", 128, 1, 2, 1, 2, 1, 256, 1),  # q = 128 // 27, r = 128 % 27
    ((9, 1, 3, 3), "bfloat16", 128, 1, 4, 0, 128, 0, 1024, 1),
    ((1, 1, 1, 1009), "float32", 256, 1, 2, 1, 4, 0, 256, 1),  # N = 1, a prime plane
    ((16, 1, 32, 32), "float16", 256, 4, 2, 0, 16, 0, 256, 1),  # 32 apply blocks
    ((2, 1, 1, 1000), "float16", 1024, 8, 2, 1, 2, 1, 256, 8),  # the only 1024-thread one
]

#: Planes that are not whole vectors of VEC and/or APPLY_VEC (PLANE_SPLIT, APPLY_PLANE_SPLIT):
#: H*W of 49 (ResNet's 7x7), 196 (14x14: half a bfloat16 vector over), 7, 1 (every plane inside
#: one vector) and 15, at vector widths 2, 4 and 8, both strategies, SPLITs that cut planes
#: between blocks, the elementwise pass separate and in the channel's block.
PLANE_SPLIT_CASES = [
    ((2, 3, 7, 7), "float32", 128, 4, 2, 1, 2, 0, 256, 4),
    ((2, 3, 7, 7), "float16", 128, 8, 2, 0, 4, 0, 256, 8),
    ((2, 3, 7, 7), "bfloat16", 128, 8, 4, 1, 1, 1, 256, 8),
    ((2, 3, 14, 14), "bfloat16", 128, 8, 2, 1, 2, 1, 256, 8),
    ((2, 3, 14, 14), "float16", 256, 4, 2, 0, 1, 0, 256, 8),  # only the elementwise pass splits
    ((3, 2, 1, 7), "float32", 128, 2, 2, 0, 2, 0, 256, 1),  # only the reduction splits
    ((3, 2, 1, 7), "float16", 128, 8, 4, 1, 8, 1, 256, 2),
    ((5, 3, 1, 1), "float32", 128, 4, 2, 1, 2, 0, 256, 4),
    ((5, 3, 1, 1), "bfloat16", 128, 8, 2, 0, 1, 1, 256, 8),
    ((2, 3, 3, 5), "float16", 128, 4, 2, 1, 1, 1, 256, 2),
    ((2, 3, 3, 5), "float32", 128, 2, 4, 0, 4, 0, 256, 2),
    ((4, 3, 3, 5), "bfloat16", 128, 8, 2, 1, 16, 0, 1024, 8),
]


def _config(block, vec, unroll, strategy, split, apply, apply_block, apply_vec) -> dict:
    return {
        "BLOCK_SIZE": block,
        "VEC": vec,
        "UNROLL": unroll,
        "STRATEGY": strategy,
        "SPLIT": split,
        "MIN_BLOCKS": 0,
        "APPLY": apply,
        "APPLY_BLOCK": apply_block,
        "APPLY_VEC": apply_vec,
    }


def emulated_cases(spec, table=CASES) -> list[Case]:
    cases = []
    for shape, dtype, *params in table:
        config = _config(*params)
        assert spec.check(config, shape, dtype) is None, (spec.name, shape, dtype, config)
        cases.append(Case(spec, config, shape, dtype, bounds=True))
    return cases


@pytest.mark.parametrize("spec", [FORWARD, BACKWARD], ids=lambda s: s.name)
def test_kernel_logic_on_the_cpu(tmp_path, norm_emulation, spec) -> None:
    failures = run_cases(emulated_cases(spec), tmp_path, np.random.default_rng(7))
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("spec", [FORWARD, BACKWARD], ids=lambda s: s.name)
def test_planes_off_vector_boundaries(tmp_path, norm_emulation, spec) -> None:
    """H*W not a multiple of VEC or APPLY_VEC renders the plane split of that pass: every
    element counted once in the statistics (sums) and written once, against the float64
    references; no access misaligned or outside the arrays."""
    cases = emulated_cases(spec, PLANE_SPLIT_CASES)
    macros = [spec.defines(c.config, c.shape, c.dtype) for c in cases]
    assert sum("PLANE_SPLIT" in m for m in macros) == len(cases) - 1
    assert sum("APPLY_PLANE_SPLIT" in m for m in macros) == len(cases) - 1
    failures = run_cases(cases, tmp_path, np.random.default_rng(13))
    assert not failures, "\n".join(failures[:20])


#: The sweep's planes: H*W of 49, 196, 7, 1 and 15.
SWEEP_SHAPES = ((2, 3, 7, 7), (2, 3, 14, 14), (3, 2, 1, 7), (5, 3, 1, 1), (2, 3, 3, 5))
#: The sweep's (APPLY, STRATEGY, SPLIT): the channel's one block does everything; two kernels
#: over 4 blocks and the apply kernel; the last of 8 blocks merges and normalises.
SWEEP_MODES = ((1, 1, 1), (0, 0, 4), (1, 1, 8))


def sweep_cases(spec) -> list[Case]:
    """Every (shape, dtype, VEC = APPLY_VEC up to 16 bytes, mode) whose planes are not whole
    vectors."""
    cases = []
    for shape in SWEEP_SHAPES:
        for dtype in spec.dtypes:
            for vec in (2, 4, 8):
                for apply, strategy, split in SWEEP_MODES:
                    config = _config(128, vec, 2, strategy, split, apply, 256, vec)
                    if spec.check(config, shape, dtype) is None and shape[2] * shape[3] % vec:
                        cases.append(Case(spec, config, shape, dtype, bounds=True))
    return cases


# CI runs the plane tables above (every sweep shape); the sweep's hundreds of emulated
# launches are for -m slow.
@pytest.mark.slow
@EVERY_DTYPE
@pytest.mark.parametrize("spec", [FORWARD, BACKWARD], ids=lambda s: s.name)
def test_plane_split_sweep(tmp_path, norm_emulation, spec, every_dtype) -> None:
    """Every split plane shape at every width that splits it and every mode, each (VEC,
    SPLIT) in one dtype (rotated) or every dtype; both under ``-m slow``."""
    cases = sweep_cases(spec)
    if not every_dtype:
        cases = rotated(cases, ("VEC", "SPLIT"))
    assert {c.shape for c in cases} == set(SWEEP_SHAPES)
    assert {c.config["VEC"] for c in cases} == {2, 4, 8}
    failures = run_cases(cases, tmp_path, np.random.default_rng(23))
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("spec", [FORWARD, BACKWARD], ids=lambda s: s.name)
def test_single_pass_leaves_the_counters_at_zero(tmp_path, norm_emulation, monkeypatch, spec):
    """The fused kernel's call twice on the same buffers: the second call must be right too
    (the last block reset its channel's counter), and the counters are zero afterwards."""
    config = _config(128, 1, 2, 1, 4, 1, 256, 1)
    shape = (2, 3, 5, 7)
    once = type(spec).steps

    def steps(self, c, s, d):
        return once(self, c, s, d) * 2

    monkeypatch.setattr(type(spec), "steps", steps)
    failures = run_cases([Case(spec, config, shape, "float32")], tmp_path, np.random.default_rng(1))
    assert not failures, failures
    counters_arg = 11 if spec is FORWARD else 9
    counters = np.fromfile(tmp_path / "case0" / f"a{counters_arg}.bin", dtype=np.uint32)
    assert counters.size == 4 and not counters.any()


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [(FORWARD, "float16"), (FORWARD, "float32"), (BACKWARD, "float32"), (BACKWARD, "bfloat16")],
    ids=lambda p: getattr(p, "name", p),
)
def test_long_thread_streams_stay_well_inside_the_tolerances(tmp_path, norm_emulation, spec, dtype):
    """Four channels of the (256, 64, 56, 56) layout with 128 threads and SPLIT 1: each thread
    streams 6272 elements (the float32 Welford merges and sums' longest runs at the benchmark
    shapes), the channel normalised in the same block. The float32 outputs (statistics, running
    statistics; dweight, dbias) stay within a tenth of their tolerances, so that a loss of
    accuracy shows before it fails, and every output passes."""
    shape = (256, 4, 56, 56)
    config = _config(128, 1, 2, 1, 1, 1, 256, 1)
    assert spec.check(config, shape, dtype) is None
    problem = spec.make_problem(shape, dtype, np.random.default_rng(3))
    failures = run_cases([Case(spec, config, shape, dtype)], tmp_path, np.random.default_rng(3))
    assert not failures, failures
    for out, ref, (atol, rtol) in zip(
        problem.outputs, problem.references, problem.tolerances, strict=True
    ):
        if problem.args[out].dtype != np.float32:
            continue
        got = stored_values(tmp_path / "case0" / f"a{out}.bin", "float32").reshape(ref.shape)
        ratio = float(np.max(np.abs(got - ref) / (atol + rtol * np.abs(ref))))
        assert ratio < 0.1, (out, ratio)
