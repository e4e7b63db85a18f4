"""PyTorch's own op per operator (tuner/torch_ops.py), run on the CPU build of torch against each
operator's float64 references, and the check that decides whether a baseline is stored.

On the GPU, tests/gpu/test_framework_gpu.py runs every equivalent (the CUDA-only ones too) and
times it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kato.kernels import list_operators  # noqa: E402
from kato.kernels.user import UserOperatorSpec  # noqa: E402
from kato.tuner import torch_ops  # noqa: E402

BUILT_IN = [spec for spec in list_operators() if not isinstance(spec, UserOperatorSpec)]
#: Awkward shapes per rank: 1, odd, prime, just past a power of two.
SHAPES = {
    1: [(1,), (1000,), (4099,)],
    2: [(1, 2), (7, 129), (33, 1000), (3, 4097)],
    3: [(1, 1, 1), (17, 33, 9)],
    4: [(2, 3, 5, 7)],
}
#: (operator, dtype) whose torch CPU kernels are not held to the references: torch's CPU layer
#: and batch norms lose a float32 variance of rows or channels offset from zero (as the problems
#: make them, to test cancellation), and its layer norm keeps 16-bit statistics in 16 bits, so
#: its backward from Kato's float32 statistics must round them first. Their CUDA kernels are
#: checked on the GPU.
CPU_INEXACT = {
    ("layernorm", "float32"),
    ("layernorm_backward", "float16"),
    ("layernorm_backward", "bfloat16"),
    ("layernorm_relu", "float32"),
    ("layernorm_relu_backward", "float16"),
    ("layernorm_relu_backward", "bfloat16"),
    ("batchnorm", "float32"),
    ("batchnorm_relu", "float32"),
    ("batchnorm_add_relu", "float32"),
}


def cpu_cases():
    for spec in BUILT_IN:
        eq = torch_ops.EQUIVALENTS.get(spec.name)
        if eq is None or eq.cuda_only:
            continue
        for dtype in spec.dtypes:
            if (spec.name, dtype) in CPU_INEXACT:
                continue
            for shape in SHAPES[spec.rank]:
                yield pytest.param(spec, dtype, shape, id=f"{spec.name}-{dtype}-{shape}")


def problem(spec, dtype, shape, seed=1):
    return spec.make_problem(shape, dtype, np.random.default_rng(seed))


def test_every_built_in_operator_has_a_torch_equivalent():
    missing = sorted(s.name for s in BUILT_IN if s.name not in torch_ops.EQUIVALENTS)
    assert missing == [], f"add an entry to tuner/torch_ops.EQUIVALENTS for {missing}"
    assert set(torch_ops.EQUIVALENTS) <= {s.name for s in BUILT_IN}  # no stale entry


@pytest.mark.parametrize(("spec", "dtype", "shape"), cpu_cases())
def test_torch_equivalent_agrees_with_the_float64_reference(spec, dtype, shape):
    made = problem(spec, dtype, shape)
    outputs = torch_ops.run_equivalent(spec.name, torch_ops.problem_values(made, "cpu"))
    assert len(outputs) == len(made.outputs)
    assert torch_ops.check_outputs(spec, dtype, made, outputs) is None


def softmax_case():
    spec = next(s for s in BUILT_IN if s.name == "softmax")
    made = problem(spec, "float32", (7, 129))
    (y,) = torch_ops.run_equivalent("softmax", torch_ops.problem_values(made, "cpu"))
    return spec, made, y


def test_check_outputs_reports_an_element_outside_tolerance():
    spec, made, y = softmax_case()
    bad = y.clone()
    bad[3, 100] += 1e-3  # far beyond float32 softmax's tolerance
    error = torch_ops.check_outputs(spec, "float32", made, (bad,))
    assert error is not None and error.startswith("output 1 (#0): 1 of 903 elements outside")


def test_check_outputs_fails_nan_and_missing_outputs_and_wrong_sizes():
    spec, made, y = softmax_case()
    nan = y.clone()
    nan[0, 0] = float("nan")
    assert "1 of 903" in torch_ops.check_outputs(spec, "float32", made, (nan,))
    assert torch_ops.check_outputs(spec, "float32", made, (None,)) == (
        "torch's op produced none of the operator's outputs"
    )
    assert "torch gave 2 outputs" in torch_ops.check_outputs(spec, "float32", made, (y, y))
    assert "torch gave (7, 128) elements" in torch_ops.check_outputs(
        spec, "float32", made, (y[:, :128],)
    )


def test_integer_outputs_must_be_equal():
    spec = next(s for s in BUILT_IN if s.name == "sort")
    made = problem(spec, "int32", (5, 33))
    (keys,) = torch_ops.run_equivalent("sort", torch_ops.problem_values(made, "cpu"))
    assert torch_ops.check_outputs(spec, "int32", made, (keys,)) is None
    swapped = keys.clone()
    swapped[2, [0, 1]] = swapped[2, [1, 0]] + 1
    assert torch_ops.check_outputs(spec, "int32", made, (swapped,)) == (
        "output 1: 2 of 165 elements differ"
    )


def test_a_narrower_torch_output_is_allowed_its_roundings_and_no_more():
    """torch's loss has the logits' type (bfloat16), Kato's is float32: the check allows the
    bfloat16 roundings, and still fails a loss 2% off."""
    spec = next(s for s in BUILT_IN if s.name == "cross_entropy")
    made = problem(spec, "bfloat16", (33, 1000))
    loss, lse = torch_ops.run_equivalent("cross_entropy", torch_ops.problem_values(made, "cpu"))
    assert loss.dtype == torch.bfloat16 and lse is None
    assert torch_ops.check_outputs(spec, "bfloat16", made, (loss, None)) is None
    assert "outside tolerance" in torch_ops.check_outputs(
        spec, "bfloat16", made, (loss.float() * 1.02, None)
    )


def test_bfloat16_arrays_become_tensors_with_the_same_values():
    values = np.array([1.5, -2.25, 3.0e-3, 65504.0], dtype=np.float32)
    import ml_dtypes

    tensor = torch_ops.as_torch(values.astype(ml_dtypes.bfloat16), "cpu")
    assert tensor.dtype == torch.bfloat16
    assert (
        tensor.float().numpy().tolist()
        == values.astype(ml_dtypes.bfloat16).astype(np.float32).tolist()
    )
    assert torch_ops.as_torch(np.int64(-100), "cpu") == -100


def test_input_copies_stream_twice_the_l2():
    assert torch_ops.input_copies(10 << 20, 60 << 20) == 12
    assert torch_ops.input_copies(1 << 30, 60 << 20) == 1
    assert torch_ops.input_copies(1, 60 << 20) == torch_ops.MAX_COPIES


def test_measure_needs_an_equivalent():
    spec = next(s for s in BUILT_IN if s.name == "softmax")
    with pytest.raises(LookupError, match="no torch equivalent of operator 'nope'"):
        torch_ops.equivalent("nope")
    assert torch_ops.equivalent(spec.name).what == "torch.softmax(x, dim=-1)"
