"""``kato_torch.user_kernel`` under torch.compile and make_fx, on the CPU: each user operator is
a ``torch.library`` custom op (``torch.ops.kato_user.<name>_<version>``) whose fake
implementation reads the shape and sizes the outputs as an eager call allocates them, in the
shape's SymInts, so a compiled graph keeps the op with no graph break. The compiled graph runs
on CUDA tensors in tests/gpu/test_user_kernel_compile_gpu.py (a CPU tensor reaching the op is
refused, as in eager mode, which the tests here use to show the op itself ran)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="kato_torch needs PyTorch (the torch extra)")

from kato.kernels.spec import InvalidInput  # noqa: E402
from kato.kernels.user import spec_from_folder  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kato_torch  # noqa: E402
from kato_torch import user  # noqa: E402
from user_ops.test_torch_user_kernel import _matmul  # noqa: E402

CUDA_ONLY = "no PyTorch implementation; its tensors must be on a CUDA device, not cpu"


pytestmark = pytest.mark.usefixtures("fresh_kato_torch")


@pytest.fixture
def vector_add(vector_add_dir):
    return kato_torch.user_kernel(spec_from_folder(vector_add_dir))


def _one_dim(name: str, arguments: list[dict], **changes):
    return _matmul(name, shape=["n"], problem_size=["n"], arguments=arguments, **changes)


def _aot_keeping(graphs: list):
    """A torch.compile backend through AOT autograd that appends each forward graph to
    ``graphs`` and runs it as traced."""

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=keep)(gm, example_inputs)

    return backend


def _op_nodes(gm, kernel):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is kernel.op]


def _outputs(node):
    value = node.meta.get("val", node.meta.get("example_value"))
    return list(value) if isinstance(value, tuple | list) else [value]


class _Recorder:
    """A torch.compile backend that keeps each graph and runs it as it is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def test_the_op_is_named_by_the_operator_and_its_version(vector_add, vector_add_dir):
    spec = vector_add.spec
    assert vector_add.op.name() == f"kato_user::vector_add_test_{spec.version}"
    schema = str(vector_add.op._schema)
    assert schema.endswith(
        "(Tensor a, Tensor b, SymInt n, SymInt[]? shape, str? dtype, Tensor[] constants) -> Tensor"
    )
    assert not vector_add.op._schema.is_mutable
    assert torch.Tag.needs_exact_strides in vector_add.op.tags  # as eager: no silent copies
    again = kato_torch.user_kernel(spec_from_folder(vector_add_dir))
    assert again.op is vector_add.op  # the same version: the op registered once


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_make_fx_keeps_the_op_with_the_outputs_a_call_allocates(vector_add, mode):
    a, b = torch.randn(1009), torch.randn(1009)
    gm = make_fx(lambda a, b: vector_add(a, b, a.numel()) * 2, tracing_mode=mode)(a, b)
    (node,) = _op_nodes(gm, vector_add)
    (traced,) = _outputs(node)
    (eager,) = vector_add.plan(a, b, 1009).outputs
    assert traced.dtype == eager.dtype == torch.float32 and traced.device == eager.device
    assert [int(d) for d in traced.shape] == list(eager.shape) == [1009]
    if mode == "symbolic":  # the output is sized by a's element count, a symbol
        (a_node, *_) = (n for n in gm.graph.nodes if n.op == "placeholder")
        assert isinstance(traced.shape[0], torch.SymInt)
        assert traced.shape[0].node.expr == a_node.meta["val"].numel().node.expr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_2d_output_has_the_symbols_of_its_factors(dtype):
    mm = kato_torch.user_kernel(_matmul())
    a, b = torch.randn(7, 5, dtype=dtype), torch.randn(5, 3, dtype=dtype)

    def f(a, b):
        return mm(a, b, a.shape[0], b.shape[1], a.shape[1])

    gm = make_fx(f, tracing_mode="symbolic")(a, b)
    (node,) = _op_nodes(gm, mm)
    (traced,) = _outputs(node)
    (eager,) = mm.plan(a, b, 7, 3, 5).outputs
    assert traced.dtype == eager.dtype == dtype
    assert [int(d) for d in traced.shape] == list(eager.shape) == [7, 3]
    a_val, b_val = (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    assert traced.shape[0].node.expr == a_val.shape[0].node.expr
    assert traced.shape[1].node.expr == b_val.shape[1].node.expr


def test_derived_sizes_are_expressions_of_the_shape_right_at_every_size():
    spec = _one_dim(
        "compile_derived",
        [
            {"name": "out", "dtype": "float32", "size": "2 * n + 1", "output": True},
            {"name": "blocks", "dtype": "int32", "size": "ceil(n / 32)", "output": True},
            {"name": "wide", "dtype": "float32", "size": "max(n, 64) * 2", "output": True},
            {"name": "x", "dtype": "float32", "size": "n"},
        ],
    )
    k = kato_torch.user_kernel(spec)
    gm = make_fx(lambda x: k(x), tracing_mode="symbolic")(torch.randn(100))
    (node,) = _op_nodes(gm, k)
    traced = _outputs(node)
    (x_val,) = (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    (symbol,) = x_val.shape[0].node.expr.free_symbols
    for n in (1, 31, 32, 33, 100, 1000, 4097):
        eager = k.plan(torch.randn(n)).outputs
        at_n = [int(t.shape[0].node.expr.subs(symbol, n)) for t in traced]
        assert at_n == [t.shape[0] for t in eager], n
        assert [t.dtype for t in traced] == [t.dtype for t in eager]


def test_a_solved_dimension_is_specialised_and_recompiled(monkeypatch):
    spec = _one_dim(
        "compile_padded",
        [
            {"name": "out", "dtype": "float32", "size": "2 * n + 1", "output": True},
            {"name": "x", "dtype": "float32", "size": "n + 3"},
        ],
    )
    k = kato_torch.user_kernel(spec)
    backend = _Recorder()
    compiled = torch.compile(lambda x: k(x), backend=backend, fullgraph=True, dynamic=True)
    for size in (100, 120):
        with pytest.raises(InvalidInput, match=CUDA_ONLY):  # the op ran (on CPU: refused)
            compiled(torch.zeros(size))
    assert len(backend.graphs) == 2  # n was solved by bisection: guarded on x's size
    sizes = [_outputs(_op_nodes(g, k)[0])[0].shape[0] for g in backend.graphs]
    assert sizes == [195, 235] == [k.plan(torch.zeros(s)).outputs[0].shape[0] for s in (100, 120)]


def test_compile_fullgraph_keeps_the_op_once_for_every_size(vector_add):
    backend = _Recorder()

    def f(a, b):
        return torch.relu(vector_add(a, b, a.numel())) + 1

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for n in (1009, 77, 4096):
        # The graph's op is the eager call's code: on CPU tensors it refuses as eager does.
        with pytest.raises(InvalidInput, match=CUDA_ONLY):
            compiled(torch.randn(n), torch.randn(n))
    assert len(backend.graphs) == 1  # no graph break (fullgraph), no recompile across sizes
    (gm,) = backend.graphs
    (node,) = _op_nodes(gm, vector_add)
    (out,) = _outputs(node)
    assert isinstance(out.shape[0], torch.SymInt) and out.dtype == torch.float32
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is vector_add.op


def test_aot_autograd_keeps_the_op():
    mm = kato_torch.user_kernel(_matmul("compile_aot_mm"))
    graphs = []
    backend = _aot_keeping(graphs)

    compiled = torch.compile(
        lambda a, b: mm(a, b, a.shape[0], b.shape[1], a.shape[1]).sum(),
        backend=backend,
        fullgraph=True,
    )
    with pytest.raises(InvalidInput, match=CUDA_ONLY):
        compiled(torch.randn(4, 6), torch.randn(6, 2))
    (gm,) = graphs
    (node,) = _op_nodes(gm, mm)
    assert [tuple(t.shape) for t in _outputs(node)] == [(4, 2)]


def test_an_input_that_requires_grad_compiles_and_no_output_has_a_gradient():
    """An eager call's outputs carry no gradient (docs/user_kernels.md: no autograd yet); the
    op's have none either, so a compiled call on an input that requires grad compiles (without
    an autograd formula AOT autograd refused the graph) and the op's output under a dispatch
    mode does not require grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mm = kato_torch.user_kernel(_matmul("compile_grad_mm"))
    graphs = []
    backend = _aot_keeping(graphs)

    compiled = torch.compile(
        lambda a, b: mm(a, b, a.shape[0], b.shape[1], a.shape[1]) * 2,
        backend=backend,
        fullgraph=True,
    )
    with pytest.raises(InvalidInput, match=CUDA_ONLY):
        compiled(torch.randn(4, 6, requires_grad=True), torch.randn(6, 2))
    (gm,) = graphs
    assert [tuple(t.shape) for t in _outputs(_op_nodes(gm, mm)[0])] == [(4, 2)]
    with FakeTensorMode():
        a = torch.randn(4, 6, requires_grad=True)
        out = mm(a, torch.randn(6, 2), 4, 2, 6)
    assert tuple(out.shape) == (4, 2) and not out.requires_grad and out.grad_fn is None


def test_a_changed_spec_under_the_same_name_is_another_op():
    def spec(size):
        return _one_dim(
            "compile_changing",
            [
                {"name": "out", "dtype": "float32", "size": size, "output": True},
                {"name": "x", "dtype": "float32", "size": "n"},
            ],
        )

    first = kato_torch.user_kernel(spec("n"))
    x = torch.randn(10)
    before = make_fx(lambda x: first(x), tracing_mode="fake")(x)
    second = kato_torch.user_kernel(spec("2 * n"))  # registered under the same name
    assert first.spec.version != second.spec.version
    assert first.op is not second.op and first.op.name() != second.op.name()
    assert first.op.name().startswith("kato_user::compile_changing_")
    after = make_fx(lambda x: second(x), tracing_mode="fake")(x)
    assert _outputs(_op_nodes(after, second)[0])[0].shape == (20,)
    # The first version's op (and a graph made with it) still sizes as that version did.
    assert _outputs(_op_nodes(before, first)[0])[0].shape == (10,)
    again = make_fx(lambda x: first(x), tracing_mode="fake")(x)
    assert _outputs(_op_nodes(again, first)[0])[0].shape == (10,)
    assert kato_torch.user_kernel(spec("n")).op is first.op  # back to the first: found


def test_bad_arguments_raise_invalid_input_in_a_trace(vector_add):
    a = torch.randn(8)
    trace = make_fx(lambda a, b, n: vector_add(a, b, n), tracing_mode="fake")
    with pytest.raises(InvalidInput, match="argument b has 7 elements; at shape n=8 its size"):
        trace(a, torch.randn(7), 8)
    with pytest.raises(InvalidInput, match="scalar n is 9; at shape n=8 it must be n = 8"):
        trace(a, torch.randn(8), 9)
    with pytest.raises(InvalidInput, match="b must be torch.float32, got torch.float64"):
        trace(a, torch.randn(8, dtype=torch.float64), 8)
    with pytest.raises(InvalidInput, match="argument b is not contiguous; pass .contiguous()"):
        trace(a, torch.randn(8, 2)[:, 0], 8)
    with pytest.raises(InvalidInput, match="argument b is an array .* pass a tensor, got float"):
        make_fx(lambda a: vector_add(a, 1.0, 8), tracing_mode="fake")(a)
    with pytest.raises(InvalidInput, match=r"takes 3 arguments \(a, b, n; outputs c are"):
        make_fx(lambda a: vector_add(a, a), tracing_mode="fake")(a)


def test_bad_arguments_under_torch_compile_carry_kato_s_message(vector_add):
    def wrong_size(a, b):
        return vector_add(a, b[:-1].contiguous(), a.numel())

    with pytest.raises(torch._dynamo.exc.TorchRuntimeError) as raised:
        torch.compile(wrong_size, backend="eager", fullgraph=True)(torch.randn(8), torch.randn(8))
    assert "InvalidInput('vector_add_test: argument b has 7 elements; at shape n=8" in str(
        raised.value
    )
    # Checked in the traced Python: without fullgraph, torch.compile runs it eagerly.
    with pytest.raises(InvalidInput, match="argument b is an array .* pass a tensor, got float"):
        torch.compile(lambda a: vector_add(a, 1.0, 8), backend="eager")(torch.randn(8))


def test_scalars_are_passed_as_the_schema_takes_them():
    spec = _one_dim(
        "compile_scaled",
        [
            {"name": "out", "dtype": "float32", "size": "n", "output": True},
            {"name": "x", "dtype": "float32", "size": "n"},
            {"name": "count", "dtype": "float32", "value": "n"},
            {"name": "alpha", "dtype": "float32", "value": "0"},
            {"name": "m", "dtype": "int64", "value": "n"},
        ],
    )
    k = kato_torch.user_kernel(spec)
    gm = make_fx(lambda x: k(x, 3, 2, 3.0), tracing_mode="fake")(torch.zeros(3))
    (node,) = _op_nodes(gm, k)
    assert node.args[1:4] == (3.0, 2.0, 3)
    assert [type(v) for v in node.args[1:4]] == [float, float, int]
    with pytest.raises(InvalidInput, match="scalar m is int64; got 3.5"):
        make_fx(lambda x: k(x, 3, 2, 3.5), tracing_mode="fake")(torch.zeros(3))
    # A size given for a float scalar under dynamic shapes: torch's schemas have no symbolic
    # float, so the op takes its value and the graph is guarded on it (one per size); the
    # integer scalar stays a symbol, and sizes the output.
    backend = _Recorder()
    compiled = torch.compile(
        lambda x: k(x, x.numel(), 2, x.numel()), backend=backend, fullgraph=True, dynamic=True
    )
    for n in (3, 11):
        with pytest.raises(InvalidInput, match=CUDA_ONLY):
            compiled(torch.zeros(n))
    assert len(backend.graphs) == 2
    for gm in backend.graphs:
        (node,) = _op_nodes(gm, k)
        count, alpha, m = node.args[1:4]
        assert count.target is torch.sym_float and alpha == 2.0 and type(alpha) is float
        assert isinstance(m.meta["example_value"], torch.SymInt)
        assert _outputs(node)[0].shape[0].node.expr == m.meta["example_value"].node.expr


def test_constants_and_a_keyword_argument_name_reach_the_op():
    from user_ops.test_constants import FILTER, _op

    conv = kato_torch.user_kernel(_op(name="compile_conv"))
    schema = str(conv.op._schema)
    assert "(Tensor in_, SymInt n, SymInt[]? shape, str? dtype, Tensor[] constants)" in schema
    x, taps = torch.randn(100 + FILTER - 1), torch.randn(FILTER)
    gm = make_fx(
        lambda x, taps: conv(x, 100, constants={"d_filter": taps}), tracing_mode="symbolic"
    )(x, taps)
    (node,) = _op_nodes(gm, conv)
    assert [int(d) for d in _outputs(node)[0].shape] == [100]
    with pytest.raises(InvalidInput, match="constant d_filter has 3 elements; its size f is 17"):
        make_fx(lambda x, taps: conv(x, 100, constants={"d_filter": taps}), tracing_mode="fake")(
            x, torch.ones(3)
        )
    with pytest.raises(InvalidInput, match=r"constants= must give .*\['d_filter'\]; got none"):
        make_fx(lambda x: conv(x, 100), tracing_mode="fake")(x)


def test_an_operator_without_outputs_mutates_its_arrays():
    spec = _one_dim(
        "compile_in_place",
        [
            {"name": "x", "dtype": "float32", "size": "n"},
            {"name": "n", "dtype": "int32", "value": "n"},
        ],
    )
    k = kato_torch.user_kernel(spec)
    schema = k.op._schema
    assert schema.is_mutable and str(schema).endswith(
        "(Tensor(a0!) x, SymInt n, " + ("SymInt[]? shape, str? dtype, Tensor[] constants) -> ()")
    )

    def f(x):
        y = x * 2
        out = k(y, y.numel())
        return y + 1, out

    gm = make_fx(f, tracing_mode="fake")(torch.randn(10))
    (node,) = _op_nodes(gm, k)  # kept though nothing reads a result of it
    assert node.args[0].target is torch.ops.aten.mul.Tensor
    graphs = []
    backend = _aot_keeping(graphs)

    with pytest.raises(InvalidInput, match=CUDA_ONLY):
        torch.compile(f, backend=backend, fullgraph=True)(torch.randn(10))
    (gm,) = graphs  # functionalised: the op kept, its write made visible to the add
    code = gm.code
    assert "auto_functionalized" in code and k.op.name().split("::")[1] in code


def test_an_eager_call_skips_the_dispatcher_and_a_mode_sees_the_op(vector_add, monkeypatch):
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(8), torch.randn(8)
    with Seen(), pytest.raises(InvalidInput, match=CUDA_ONLY):
        vector_add(a, b, 8)
    assert vector_add.op in seen
    seen.clear()
    monkeypatch.setattr(vector_add, "_call_op", lambda *a: pytest.fail("went to the op"))
    with pytest.raises(InvalidInput, match=CUDA_ONLY):
        vector_add(a, b, 8)  # plain eager: straight to the launch path


def test_schema_names_avoid_keywords_and_the_call_s_own_arguments():
    taken: set[str] = set()
    names = [user._schema_name(n, taken) for n in ("in", "shape", "shape_", "x", "self", "out")]
    assert names == ["in_", "shape_", "shape__", "x", "self_", "out_"]


def test_a_changed_spec_does_not_launch_the_kernel_bound_for_the_old_one(monkeypatch):
    from types import SimpleNamespace

    from kato_torch import _kernels

    def spec(size):
        return _one_dim(
            "compile_rebound",
            [
                {"name": "out", "dtype": "float32", "size": size, "output": True},
                {"name": "x", "dtype": "float32", "size": "n"},
            ],
        )

    old, new = spec("n"), spec("n + 0")
    stale = SimpleNamespace(spec=old)
    key = ("compile_rebound", (8,), "float32", 0, _kernels.MAX_VECTOR_BYTES)
    # bound for the old version, and (as a call naming no spec finds it) by name
    monkeypatch.setitem(_kernels._bound, (*key, old.version), stale)
    monkeypatch.setitem(_kernels._bound, (*key, None), stale)

    class Compiles(Exception):
        pass

    def no_gpu(index):
        raise Compiles

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    assert _kernels.bind("compile_rebound", (8,), "float32", 0, spec=old) is stale
    assert _kernels.bind("compile_rebound", (8,), "float32", 0) is stale  # by name, as before
    with pytest.raises(Compiles):  # another version: bound anew, not the cached one
        _kernels.bind("compile_rebound", (8,), "float32", 0, spec=new)
    # and the old version keeps its binding: two versions alternating do not rebind each call
    assert _kernels.bind("compile_rebound", (8,), "float32", 0, spec=old) is stale


def test_a_misaligned_array_of_an_operator_without_outputs_gets_its_copy_back():
    """A kernel without outputs works by writing its arrays; one a few elements into its
    storage runs on an aligned copy, whose contents the call copies back (else the write would
    be lost); an operator with outputs writes only those, and keeps no such pair."""
    spec = _one_dim(
        "write_back_in_place",
        [
            {"name": "x", "dtype": "float32", "size": "n"},
            {"name": "n", "dtype": "int32", "value": "n"},
        ],
    )
    k = kato_torch.user_kernel(spec)
    storage = torch.arange(11, dtype=torch.float32)
    view = storage[1:]  # 4 bytes into its storage
    call = k.plan(view, 10)
    ((given, copy),) = call.write_back
    assert given is view and copy.data_ptr() % 16 == 0
    assert call.arguments[0] is copy and torch.equal(copy, view)
    aligned = k.plan(storage[:10], 10)
    assert aligned.write_back == [] and aligned.arguments[0].data_ptr() == storage.data_ptr()


def test_an_operator_with_outputs_keeps_no_write_back(vector_add):
    a = torch.arange(11, dtype=torch.float32)[1:]
    call = vector_add.plan(a, a.clone(), 10)
    assert call.write_back == [] and call.arguments[0] is not a  # still an aligned copy
