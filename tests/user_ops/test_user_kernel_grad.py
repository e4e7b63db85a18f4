"""Gradients of ``kato_torch.user_kernel`` on the CPU: the spec's ``[backward]`` operator and a
Python ``backward=``, through the op's autograd formula, eagerly, in ``make_fx`` and under
``torch.compile`` (AOT autograd).

A user kernel refuses CPU tensors (its only implementation is CUDA), so most tests here replace
the launch (:meth:`UserKernel._launch`, after its real :meth:`plan`: the checks, the shape and
the outputs are a call's) by a PyTorch stand-in of the kernel, and record each launch: what
reaches the backward kernel and the gradients that come back are then checked by value. The
graphs of make_fx and AOT autograd are checked without running anything. The CUDA kernels run
in tests/gpu/test_user_kernel_grad_gpu.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the torch extra)")

from kato.kernels.spec import InvalidInput  # noqa: E402
from kato.kernels.user import definition, spec_from_folder  # noqa: E402
from kato.kernels.user.spec import UserOperatorSpec  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import kato_torch  # noqa: E402
from kato_torch.user import UserKernel  # noqa: E402

CUDA_ONLY = "no PyTorch implementation; its tensors must be on a CUDA device, not cpu"


def _scaled_mul(y, a, b, alpha, n):
    y.copy_(alpha * a * b)


def _scaled_mul_backward(grad_a, grad_b, grad_y, a, b, alpha, n):
    grad_a.copy_(alpha * grad_y * b)
    grad_b.copy_(alpha * grad_y * a)


#: PyTorch stand-ins of the kernels, by operator name or else kernel name (the folders' kernels,
#: under any operator name): the kernel's arguments in spec order.
STAND_INS = {
    "scaled_mul": _scaled_mul,
    "scaled_mul_backward": _scaled_mul_backward,
}


pytestmark = pytest.mark.usefixtures("fresh_kato_torch")


@pytest.fixture
def launches(monkeypatch):
    """Each user kernel launch as (operator, its arguments as the kernel gets them); launches
    run the :data:`STAND_INS` on the CPU."""
    seen = []

    def launch(self, *args, shape=None, dtype=None, constants=None):
        call = self.plan(*args, shape=shape, dtype=dtype, constants=constants)
        seen.append((self.name, [a.clone() if torch.is_tensor(a) else a for a in call.arguments]))
        with torch.no_grad():  # a kernel records nothing for autograd
            (STAND_INS.get(self.name) or STAND_INS[self.spec.kernel_name])(*call.arguments)
        return call.outputs[0] if len(call.outputs) == 1 else tuple(call.outputs)

    monkeypatch.setattr(UserKernel, "_launch", launch)
    return seen


@pytest.fixture
def backward_kernel(scaled_mul_backward_dir):
    return kato_torch.user_kernel(spec_from_folder(scaled_mul_backward_dir))


@pytest.fixture
def scaled_mul(scaled_mul_dir, backward_kernel):
    """y = alpha * a * b, its backward operator registered first."""
    return kato_torch.user_kernel(spec_from_folder(scaled_mul_dir))


def _without_backward(folder, name="scaled_mul_plain") -> UserOperatorSpec:
    """The scaled_mul folder's operator without its [backward] section (another name)."""
    import tomllib

    spec = tomllib.loads((folder / "kato.toml").read_text()) | {"name": name}
    del spec["backward"]
    files = {p.name: p.read_text() for p in folder.glob("*.cu")}
    return UserOperatorSpec(definition(spec, files))


def _op_nodes(gm, kernel):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is kernel.op]


# --- the declared backward -----------------------------------------------------------------


def test_eager_gradients_come_from_the_backward_operator(scaled_mul, launches):
    a = torch.randn(37, requires_grad=True)
    b = torch.randn(37, requires_grad=True)
    y = scaled_mul(a, b, 1.5, 37)
    assert y.requires_grad and "kato_user_scaled_mul_test" in type(y.grad_fn).__name__
    weights = torch.randn(37)
    (y * weights).sum().backward()
    assert [name for name, _ in launches] == ["scaled_mul_test", "scaled_mul_backward_test"]
    _, (grad_a, grad_b, grad_y, a_in, b_in, alpha, n) = launches[1]
    # fed as the section maps them: grad:y is the gradient reaching y, then a, b, alpha, n
    assert torch.equal(grad_y, weights) and torch.equal(a_in, a) and torch.equal(b_in, b)
    assert (alpha, n) == (1.5, 37) and type(alpha) is float and type(n) is int
    # and its outputs are the gradients of a and b (against float64 autograd)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (1.5 * a64 * b64 * weights.double()).sum().backward()
    torch.testing.assert_close(a.grad.double(), a64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-6, atol=1e-6)


