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


# --- the compiled baseline's compile (torch.compile of an equivalent) ------------------------
# Dynamo traces here with its "eager" backend (seconds less than Inductor's C++ on the CPU);
# tests/gpu/test_framework_gpu.py compiles with Inductor on the GPU.


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_equivalent_is_traced_whole_and_agrees_with_the_references(fresh_dynamo):
    spec = next(s for s in BUILT_IN if s.name == "softmax")
    made = problem(spec, "float32", (7, 129))
    state = torch_ops.equivalent("softmax").prepare(torch_ops.problem_values(made, "cpu"))
    run, outputs, what = torch_ops.compile_equivalent(
        torch_ops.equivalent("softmax"), state, backend="eager"
    )
    assert what == "torch.compile(torch.softmax(x, dim=-1))"
    assert torch_ops.check_outputs(spec, "float32", made, outputs) is None
    copy = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in state)
    assert torch.equal(run(copy)[0], outputs[0])  # a copy of the state: the same graph
    # A state the graph was not compiled for is refused, never timed as another graph.
    other = torch_ops.problem_values(problem(spec, "float32", (9, 129)), "cpu")
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        run(torch_ops.equivalent("softmax").prepare(other))


def test_an_op_dynamo_cannot_trace_whole_is_compiled_with_graph_breaks(fresh_dynamo):
    import torch._dynamo

    def run(s):
        y = torch.softmax(s[0], dim=-1)
        torch._dynamo.graph_break()
        return (y * 1,)

    eq = torch_ops.Equivalent(run, "softmax, a break, a copy")
    x = torch.randn(4, 8)
    compiled, outputs, what = torch_ops.compile_equivalent(eq, (x,), backend="eager")
    assert what == "torch.compile(softmax, a break, a copy) (graph breaks)"
    assert torch.allclose(outputs[0], torch.softmax(x, dim=-1))


def test_a_compiler_that_raises_makes_the_compiled_baseline_unavailable(fresh_dynamo):
    def broken(graph, example_inputs):
        raise RuntimeError("no kernels for you")

    with pytest.raises(torch_ops.CompileUnavailable, match="RuntimeError.*no kernels for you"):
        torch_ops.compile_equivalent(torch_ops.equivalent("softmax"), (torch.ones(2, 3),),
                                     backend=broken)  # fmt: skip


def test_the_compiled_baseline_is_labelled_with_torch_and_inductor():
    assert torch_ops.compiled_label() == f"torch.compile {torch.__version__} inductor"
