"""kato_torch.batch_norm_relu and kato_torch.fuse on the CPU: the fused custom operators'
schemas, fake implementations and autograd (opcheck), their PyTorch paths giving exactly the
unfused sequence's values and gradients, and the fx rewrite of a model (which calls it rewrites,
which it leaves alone, state dict and parameters unchanged and shared, eval mode, hooks,
torch.compile). Kato's kernels on these paths run in tests/gpu/test_torch_ops_gpu.py."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="kato_torch's tests need PyTorch (the torch extra)")
F = torch.nn.functional

import kato_torch  # noqa: E402
from kato_torch.fuse import fused, unfuse  # noqa: E402


def _rand(*shape, grad=True, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) + offset).float().requires_grad_(grad)


# --- the operators and the function -----------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True])
def test_opcheck_and_autograd_of_the_fused_op_are_the_unfused_sequence(residual):
    # A positive scale and a small shift keep every channel on both sides of the ReLU.
    x, w = _rand(4, 6, 5, 3), (torch.rand(6) + 0.5).requires_grad_()
    b = (0.1 * torch.randn(6)).requires_grad_()
    r = _rand(4, 6, 5, 3) if residual else None
    rm, rv = torch.rand(6), torch.rand(6) + 0.5
    args = (x, r, w, b, rm, rv, 1e-5, 0.1)
    opcheck = torch.library.opcheck
    opcheck(torch.ops.kato.batch_norm_relu.default, args)
    y, mean, invstd, new_mean, new_var = torch.ops.kato.batch_norm_relu(*args)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    rr = r.detach().clone().requires_grad_() if residual else None
    z = F.batch_norm(xr, rm_ref, rv_ref, wr, br, True, 0.1, 1e-5)
    y_ref = torch.relu(z + rr if residual else z)
    assert torch.equal(y, y_ref)
    assert 0.2 < (y == 0).float().mean() < 0.8  # both sides of the ReLU
    assert torch.equal(new_mean, rm_ref) and torch.equal(new_var, rv_ref)
    dy = torch.randn(y.shape)
    leaves = [x, w, b] + ([r] if residual else [])
    leaves_ref = [xr, wr, br] + ([rr] if residual else [])
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(y_ref, leaves_ref, dy)
    for g, h in zip(got, want, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
def test_the_eager_path_of_the_fused_op_is_the_unfused_sequence(residual):
    """The direct eager call (KatoOp's autograd.Function, not the dispatcher) with the same
    setup_context and backward: torch's values and gradients exactly."""
    from kato_torch.ops import _batch_norm_relu

    x, w, b = _rand(3, 4, 5, 2), _rand(4, offset=1), _rand(4)
    r = _rand(3, 4, 5, 2) if residual else None
    y, *_ = _batch_norm_relu(x, r, w, b, torch.zeros(4), torch.ones(4), 1e-5, 0.1)
    z = F.batch_norm(x, torch.zeros(4), torch.ones(4), w, b, True, 0.1, 1e-5)
    y_ref = torch.relu(z + r if residual else z)
    assert torch.equal(y, y_ref)
    leaves = [x, w, b] + ([r] if residual else [])
    dy = torch.randn(y.shape)
    for g, h in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy),
                    strict=True):  # fmt: skip
        assert torch.equal(g, h)


def test_opcheck_of_the_backward_ops():
    x, dy = _rand(3, 4, 5, 5, grad=False), _rand(3, 4, 5, 5, grad=False)
    y = torch.relu(_rand(3, 4, 5, 5, grad=False))
    mean, invstd = torch.randn(4), torch.rand(4) + 0.5
    w, b = _rand(4, grad=False), _rand(4, grad=False)
    torch.library.opcheck(
        torch.ops.kato.batch_norm_relu_backward.default, (x, dy, y, mean, invstd, w, b, 1e-5)
    )
    torch.library.opcheck(
        torch.ops.kato.batch_norm_add_relu_backward.default, (x, dy, y, mean, invstd, w, 1e-5)
    )
    dx, dw, db, dres = torch.ops.kato.batch_norm_add_relu_backward(x, dy, y, mean, invstd, w, 1e-5)
    assert torch.equal(dres, torch.where(y > 0, dy, 0.0))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_the_function_on_cpu_is_torchs_sequence_exactly(residual, training):
    x, w, b = _rand(2, 3, 4, 4), _rand(3, offset=1), _rand(3)
    r = _rand(2, 3, 4, 4) if residual else None
    stats, stats_ref = (torch.rand(3), torch.rand(3) + 0.5), None
    stats_ref = tuple(s.clone() for s in stats)
    y = kato_torch.batch_norm_relu(x, *stats, w, b, training, 0.1, 1e-5, residual=r)
    z = F.batch_norm(x, *stats_ref, w, b, training, 0.1, 1e-5)
    y_ref = torch.relu(z + r if residual else z)
    assert torch.equal(y, y_ref)
    for s, t in zip(stats, stats_ref, strict=True):
        assert torch.equal(s, t)
    assert not torch.equal(x, y)


