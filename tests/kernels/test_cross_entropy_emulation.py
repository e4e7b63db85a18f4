"""The cross_entropy and cross_entropy_backward kernels' logic on the CPU: the real templates
compiled as host C++ against tests/kernels/cuda_emulation.py, every (dtype, ROW_THREADS, SPLIT 1
or more) on awkward shapes (odd and prime widths, one column, fewer columns than a vector, one
row, rows whose head moves), a third of them on a grid capped at 2 blocks (grid-stride loops),
verified with the spec's tolerances exactly as the GPU backend verifies; then labels outside
[0, cols) (NaN rows, no out-of-bounds read), another ignore index, and the backward in place."""

from __future__ import annotations

import itertools
import random
import shutil
import subprocess
from pathlib import Path

import cuda_emulation
import numpy as np
import pytest
from cuda_emulation import Case, HostBuild, emulation_source, run_cases
from kato.kernels import get_operator
from kato.kernels.cross_entropy import model
from kato.kernels.spec import OperatorSpec, Problem

FORWARD = get_operator("cross_entropy")
BACKWARD = get_operator("cross_entropy_backward")
SHAPES = ((7, 31), (6, 203), (3, 1031), (40, 9), (1, 1), (5, 3), (33, 128), (1, 2053), (2, 4104))
EXTRA = r"""
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, sizeof f); return f; }
"""


@pytest.fixture
def emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    include = cuda_emulation.cuda_include_dir()
    if include is None or not (include / "cuda_fp16.h").is_file():
        pytest.skip("CUDA headers not found next to nvcc")
    header = cuda_emulation.HEADER + cuda_emulation.NORM_EXTRA + EXTRA
    monkeypatch.setattr(cuda_emulation, "HEADER", header)


def cases(spec: OperatorSpec, seed: int = 0) -> list[Case]:
    """One valid case per (dtype, ROW_THREADS, SPLIT == 1 or > 1), where one exists among
    :data:`SHAPES` (rotated per case) and the vector widths; the other parameters seeded."""
    rnd = random.Random(seed)
    found: list[Case] = []
    for dtype, lanes, split in itertools.product(spec.dtypes, (8, 16, 32, 0), (False, True)):
        start = len(found) % len(SHAPES)
        for shape in SHAPES[start:] + SHAPES[:start]:
            config = None
            for vec in rnd.sample([8, 4, 2, 1], 4):
                splits = [s for s in model.SPLITS if (s > 1) == split]
                trial = {
                    "BLOCK_SIZE": rnd.choice((128, 256)),  # threads are host threads
                    "VEC": vec,
                    "ROW_THREADS": lanes,
                    "MIN_BLOCKS": 0,
                    "SPLIT": rnd.choice(splits[:3]),
                }
                if spec.check(trial, shape, dtype) is None:
                    config = trial
                    break
            if config is not None:
                cap = 2 if len(found) % 3 == 0 else None
                found.append(Case(spec, config, tuple(shape), dtype, cap))
                break
    return found