def test_an_expanded_gradient_reaches_the_kernel_contiguous(scaled_mul, launches):
    a = torch.randn(8, requires_grad=True)
    scaled_mul(a, torch.ones(8), 2.0, 8).sum().backward()  # sum's gradient: stride 0
    _, (_, _, grad_y, *_) = launches[1]
    assert torch.equal(grad_y, torch.ones(8))
    assert torch.equal(a.grad, torch.full((8,), 2.0))


def test_only_the_gradients_wanted_are_returned_and_scalars_get_none(scaled_mul, launches):
    a, b = torch.randn(10, requires_grad=True), torch.randn(10)
    y = scaled_mul(a, b, 1.5, 10)
    grads = y.grad_fn.apply(torch.ones(10))  # one per op input: a, b, alpha, n, shape, ...
    torch.testing.assert_close(grads[0], 1.5 * b)
    assert all(g is None for g in grads[1:])  # b needs none; alpha, n are numbers
    with torch.no_grad():
        scaled_mul(torch.randn(4, requires_grad=True), torch.randn(4), 1.0, 4)
    assert launches[-1][0] == "scaled_mul_test"


def test_a_call_needing_no_gradient_skips_the_dispatcher(scaled_mul, launches, monkeypatch):
    """As before: the op (and its autograd) only where a gradient is recorded or a trace runs."""
    monkeypatch.setattr(scaled_mul, "_call_op", lambda *a: pytest.fail("went to the op"))
    y = scaled_mul(torch.randn(4), torch.randn(4), 1.0, 4)
    with torch.no_grad():
        scaled_mul(torch.randn(4, requires_grad=True), torch.randn(4), 1.0, 4)
    assert not y.requires_grad and len(launches) == 2


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_make_fx_feeds_the_output_gradient_to_the_backward_op(scaled_mul, backward_kernel, mode):
    def f(a, b, g):
        y = scaled_mul(a, b, 1.5, a.numel())
        return torch.autograd.grad(y, (a, b), g)

    a, b = torch.randn(33, requires_grad=True), torch.randn(33, requires_grad=True)
    gm = make_fx(f, tracing_mode=mode)(a, b, torch.randn(33))
    (forward,) = _op_nodes(gm, scaled_mul)
    (node,) = _op_nodes(gm, backward_kernel)
    a_node, b_node, g_node = (n for n in gm.graph.nodes if n.op == "placeholder")
    grad_y, a_in, b_in, alpha, n, shape, dtype, constants = node.args
    assert (grad_y, a_in, b_in, alpha, dtype, constants) == (g_node, a_node, b_node, 1.5,
                                                             "float32", [])  # fmt: skip
    assert forward.args[3] is n or forward.args[3] == n == 33
    assert list(shape) == [n]  # the backward runs at the forward's shape (same shape names)
    # what the graph returns: the backward op's outputs, grad_a for a and grad_b for b
    returned = [arg.args[0] for arg in gm.graph.output_node().args[0]]  # through a view each
    assert [(r.target, r.args) for r in returned] == [
        (returned[0].target, (node, 0)),
        (returned[1].target, (node, 1)),
    ]


def test_compiled_training_step_has_the_backward_op_in_its_backward_graph(
    scaled_mul, backward_kernel, launches
):
    graphs = {"forward": [], "backward": []}

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def keep(kind):
            def compiler(g, _):
                graphs[kind].append(g)
                return make_boxed_func(g.forward)

            return compiler

        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))(
            gm, example_inputs
        )

    def loss(a, b):
        return (scaled_mul(a, b, 1.5, a.numel()) * 3).sum()

    compiled = torch.compile(loss, backend=backend, fullgraph=True, dynamic=True)
    for size in (100, 37):
        a = torch.randn(size, requires_grad=True)
        b = torch.randn(size, requires_grad=True)
        compiled(a, b).backward()
        torch.testing.assert_close(a.grad, 4.5 * b.detach())
        torch.testing.assert_close(b.grad, 4.5 * a.detach())
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1  # one graph for both sizes
    (bw,) = graphs["backward"]
    assert not _op_nodes(bw, scaled_mul)
    (node,) = _op_nodes(bw, backward_kernel)
    tangent = next(n for n in bw.graph.nodes if n.op == "placeholder" and "tangents" in n.name)
    fed = node.args[0]  # 3 * the tangent, expanded over y
    assert fed.target is torch.ops.aten.mul.Tensor and fed.args[1] == 3
    assert fed.args[0].args[0] is tangent
    assert node.args[3] == 1.5
    (fw,) = graphs["forward"]
    assert len(_op_nodes(fw, scaled_mul)) == 1 and not _op_nodes(fw, backward_kernel)
    assert [n for n, _ in launches] == ["scaled_mul_test", "scaled_mul_backward_test"] * 2


