"""kato_torch's custom operators on the GPU with Kato's kernels (policy "kato", default
configs): values and gradients against PyTorch in float64, ``opcheck`` of every operator
(fake implementations agree with the kernels' outputs), ``torch.compile`` with Inductor
keeping the operators in one graph, CUDA-graph capture and replay, autocast, and the "auto"
policy giving PyTorch's own results where nothing is known faster."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the GPU image has it)")
if not torch.cuda.is_available():
    pytest.skip("kato_torch's kernels need a CUDA GPU", allow_module_level=True)

from torch.library import opcheck  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kato_torch  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: rtol, atol per dtype for values; gradients get a multiple (longer sums).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def _kato_defaults():
    kato_torch.configure(client=None, policy="kato")
    yield
    kato_torch.configure(client=None)


def rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0, grad=True):
    t = (torch.randn(*shape, device="cuda", dtype=torch.float64) * scale + offset).to(dtype)
    return t.requires_grad_(grad)


def check(kato_fn, ref_fn, inputs, dtype, scale=1.0, grad_scale=4.0):
    """kato_fn's outputs and input gradients against ref_fn's computed in float64 from the
    same (rounded) inputs."""
    ours = [t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
            for t in inputs]  # fmt: skip
    ref = [t.detach().double().requires_grad_(t.requires_grad)
           if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]  # fmt: skip
    out, want = kato_fn(*ours), ref_fn(*ref)
    out = out if isinstance(out, tuple) else (out,)
    want = want if isinstance(want, tuple) else (want,)
    gen = torch.Generator(device="cuda").manual_seed(1)
    weights = [torch.randn(o.shape, device="cuda", dtype=torch.float64, generator=gen) for o in out]
    rtol, atol = TOL[dtype]
    for o, w in zip(out, want, strict=True):
        assert o.dtype == dtype or o.dtype == torch.float32
        torch.testing.assert_close(o.double(), w, rtol=rtol * scale, atol=atol * scale)
    leaves = [i for i, t in enumerate(ours) if torch.is_tensor(t) and t.requires_grad]
    pairs, pairs_ref = zip(out, weights, strict=True), zip(want, weights, strict=True)
    grads = torch.autograd.grad(sum((o.double() * g).sum() for o, g in pairs),
                                [ours[i] for i in leaves])  # fmt: skip
    grads_ref = torch.autograd.grad(sum((o * g).sum() for o, g in pairs_ref),
                                    [ref[i] for i in leaves])  # fmt: skip
    for g, r in zip(grads, grads_ref, strict=True):
        bound = float(r.abs().max()) if r.numel() else 1.0
        torch.testing.assert_close(g.double(), r, rtol=rtol * grad_scale,
                                   atol=atol * grad_scale * max(1.0, bound))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 1031), (256, 4096)])
def test_rms_norm(dtype, shape):
    cols = shape[-1]
    x, w = rand(*shape, dtype=dtype, scale=2), rand(cols, dtype=dtype, offset=1)
    check(lambda x, w: kato_torch.rms_norm(x, (cols,), w, 1e-6),
          lambda x, w: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6),
          [x, w], dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 130), (300, 768)])
def test_add_norms(dtype, shape):
    cols = shape[-1]
    x, r = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    w, b = rand(cols, dtype=dtype, offset=1), rand(cols, dtype=dtype)

    def rms_ref(x, r, w):
        s = x + r
        return s, torch.nn.functional.rms_norm(s, (cols,), w, 1e-6)

    def ln_ref(x, r, w, b):
        s = x + r
        return s, torch.nn.functional.layer_norm(s, (cols,), w, b, 1e-5)

    check(lambda x, r, w: kato_torch.add_rms_norm(x, r, w, 1e-6), rms_ref, [x, r, w], dtype, 2)
    check(kato_torch.add_layer_norm, ln_ref, [x, r, w, b], dtype, 2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (64, 50257), (5, 128256)])
def test_cross_entropy(dtype, shape, reduction):
    rows, cols = shape
    logits = rand(rows, cols, dtype=dtype, scale=3)
    labels = torch.randint(0, cols, (rows,), device="cuda")
    labels[3::5] = -100
    check(lambda x: kato_torch.cross_entropy(x, labels, reduction=reduction).float(),
          lambda x: torch.nn.functional.cross_entropy(x, labels, reduction=reduction),
          [logits], dtype, scale=4)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_mm_layouts(dtype, layout):
    m, n, k = 129, 67, 200
    a = rand(*{"nn": (m, k), "nt": (m, k), "tn": (k, m)}[layout], dtype=dtype)
    b = rand(*{"nn": (k, n), "nt": (n, k), "tn": (k, n)}[layout], dtype=dtype)
    ref = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.t(), "tn": lambda a, b: a.t() @ b}
    check(lambda a, b: torch.ops.kato.mm(a, b, layout), ref[layout], [a, b], dtype,
          scale=k**0.5, grad_scale=4 * k**0.5)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(dtype):
    x, w, b = rand(4, 33, 96, dtype=dtype), rand(80, 96, dtype=dtype), rand(80, dtype=dtype)
    check(kato_torch.linear, torch.nn.functional.linear, [x, w, b], dtype, scale=10, grad_scale=40)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_features", [1001, 50257])
def test_linear_pads_an_unaligned_output_dim_and_matches_pytorch(dtype, out_features):
    """A 16-bit Linear whose out_features is not a multiple of 8 runs as the aligned GEMM of a
    zero-padded weight: the output is a view of rows padded to a multiple of 8, values and
    gradients as PyTorch's in float64."""
    x, w = rand(2, 1024, 768, dtype=dtype, scale=0.5), rand(out_features, 768, dtype=dtype)
    bias = rand(out_features, dtype=dtype)
    y = kato_torch.linear(x, w)
    assert y.shape == (2, 1024, out_features)
    assert y.stride(-2) == -(-out_features // 8) * 8  # the padded rows' stride
    check(kato_torch.linear, torch.nn.functional.linear, [x, w], dtype, scale=12, grad_scale=60)
    check(kato_torch.linear, torch.nn.functional.linear, [x, w, bias], dtype, scale=12,
          grad_scale=60)  # fmt: skip
    kato_torch.configure(client=None, policy="torch")  # PyTorch's op exactly: no padding
    assert kato_torch.linear(x, w).is_contiguous()


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that records the operators it sees and runs them unchanged."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func.name()))
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher_and_match_the_registered_op():
    """In plain eager mode an operator runs its implementation directly (no ``kato::`` op
    reaches the dispatcher); under a dispatch mode it is the registered custom op. Both give
    the same values and gradients, bit for bit."""
    x, w, b = rand(300, 768), rand(768), rand(768)

    def run():
        xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = kato_torch.layer_norm(xs[0], (768,), xs[1], xs[2])
        return [y, *torch.autograd.grad(y.square().sum(), xs)]

    direct = run()
    mode = _PassThrough()
    with mode:
        dispatched = run()
    assert {"kato::layer_norm", "kato::layer_norm_backward"} <= mode.seen
    for a, b_ in zip(direct, dispatched, strict=True):
        assert torch.equal(a, b_)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = {e.key for e in prof.key_averages()}
    assert "kato::layer_norm" not in names and "kato::layer_norm_backward" not in names


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3, 1, 7), (8, 64, 14, 14), (32, 16, 56, 56)])
def test_batch_norm_training(dtype, shape):
    c = shape[1]
    x = rand(*shape, dtype=dtype, scale=2, offset=3)
    w, b = rand(c, offset=1), rand(c)
    if shape[0] * shape[2] * shape[3] == 1:
        pytest.skip("one element per channel: the unbiased variance is undefined")
    stats, stats_ref = [torch.rand(c, device="cuda") for _ in range(2)], None
    stats_ref = [t.clone().double() for t in stats]
    check(lambda x, w, b: kato_torch.batch_norm(x, *stats, w, b, True, 0.1, 1e-5),
          lambda x, w, b: torch.nn.functional.batch_norm(x, *stats_ref, w, b, True, 0.1, 1e-5),
          [x, w, b], dtype, scale=4, grad_scale=16)  # fmt: skip
    for got, want in zip(stats, stats_ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("residual", [False, True], ids=["relu", "add_relu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 1, 7), (8, 64, 14, 14), (16, 32, 28, 28)])
def test_batch_norm_relu_training(residual, dtype, shape):
    """kato_torch.batch_norm_relu (Kato's fused kernels both ways) against torch's float64
    relu(batch_norm(x) [+ r]) and its autograd: y, the running statistics, and the gradients
    of x, weight, bias [, residual] for a dy that is 0 where relu's input is within rounding of
    0 (there relu's gradient depends on who rounds: bn(x) is rounded to the element type before
    the add, as in torch's own sequence)."""
    c = shape[1]
    x = rand(*shape, dtype=dtype, scale=2, offset=3)
    w, b = rand(c, offset=1), rand(c)
    r = rand(*shape, dtype=dtype, scale=2) if residual else None
    stats = [torch.rand(c, device="cuda"), torch.rand(c, device="cuda") + 0.5]
    stats_ref = [t.clone().double() for t in stats]
    y = kato_torch.batch_norm_relu(x, *stats, w, b, True, 0.1, 1e-5, residual=r)
    leaves = [x, w, b] + ([r] if residual else [])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    z = torch.nn.functional.batch_norm(ref_leaves[0], *stats_ref, ref_leaves[1], ref_leaves[2],
                                       True, 0.1, 1e-5)  # fmt: skip
    bn_max = float(z.detach().abs().max())
    if residual:
        z = z + ref_leaves[3]
    y_ref = torch.relu(z)
    rtol, atol = TOL[dtype]
    unit = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    atol_y = atol + (unit * bn_max if residual else 0.0)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), y_ref.detach(), rtol=rtol, atol=atol_y)
    for got, want in zip(stats, stats_ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(shape, device="cuda", dtype=torch.float64, generator=gen)
    dy[z.detach().abs() < max(1e-3, 2 * atol_y)] = 0
    dy = dy.to(dtype)
    grads = torch.autograd.grad(y, leaves, dy)
    grads_ref = torch.autograd.grad(y_ref, ref_leaves, dy.double())
    for g, want in zip(grads, grads_ref, strict=True):
        bound = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(g.double(), want, rtol=rtol * 16,
                                   atol=atol * 16 * max(1.0, bound))  # fmt: skip


OPCHECKS = {
    "softmax": lambda d: (rand(33, 1031, dtype=d),),
    "layer_norm": lambda d: (rand(33, 130, dtype=d), rand(130, dtype=d), rand(130, dtype=d), 1e-5),
    "rms_norm": lambda d: (rand(33, 130, dtype=d), rand(130, dtype=d), 1e-6),
    "add_rms_norm": lambda d: (rand(9, 64, dtype=d), rand(9, 64, dtype=d), rand(64, dtype=d), 1e-6),
    "add_layer_norm": lambda d: (rand(9, 64, dtype=d), rand(9, 64, dtype=d), rand(64, dtype=d),
                                 rand(64, dtype=d), 1e-5),
    "cross_entropy": lambda d: (rand(7, 1000, dtype=d),
                                torch.tensor([1, 2, -100, 999, 0, 5, 7], device="cuda"), -100),
    "relu": lambda d: (rand(1000, dtype=d),),
    "batch_norm": lambda d: (rand(4, 8, 5, 5, dtype=d), rand(8), rand(8), torch.zeros(8,
                             device="cuda"), torch.ones(8, device="cuda"), 1e-5, 0.1),
    "batch_norm_relu": lambda d: (rand(4, 8, 5, 5, dtype=d), rand(4, 8, 5, 5, dtype=d), rand(8),
                                  rand(8), torch.zeros(8, device="cuda"),
                                  torch.ones(8, device="cuda"), 1e-5, 0.1),
    "mm": lambda d: (rand(64, 32, dtype=d), rand(32, 48, dtype=d), "nn"),
    "transpose": lambda d: (rand(33, 65, dtype=d),),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPCHECKS))
def test_opcheck(name, dtype):
    """Schema, fake implementation (shapes, dtypes, strides of the kernels' real outputs),
    autograd registration and torch.compile's tracing of every kato operator."""
    op = getattr(torch.ops.kato, name).default
    opcheck(op, OPCHECKS[name](dtype), atol=TOL[dtype][1] * 10, rtol=TOL[dtype][0] * 10)


class Block(torch.nn.Module):
    def __init__(self, width=256, classes=1000):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, width)
        self.act = torch.nn.ReLU()
        self.rms = torch.nn.RMSNorm(width, eps=1e-6)
        self.fc2 = torch.nn.Linear(width, classes)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        h = self.rms(self.act(self.fc1(self.norm(x))))
        return self.loss(self.fc2(h), labels)