def run_problems(
    cases: list[Case], problems: list[Problem], workdir: Path, alias: tuple[int, int] | None = None
) -> list[list]:
    """Run each case on its own problem (one program); every array argument as it is after the
    run, in argument order (None for scalars). ``alias=(k, j)``: argument k is passed as
    argument j's buffer (one buffer for both, as an in-place call)."""
    include = cuda_emulation.cuda_include_dir()
    source = emulation_source(cases, problems)
    if alias is not None:
        k, j = alias
        passed = f"AnyPtr{{buf[{k}].data() + kEmuPad"
        assert passed in source
        source = source.replace(passed, f"AnyPtr{{buf[{j}].data() + kEmuPad")
    (workdir / "emu.cpp").write_text(source)
    returncode, err = HostBuild(workdir, "emu.cpp", "emu", include).wait()
    assert returncode == 0, err[:4000]
    results = []
    for i, problem in enumerate(problems):
        data = workdir / f"case{i}"
        data.mkdir()
        for k, a in enumerate(problem.args):
            if isinstance(a, np.ndarray):
                a.tofile(data / f"a{k}.bin")
        proc = subprocess.run(
            [str(workdir / "emu"), str(i), str(data)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[:300]
        results.append(
            [
                np.fromfile(data / f"a{k}.bin", dtype=a.dtype).reshape(a.shape)
                if isinstance(a, np.ndarray)
                else None
                for k, a in enumerate(problem.args)
            ]
        )
    return results


@pytest.mark.parametrize("spec", [FORWARD, BACKWARD], ids=lambda s: s.name)
def test_kernel_logic_on_the_cpu(tmp_path, emulation, spec) -> None:
    found = cases(spec)
    covered = {(c.dtype, c.config["ROW_THREADS"], c.config["SPLIT"] > 1) for c in found}
    assert len(covered) == 3 * 4 * 2
    assert {c.config["VEC"] for c in found} == {1, 2, 4, 8}
    failures = run_cases(found, tmp_path, np.random.default_rng(2026))
    assert not failures, "\n".join(failures[:20])


def _bad_labels(problem: Problem, cols: int, ignore_index: int) -> None:
    """Labels outside [0, cols) in rows 0, 1, 2 (cols, -1, 2**40) and, with another ignore
    index, torch's -100 (then out of range too) in row 3; the ignore index itself in row 4."""
    labels = problem.args[1]
    labels[0], labels[1], labels[2] = cols, -1, 2**40
    labels[4] = ignore_index
    problem.args[-1] = np.int64(ignore_index)


@pytest.mark.parametrize(("lanes", "split"), [(0, 1), (8, 4)])
def test_forward_labels_out_of_range_give_nan_rows(tmp_path, emulation, lanes, split) -> None:
    """Rows with a label outside [0, cols) get a NaN loss (and their true lse); the ignore index
    is the kernel argument's, not a fixed -100. The logits sit in a buffer of exactly
    rows * cols elements: an out-of-bounds read of label 2**40 would crash the program."""
    shape, dtype = (6, 203), "float32"
    config = {"BLOCK_SIZE": 128, "VEC": 4, "ROW_THREADS": lanes, "MIN_BLOCKS": 0, "SPLIT": split}
    assert FORWARD.check(config, shape, dtype) is None
    problems, found = [], []
    for ignore_index in (model.IGNORE_INDEX, 5):
        problem = FORWARD.make_problem(shape, dtype, np.random.default_rng(abs(ignore_index)))
        _bad_labels(problem, shape[1], ignore_index)
        problems.append(problem)
        found.append(Case(FORWARD, config, shape, dtype))
    for problem, out in zip(problems, run_problems(found, problems, tmp_path), strict=True):
        logits, labels, ignore_index = problem.args[0], problem.args[1], int(problem.args[-1])
        ref_loss, ref_lse = model.cross_entropy_reference(logits, labels, ignore_index)
        loss, lse = out[2], out[3]
        expect_nan = [0, 1, 2] + ([3] if ignore_index != model.IGNORE_INDEX else [])
        assert np.isnan(ref_loss[expect_nan]).all()
        np.testing.assert_array_equal(np.isnan(loss), np.isnan(ref_loss))
        assert loss[4] == 0.0
        ok = ~np.isnan(ref_loss)
        np.testing.assert_allclose(loss[ok], ref_loss[ok], atol=1e-4, rtol=1e-6)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize(("lanes", "split"), [(0, 1), (8, 4)])
def test_backward_labels_out_of_range_give_nan_rows(tmp_path, emulation, lanes, split) -> None:
    """The backward writes NaN rows for labels outside [0, cols), zeros for the ignore index
    (the kernel argument's), and never indexes with the label."""
    shape, dtype = (6, 203), "bfloat16"
    config = {"BLOCK_SIZE": 128, "VEC": 4, "ROW_THREADS": lanes, "MIN_BLOCKS": 0, "SPLIT": split}
    assert BACKWARD.check(config, shape, dtype) is None
    problem = BACKWARD.make_problem(shape, dtype, np.random.default_rng(7))
    _bad_labels(problem, shape[1], 5)
    [out] = run_problems([Case(BACKWARD, config, shape, dtype)], [problem], tmp_path)
    got = out[4].astype(np.float64)
    logits, labels, lse, dloss = problem.args[:4]
    ref = model.cross_entropy_backward_reference(logits, labels, lse, dloss, ignore_index=5)
    assert np.isnan(got[:4]).all() and (got[4] == 0).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(got[ok], ref[ok], atol=1e-6, rtol=8e-3)


@pytest.mark.parametrize(
    ("dtype", "shape", "lanes", "vec", "split"),
    [
        ("float32", (5, 1031), 0, 4, 1),
        ("float16", (9, 203), 16, 8, 1),
        ("bfloat16", (2, 4104), 0, 8, 4),
    ],
)
def test_backward_in_place(tmp_path, emulation, dtype, shape, lanes, vec, split) -> None:
    """dlogits passed as the logits buffer itself: the gradient lands over the logits, equal to
    the reference within the spec's tolerance (rows of a moving head included)."""
    config = {"BLOCK_SIZE": 128, "VEC": vec, "ROW_THREADS": lanes, "MIN_BLOCKS": 0, "SPLIT": split}
    assert BACKWARD.check(config, shape, dtype) is None
    problem = BACKWARD.make_problem(shape, dtype, np.random.default_rng(11))
    [out] = run_problems([Case(BACKWARD, config, shape, dtype)], [problem], tmp_path, alias=(4, 0))
    [(atol, rtol)] = problem.tolerances
    assert np.isnan(out[4].astype(np.float64)).all()  # the dlogits buffer was not written
    error = cuda_emulation.compare(out[0], problem.references[0], atol, rtol)
    assert error is None, error


@pytest.mark.parametrize("spec", [FORWARD, BACKWARD], ids=lambda s: s.name)
def test_vocabulary_rows_on_the_cpu(tmp_path, emulation, spec) -> None:
    """Default configs at language-model widths: 3 rows of 50257 (odd) and 1 row of 128256
    (both split over blocks by the default), and 50257 unsplit in warp mode."""
    found = [
        Case(spec, spec.default_config((3, 50257), "bfloat16"), (3, 50257), "bfloat16"),
        Case(spec, spec.default_config((1, 128256), "float32"), (1, 128256), "float32"),
        Case(
            spec,
            {"BLOCK_SIZE": 128, "VEC": 8, "ROW_THREADS": 32, "MIN_BLOCKS": 0, "SPLIT": 1},
            (3, 50257),
            "float16",
        ),
    ]
    assert [c.config["SPLIT"] > 1 for c in found] == [True, True, False]
    failures = run_cases(found, tmp_path, np.random.default_rng(9), binaries=1)
    assert not failures, "\n".join(failures)
