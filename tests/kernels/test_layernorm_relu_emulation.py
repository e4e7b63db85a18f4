"""layernorm_relu and layernorm_relu_backward on the CPU: the real templates rendered with
``EPILOGUE_RELU=1``, compiled as host C++ against tests/kernels/cuda_emulation.py and verified
with the problems' tolerances exactly as the GPU backend verifies.

The forward runs layernorm's own case sets (every (ROW_THREADS, CACHE) on awkward shapes,
split rows on shifted pointers, the two-launch GROUP_ROWS=0 pieces), the backward
layernorm_backward's (every (ROW_THREADS, CACHE, DW_ACC) on 1 row, 1 column, odd and prime
widths, rows whose head moves): in CI a third of each, every dtype meeting every value
(ci_sample.rotated; test_layernorm_emulation and test_layernorm_backward_emulation run the whole
product without the epilogue), the whole product here too under ``-m slow``. A template whose mask
is broken (no ReLU, or the mask taken without the bias) fails on every case."""

from __future__ import annotations

import cuda_emulation
import numpy as np
import pytest
import rowwise_emulation
import test_layernorm_emulation as ln_cases
from ci_sample import EVERY_DTYPE, assert_rotated, rotated
from cuda_emulation import Case, run_cases
from kato.kernels import get_operator

FORWARD = get_operator("layernorm_relu")
BACKWARD = get_operator("layernorm_relu_backward")


def as_relu(cases: list[Case]) -> list[Case]:
    """Layernorm's cases (same space, same checks) for layernorm_relu."""
    return [Case(FORWARD, c.config, c.shape, c.dtype, c.grid_cap, offset=c.offset) for c in cases]


def failing_cases(failures: list[str]) -> set[str]:
    return {line.split(": output")[0].split(": exit")[0] for line in failures}


@EVERY_DTYPE
def test_forward_logic_on_the_cpu(tmp_path, norm_emulation, every_dtype) -> None:
    """Every (ROW_THREADS, CACHE), each value of them in every dtype (``-m slow``: every (dtype,
    ROW_THREADS, CACHE)), on awkward shapes and on split rows (ROW_SPLIT) at every VEC on
    shifted pointers: y, mean and rstd within tolerance."""
    keys = ("ROW_THREADS", "CACHE")
    whole, split = ln_cases.emulated_cases(), ln_cases.split_cases()
    shapes = {c.shape for c in whole + split}
    if not every_dtype:  # turned so that every shape stays in the sample
        whole, split = rotated(whole, keys, turn=2), rotated(split, keys, turn=2)
    cases = as_relu(whole + split)
    assert {c.shape for c in cases} == shapes
    for part in (whole, split):
        assert {(c.config["ROW_THREADS"], c.config["CACHE"]) for c in part} == {
            (t, k) for t in (8, 16, 32, 0) for k in (0, 1, 2)
        }
        assert_rotated(part, keys)
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    assert {c.offset for c in cases} == {0, 1, 3}
    assert any(FORWARD.defines(c.config, c.shape, c.dtype).get("ROW_SPLIT") for c in cases)
    assert all(FORWARD.defines(c.config, c.shape, c.dtype)["EPILOGUE_RELU"] == 1 for c in cases)
    failures = run_cases(cases, tmp_path, np.random.default_rng(3030))
    assert not failures, "\n".join(failures[:20])


def test_forward_rows_in_pieces_on_the_cpu(tmp_path, norm_emulation) -> None:
    """GROUP_ROWS=0 (a block per piece of a row, two launches, split rows' head and tail in
    the first piece) applies the ReLU too: every third of layernorm's own piece cases (each
    shape and dtype once; test_layernorm_emulation runs them all without the epilogue)."""
    cases = as_relu(ln_cases.piece_cases()[::3])
    assert {c.config["GROUP_ROWS"] for c in cases} == {0}
    assert {c.dtype for c in cases} == set(FORWARD.dtypes)
    assert {c.shape for c in cases} == set(ln_cases.PIECE_SHAPES)
    failures = run_cases(cases, tmp_path, np.random.default_rng(3031))
    assert not failures, "\n".join(failures[:20])


