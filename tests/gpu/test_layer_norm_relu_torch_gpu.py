"""kato_torch.layer_norm_relu on the GPU with Kato's kernels (policy "kato", default configs):
y and the gradients of x, weight and bias against float64 autograd of relu(layer_norm(x)), for
every dtype on awkward shapes and a view off a vector boundary; and the step of a small MLP
(Linear, layer_norm_relu, Linear) against the same step through torch's ops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the GPU image has it)")

import kato_torch  # noqa: E402

#: (rtol, atol) per dtype of y; gradients get a multiple (sums over rows and columns).
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kato_kernels():
    kato_torch.configure(client=None, policy="kato")
    yield
    kato_torch.configure(client=None)


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cols = shape[-1]
    x = torch.randn(shape, device="cuda", generator=gen) * 3 + 50
    w = torch.randn(cols, device="cuda", generator=gen)
    b = torch.randn(cols, device="cuda", generator=gen)
    dy = torch.randn(shape, device="cuda", generator=gen)
    return [t.to(dtype) for t in (x, w, b, dy)]


def _reference(x, w, b, dy):
    """float64 y and gradients; dy zeroed where the pre-activation is within 1e-3 of zero,
    where a float32 recomputation of the mask may fall on the other side."""
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    pre = torch.nn.functional.layer_norm(ref[0], (x.shape[-1],), ref[1], ref[2], 1e-5)
    dy = torch.where(pre.detach().abs() < 1e-3, 0.0, dy.double()).to(dy.dtype)
    y = torch.relu(pre)
    return dy, y, torch.autograd.grad(y, ref, dy.double())


def _check(x, w, b, dy, dtype):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    dy, y_ref, grads_ref = _reference(x, w, b, dy)
    y = kato_torch.layer_norm_relu(x, (x.shape[-1],), w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), y_ref, rtol=4 * rtol, atol=4 * atol)
    rows = x.numel() // x.shape[-1]
    scale = 8 * max(1.0, (rows / 64) ** 0.5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), g_ref, rtol=scale * rtol, atol=scale * atol)
    if x.shape[-1] >= 100:  # both sides of the ReLU exercised
        assert (y == 0).any() and (y > 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 128), (333, 1000), (4096, 2048), (4, 7, 130)])
def test_values_and_gradients(dtype, shape):
    _check(*_inputs(shape, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_view_off_a_vector_boundary(dtype):
    """Rows 1.. of a (65, 130) tensor: 130 elements past the allocation's start."""
    x, w, b, dy = _inputs((65, 130), dtype, seed=1)
    _check(x[1:], w, b, dy[1:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_step_matches_torchs_ops(dtype):
    """Linear -> layer_norm_relu -> Linear -> mean square, batch 512, widths 256-512-64: the
    loss and every parameter's gradient as through F.layer_norm and torch.relu."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(512, 256, device="cuda", generator=gen).to(dtype)
    params = [
        torch.randn(512, 256, device="cuda", generator=gen) / 16,
        torch.randn(512, device="cuda", generator=gen),
        torch.randn(512, device="cuda", generator=gen) / 4,
        torch.randn(64, 512, device="cuda", generator=gen) / 22,
    ]
    params = [p.to(dtype) for p in params]

    def step(norm_relu, ps):
        h = torch.nn.functional.linear(x, ps[0])
        h = norm_relu(h, (512,), ps[1], ps[2])
        return torch.nn.functional.linear(h, ps[3]).float().square().mean()

    def torch_norm_relu(h, shape, w, b):
        return torch.relu(torch.nn.functional.layer_norm(h, shape, w, b))

    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    loss = step(kato_torch.layer_norm_relu, ours)
    loss_ref = step(torch_norm_relu, theirs)
    grads = torch.autograd.grad(loss, ours)
    grads_ref = torch.autograd.grad(loss_ref, theirs)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(loss, loss_ref, rtol=4 * rtol, atol=4 * atol)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        scale = 16 * max(1.0, g_ref.abs().max().item())
        torch.testing.assert_close(g.float(), g_ref.float(), rtol=4 * rtol, atol=atol * scale)