def _step(model, x, labels):
    loss = model(x, labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss, grads


def test_compiled_model_keeps_kato_ops_and_matches_eager():
    torch.manual_seed(0)
    model = kato_torch.patch(Block().cuda())
    x, labels = torch.randn(64, 256, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    loss, grads = _step(model, x, labels)
    compiled = torch.compile(model, fullgraph=True)
    loss_c, grads_c = _step(compiled, x, labels)
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)


class ConvBlock(torch.nn.Module):
    """A ResNet basic block (torchvision's forward: in-place ReLU, ``+=``) and a head."""

    def __init__(self, width=32, classes=10):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.relu = torch.nn.ReLU(inplace=True)
        self.fc = torch.nn.Linear(width, classes)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        y += x
        y = self.relu(y)
        return self.loss(self.fc(y.mean(dim=(2, 3))), labels)


def test_fused_model_runs_the_fused_kernels_eager_and_compiled():
    """kato_torch.fuse(patch(model)) in float32 with Kato's kernels (policy "kato"): the step
    records the fused operators (and no plain batchnorm), matches the unfused eager model
    (loss, every gradient, the running statistics), and compiles with the fused custom ops in
    one graph (fullgraph) to the same values."""
    torch.manual_seed(0)
    model = ConvBlock().cuda()
    fused = kato_torch.fuse(kato_torch.patch(ConvBlock().cuda()))
    fused.load_state_dict(model.state_dict())
    x = torch.randn(16, 32, 14, 14, device="cuda")
    labels = torch.randint(0, 10, (16,), device="cuda")
    with kato_torch.record() as rec:
        loss, grads = _step(fused, x, labels)
    ops = {k.operator for k in rec.keys}
    assert {"batchnorm_relu", "batchnorm_relu_backward", "batchnorm_add_relu",
            "batchnorm_add_relu_backward"} <= ops and "batchnorm" not in ops  # fmt: skip
    loss_ref, grads_ref = _step(model, x, labels)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)
    for a, b in zip(fused.state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    compiled = torch.compile(fused, fullgraph=True)
    loss_c, grads_c = _step(compiled, x, labels)
    loss_e, grads_e = _step(fused, x, labels)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)


