"""Every ``torch.ops.kato`` operator passes ``torch.library.opcheck`` (schema, fake
implementation, autograd registration) and computes what PyTorch computes, gradients included,
on the path it takes for a tensor Kato's kernels cannot run on (a CPU tensor)."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import kato_torch

DTYPES = [torch.float32, torch.float64]


def _rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0, grad=True):
    t = (torch.randn(*shape, dtype=torch.float64) * scale + offset).to(dtype)
    return t.requires_grad_(grad)


def _grads(fn, inputs, seed=0):
    """Outputs of fn(*inputs) and the gradients of a random projection of them."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    total = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
                for o in outs)  # fmt: skip
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, torch.autograd.grad(total, leaves)


def _same(kato_fn, torch_fn, inputs, atol=1e-5, rtol=1e-5):
    ours = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
            else t for t in inputs]  # fmt: skip
    theirs = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
              else t for t in inputs]  # fmt: skip
    out_a, grad_a = _grads(kato_fn, ours)
    out_b, grad_b = _grads(torch_fn, theirs)
    assert len(out_a) == len(out_b) and len(grad_a) == len(grad_b)
    for a, b in zip(out_a + grad_a, out_b + grad_b, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


SHAPES = [(1, 1), (3, 7), (33, 130)]


@pytest.mark.parametrize("shape", SHAPES)
def test_softmax(shape):
    x = _rand(*shape, scale=3)
    opcheck(torch.ops.kato.softmax.default, (x,))
    _same(kato_torch.softmax, lambda t: torch.softmax(t, -1), [x])
    _same(torch.ops.kato.softmax, lambda t: torch.softmax(t, -1), [x])


@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_and_its_statistics(shape):
    cols = shape[-1]
    x, w, b = _rand(*shape, scale=3, offset=20), _rand(cols), _rand(cols)
    opcheck(torch.ops.kato.layer_norm.default, (x, w, b, 1e-5))
    ref = lambda x, w, b: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5)  # noqa: E731
    _same(lambda x, w, b: torch.ops.kato.layer_norm(x, w, b, 1e-5)[0], ref, [x, w, b])
    _same(lambda x, w, b: kato_torch.layer_norm(x, (cols,), w, b), ref, [x, w, b])
    _, mean, rstd = torch.ops.kato.layer_norm(x, w, b, 1e-5)
    x64 = x.detach().double()
    torch.testing.assert_close(mean.double(), x64.mean(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        rstd.double(), torch.rsqrt(x64.var(-1, unbiased=False) + 1e-5), atol=1e-4, rtol=1e-4
    )
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (shape[0],)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape):
    cols = shape[-1]
    x, w = _rand(*shape, scale=3), _rand(cols)
    opcheck(torch.ops.kato.rms_norm.default, (x, w, 1e-6))
    ref = lambda x, w: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6)  # noqa: E731
    _same(lambda x, w: torch.ops.kato.rms_norm(x, w, 1e-6)[0], ref, [x, w])
    _same(lambda x, w: kato_torch.rms_norm(x, (cols,), w, 1e-6), ref, [x, w])


@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_and_add_layer_norm_return_the_sum_and_its_norm(shape):
    cols = shape[-1]
    x, r, w, b = _rand(*shape), _rand(*shape), _rand(cols), _rand(cols)
    opcheck(torch.ops.kato.add_rms_norm.default, (x, r, w, 1e-6))
    opcheck(torch.ops.kato.add_layer_norm.default, (x, r, w, b, 1e-5))

    def rms_ref(x, r, w):
        s = x + r
        return s, torch.nn.functional.rms_norm(s, (cols,), w, 1e-6)

    def ln_ref(x, r, w, b):
        s = x + r
        return s, torch.nn.functional.layer_norm(s, (cols,), w, b, 1e-5)

    _same(lambda x, r, w: torch.ops.kato.add_rms_norm(x, r, w, 1e-6)[:2], rms_ref, [x, r, w])
    _same(lambda x, r, w: kato_torch.add_rms_norm(x, r, w, 1e-6), rms_ref, [x, r, w])
    _same(lambda x, r, w, b: torch.ops.kato.add_layer_norm(x, r, w, b, 1e-5)[:2], ln_ref,
          [x, r, w, b])  # fmt: skip
    _same(kato_torch.add_layer_norm, ln_ref, [x, r, w, b])