def test_forward_without_the_relu_fails(tmp_path, norm_emulation, monkeypatch) -> None:
    """The same template with the ReLU taken out of its epilogue fails every case: y's
    reference is clipped (about half of every row negative before it)."""
    relu = "return v < 0.0f ? 0.0f : v;"
    original = cuda_emulation.host_template

    def no_relu(spec, config):
        source = original(spec, config)
        assert relu in source
        return source.replace(relu, "return v;")

    monkeypatch.setattr(cuda_emulation, "host_template", no_relu)
    cases = as_relu(ln_cases.emulated_cases()[::6] + ln_cases.split_cases()[::6])
    failures = run_cases(cases, tmp_path, np.random.default_rng(3032))
    assert failing_cases(failures) == {str(c) for c in cases}
    assert all(": output 3:" in line for line in failures)  # y alone: mean and rstd are right


def backward_cases() -> list[Case]:
    cases = rowwise_emulation.cases(BACKWARD, {"DW_ACC": (0, 1, 2)}, seed=5)
    # DW_ACC=2 only in block mode: 3 dtypes x (3 warp widths x 3 caches x 2 + 3 caches x 3).
    assert len(
        {(c.dtype, c.config["ROW_THREADS"], c.config["CACHE"], c.config["DW_ACC"]) for c in cases}
    ) == 3 * (3 * 3 * 2 + 3 * 3)
    return cases


@EVERY_DTYPE
def test_backward_logic_on_the_cpu(tmp_path, monkeypatch, every_dtype) -> None:
    """Every (ROW_THREADS, CACHE, DW_ACC), each value of them in every dtype (``-m slow``:
    every (dtype, ROW_THREADS, CACHE, DW_ACC)), on every shape of rowwise_emulation: dx,
    dweight, dbias within tolerance."""
    rowwise_emulation.set_up(monkeypatch)
    keys = ("ROW_THREADS", "CACHE", "DW_ACC")
    cases = backward_cases() if every_dtype else rotated(backward_cases(), keys)
    assert len({tuple(c.config[k] for k in keys) for c in cases}) == 3 * 3 * 2 + 3 * 3
    assert_rotated(cases, keys)
    assert {c.config["VEC"] for c in cases} == {1, 2, 4, 8}
    assert {c.shape for c in cases} == set(rowwise_emulation.SHAPES)
    failures = run_cases(cases, tmp_path, np.random.default_rng(3033))
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize(
    ("broken", "replacement"),
    [("fmaf(xh, w, b) > 0.0f ? d : 0.0f", "d"), ("fmaf(xh, w, b) > 0.0f", "xh * w > 0.0f")],
    ids=["no-mask", "mask-without-bias"],
)
def test_backward_with_a_broken_mask_fails(tmp_path, monkeypatch, broken, replacement) -> None:
    """The template with dy left unmasked, or masked by xhat * w without the bias, fails every
    case of a sample covering every CACHE and DW_ACC."""
    rowwise_emulation.set_up(monkeypatch)
    original = cuda_emulation.host_template

    def mutated(spec, config):
        source = original(spec, config)
        assert broken in source
        return source.replace(broken, replacement)

    monkeypatch.setattr(cuda_emulation, "host_template", mutated)
    sample: dict[tuple[int, int], Case] = {}
    for c in backward_cases():  # the first of each (CACHE, DW_ACC), more than one column
        if c.shape[1] > 1:
            sample.setdefault((c.config["CACHE"], c.config["DW_ACC"]), c)
    assert set(sample) == {(k, a) for k in (0, 1, 2) for a in (0, 1, 2)}
    cases = list(sample.values())
    failures = run_cases(cases, tmp_path, np.random.default_rng(3034))
    assert failing_cases(failures) == {str(c) for c in cases}