def test_a_broadcast_residual_runs_torchs_add():
    x, w, b = _rand(2, 3, 4, 4), _rand(3), _rand(3)
    r = _rand(1, 3, 1, 1)
    stats = torch.zeros(3), torch.ones(3)
    y = kato_torch.batch_norm_relu(x, *stats, w, b, True, 0.1, 1e-5, residual=r)
    z = F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, True, 0.1, 1e-5)
    assert torch.equal(y, torch.relu(z + r))


def test_record_lists_the_fused_operators():
    x, w, b = _rand(2, 3, 4, 4), _rand(3), _rand(3)
    with kato_torch.record() as rec:
        kato_torch.batch_norm_relu(x, torch.zeros(3), torch.ones(3), w, b, True)
        kato_torch.batch_norm_relu(x, torch.zeros(3), torch.ones(3), w, b, True, residual=x)
    ops = {k.operator for k in rec.keys}
    assert {"batchnorm_relu", "batchnorm_relu_backward", "batchnorm_add_relu",
            "batchnorm_add_relu_backward"} <= ops  # fmt: skip


# --- the fusion pass --------------------------------------------------------------------------


class Block(torch.nn.Module):
    """ResNet's basic block, written the ways models write it."""

    def __init__(self, cin, cout, stride, style):
        super().__init__()
        self.style = style
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.relu = torch.nn.ReLU(inplace=True)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.skip is None else self.skip(x)
        if self.style == 0:  # torchvision's
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            y += identity
            return self.relu(y)
        if self.style == 1:  # functional
            y = F.relu(self.bn1(self.conv1(x)))
            return torch.relu(identity + self.bn2(self.conv2(y)))
        y = self.bn1(self.conv1(x)).relu()  # methods
        return torch.add(self.bn2(self.conv2(y)), identity).relu_()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
        )  # fmt: skip
        self.blocks = torch.nn.Sequential(
            Block(8, 8, 1, 0), Block(8, 16, 2, 1), Block(16, 16, 1, 2), Block(16, 8, 1, 0)
        )
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _step(model, x):
    loss = model(x).square().sum()
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def test_fuse_rewrites_every_pattern_and_keeps_the_models_values_and_gradients():
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    assert kato_torch.fuse(model) is model
    codes = {name: fused(m) for name, m in model.named_modules() if fused(m)}
    assert set(codes) == {"stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3"}
    assert all(
        code.count("batch_norm_relu_module(") == 2 for n, code in codes.items() if n != "stem"
    )
    assert codes["stem"].count("batch_norm_relu_module(") == 1
    assert ", None)" not in codes["blocks.1"].split("batch_norm_relu_module(")[2]  # the residual
    # Same parameter and buffer objects, same state dict.
    assert {n: p for n, p in model.named_parameters()} == params
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert list(model.state_dict()) == list(reference.state_dict())
    x = torch.randn(4, 3, 12, 12)
    for _ in range(2):  # training: running statistics and num_batches_tracked move alike
        loss, grads = _step(model, x)
        loss_ref, grads_ref = _step(reference, x)
        assert torch.equal(loss, loss_ref)
        for g, r in zip(grads, grads_ref, strict=True):
            assert torch.equal(g, r)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    assert int(model.blocks[0].bn1.num_batches_tracked) == 2
    model.eval(), reference.eval()
    assert torch.equal(model(x), reference(x))


def test_fuse_after_patch_and_cumulative_momentum():
    torch.manual_seed(1)
    model = Net()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None
    reference = copy.deepcopy(model)
    kato_torch.fuse(kato_torch.patch(model))
    assert type(model.stem[1]) is kato_torch.nn.BatchNorm2d and fused(model.stem)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        loss, grads = _step(model, x)
        loss_ref, grads_ref = _step(reference, x)
        torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    torch.testing.assert_close(model.stem[1].running_var, reference.stem[1].running_var)


class Untraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: fx cannot trace it
            return torch.relu(self.bn(x))
        return self.bn(x)


class NotFusable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn1, self.bn2, self.bn3 = (torch.nn.BatchNorm2d(3) for _ in range(3))
        self.bn3.register_forward_hook(lambda m, i, o: None)

    def forward(self, x):
        a = self.bn1(x)
        y = torch.relu(a) + a  # the norm's output used twice
        y = torch.add(self.bn2(y), x, alpha=2).relu()  # an add with alpha
        return torch.relu(self.bn3(y))  # a hooked norm


def test_what_fuse_leaves_alone():
    model = torch.nn.Sequential(Untraceable(), NotFusable())
    state = copy.deepcopy(model.state_dict())
    kato_torch.fuse(model)
    assert not any(fused(m) for m in model.modules())
    assert "forward" not in model[0].__dict__
    x = torch.randn(2, 3, 4, 4)
    model(x)
    assert list(model.state_dict()) == list(state)