def _backward_ops(fn, inputs):
    """ATen ops the backward of ``fn(*inputs)``'s second output runs (its first unused)."""
    y = fn(*inputs)[1]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=y.dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grads = torch.autograd.grad(y, inputs, dy)
    return [e.name for e in prof.events()], grads


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_an_unused_residual_sum_costs_its_backward_no_zeros_and_no_add(name):
    """The direct eager path of the add + norm ops hands their backward None for an unused
    sum (autograd used to fill a tensor of zeros and the backward added it to dx): the
    gradients stay those of the custom op's path (the dispatcher's, which hands zeros)."""
    from kato_torch import ops

    cols = 33
    x, r, w, b = _rand(5, cols), _rand(5, cols), _rand(cols), _rand(cols)
    inputs = [x, r, w, b] if name == "add_layer_norm" else [x, r, w]
    extra = (1e-5,) if name == "add_layer_norm" else (1e-6,)
    direct = getattr(ops, f"_{name}")
    names, grads = _backward_ops(lambda *t: direct(*t, *extra), inputs)
    assert "aten::zeros" not in names, names
    assert "aten::add" not in names, names
    dispatched = getattr(torch.ops.kato, name)
    _, want = _backward_ops(lambda *t: dispatched(*t, *extra), inputs)
    for g, h in zip(grads, want, strict=True):
        torch.testing.assert_close(g, h, atol=0, rtol=0)
    # dx and dresidual are the same gradient: the norm's, nothing added.
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(1, 2), (9, 1031)])
def test_cross_entropy_with_ignored_rows(shape, reduction):
    rows, cols = shape
    logits = _rand(rows, cols, scale=4)
    labels = torch.randint(0, cols, (rows,))
    labels[3::4] = -100
    opcheck(torch.ops.kato.cross_entropy.default, (logits, labels, -100))
    ref = lambda x: torch.nn.functional.cross_entropy(x, labels, reduction=reduction)  # noqa: E731
    _same(lambda x: kato_torch.cross_entropy(x, labels, reduction=reduction), ref, [logits])
    loss, lse = torch.ops.kato.cross_entropy(logits, labels, -100)
    torch.testing.assert_close(lse, torch.logsumexp(logits.detach(), -1))
    kept = labels != -100
    torch.testing.assert_close(loss[~kept], torch.zeros(int((~kept).sum())))


def test_cross_entropy_backward_op_is_the_softmax_minus_onehot():
    logits = _rand(6, 11, grad=False)
    labels = torch.tensor([0, 10, -100, 5, 5, 1])
    _, lse = torch.ops.kato.cross_entropy(logits, labels, -100)
    dloss = torch.rand(6)
    opcheck(torch.ops.kato.cross_entropy_backward.default, (logits, labels, lse, dloss, -100))
    got = torch.ops.kato.cross_entropy_backward(logits, labels, lse, dloss, -100)
    want = torch.softmax(logits, -1) - torch.nn.functional.one_hot(labels.clamp(min=0), 11)
    want = want * dloss[:, None]
    want[2] = 0
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n", [1, 31, 33, 1000])
def test_relu(n):
    x = _rand(n)
    opcheck(torch.ops.kato.relu.default, (x,))
    _same(lambda t: torch.ops.kato.relu(t)[0], torch.relu, [x])
    _same(kato_torch.relu, torch.relu, [x])


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (5, 7, 3), (33, 17, 65)])
def test_mm_every_layout_and_its_gradients(layout, mnk):
    m, n, k = mnk
    a = _rand(*{"nn": (m, k), "nt": (m, k), "tn": (k, m)}[layout])
    b = _rand(*{"nn": (k, n), "nt": (n, k), "tn": (k, n)}[layout])
    opcheck(torch.ops.kato.mm.default, (a, b, layout))
    ref = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.t(), "tn": lambda a, b: a.t() @ b}
    _same(lambda a, b: torch.ops.kato.mm(a, b, layout), ref[layout], [a, b])


