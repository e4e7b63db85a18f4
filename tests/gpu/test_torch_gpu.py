"""kato_torch on the GPU: each function against PyTorch (values and gradients), on the caller's
stream, with configs from a client; and a small MLP training step against plain PyTorch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the GPU image has it)")

import kato_torch  # noqa: E402
from benchmarks.torch_mlp import KATO_OPS, TORCH_OPS, mlp_problem, mlp_step  # noqa: E402

TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.fixture(autouse=True)
def _defaults():
    # Kato's kernels with their default configs (no service here); "auto" would run PyTorch's.
    kato_torch.configure(client=None, policy="kato")
    yield
    kato_torch.configure(client=None)


def _saved_tensors(y):
    """Tensors the autograd graph keeps for y's backward: those of the first node up from y
    that is a Python autograd function (the custom op's; y itself may be a view)."""
    node = y.grad_fn
    while node is not None and not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0] if node.next_functions else None
    return list(node.saved_tensors)


def close(a, b, dtype, scale=1.0):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol * scale, atol=atol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1000), (257, 4096), (4, 7, 130)])
def test_softmax_and_grad(dtype, shape):
    x = (torch.randn(shape, device="cuda") * 4).to(dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda").to(dtype)
    y = kato_torch.softmax(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    x_ref = x.detach().float().requires_grad_()
    y_ref = torch.softmax(x_ref, -1)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy.float())
    close(y, y_ref, dtype)
    close(dx, dx_ref, dtype, scale=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (5, 128), (333, 1000), (64, 4096)])
def test_layernorm_and_grads(dtype, shape):
    cols = shape[-1]
    x = (torch.randn(shape, device="cuda") * 3 + 50).to(dtype).requires_grad_()
    w = torch.randn(cols, device="cuda").to(dtype).requires_grad_()
    b = torch.randn(cols, device="cuda").to(dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda").to(dtype)
    y = kato_torch.layernorm(x, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    ref_in = [t.detach().float().requires_grad_() for t in (x, w, b)]
    y_ref = torch.nn.functional.layer_norm(ref_in[0], (cols,), ref_in[1], ref_in[2], 1e-5)
    grads_ref = torch.autograd.grad(y_ref, ref_in, dy.float())
    close(y, y_ref, dtype, scale=4)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        close(g, g_ref, dtype, scale=8 * max(1.0, (shape[0] / 64) ** 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 31, 33, 1000003])
def test_relu_saves_a_bit_mask_and_backward_uses_it(dtype, n):
    x = torch.randn(n, device="cuda").to(dtype)
    x[x == 0] = 1.0
    x.requires_grad_()
    dy = torch.randn(n, device="cuda").to(dtype)
    y = kato_torch.relu(x)
    bound = kato_torch.bind("relu", (n,), str(dtype).removeprefix("torch."), 0)
    if bound.config.get("MASK", 1):  # the backward keeps the bits, not x
        saved = [t for t in _saved_tensors(y) if t.numel()]
        assert [(t.numel(), t.dtype) for t in saved] == [((n + 31) // 32, torch.int32)]
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(y, torch.relu(x.detach()))
    assert torch.equal(dx, torch.where(x.detach() > 0, dy, torch.zeros_like(dy)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 999), (999, 1), (1000, 1234)])
def test_transpose(dtype, shape):
    x = torch.randn(shape, device="cuda").to(dtype).requires_grad_()
    y = kato_torch.transpose(x)
    assert torch.equal(y, x.detach().t().contiguous())
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(dx, torch.ones_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (127, 131, 257), (256, 512, 64)])
def test_matmul_and_grads(dtype, mnk):
    m, n, k = mnk
    a = (torch.rand(m, k, device="cuda") * 2 - 1).to(dtype).requires_grad_()
    b = (torch.rand(k, n, device="cuda") * 2 - 1).to(dtype).requires_grad_()
    dc = (torch.rand(m, n, device="cuda") * 2 - 1).to(dtype)
    c = kato_torch.matmul(a, b)
    da, db = torch.autograd.grad(c, (a, b), dc)
    a64, b64, dc64 = a.detach().double(), b.detach().double(), dc.double()
    scale = max(1.0, k**0.5 / 4)
    close(c, a64 @ b64, dtype, scale=scale)
    close(da, dc64 @ b64.t(), dtype, scale=max(1.0, n**0.5 / 4))
    close(db, a64.t() @ dc64, dtype, scale=max(1.0, m**0.5 / 4))


def test_runs_on_the_callers_stream():
    """Work queued on a side stream before a Kato call is seen by it, and work after it sees
    its result, with no synchronisation in between: the launch went to that stream."""
    side = torch.cuda.Stream()
    x = torch.empty(4096, 4096, device="cuda")
    with torch.cuda.stream(side):
        for _ in range(20):  # keep the side stream busy, so a launch elsewhere would race
            x.normal_()
        x.fill_(1.0)
        y = kato_torch.softmax(x)
        total = y.sum()
    side.synchronize()
    assert abs(total.item() - 4096.0) < 1e-2


def test_config_comes_from_the_client_once_per_shape():
    calls = []

    class Client:
        def config(self, operator, shape, dtype, gpu=None):
            calls.append((operator, tuple(shape), dtype))
            return {
                "BLOCK_SIZE": 128,
                "VEC": 4,
                "STRATEGY": 1,
                "CACHE": 0,
                "MIN_BLOCKS": 0,
                "LANES": 32,
            }

    kato_torch.configure(client=Client(), policy="kato")
    x = torch.randn(64, 1024, device="cuda")
    for _ in range(3):
        close(kato_torch.softmax(x), torch.softmax(x, -1), torch.float32)
    assert calls == [("softmax", (64, 1024), "float32")]
    assert kato_torch.bind("softmax", (64, 1024), "float32", 0).config["BLOCK_SIZE"] == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_training_step_matches_pytorch(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    x, labels, params = mlp_problem(dtype)
    loss, grads = mlp_step(x, labels, params, KATO_OPS)
    loss_ref, grads_ref = mlp_step(x, labels, params, TORCH_OPS)
    scale = 1 if dtype == torch.float32 else 4
    torch.testing.assert_close(loss.float(), loss_ref.float(), rtol=1e-3 * scale, atol=1e-4)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        err = (g.float() - g_ref.float()).norm() / g_ref.float().norm()
        assert err < (2e-3 if dtype == torch.float32 else 3e-2), err