def test_opcheck_passes_on_the_cpu_stand_in(scaled_mul, scaled_mul_dir, launches):
    def backward(saved, grad_y):
        return grad_y * saved["alpha"] * saved["b"], grad_y * saved["alpha"] * saved["a"]

    python = kato_torch.user_kernel(
        _without_backward(scaled_mul_dir, "scaled_mul_opcheck"),
        backward=lambda saved, g: (*backward(saved, g), None, None),
    )
    for kernel in (scaled_mul, python):
        a, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
        results = torch.library.opcheck(kernel.op, (a, b, 0.5, 16, None, None, []))
        assert set(results.values()) == {"SUCCESS"}, results
        assert "test_aot_dispatch_dynamic" in results and "test_autograd_registration" in results


def test_the_backward_operator_must_be_registered_when_a_gradient_is_recorded(
    scaled_mul_dir, launches
):
    import tomllib

    spec = tomllib.loads((scaled_mul_dir / "kato.toml").read_text())
    spec["name"] = "scaled_mul_orphan"
    spec["backward"]["operator"] = "never_registered_backward"
    files = {p.name: p.read_text() for p in scaled_mul_dir.glob("*.cu")}
    k = kato_torch.user_kernel(UserOperatorSpec(definition(spec, files)))
    assert k.differentiable
    k(torch.randn(4), torch.randn(4), 1.0, 4)  # no gradient needed: it runs
    with pytest.raises(InvalidInput, match="'never_registered_backward' is not registered"):
        k(torch.randn(4, requires_grad=True), torch.randn(4), 1.0, 4)


def test_one_version_has_an_op_per_backward_section(scaled_mul_dir, backward_kernel, launches):
    """The version leaves the [backward] section out and an op has one autograd formula: the
    same version without a section, with it and with another one are three ops in one process,
    each computing its own section's gradients (a section stored again takes effect)."""
    import copy
    import tomllib

    spec = tomllib.loads((scaled_mul_dir / "kato.toml").read_text()) | {
        "name": "scaled_mul_rebound"
    }
    files = {p.name: p.read_text() for p in scaled_mul_dir.glob("*.cu")}

    def kernel(section):
        body = copy.deepcopy(spec)
        body.pop("backward")
        return kato_torch.user_kernel(
            UserOperatorSpec(definition(body | ({"backward": section} if section else {}), files))
        )

    plain, declared = kernel(None), kernel(spec["backward"])
    swapped = kernel(spec["backward"] | {"gradients": {"grad_a": "b", "grad_b": "a"}})
    version = plain.spec.version
    assert declared.spec.version == swapped.spec.version == version
    names = [k.op.name() for k in (plain, declared, swapped)]
    assert names[0] == f"kato_user::scaled_mul_rebound_{version}" and len(set(names)) == 3
    assert all(n.startswith(names[0] + "_b") for n in names[1:])
    a, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    assert not plain(a, b, 2.0, 5).requires_grad
    declared(a, b, 2.0, 5).sum().backward()
    torch.testing.assert_close((a.grad, b.grad), (2 * b.detach(), 2 * a.detach()))
    a.grad = b.grad = None
    swapped(a, b, 2.0, 5).sum().backward()  # grad_a (2 b) is now b's gradient, grad_b a's
    torch.testing.assert_close((a.grad, b.grad), (2 * a.detach(), 2 * b.detach()))
    assert kernel(spec["backward"]).op is declared.op  # one op per section, reused


def test_a_double_backward_through_a_backward_operator_without_one_raises(scaled_mul, launches):
    """create_graph=True: the first gradients are right, and differentiating them again (a
    gradient penalty) raises, since the backward operator records no gradient of its own,
    instead of leaving the penalty's terms out (b.grad was 1.5 a, not 1.5 a + 4.5 b)."""
    a, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    y = scaled_mul(a, b, 1.5, 5)
    (grad_a,) = torch.autograd.grad(y.sum(), a, create_graph=True)
    torch.testing.assert_close(grad_a, 1.5 * b.detach())
    assert grad_a.requires_grad
    with pytest.raises(RuntimeError, match="operator scaled_mul_backward_test has no gradient"):
        (y.sum() + (grad_a**2).sum()).backward()
    # without create_graph nothing changes: the gradients are plain tensors
    a.grad = b.grad = None
    scaled_mul(a, b, 1.5, 5).sum().backward()
    torch.testing.assert_close(b.grad, 1.5 * a.detach())
    assert a.grad.grad_fn is None


