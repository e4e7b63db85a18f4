"""The fused batchnorm + relu kernels' logic on the CPU (``batchnorm_relu``,
``batchnorm_add_relu`` and their backwards: batchnorm.cu / batchnorm_backward.cu rendered with
BN_RELU 1 and 2), compiled as host C++ against tests/kernels/cuda_emulation.py with every step
of spec.steps() at its real grid: both reduction strategies, the elementwise pass separate and
in the channel's block, several vector widths, unrolls and block sizes, on awkward shapes (H*W
odd, prime, 1; C=1; N=1; N*H*W = 2) in every dtype; every output verified with the problem's
tolerances as the GPU backend verifies. The epilogue itself is shown to matter: the same cases
rendered without it fail.

In CI each operator runs half of the cases (:func:`ci_cases`): every case still runs for one
forward and one backward, and each half holds every dtype, both strategies and both places of
the elementwise pass; ``-m slow`` runs every case for every operator."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulation import Case, run_cases
from kato.kernels import get_operator

SPECS = [
    get_operator(name)
    for name in (
        "batchnorm_relu",
        "batchnorm_add_relu",
        "batchnorm_relu_backward",
        "batchnorm_add_relu_backward",
    )
]

#: (shape, dtype, BLOCK_SIZE, VEC, UNROLL, STRATEGY, SPLIT, APPLY, APPLY_BLOCK, APPLY_VEC)
CASES = [
    ((2, 3, 5, 7), "float32", 128, 1, 2, 0, 1, 0, 256, 1),
    ((2, 3, 5, 7), "float16", 128, 1, 4, 1, 4, 1, 256, 1),
    ((2, 3, 5, 7), "bfloat16", 256, 1, 2, 0, 8, 0, 512, 1),
    ((3, 5, 4, 8), "float32", 128, 4, 2, 1, 2, 0, 256, 2),
    ((3, 5, 4, 8), "float16", 128, 8, 2, 0, 2, 0, 256, 8),
    ((3, 5, 4, 8), "bfloat16", 128, 2, 2, 1, 16, 1, 256, 4),
    ((1, 2, 1, 2), "float32", 128, 2, 2, 1, 32, 1, 256, 1),  # 2 elements per channel
    ((2, 2, 1, 1), "float16", 128, 1, 2, 0, 64, 0, 256, 1),  # H*W = 1, 63 empty blocks
    ((4, 4, 16, 16), "float32", 128, 1, 2, 0, 4, 0, 256, 1),  # 2 apply blocks per channel
    ((4, 4, 16, 16), "bfloat16", 512, 4, 2, 1, 8, 0, 256, 8),
    ((9, 4, 3, 3), "float32", 128, 1, 2, 1, 2, 1, 256, 1),  # q = 128 // 27, r = 128 % 27
    ((1, 1, 1, 1009), "bfloat16", 256, 1, 2, 1, 4, 0, 256, 1),  # N = 1, C = 1, a prime plane
]

#: Planes that are not whole vectors (PLANE_SPLIT and APPLY_PLANE_SPLIT): H*W of 49, 196, 1 and
#: 15 at vector widths 2 to 8, both strategies and both places of the elementwise pass.
PLANE_SPLIT_CASES = [
    ((2, 3, 7, 7), "bfloat16", 128, 8, 2, 1, 2, 0, 256, 8),
    ((2, 3, 14, 14), "float16", 128, 8, 2, 0, 1, 1, 256, 8),
    ((5, 3, 1, 1), "float32", 128, 4, 2, 1, 1, 1, 256, 4),
    ((2, 3, 3, 5), "float16", 128, 2, 2, 0, 4, 0, 256, 4),
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


def emulated_cases(spec, cases=CASES) -> list[Case]:
    """The cases as configs of ``spec``; where its check refuses one (batchnorm_add_relu_backward
    streams three arrays: the widest vectors would spill), APPLY_VEC halved until it accepts."""
    out = []
    for shape, dtype, *params in cases:
        config = _config(*params)
        while spec.check(config, shape, dtype) is not None and config["APPLY_VEC"] > 1:
            config = {**config, "APPLY_VEC": config["APPLY_VEC"] // 2}
        assert spec.check(config, shape, dtype) is None, (spec.name, shape, dtype, config)
        out.append(Case(spec, config, shape, dtype))
    return out


def ci_cases(spec) -> list:
    """CI's half of :data:`CASES` for ``spec``: the even rows for batchnorm_relu and
    batchnorm_add_relu_backward, the odd ones for the other two, so that each row runs for a
    forward and a backward. The rows vary the launch paths, which are the plain kernels' own
    (test_batchnorm_train_emulation.py runs them all); the epilogue is the same on each."""
    even = spec.name in ("batchnorm_relu", "batchnorm_add_relu_backward")
    return CASES[0 if even else 1 :: 2]


@pytest.mark.parametrize(
    "every_case", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ci", "full"]
)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_logic_on_the_cpu(tmp_path, norm_emulation, spec, every_case) -> None:
    rows = CASES if every_case else ci_cases(spec)
    assert {r[1] for r in rows} == {"float32", "float16", "bfloat16"}
    assert {r[5] for r in rows} == {0, 1} and {r[7] for r in rows} == {0, 1}  # STRATEGY, APPLY
    failures = run_cases(emulated_cases(spec, rows), tmp_path, np.random.default_rng(11))
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_planes_off_vector_boundaries(tmp_path, norm_emulation, spec) -> None:
    """The epilogues on planes that are not whole vectors: both passes split (the mask from x,
    or from y, read per element in the head and tail; dresidual written once per element), no
    access misaligned or outside the arrays."""
    cases = [
        Case(c.spec, c.config, c.shape, c.dtype, bounds=True)
        for c in emulated_cases(spec, PLANE_SPLIT_CASES)
    ]
    for c in cases:
        macros = spec.defines(c.config, c.shape, c.dtype)
        assert macros.get("PLANE_SPLIT") == 1 and macros.get("APPLY_PLANE_SPLIT") == 1, c
    failures = run_cases(cases, tmp_path, np.random.default_rng(17))
    assert not failures, "\n".join(failures[:20])


def test_the_epilogue_is_what_passes(tmp_path, norm_emulation, monkeypatch) -> None:
    """batchnorm_relu's kernel rendered without the epilogue (BN_RELU 0: plain batchnorm on the
    same arguments) fails its problems: the references and tolerances see the relu. (The other
    three take other arguments, so plain kernels do not bind to their problems; their problems
    are shown to depend on the mask by tests/kernels/test_batchnorm_relu_spec.py.)"""
    spec = SPECS[0]
    monkeypatch.setattr(spec, "relu_mode", 0)
    cases = emulated_cases(spec, [CASES[0], CASES[5]])
    failures = run_cases(cases, tmp_path, np.random.default_rng(11))
    assert len(failures) == len(cases), failures
