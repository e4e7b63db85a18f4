"""Gradients of user kernels on the GPU: ``scaled_mul_test`` (y = alpha * a * b) with its
``[backward]`` operator ``scaled_mul_backward_test`` (tests/user_ops/data), both CUDA, trained
eagerly and under ``torch.compile`` (Inductor, AOT autograd), against float64 PyTorch; the
same gradients from a Python ``backward=`` that calls the backward kernel; a gradcheck-like
test of the kernel's backward against finite differences of its own forward; ``opcheck`` with
inputs that require grad. The CPU side (specs, graphs, the formula with a stand-in launch):
tests/user_ops/test_user_kernel_grad.py and test_user_kernel_grad_spec.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the GPU image has it)")
if not torch.cuda.is_available():
    pytest.skip("user kernels need a CUDA GPU", allow_module_level=True)

from kato.kernels.user import definition, spec_from_folder  # noqa: E402
from kato.kernels.user.spec import UserOperatorSpec  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch.library import opcheck  # noqa: E402

import kato_torch  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "user_ops" / "data"
SIZES = (1, 31, 1025, 1_000_003)
#: Two float32 roundings of products of N(0, 1) values (and a float32 sum in the loss).
TOL = {"rtol": 1e-5, "atol": 1e-6}


pytestmark = pytest.mark.usefixtures("fresh_kato_torch")


@pytest.fixture
def backward_kernel():
    return kato_torch.user_kernel(spec_from_folder(DATA / "scaled_mul_backward"))


@pytest.fixture
def scaled_mul(backward_kernel):
    return kato_torch.user_kernel(spec_from_folder(DATA / "scaled_mul"))


def _inputs(n: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(n, device="cuda", generator=gen).requires_grad_()
    b = torch.randn(n, device="cuda", generator=gen).requires_grad_()
    w = torch.randn(n, device="cuda", generator=gen)
    return a, b, w


def _reference(a, b, w, alpha, outer=None):
    """The loss's value and the gradients of a and b in float64 autograd."""
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    y = alpha * a64 * b64
    loss = ((outer(y) if outer else y) * w.double()).sum()
    loss.backward()
    return loss.detach(), a64.grad, b64.grad


@pytest.mark.parametrize("n", SIZES)
def test_eager_gradients_match_float64(scaled_mul, n):
    a, b, w = _inputs(n)
    y = scaled_mul(a, b, 0.75, n)
    assert y.requires_grad and y.shape == (n,)
    loss = (y * w).sum()
    loss.backward()
    want, grad_a, grad_b = _reference(a, b, w, 0.75)
    torch.testing.assert_close(y.detach().double(), 0.75 * a.double() * b.double(), **TOL)
    torch.testing.assert_close(a.grad.double(), grad_a, **TOL)
    torch.testing.assert_close(b.grad.double(), grad_b, **TOL)


def test_the_backward_kernel_agrees_with_finite_differences_of_the_forward(scaled_mul):
    """gradcheck's question in float32: <grad, v> against the central difference of the
    kernel's own forward along v (exact up to rounding here: y is linear in each input)."""
    n = 4099
    a, b, w = _inputs(n, seed=1)
    (scaled_mul(a, b, 1.25, n) * w).sum().backward()
    for x, grad in ((a, a.grad), (b, b.grad)):
        v = torch.randn(n, device="cuda", dtype=torch.float64)
        eps = 1e-2

        def loss(shift, x=x, v=v, eps=eps):
            moved = (x.detach().double() + shift * eps * v).float()
            with torch.no_grad():
                if x is a:
                    y = scaled_mul(moved, b.detach(), 1.25, n)
                else:
                    y = scaled_mul(a.detach(), moved, 1.25, n)
            return (y.double() * w.double()).sum()

        numeric = (loss(1) - loss(-1)) / (2 * eps)
        analytic = (grad.double() * v).sum()
        torch.testing.assert_close(analytic, numeric, rtol=1e-3, atol=1e-3)


def test_a_compiled_training_step_matches_float64_at_every_size(scaled_mul):
    def loss(a, b, w):
        y = scaled_mul(a * 2, b, 0.5, a.numel())
        return (torch.tanh(y) * w).sum()

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for n in (31, 1025, 1_000_003, 77):
        a, b, w = _inputs(n, seed=n)
        got = compiled(a, b, w)
        got.backward()
        want, grad_a, grad_b = _reference(a * 2, b, w, 0.5, outer=torch.tanh)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(a.grad.double(), 2 * grad_a, **TOL)
        torch.testing.assert_close(b.grad.double(), grad_b, **TOL)
    assert counter.frame_count == 1  # one graph (forward and backward) for every size


def _plain_spec() -> UserOperatorSpec:
    folder = DATA / "scaled_mul"
    spec = tomllib.loads((folder / "kato.toml").read_text()) | {"name": "gpu_scaled_mul_py"}
    del spec["backward"]
    return UserOperatorSpec(definition(spec, {p.name: p.read_text() for p in folder.glob("*.cu")}))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_python_backward_calling_the_backward_kernel(backward_kernel, compiled):
    def backward(saved, grad_y):
        grad_a, grad_b = backward_kernel(grad_y, saved["a"], saved["b"], saved["alpha"], saved["n"])
        return grad_a, grad_b, None, None

    k = kato_torch.user_kernel(_plain_spec(), backward=backward)

    def loss(a, b, w):
        return (k(a, b, -1.5, a.numel()) * w).sum()

    run = torch.compile(loss, fullgraph=True, dynamic=True) if compiled else loss
    for n in (1025, 1_000_003):
        a, b, w = _inputs(n, seed=7)
        run(a, b, w).backward()
        _, grad_a, grad_b = _reference(a, b, w, -1.5)
        torch.testing.assert_close(a.grad.double(), grad_a, **TOL)
        torch.testing.assert_close(b.grad.double(), grad_b, **TOL)


def test_opcheck_with_inputs_that_require_grad(scaled_mul):
    a, b, _ = _inputs(1031, seed=3)
    opcheck(scaled_mul.op, (a, b, 0.5, 1031, None, None, []))