def test_integer_outputs_carry_no_gradient(launches, monkeypatch):
    """An integer output is marked non-differentiable; a float one, fed to the backward, has
    a gradient. 2-D inputs of ``r * c`` elements get gradients of their shape from a backward
    of other shape names (1-D: it reads its shape from its arguments)."""
    kernel = {"k.cu": "__global__ void k() {}"}

    def spec(name, shape, arguments, **extra):
        return UserOperatorSpec(
            definition(
                {
                    "name": name,
                    "template": "k.cu",
                    "kernel_name": "k",
                    "shape": shape,
                    "tune_params": {"block_size_x": [64]},
                    "arguments": arguments,
                    "verify": False,
                }
                | extra,
                kernel,
            )
        )

    backward = spec(
        "grad_count_backward",
        ["n"],
        [
            {"name": "gx", "dtype": "float32", "size": "n", "output": True},
            {"name": "gy", "dtype": "float32", "size": "n"},
            {"name": "x", "dtype": "float32", "size": "n"},
        ],
    )
    forward = spec(
        "grad_count",
        ["r", "c"],
        [
            {"name": "y", "dtype": "float32", "size": "r * c", "output": True},
            {"name": "positive", "dtype": "int32", "size": "1", "output": True},
            {"name": "x", "dtype": "float32", "size": "r * c"},
        ],
        backward={"operator": "grad_count_backward", "inputs": {"gy": "grad:y", "x": "x"},
                  "gradients": {"gx": "x"}},
    )  # fmt: skip
    monkeypatch.setitem(
        STAND_INS,
        "grad_count",
        lambda y, positive, x: (
            y.copy_((x * x).reshape(y.shape)),
            positive.fill_(int((x > 0).sum())),
        ),
    )
    monkeypatch.setitem(
        STAND_INS, "grad_count_backward", lambda gx, gy, x: gx.copy_(2 * x.ravel() * gy.ravel())
    )
    kato_torch.user_kernel(backward)
    square = kato_torch.user_kernel(forward)
    x = torch.randn(3, 5, requires_grad=True)
    y, positive = square(x)
    assert y.shape == (3, 5) and y.requires_grad
    assert positive.dtype == torch.int32 and not positive.requires_grad
    (y * 2).sum().backward()
    assert x.grad.shape == (3, 5)
    torch.testing.assert_close(x.grad, 4 * x.detach())
    _, (gx, gy, x_in) = launches[-1]
    assert gx.shape == (15,)  # allocated at the backward's own (1-D) shape, then reshaped
    assert gy.numel() == x_in.numel() == 15


# --- a Python backward ---------------------------------------------------------------------


def test_a_python_backward_gets_what_the_call_saw_and_may_call_user_kernels(
    scaled_mul_dir, backward_kernel, launches
):
    calls = []

    def backward(saved, grad_y):
        calls.append(saved)
        assert grad_y.is_contiguous()
        grad_a, grad_b = backward_kernel(grad_y, saved["a"], saved["b"], saved["alpha"],
                                         saved["n"])  # fmt: skip
        return {"a": grad_a, "b": grad_b}

    k = kato_torch.user_kernel(_without_backward(scaled_mul_dir), backward=backward)
    assert k.differentiable and k.op.name().endswith("_py1")
    a, b = torch.randn(12, requires_grad=True), torch.randn(12)
    y = k(a, b, 0.25, 12)
    y.sum().backward()
    (saved,) = calls
    assert saved.inputs[2:] == (0.25, 12) and saved.needs_input_grad == (True, False, False,
                                                                           False)  # fmt: skip
    assert saved["a"] is not None and torch.equal(saved["a"], a) and torch.equal(saved["y"], y)
    assert saved.outputs[0] is saved["y"] and saved.dtype == "float32" and saved.constants == {}
    with pytest.raises(KeyError, match="'z' is no argument of the call"):
        saved["z"]
    torch.testing.assert_close(a.grad, 0.25 * b)
    assert b.grad is None
    assert [n for n, _ in launches] == ["scaled_mul_plain", "scaled_mul_backward_test"]
    # traced: the backward kernel the Python backward calls is in the graph
    gm = make_fx(
        lambda a, b: torch.autograd.grad(k(a, b, 0.25, a.numel()).sum(), a), tracing_mode="fake"
    )(a, b)
    assert len(_op_nodes(gm, k)) == 1 and len(_op_nodes(gm, backward_kernel)) == 1