def test_fuse_is_idempotent_and_unfuse_restores_the_forwards():
    model = Net()
    kato_torch.fuse(model)
    code = fused(model.blocks[0])
    kato_torch.fuse(model)
    assert fused(model.blocks[0]) == code
    unfuse(model)
    assert not any(fused(m) for m in model.modules())
    assert "forward" not in model.blocks[0].__dict__


def test_deepcopy_of_a_fused_model_runs_its_own_modules():
    torch.manual_seed(2)
    model = kato_torch.fuse(Net())
    twin = copy.deepcopy(model)
    assert fused(twin.blocks[0]) and twin.blocks[0].forward.__self__ is twin.blocks[0]
    with torch.no_grad():
        twin.blocks[0].bn1.weight.mul_(2)
    x = torch.randn(2, 3, 8, 8)
    assert not torch.equal(twin(x), model(x))


def test_fused_model_compiles_and_matches():
    torch.manual_seed(3)
    model = kato_torch.fuse(Net())
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 3, 8, 8)
    loss, grads = _step(compiled, x)
    loss_ref, grads_ref = _step(reference, x)
    torch.testing.assert_close(loss, loss_ref)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r)


def test_fuse_rewrites_layer_norm_then_relu_and_keeps_values_and_gradients():
    """An MLP's ``Linear -> LayerNorm -> ReLU`` (a Sequential, patched or not): both norms call
    the fused function, a norm whose output feeds something else stays, and on the CPU (torch's
    sequence) the values and every gradient are the unfused model's exactly."""
    torch.manual_seed(0)

    def mlp():
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
            torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
            torch.nn.Linear(16, 4), torch.nn.LayerNorm(4),
        )  # fmt: skip

    ref = mlp()
    for model in (kato_torch.fuse(copy.deepcopy(ref)),
                  kato_torch.fuse(kato_torch.patch(copy.deepcopy(ref)))):  # fmt: skip
        code = fused(model)
        assert code is not None and code.count("= kato_torch_fuse_layer_norm_relu_module(") == 2
        x = _rand(5, 8)
        y, y_ref = model(x), ref(x)
        assert torch.equal(y, y_ref)
        dy = torch.randn(y.shape)
        got = torch.autograd.grad(y, [x, *model.parameters()], dy)
        want = torch.autograd.grad(y_ref, [x, *ref.parameters()], dy)
        for g, h in zip(got, want, strict=True):
            assert torch.equal(g, h)


class _Branchy(torch.nn.Module):
    """A block whose forward branches on Python values fx would fix at trace time."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x, scale=None):
        y = torch.relu(self.bn(x))
        if self.kind == "training" and self.training:
            y = y * 2
        if scale is not None:
            y = y * scale
        return y


class _PlainBranchy(_Branchy):
    def forward(self, x):
        y = torch.relu(self.bn(x))
        return y * 2 if self.training else y


class _InPlaceResidual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x, idt):
        out = idt.add_(self.bn(x))  # writes idt, which the return reads again
        return torch.relu(out) + idt


def test_fuse_leaves_alone_forwards_whose_trace_would_not_hold():
    """fx runs Python branches once: a forward that branches on self.training, or takes a
    defaulted argument, is left alone (its outputs stay the unfused ones in both modes)."""
    torch.manual_seed(0)
    for model in (_Branchy("training"), _PlainBranchy("training")):
        ref = copy.deepcopy(model)
        kato_torch.fuse(model)
        assert fused(model) is None
        for mode in (True, False):
            model.train(mode), ref.train(mode)
            x = _rand(2, 3, 4, 4, grad=False)
            assert torch.equal(model(x), ref(x))
    model = kato_torch.fuse(_Branchy("none"))
    assert fused(model) is None  # a defaulted argument
    x = _rand(2, 3, 4, 4, grad=False)
    assert torch.equal(model(x, 2.0), 2.0 * model(x))


def test_fuse_keeps_its_forward_on_copies_of_the_module():
    """A copy that shares the module's __dict__ (copy.copy, DataParallel's replicas) runs the
    fused forward on itself, not on the module it was copied from."""
    model = kato_torch.fuse(torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU()))
    replica = copy.copy(model)
    assert fused(replica) is not None
    assert replica.forward.__self__ is replica
    kato_torch.unfuse(model)
    assert fused(model) is None and type(model) is torch.nn.Sequential


def test_an_in_place_add_into_the_residual_is_not_fused():
    torch.manual_seed(0)
    model, ref = _InPlaceResidual(), _InPlaceResidual()
    ref.load_state_dict(model.state_dict())
    kato_torch.fuse(model)
    assert fused(model) is None
    x, idt = _rand(2, 3, 4, 4, grad=False), _rand(2, 3, 4, 4, grad=False)
    assert torch.equal(model(x, idt.clone()), ref(x, idt.clone()))
