"""User kernels (``kato_torch.user_kernel``) inside ``torch.compile`` graphs on the GPU: compiled
with Inductor (fullgraph, dynamic shapes) and compared with the eager call, which runs the same
kernel, so the op's output must equal it exactly; ``torch.library.opcheck`` of each op (schema,
fake implementation against the kernel's outputs, AOT dispatch with dynamic shapes); an operator
without outputs that writes its array in place; a changed spec under the same name running its
own kernel. The CPU side (graphs, symbolic sizes, errors) is tests/user_ops/
test_torch_user_compile.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the GPU image has it)")
if not torch.cuda.is_available():
    pytest.skip("user kernels need a CUDA GPU", allow_module_level=True)

from kato.kernels.user import definition, spec_from_folder  # noqa: E402
from kato.kernels.user.spec import UserOperatorSpec  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch.library import opcheck  # noqa: E402
from user_ops.test_torch_user_kernel import _matmul  # noqa: E402

import kato_torch  # noqa: E402

FOLDER = Path(__file__).resolve().parent.parent / "user_ops" / "data" / "vector_add"

# x[i] = 2 x[i] + 1, in place: an operator without outputs.
IN_PLACE = """
__global__ void step(float *x, int n) {
    int i = blockIdx.x * block_size_x + threadIdx.x;
    if (i < n) x[i] = 2.0f * x[i] + 1.0f;
}
"""
# out[i] = RULE, two versions of one operator name.
AXPY = """
__global__ void axpy(float *out, const float *x, int n) {
    int i = blockIdx.x * block_size_x + threadIdx.x;
    if (i < n) out[i] = RULE;
}
"""


def _one_dim(name, template, kernel, arguments) -> UserOperatorSpec:
    spec = {
        "name": name,
        "template": "k.cu",
        "kernel_name": kernel,
        "shape": ["n"],
        "problem_size": ["n"],
        "tune_params": {"block_size_x": [64, 256]},
        "arguments": arguments,
        "verify": False,
    }
    return UserOperatorSpec(definition(spec, {"k.cu": template}))


def _axpy(rule: str) -> UserOperatorSpec:
    return _one_dim(
        "gpu_compile_axpy",
        AXPY.replace("RULE", rule),
        "axpy",
        [
            {"name": "out", "dtype": "float32", "size": "n", "output": True},
            {"name": "x", "dtype": "float32", "size": "n"},
            {"name": "n", "dtype": "int32", "value": "n"},
        ],
    )


pytestmark = pytest.mark.usefixtures("fresh_kato_torch")


def test_a_compiled_vector_add_equals_eager_at_every_size():
    add = kato_torch.user_kernel(spec_from_folder(FOLDER))

    def f(a, b):
        return add(a, b, a.numel())

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for n in (31, 1025, 1_000_003, 77):
        a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        got, want = compiled(a, b), f(a, b)
        assert got.shape == want.shape == (n,) and got.dtype == torch.float32
        assert torch.equal(got, want)  # the same kernel and config: bitwise equal
        torch.testing.assert_close(got.double(), a.double() + b.double(), rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1  # one graph for every size, no graph break


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_compiled_2d_kernel_between_torch_ops_equals_eager(dtype):
    mm = kato_torch.user_kernel(_matmul(f"gpu_compile_mm_{str(dtype)[6:]}"))

    def f(a, b):
        c = mm(torch.relu(a), b * 2, a.shape[0], b.shape[1], a.shape[1])
        return c, torch.tanh(c).sum(dim=1)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for m, n, k in ((17, 33, 65), (128, 129, 31)):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        (c, s), (c_eager, s_eager) = compiled(a, b), f(a, b)
        assert c.shape == (m, n) and c.dtype == dtype
        assert torch.equal(c, c_eager)
        torch.testing.assert_close(s, s_eager, rtol=2e-3, atol=2e-3)
        want = torch.relu(a).double() @ (b.double() * 2)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(c.double(), want, rtol=tol, atol=tol * k**0.5)
    assert counter.frame_count <= 2  # the second shape at most recompiles once (dynamic)


def test_constants_reach_a_compiled_kernel():
    from user_ops.test_constants import FILTER, _op

    conv = kato_torch.user_kernel(_op(name="gpu_compile_conv"))
    n = 100_003

    def f(x, taps):
        return conv(x, n, shape=(n, FILTER), constants={"d_filter": taps})

    x = torch.randn(n + FILTER - 1, device="cuda")
    taps = torch.randn(FILTER, device="cuda")
    compiled = torch.compile(f, fullgraph=True)
    got, want = compiled(x, taps), f(x, taps)
    assert torch.equal(got, want)
    window = x.double().unfold(0, FILTER, 1)
    torch.testing.assert_close(got.double(), window @ taps.double(), rtol=1e-5, atol=1e-5)


def test_opcheck_of_the_ops():
    add = kato_torch.user_kernel(spec_from_folder(FOLDER))
    a, b = torch.randn(1031, device="cuda"), torch.randn(1031, device="cuda")
    opcheck(add.op, (a, b, 1031, None, None, []))
    mm = kato_torch.user_kernel(_matmul("gpu_compile_opcheck_mm"))
    x, y = torch.randn(9, 5, device="cuda"), torch.randn(5, 7, device="cuda")
    opcheck(mm.op, (x, y, 9, 7, 5, None, None, []))
    from user_ops.test_constants import FILTER, _op

    conv = kato_torch.user_kernel(_op(name="gpu_compile_opcheck_conv"))
    z = torch.randn(200 + FILTER - 1, device="cuda")
    opcheck(conv.op, (z, 200, [200, FILTER], None, [torch.randn(FILTER, device="cuda")]))


def test_an_in_place_operator_compiles_with_its_write_kept():
    step = kato_torch.user_kernel(
        _one_dim(
            "gpu_compile_in_place",
            IN_PLACE,
            "step",
            [
                {"name": "x", "dtype": "float32", "size": "n"},
                {"name": "n", "dtype": "int32", "value": "n"},
            ],
        )
    )
    assert step.op._schema.is_mutable

    def f(x):
        y = x + 0
        step(y, y.numel())
        return y * 3

    x = torch.randn(4099, device="cuda")
    y = x.clone()
    assert step(y, 4099) == ()  # eager: no outputs, the array written
    torch.testing.assert_close(y, x * 2 + 1)
    got, want = torch.compile(f, fullgraph=True)(x), f(x)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, (x * 2 + 1) * 3)
    opcheck(step.op, (torch.randn(513, device="cuda"), 513, None, None, []))


def test_a_changed_spec_under_the_same_name_runs_its_own_kernel():
    first = kato_torch.user_kernel(_axpy("x[i] * 2"))
    x = torch.randn(1000, device="cuda")
    one = torch.compile(lambda x: first(x, x.numel()), fullgraph=True)
    torch.testing.assert_close(one(x), x * 2)
    second = kato_torch.user_kernel(_axpy("x[i] - 1"))  # same name and shape, another version
    two = torch.compile(lambda x: second(x, x.numel()), fullgraph=True)
    torch.testing.assert_close(two(x), x - 1)
    torch.testing.assert_close(second(x, 1000), x - 1)
    torch.testing.assert_close(one(x), x * 2)  # the first graph keeps the first version
    torch.testing.assert_close(first(x, 1000), x * 2)