def test_each_python_backward_has_its_own_op(scaled_mul_dir, launches):
    spec = _without_backward(scaled_mul_dir, "scaled_mul_ops")
    plain = kato_torch.user_kernel(spec)

    def double(saved, g):
        return 2 * g * saved["b"], None, None, None

    def triple(saved, g):
        return [3 * g * saved["b"], None, None, None]

    first = kato_torch.user_kernel(spec, backward=double)
    second = kato_torch.user_kernel(spec, backward=triple)
    assert not plain.differentiable
    assert len({plain.op, first.op, second.op}) == 3
    assert kato_torch.user_kernel(spec, backward=double).op is first.op
    a, b = torch.randn(6, requires_grad=True), torch.randn(6)
    for kernel, factor in ((first, 2), (second, 3), (first, 2)):
        a.grad = None
        kernel(a, b, 1.0, 6).sum().backward()
        torch.testing.assert_close(a.grad, factor * b)
    assert not plain(a, b, 1.0, 6).requires_grad  # no formula: no gradient, as before


def test_one_op_per_bound_method_and_a_warning_as_functions_pile_up(scaled_mul_dir, monkeypatch):
    """``backward=self.method`` is one backward per instance (a new bound-method object each
    time); past MAX_PYTHON_BACKWARDS functions of one operator version, each new op (never
    freed) is warned about."""
    import warnings

    from kato_torch import user

    spec = _without_backward(scaled_mul_dir, "scaled_mul_methods")

    class Layer:
        def backward(self, saved, g):
            return 2 * g * saved["b"], None, None, None

    layer = Layer()
    first = kato_torch.user_kernel(spec, backward=layer.backward)
    assert kato_torch.user_kernel(spec, backward=layer.backward).op is first.op
    other = kato_torch.user_kernel(spec, backward=Layer().backward)
    assert other.op is not first.op and other.op.name().endswith("_py2")
    monkeypatch.setattr(user, "MAX_PYTHON_BACKWARDS", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kato_torch.user_kernel(spec, backward=lambda saved, g: None)  # the third
        kato_torch.user_kernel(spec, backward=layer.backward)  # no new op
    with pytest.warns(RuntimeWarning, match="scaled_mul_methods: 4 Python backward functions"):
        fourth = kato_torch.user_kernel(spec, backward=lambda saved, g: None)
    assert fourth.op.name().endswith("_py4")


@pytest.mark.parametrize(
    ("returned", "says"),
    [
        (lambda g, b: (g, None, 1.0, None), "input alpha is a scalar; its gradient must be None"),
        (lambda g, b: (g[:-1], None, None, None), "the gradient of a has 5 elements; a has 6"),
        (lambda g, b: (g, None), r"return one gradient \(or None\) per input \(a, b, alpha, n\)"),
        (lambda g, b: {"a": g, "c": g}, "returned gradients of c, which are not its inputs"),
        (lambda g, b: ("g", None, None, None), "the gradient of a must be a tensor or None"),
    ],
)
def test_a_python_backward_s_answer_is_checked(scaled_mul_dir, launches, returned, says):
    k = kato_torch.user_kernel(
        _without_backward(scaled_mul_dir, "scaled_mul_checked"),
        backward=lambda saved, g: returned(g, saved["b"]),
    )
    y = k(torch.randn(6, requires_grad=True), torch.randn(6), 1.0, 6)
    with pytest.raises(InvalidInput, match=says):
        y.sum().backward()


def test_backward_must_be_a_function_of_an_operator_with_outputs(scaled_mul_dir):
    with pytest.raises(InvalidInput, match="backward= must be a function"):
        kato_torch.user_kernel(_without_backward(scaled_mul_dir, "not_callable"), backward=3)
    in_place = UserOperatorSpec(
        definition(
            {
                "name": "grad_in_place",
                "template": "k.cu",
                "kernel_name": "k",
                "shape": ["n"],
                "tune_params": {"block_size_x": [64]},
                "arguments": [{"name": "x", "dtype": "float32", "size": "n"}],
                "verify": False,
            },
            {"k.cu": "__global__ void k() {}"},
        )
    )
    with pytest.raises(InvalidInput, match="has no output .* no backward="):
        kato_torch.user_kernel(in_place, backward=lambda saved: None)


def test_without_a_stand_in_the_op_refuses_cpu_tensors_as_before(scaled_mul):
    a = torch.randn(4, requires_grad=True)
    with pytest.raises(InvalidInput, match=CUDA_ONLY):
        scaled_mul(a, torch.randn(4), 1.0, 4)