def test_cuda_graph_capture_and_replay():
    torch.manual_seed(0)
    model = kato_torch.patch(Block().cuda())
    x, labels = torch.randn(64, 256, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: lookups and compiles happen here, not in the capture
            _step(model, x, labels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_g, grads_g = _step(model, x, labels)
    x.copy_(torch.randn_like(x))
    graph.replay()
    loss, grads = _step(model, x, labels)
    torch.testing.assert_close(loss_g, loss)
    for g, r in zip(grads_g, grads, strict=True):
        torch.testing.assert_close(g, r)


def test_autocast_casts_as_pytorch_does():
    torch.manual_seed(0)
    model = Block().cuda()
    patched = kato_torch.patch(Block().cuda())
    patched.load_state_dict(model.state_dict())
    x, labels = torch.randn(64, 256, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h_ref = model.fc1(model.norm(x))
        h = patched.fc1(patched.norm(x))
        n_ref, n = model.norm(x), patched.norm(x)
        loss_ref, loss = model(x, labels), patched(x, labels)
    assert h.dtype == h_ref.dtype == torch.bfloat16
    assert n.dtype == n_ref.dtype == torch.float32
    assert loss.dtype == loss_ref.dtype
    torch.testing.assert_close(loss.float(), loss_ref.float(), rtol=2e-2, atol=2e-2)


def test_auto_policy_without_known_speedups_is_pytorch_exactly():
    kato_torch.configure(client=None)  # "auto": nothing is known faster
    torch.manual_seed(0)
    model = Block().cuda()
    patched = kato_torch.patch(Block().cuda())
    patched.load_state_dict(model.state_dict())
    x, labels = torch.randn(64, 256, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    loss_ref, grads_ref = _step(model, x, labels)
    loss, grads = _step(patched, x, labels)
    assert torch.equal(loss, loss_ref)
    for g, r in zip(grads, grads_ref, strict=True):
        assert torch.equal(g, r)


def test_a_shape_the_kernels_refuse_runs_pytorchs_op_not_an_error():
    """Policy "kato" (the fixture) and M one past the GEMM's grid limit: spec.validate
    refuses (M, N, K), so kato::mm's forward runs torch's GEMM instead of raising
    InvalidInput from inside the op (its A^T B backward layout, which takes the shape, keeps
    the custom op in the path)."""
    from kato.kernels.matmul import MAX_M

    a, b = rand(MAX_M + 1, 1, grad=False), rand(1, 3, grad=False)
    torch.testing.assert_close(kato_torch.matmul(a, b), a @ b)


def test_autocast_linear_of_bf16_activations_runs_kato_and_matches_pytorch():
    """bf16 activations into a float32 Linear under autocast: both cast to bf16 and Kato's
    GEMM runs (record() lists it), with torch's values."""
    x, w, b = rand(64, 96, dtype=torch.bfloat16), rand(80, 96), rand(80)
    with torch.autocast("cuda", dtype=torch.bfloat16), kato_torch.record() as rec:
        y = kato_torch.linear(x, w, b)
        y_ref = torch.nn.functional.linear(x, w, b)
    assert ("matmul_nt", (64, 80, 96), "bfloat16") in {
        (k.operator, k.shape, k.dtype) for k in rec.keys
    }
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kato_side", ["rmsnorm", "rmsnorm_backward"])
def test_rms_norm_with_only_one_side_on_kato_runs_torchs_fused_op_on_the_other(dtype, kato_side):
    """The never-slower policy may pick Kato for the forward and not the backward (or the
    reverse): the other side inside the custom op is torch's own fused kernel (what F.rms_norm
    runs), so its forward output is torch's bit for bit, and the gradients are right."""
    other = "rmsnorm_backward" if kato_side == "rmsnorm" else "rmsnorm"
    kato_torch.configure(client=None, policy={kato_side: "kato", other: "torch", "*": "torch"})
    x, w = rand(4, 33, 130, dtype=dtype, scale=3), rand(130, dtype=dtype)
    if kato_side == "rmsnorm_backward":
        y = kato_torch.rms_norm(x.detach(), (130,), w.detach(), 1e-6)
        assert torch.equal(y, torch.nn.functional.rms_norm(x.detach(), (130,), w.detach(), 1e-6))
    check(lambda x, w: kato_torch.rms_norm(x, (130,), w, 1e-6),
          lambda x, w: torch.nn.functional.rms_norm(x, (130,), w, 1e-6), [x, w], dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("cols", [4096, 50257])
def test_views_that_start_off_a_vector_boundary(dtype, shift, cols):
    """A contiguous view a few elements into its storage (its data pointer 2, 4, 6 or 12 bytes
    past a 16-byte boundary): softmax and layer_norm bind a variant with a narrower VEC for it
    (issue 31) and match PyTorch, where the aligned config would fault on a misaligned vector."""
    storage = torch.randn(8 * cols + shift, device="cuda", dtype=torch.float64).to(dtype)
    x = storage[shift:].view(8, cols)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        kato_torch.softmax(x, -1).double(), torch.softmax(x.double(), -1), rtol=rtol, atol=atol
    )
    weight = torch.randn(cols, device="cuda", dtype=dtype)
    bias = torch.randn(cols, device="cuda", dtype=dtype)
    got = kato_torch.layer_norm(x, (cols,), weight, bias)
    want = torch.nn.functional.layer_norm(x.double(), (cols,), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), want, rtol=4 * rtol, atol=4 * atol)
    # The aligned tensor still runs the widest vector.
    assert kato_torch.softmax(x.clone(), -1).shape == x.shape


def test_split_row_softmax_on_two_streams_at_once_keeps_each_calls_partials():
    """Few long rows run softmax's STRATEGY 2, whose pieces' partials live in its module's
    ``__device__`` globals: kato_torch loads that module once per stream, so two calls on two
    streams at once do not mix them (one shared module would give wrong rows here)."""
    from kato.kernels import get_operator

    rows, cols = 8, 1 << 20
    assert get_operator("softmax").default_config((rows, cols), "float32")["STRATEGY"] == 2
    xs = [torch.randn(rows, cols, device="cuda") * scale for scale in (1.0, 4.0)]
    refs = [torch.softmax(x.double(), -1) for x in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    for x, stream in zip(xs, streams, strict=True):  # compiled and loaded before the race
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kato_torch.softmax(x)
    torch.cuda.synchronize()
    for stream in streams:
        with torch.cuda.stream(stream):
            # About 0.1 s: every call below is queued before any runs, so the two streams'
            # calls overlap on the GPU to the end instead of only while a backlog lasts.
            torch.cuda._sleep(200_000_000)
    outs: list[list] = [[] for _ in xs]
    for _ in range(30):
        for i, (x, stream) in enumerate(zip(xs, streams, strict=True)):
            with torch.cuda.stream(stream):
                outs[i].append(kato_torch.softmax(x))
    torch.cuda.synchronize()
    for calls, ref in zip(outs, refs, strict=True):
        for out in calls:  # every call: any of them may be the one whose partials mixed
            torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=1e-9)


def test_a_small_saving_runs_kato_while_the_gpu_lags_and_torch_when_it_waits():
    """A winner 2x faster than PyTorch's op that saves less than MIN_SAVING_MS a call is
    WHEN_BUSY: Kato's kernel runs while the GPU is far behind the host (a step bound by the
    GPU), PyTorch's op while the GPU keeps up (bound by the host); either way the result is
    the layer norm, and neither choice is remembered for the next call."""
    import time

    from kato.kernels import get_operator
    from torch.profiler import ProfilerActivity, profile

    rows, cols = 64, 768

    class SmallSaving:
        def lookup(self, operator, shape, dtype, gpu=None):
            config = get_operator(operator).default_config(shape, dtype)
            return {"config": config, "source": "exact", "speedup": 2.0, "time_ms": 0.002,
                    "framework_ms": 0.004}  # fmt: skip

    kato_torch.configure(client=SmallSaving())
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(cols, device="cuda"), torch.randn(cols, device="cuda")
    w_lo, b_lo = w.bfloat16(), b.bfloat16()
    ref = torch.nn.functional.layer_norm(x.float(), (cols,), w_lo.float(), b_lo.float())
    assert kato_torch.policy.verdict("layernorm", (rows, cols), "bfloat16", "cuda") == (
        kato_torch.policy.WHEN_BUSY
    )

    def kernels(lagging):
        """Kernel names of three calls 2 ms of host time apart, behind 100 ms of queued GPU
        work (lagging) or on an idle GPU."""
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if lagging:
                torch.cuda._sleep(100_000_000)
            for _ in range(3):
                y = kato_torch.layer_norm(x, (cols,), w_lo, b_lo)
                time.sleep(0.002)
            torch.cuda.synchronize()
        torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=3e-2)
        return [e.key for e in prof.key_averages()]

    for _ in range(2):
        assert "layernorm_fwd" in kernels(lagging=True)  # Kato's kernel (extern "C")
        assert "layernorm_fwd" not in kernels(lagging=False)


def test_batch_norm_off_its_layout_runs_pytorchs_op_eager_and_compiled():
    """Kato's batch-norm kernels take NCHW-contiguous activations. Under "auto", with winners
    far over every bar: a channels-last model runs PyTorch's batch norm eagerly; a compiled
    model runs Inductor's (its layout optimisation makes convolution activations channels-last,
    and a fixed-stride custom op would get a copy in and out: no kato op in the output code),
    while with that optimisation off the compiled graph keeps Kato's fused ops. Values match
    PyTorch's either way."""
    from kato.kernels import get_operator
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    class Faster:
        def lookup(self, operator, shape, dtype, gpu=None):
            config = get_operator(operator).default_config(shape, dtype)
            return {"config": config, "source": "exact", "speedup": 10.0}

    kato_torch.configure(client=Faster())
    torch.manual_seed(0)
    model = ConvBlock().cuda()
    fused = kato_torch.fuse(kato_torch.patch(ConvBlock().cuda()))
    fused.load_state_dict(model.state_dict())
    x = torch.randn(16, 32, 14, 14, device="cuda")
    labels = torch.randint(0, 10, (16,), device="cuda")

    last = x.to(memory_format=torch.channels_last)
    fused_last = fused.to(memory_format=torch.channels_last)
    loss_ref, _ = _step(model, x, labels)
    with _PassThrough() as mode:
        loss, _ = _step(fused_last, last, labels)
    assert not any(op.startswith("kato::batch_norm") for op in mode.seen), mode.seen
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-4)
    fused = fused.to(memory_format=torch.contiguous_format)
    with _PassThrough() as mode:
        _step(fused, x, labels)  # the same shapes in NCHW: Kato's fused kernels
    assert "kato::batch_norm_relu" in mode.seen

    def code(layout_optimization):
        torch._dynamo.reset()
        with inductor_config.patch(layout_optimization=layout_optimization):
            compiled = torch.compile(fused, fullgraph=True)
            (loss, _), sources = run_and_get_code(_step, compiled, x, labels)
        return loss, "\n".join(sources)

    loss_c, source = code(True)
    assert "kato.batch_norm" not in source
    torch.testing.assert_close(loss_c, loss_ref, rtol=1e-4, atol=1e-4)
    loss_c, source = code(False)
    assert "kato.batch_norm_relu" in source
    torch.testing.assert_close(loss_c, loss_ref, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
