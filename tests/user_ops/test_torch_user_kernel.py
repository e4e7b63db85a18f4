"""``kato_torch.user_kernel`` on the CPU: a user operator's arguments checked and its outputs
allocated from the spec (shape read from the arguments), the policy's decision for an operator
without a PyTorch equivalent, and clear errors. The launch itself runs in
tests/gpu/test_user_kernel_torch_gpu.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the torch extra)")

from kato.kernels.spec import InvalidInput  # noqa: E402
from kato.kernels.user import definition, spec_from_folder  # noqa: E402
from kato.kernels.user.spec import UserOperatorSpec  # noqa: E402

import kato_torch  # noqa: E402
from kato_torch import policy  # noqa: E402

MATMUL = """
#include <cuda_fp16.h>
extern "C" __global__ void mm(T *C, const T *A, const T *B, int m, int n, int k) {
    int row = blockIdx.y * block_size_y + threadIdx.y;
    int col = blockIdx.x * block_size_x + threadIdx.x;
    if (row < m && col < n) {
        float acc = 0;
        for (int i = 0; i < k; i++) acc += (float)A[row * k + i] * (float)B[i * n + col];
        C[row * n + col] = acc;
    }
}
"""


def _matmul(name="torch_user_mm", **changes) -> UserOperatorSpec:
    spec = {
        "name": name,
        "template": "mm.cu",
        "kernel_name": "mm",
        "shape": ["m", "n", "k"],
        "dtypes": ["float32", "float16"],
        "dtype_macro": "T",
        "problem_size": ["n", "m"],
        "tune_params": {"block_size_x": [16, 32], "block_size_y": [4, 8]},
        "arguments": [
            {"name": "C", "dtype": "dtype", "size": "m * n", "output": True},
            {"name": "A", "dtype": "dtype", "size": "m * k"},
            {"name": "B", "dtype": "dtype", "size": "k * n"},
            {"name": "m", "dtype": "int32", "value": "m"},
            {"name": "n", "dtype": "int32", "value": "n"},
            {"name": "k", "dtype": "int32", "value": "k"},
        ],
        "verify": False,
    } | changes
    return UserOperatorSpec(definition(spec, {"mm.cu": MATMUL}))


@pytest.fixture(autouse=True)
def _no_client():
    kato_torch.configure(client=None)
    yield
    kato_torch.configure(client=None)


@pytest.fixture(autouse=True)
def _registrations_end_with_the_test():
    """``kato_torch.user_kernel(spec)`` registers the spec process-wide: without this, a later
    test in the same process (``kato operator add`` of the same folder) finds the name taken."""
    from kato.kernels import registry

    before = {spec.name for spec in registry.list_operators()}
    yield
    for name in {spec.name for spec in registry.list_operators()} - before:
        registry._OPERATORS.pop(name, None)


@pytest.fixture
def vector_add(vector_add_dir):
    return kato_torch.user_kernel(spec_from_folder(vector_add_dir))


def test_outputs_are_allocated_from_the_spec(vector_add):
    a, b = torch.randn(1009), torch.randn(1009)
    call = vector_add.plan(a, b, 1009)
    assert call.shape == (1009,) and call.dtype == "float32"
    (c,) = call.outputs
    assert c.shape == (1009,) and c.dtype == torch.float32 and c.device == a.device
    assert not c.any()  # an output's default init is zeros
    assert call.arguments[0] is c and call.arguments[1] is a and call.arguments[2] is b
    assert call.arguments[3] == 1009 and type(call.arguments[3]) is int


def test_a_view_off_a_vector_boundary_is_passed_as_an_aligned_copy(vector_add):
    storage = torch.randn(2 * 1009 + 3)
    a, b = storage[1:1010], storage[1010 + 1 : 2019 + 1]  # 4 and 8 bytes past a 16-byte boundary
    assert a.data_ptr() % 16 and b.data_ptr() % 16
    call = vector_add.plan(a, b, 1009)
    for given, passed in zip((a, b), call.arguments[1:3], strict=True):
        assert passed.data_ptr() % 16 == 0 and torch.equal(passed, given)
    aligned = torch.randn(1009)
    assert vector_add.plan(aligned, aligned, 1009).arguments[1] is aligned  # no copy


def test_a_product_of_shape_names_reads_and_gives_dimensions():
    mm = kato_torch.user_kernel(_matmul())
    a = torch.randn(7, 5, dtype=torch.float16)
    b = torch.randn(5, 3, dtype=torch.float16)
    call = mm.plan(a, b, 7, 3, 5)
    assert call.shape == (7, 3, 5) and call.dtype == "float16"
    assert call.outputs[0].shape == (7, 3) and call.outputs[0].dtype == torch.float16
    # Flat arrays: the scalars give the dimensions.
    call = mm.plan(a.ravel(), b.ravel(), 7, 3, 5)
    assert call.shape == (7, 3, 5)


def test_a_dimension_is_solved_from_an_element_count():
    spec = _matmul(
        "torch_user_padded",
        shape=["n"],
        problem_size=["n"],
        arguments=[
            {"name": "out", "dtype": "float32", "size": "2 * n + 1", "output": True},
            {"name": "x", "dtype": "float32", "size": "n + 3"},
        ],
    )
    k = kato_torch.user_kernel(spec)
    call = k.plan(torch.zeros(100))
    assert call.shape == (97,) and call.outputs[0].shape == (195,)
    ambiguous = _matmul(
        "torch_user_ambiguous",
        shape=["n"],
        problem_size=["n"],
        arguments=[
            {"name": "out", "dtype": "float32", "size": "n", "output": True},
            {"name": "x", "dtype": "float32", "size": "ceil(n / 32)"},
        ],
    )
    with pytest.raises(InvalidInput, match=r"cannot read n of the shape .* pass shape="):
        kato_torch.user_kernel(ambiguous).plan(torch.zeros(4))
    assert kato_torch.user_kernel(ambiguous).plan(torch.zeros(4), shape=(100,)).shape == (100,)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            (torch.randn(8), torch.randn(8)),
            r"takes 3 arguments \(a, b, n; outputs c are allocated\), got 2",
        ),
        ((torch.randn(8), 1.0, 8), "argument b is an array .* pass a tensor, got float"),
        (
            (torch.randn(8), torch.randn(8), torch.tensor(8)),
            "argument n is a scalar .* pass a number",
        ),
        (
            (torch.randn(8), torch.randn(8, dtype=torch.float64), 8),
            "b must be torch.float32, got torch.float64",
        ),
        ((torch.randn(8), torch.randn(8), 8.5), "scalar n is int32; got 8.5"),
        (
            (torch.randn(8), torch.randn(9), 8),
            "argument b has 9 elements; at shape n=8 its size n is 8",
        ),
        ((torch.randn(8), torch.randn(8), 9), "scalar n is 9; at shape n=8 it must be n = 8"),
        ((torch.randn(8, 2)[:, 0], torch.randn(8), 8), "a is not contiguous"),
        ((torch.randn(8), torch.randn(8, device="meta"), 8), "tensors on several devices"),
    ],
)
def test_bad_arguments_say_what_to_pass(vector_add, args, says):
    with pytest.raises(InvalidInput, match=says):
        vector_add.plan(*args)


def test_the_request_dtype_must_be_one_the_operator_takes():
    mm = kato_torch.user_kernel(_matmul())
    a, b = torch.randn(2, 2, dtype=torch.bfloat16), torch.randn(2, 2, dtype=torch.bfloat16)
    with pytest.raises(
        InvalidInput, match="takes dtype float32, float16; the arguments are bfloat16"
    ):
        mm.plan(a, b, 2, 2, 2)
    with pytest.raises(InvalidInput, match="arrays of the request's dtype disagree"):
        mm.plan(a, b.half(), 2, 2, 2)


def test_a_call_needs_cuda_tensors(vector_add):
    with pytest.raises(
        InvalidInput, match="no PyTorch implementation; its tensors must be on a CUDA"
    ):
        vector_add(torch.randn(8), torch.randn(8), 8)


def test_auto_runs_a_user_kernel_and_torch_never_does(vector_add):
    name = vector_add.name
    assert policy.decide(name, (8,), "float32", "cuda") is True  # no client, no winner: still Kato
    assert policy.decide("softmax", (8, 8), "float32", "cuda") is False  # has PyTorch's op
    assert policy.decide(name, (8,), "float32", "cpu") is False
    kato_torch.configure(client=None, policy={name: "torch"})
    assert policy.decide(name, (8,), "float32", "cuda") is False
    with kato_torch.record() as rec:
        policy.decide(name, (8,), "float32", "cuda")
    assert rec.keys == [kato_torch.Key(name, (8,), "float32")]  # tunable as a batch like any


def test_only_user_operators():
    with pytest.raises(InvalidInput, match="one of Kato's own operators"):
        kato_torch.user_kernel("softmax")
    with pytest.raises(InvalidInput, match="unknown operator 'no_such_user_op'"):
        kato_torch.user_kernel("no_such_user_op")


def test_constant_memory_arrays_are_given_by_name():
    from user_ops.test_constants import FILTER, _op

    conv = kato_torch.user_kernel(_op(name="torch_user_conv"))
    x = torch.randn(100 + FILTER - 1)
    taps = [0.5] * FILTER
    call = conv.plan(x, 100, constants={"d_filter": taps})
    assert call.shape == (100, FILTER) and call.outputs[0].shape == (100,)  # f solved from x
    (values,) = call.constants.values()
    assert values.dtype == torch.float32 and values.tolist() == taps
    with pytest.raises(InvalidInput, match=r"constants= must give .*\['d_filter'\]; got none"):
        conv.plan(x, 100, shape=(100, FILTER))
    with pytest.raises(InvalidInput, match="constant d_filter has 3 elements; its size f is 17"):
        conv.plan(x, 100, shape=(100, FILTER), constants={"d_filter": [1.0, 2.0, 3.0]})
    with pytest.raises(InvalidInput, match="got \\['d_other'\\]"):
        conv.plan(x, 100, shape=(100, FILTER), constants={"d_other": taps})


def test_a_float_scalar_of_the_shape_is_checked_and_passed_as_a_float():
    spec = _matmul(
        "torch_user_scaled",
        shape=["n"],
        problem_size=["n"],
        arguments=[
            {"name": "out", "dtype": "float32", "size": "n", "output": True},
            {"name": "x", "dtype": "float32", "size": "n"},
            {"name": "count", "dtype": "float32", "value": "n"},
            {"name": "alpha", "dtype": "float32", "value": "0"},  # not of the shape: as given
        ],
    )
    k = kato_torch.user_kernel(spec)
    call = k.plan(torch.zeros(3), 3, 2.5)
    assert call.shape == (3,) and call.arguments[2:] == [3.0, 2.5]
    assert type(call.arguments[2]) is float
    with pytest.raises(InvalidInput, match=r"scalar count is 3.5; at shape n=3 it must be n = 3"):
        k.plan(torch.zeros(3), 3.5, 2.5)