def test_matmul_and_linear_take_torchs_arguments():
    a, b = _rand(4, 6), _rand(6, 5)
    _same(kato_torch.matmul, torch.matmul, [a, b])
    x, w, bias = _rand(2, 3, 6), _rand(5, 6), _rand(5)
    _same(kato_torch.linear, torch.nn.functional.linear, [x, w, bias])
    _same(lambda x, w: kato_torch.linear(x, w), torch.nn.functional.linear, [x, w])


def test_transpose():
    x = _rand(5, 9)
    opcheck(torch.ops.kato.transpose.default, (x,))
    _same(kato_torch.transpose, lambda t: t.t().contiguous(), [x])
    with pytest.raises(ValueError, match="2-D"):
        kato_torch.transpose(_rand(2, 3, 4))


def test_functions_pass_what_kato_does_not_cover_to_pytorch():
    """Other dims, dtypes and arguments give exactly PyTorch's results."""
    x = _rand(4, 5, dtype=torch.float64)
    torch.testing.assert_close(kato_torch.softmax(x, dim=0), torch.softmax(x, 0))
    y = _rand(2, 3, 4)
    torch.testing.assert_close(
        kato_torch.layer_norm(y, (3, 4)), torch.nn.functional.layer_norm(y, (3, 4))
    )
    logits, target = _rand(4, 3), torch.tensor([0, 2, 1, 1])
    torch.testing.assert_close(
        kato_torch.cross_entropy(logits, target, label_smoothing=0.1),
        torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1),
    )


def test_compiled_graph_keeps_kato_ops_without_breaking():
    """torch.compile(fullgraph=True) traces the custom ops through their fake implementations
    and the backward through the registered backward ops (aot_eager: no C++ compiler needed)."""
    cols = 16
    w, b = _rand(cols), _rand(cols)
    lin = _rand(8, cols)

    def step(x, labels):
        h = torch.ops.kato.layer_norm(x, w, b, 1e-5)[0]
        h = torch.ops.kato.relu(h)[0]
        h = torch.ops.kato.mm(h, lin, "nt")
        loss, _ = torch.ops.kato.cross_entropy(h, labels, -100)
        return loss.mean()

    x, labels = _rand(6, cols), torch.randint(0, 8, (6,))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, labels)
    (dx,) = torch.autograd.grad(got, x)
    x_ref = x.detach().clone().requires_grad_()
    want = step(x_ref, labels)
    (dx_ref,) = torch.autograd.grad(want, x_ref)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, dx_ref)


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (1, 4, 1, 7)])
def test_batch_norm_training_and_its_running_statistics(shape):
    c = shape[1]
    x, w, b = _rand(*shape, offset=3), _rand(c), _rand(c)
    mean0, var0 = torch.rand(c), torch.rand(c) + 0.5
    opcheck(torch.ops.kato.batch_norm.default, (x, w, b, mean0, var0, 1e-5, 0.1))
    ours = (mean0.clone(), var0.clone())
    theirs = (mean0.clone(), var0.clone())
    _same(lambda x, w, b: kato_torch.batch_norm(x, *ours, w, b, True, 0.1, 1e-5),
          lambda x, w, b: torch.nn.functional.batch_norm(x, *theirs, w, b, True, 0.1, 1e-5),
          [x, w, b])  # fmt: skip
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r)
    assert not torch.equal(ours[0], mean0)  # updated in place


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (1, 1), (0, 3)])
def test_transpose_of_a_row_or_column_is_a_copy(shape):
    """x.t() of a row or a column is already contiguous: the op must still return a new
    tensor (a custom op's output may not alias its input), forward and backward."""
    x = _rand(*shape)
    opcheck(torch.ops.kato.transpose.default, (x,))
    y = torch.ops.kato.transpose(x)
    assert y.shape == (shape[1], shape[0]) and y.is_contiguous()
    if x.numel():
        assert y.data_ptr() != x.data_ptr()
    _same(torch.ops.kato.transpose, lambda t: t.t().contiguous(), [x])
