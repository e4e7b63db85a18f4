"""Kato's kernels as PyTorch custom operators, and the differentiable functions that use them.

Each operator is registered with ``torch.library.custom_op`` in the ``kato`` namespace
(``_softmax``, ...), with a fake implementation (so ``torch.compile`` keeps it in
its graph instead of breaking it) and its backward registered as another ``kato`` operator.
An operator's implementation launches Kato's kernel on the current CUDA stream (so CUDA graphs
capture it) where the policy (:mod:`kato_torch.policy`) picks Kato for that key, and PyTorch's
own op otherwise or on a tensor that is not on a CUDA device.

The public functions (:func:`softmax`, :func:`layer_norm`, ...) take what their
``torch.nn.functional`` namesakes take. They go through the custom operators only where the
policy picks Kato for the forward or the backward operator of that key; otherwise they call
PyTorch's functions directly, so a compiled model whose Kato kernels are not faster is plain
PyTorch for Inductor to fuse. Under autocast they cast as PyTorch's autocast does for the op
(norms, softmax and cross-entropy in float32; matmul and linear in the autocast type).

Kernel argument lists follow each operator spec's ``make_problem`` order (see the ``Kernel
arguments`` paragraph of each ``kernels/<operator>`` docstring).
"""

from __future__ import annotations

import functools
import operator as _operator
from collections.abc import Callable, Sequence

import torch
from kato.kernels import InvalidInput, get_operator
from kato.kernels import batchnorm as bn_forward
from kato.kernels import batchnorm_backward as bn_backward
from kato.kernels.cross_entropy import model as ce_model
from kato.kernels.layernorm_backward import partial_rows as layernorm_partial_rows
from kato.kernels.rmsnorm_backward import partial_rows as rmsnorm_partial_rows
from torch import Tensor

from kato_torch import _backlog
from kato_torch import policy as _policy
from kato_torch._backlog import lagging
from kato_torch._fallbacks import chose_kato, remembers_fallbacks, waited
from kato_torch._kernels import MAX_VECTOR_BYTES, MisalignedArguments, bind, pointer_alignment
from kato_torch._op import KatoOp

_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_name(t: Tensor) -> str:
    return _DTYPES.get(t.dtype, str(t.dtype).removeprefix("torch."))


@torch.compiler.assume_constant_result
def _decide(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    device: str,
    compiled: bool = False,
    relayout: bool = False,
) -> int:
    """The policy's verdict for this key (:func:`kato_torch.policy.verdict`); ``TORCH`` for an
    operator, dtype or shape Kato does not have (a shape the operator's spec refuses, e.g.
    past its kernels' int indices: binding it would raise inside the custom op). A constant
    for ``torch.compile`` (shapes are static in a compiled graph)."""
    try:
        spec = get_operator(operator)
    except InvalidInput:  # not in this installation (e.g. a layout added later)
        return _policy.TORCH
    if dtype not in spec.dtypes:
        return _policy.TORCH
    try:
        spec.validate(shape, dtype)
    except InvalidInput:
        return _policy.TORCH
    return _policy.verdict(operator, shape, dtype, device, compiled, relayout)


#: (operator, shape, dtype, is_cuda) -> verdict (kato_torch.policy.KATO, ...), valid for
#: :func:`policy.generation` ``_fast_generation``: one dictionary read per call instead of the
#: registry and the policy.
_fast: dict[tuple, int] = {}
_fast_generation = -1


def _use(operator: str, shape: Sequence[int], t: Tensor, relayout: bool = False) -> bool:
    """Whether Kato's ``operator`` runs for this key (see :func:`_decide`; ``relayout``: the
    call's tensors are not in the layout its kernel takes); a ``WHEN_BUSY`` verdict runs it
    while ``t``'s GPU lags the host (:func:`kato_torch._backlog.lagging`: asked once per call
    of a public function, whichever of its keys asks first)."""
    global _fast_generation
    if torch.compiler.is_compiling():  # folded to a constant at trace time
        # operator.index specializes a dynamic dimension (a guard on its value): a decision is
        # per shape, and assume_constant_result takes constants only (a SymInt breaks the graph).
        key = tuple(_operator.index(d) for d in shape)
        decision = _decide(operator, key, _dtype_name(t), t.device.type, True, relayout)
        return decision == _policy.KATO
    # The hot path of every call: a key of cheap attributes (is_cuda, not device.type).
    key = (operator, shape, t.dtype, t.is_cuda, relayout)
    if _fast_generation != _policy.generation():
        _fast.clear()
        _fast_generation = _policy.generation()
    try:
        decision = _fast.get(key)
    except TypeError:  # a SymInt in the shape (a fake-tensor trace): specialise it
        shape = tuple(int(d) for d in shape)
        key = (operator, shape, t.dtype, t.is_cuda, relayout)
        decision = _fast.get(key)
    if decision is None or _policy.recording():
        shape = tuple(int(d) for d in shape)
        decision = _decide(operator, shape, _dtype_name(t), t.device.type, False, relayout)
        _fast[key] = decision
    if decision == _policy.TORCH:
        return False
    if decision == _policy.WHEN_BUSY and not lagging(t):
        # The host bounds the step: PyTorch's cheaper call wins. Remembered as a fallback
        # that asks the backlog again before it runs PyTorch's op (kato_torch._fallbacks).
        waited()
        return False
    # The GPU far enough behind the host (or the verdict KATO): the kernel's saving counts.
    chose_kato()
    return True


def _one_answer(fn: Callable) -> Callable:
    """``fn`` as one call of the backlog's (:func:`kato_torch._backlog.enter`): every key it
    asks about gets the first answer. (The functions that remember their fallbacks,
    :mod:`kato_torch._fallbacks`, do this already.)"""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        outer = _backlog.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _backlog.leave(outer)

    return call


def _run(
    operator: str, shape: Sequence[int], t: Tensor, args: list, steps: list[int] | None = None
) -> None:
    """Launch ``operator``'s served config (its ``steps``, default all) on ``args``, bound for
    their pointers' alignment."""
    dtype = _DTYPES[t.dtype]
    index = t.device.index
    # Fresh allocations are 16-byte aligned: the launch checks that while it reads the
    # pointers, instead of a pass over them before every call.
    try:
        bind(operator, shape, dtype, index).run(args, steps, aligned_to=MAX_VECTOR_BYTES)
        return
    except MisalignedArguments:
        pass
    # A contiguous view may start a few elements into its storage: bound for that alignment.
    alignment = pointer_alignment(args)
    try:
        bound = bind(operator, shape, dtype, index, alignment)
    except InvalidInput:
        if alignment >= MAX_VECTOR_BYTES:
            raise
        # No variant runs on these pointers (a tensor-core GEMM needs 16-byte vectors): the
        # views off a boundary are copied to fresh, aligned storage. Only inputs can be such
        # views: every op here is functional, its outputs fresh allocations.
        args = [
            a.clone() if isinstance(a, Tensor) and a.data_ptr() % MAX_VECTOR_BYTES else a
            for a in args
        ]
        bound = bind(operator, shape, dtype, index)
    bound.run(args, steps)


def _rows_cols(x: Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() else 1
    return (x.numel() // cols if cols else 0), cols


def _autocast(dtype_kind: str, *tensors: Tensor | None) -> list[Tensor | None]:
    """Cast as autocast would for this op (``"float32"``: norms and losses; ``"lower"``: matmul
    in the autocast type); tensors unchanged outside an autocast region."""
    if not tensors or not any(t is not None and t.is_cuda for t in tensors):
        return list(tensors)
    if not torch.is_autocast_enabled("cuda"):
        return list(tensors)
    target = torch.float32 if dtype_kind == "float32" else torch.get_autocast_dtype("cuda")
    return [t.to(target) if t is not None and t.dtype in _FLOATS else t for t in tensors]


def _empty_rows(x: Tensor, rows: int) -> Tensor:
    return torch.empty(rows, device=x.device, dtype=torch.float32)


# --- softmax ----------------------------------------------------------------------------------


@KatoOp.define("softmax")
def _softmax(x: Tensor) -> Tensor:
    """Softmax over the last dim of a contiguous tensor."""
    rows, cols = _rows_cols(x)
    if not _use("softmax", (rows, cols), x) or x.numel() == 0:
        return torch.softmax(x, -1)
    y = torch.empty_like(x)
    _run("softmax", (rows, cols), x, [x, y, rows, cols])
    return y


@_softmax.register_fake
def _(x):
    return torch.empty_like(x)


@KatoOp.define("softmax_backward")
def _softmax_backward(y: Tensor, dy: Tensor) -> Tensor:
    """dx = y * (dy - sum(dy * y)) per row, from the forward's output."""
    rows, cols = _rows_cols(y)
    if not _use("softmax_backward", (rows, cols), y) or y.numel() == 0:
        return torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)
    dx = torch.empty_like(y)
    _run("softmax_backward", (rows, cols), y, [y, dy, dx, rows, cols])
    return dx


@_softmax_backward.register_fake
def _(y, dy):
    return torch.empty_like(y)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return _softmax_backward(y, dy.contiguous())


_softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


@remembers_fallbacks(lambda x, dim=-1: torch.softmax(x, dim))
def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``torch.softmax(x, dim)``; Kato's kernels over the last dim (float32 accumulation)."""
    if x.dim() == 0 or dim not in (-1, x.dim() - 1) or x.dtype not in _FLOATS:
        return torch.softmax(x, dim)
    (x,) = _autocast("float32", x)
    rows, cols = _rows_cols(x)
    if _use("softmax", (rows, cols), x) | _use("softmax_backward", (rows, cols), x):
        return _softmax(x.contiguous())
    return torch.softmax(x, dim)


# --- layer norm -------------------------------------------------------------------------------


def _native_layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """torch's (y, mean, rstd), the statistics flat and float32 as Kato's kernels write them."""
    rows, cols = _rows_cols(x)
    y, mean, rstd = torch.native_layer_norm(x, (cols,), weight, bias, eps)
    return y, mean.reshape(rows).float(), rstd.reshape(rows).float()


def _launch_layer_norm(
    operator: str, x: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) from Kato's ``layernorm`` or ``layernorm_relu`` (the same arguments)."""
    rows, cols = _rows_cols(x)
    y, mean, rstd = torch.empty_like(x), _empty_rows(x, rows), _empty_rows(x, rows)
    _run(operator, (rows, cols), x, [x, weight, bias, y, mean, rstd, rows, cols, eps])
    return y, mean, rstd


def _layer_norm_fake(x, weight, bias, eps):
    rows, _ = _rows_cols(x)
    return (
        torch.empty_like(x),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.float32),
    )


def _layer_norm_grads(x: Tensor, weight: Tensor) -> tuple[Tensor, ...]:
    """(dx, dweight, dbias, partials, nparts): the outputs and workspace of Kato's layer-norm
    backwards (``layernorm_backward``, ``layernorm_relu_backward``)."""
    rows, cols = _rows_cols(x)
    partials = torch.empty(
        layernorm_partial_rows(rows) * 2 * cols, device=x.device, dtype=torch.float32
    )
    nparts = torch.empty(1, device=x.device, dtype=torch.int32)
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight), partials, nparts


@KatoOp.define("layer_norm")
def _layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) of a contiguous (rows, cols) x; mean and rstd float32 per row."""
    rows, cols = _rows_cols(x)
    if not _use("layernorm", (rows, cols), x) or x.numel() == 0:
        return _native_layer_norm(x, weight, bias, eps)
    return _launch_layer_norm("layernorm", x, weight, bias, eps)


_layer_norm.register_fake(_layer_norm_fake)


@KatoOp.define("layer_norm_backward")
def _layer_norm_backward(
    x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) from the forward's input and statistics."""
    rows, cols = _rows_cols(x)
    if not _use("layernorm_backward", (rows, cols), x) or x.numel() == 0:
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, x, (cols,), mean.reshape(rows, 1), rstd.reshape(rows, 1), weight, weight,
            (True, True, True),
        )  # fmt: skip
        return dx, dw, db
    dx, dw, db, partials, nparts = _layer_norm_grads(x, weight)
    _run("layernorm_backward", (rows, cols), x,
         [x, weight, mean, rstd, dy, dx, dw, db, partials, nparts, rows, cols])  # fmt: skip
    return dx, dw, db


@_layer_norm_backward.register_fake
def _(x, weight, mean, rstd, dy):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _layer_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward(x, weight, mean, rstd, dy.contiguous())
    return dx, dw, db, None


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


def _norm_inputs(x: Tensor, *params: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    # .to() costs microseconds of dispatch even when it has nothing to do: ask first.
    return x.contiguous(), [
        None if p is None else (p if p.dtype == x.dtype else p.to(x.dtype)).contiguous()
        for p in params
    ]


@remembers_fallbacks(
    lambda x, normalized_shape, weight=None, bias=None, eps=1e-5: torch.nn.functional.layer_norm(
        x, tuple(normalized_shape), weight, bias, eps
    )
)
def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``torch.nn.functional.layer_norm``; Kato's kernels (Welford statistics, float32
    accumulation) over the last dim when ``weight`` and ``bias`` are given."""
    normalized_shape = tuple(normalized_shape)
    if (
        len(normalized_shape) != 1
        or x.dim() == 0
        or normalized_shape[0] != x.shape[-1]
        or weight is None
        or bias is None
        or x.dtype not in _FLOATS
    ):
        return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)
    x, weight, bias = _autocast("float32", x, weight, bias)
    rows, cols = _rows_cols(x)
    if _use("layernorm", (rows, cols), x) | _use("layernorm_backward", (rows, cols), x):
        x2, (w, b) = _norm_inputs(x, weight, bias)
        y, _, _ = _layer_norm(x2, w, b, float(eps))
        return y
    return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)


def layernorm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Layer norm over the last dim with ``weight`` and ``bias`` (kept from earlier releases:
    :func:`layer_norm` with ``normalized_shape=(x.shape[-1],)``)."""
    return layer_norm(x, (x.shape[-1],), weight, bias, eps)


# --- layer norm + ReLU ------------------------------------------------------------------------


@KatoOp.define("layer_norm_relu")
def _layer_norm_relu(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(relu(layer_norm(x)), mean, rstd) of a contiguous (rows, cols) x; mean and rstd float32
    per row, as :func:`_layer_norm`'s."""
    rows, cols = _rows_cols(x)
    if not _use("layernorm_relu", (rows, cols), x) or x.numel() == 0:
        y, mean, rstd = _native_layer_norm(x, weight, bias, eps)
        return torch.relu(y), mean, rstd
    return _launch_layer_norm("layernorm_relu", x, weight, bias, eps)


_layer_norm_relu.register_fake(_layer_norm_fake)


@KatoOp.define("layer_norm_relu_backward")
def _layer_norm_relu_backward(
    x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor, y: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) from the forward's input, statistics and output. Kato's kernel
    recomputes the ReLU's mask from x (it reads x anyway) and never reads y; torch's sequence
    (threshold_backward on y, then native_layer_norm_backward) is autograd's for
    ``relu(layer_norm(x))``."""
    rows, cols = _rows_cols(x)
    if not _use("layernorm_relu_backward", (rows, cols), x) or x.numel() == 0:
        g = torch.ops.aten.threshold_backward(dy, y, 0)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            g, x, (cols,), mean.reshape(rows, 1), rstd.reshape(rows, 1), weight, bias,
            (True, True, True),
        )  # fmt: skip
        return dx, dw, db
    dx, dw, db, partials, nparts = _layer_norm_grads(x, weight)
    _run("layernorm_relu_backward", (rows, cols), x,
         [x, weight, bias, mean, rstd, dy, dx, dw, db, partials, nparts, rows, cols])  # fmt: skip
    return dx, dw, db


@_layer_norm_relu_backward.register_fake
def _(x, weight, bias, mean, rstd, y, dy):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _layer_norm_relu_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # y is what torch's relu saves too (and the next layer's input, which it keeps anyway).
    ctx.save_for_backward(x, weight, bias, mean, rstd, y)


def _layer_norm_relu_grad(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd, y = ctx.saved_tensors
    dx, dw, db = _layer_norm_relu_backward(x, weight, bias, mean, rstd, y, dy.contiguous())
    return dx, dw, db, None


_layer_norm_relu.register_autograd(_layer_norm_relu_grad, setup_context=_layer_norm_relu_setup)


def _layer_norm_relu_torch(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    return torch.relu(torch.nn.functional.layer_norm(x, tuple(normalized_shape), weight, bias, eps))


@remembers_fallbacks(_layer_norm_relu_torch)
def layer_norm_relu(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``torch.relu(torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps))``
    in one kernel forward and one backward (the ReLU's mask recomputed from x), where the
    policy picks Kato's ``layernorm_relu`` or ``layernorm_relu_backward`` for the key; the
    same conditions as :func:`layer_norm` (last dim, ``weight`` and ``bias`` given). Otherwise,
    and for each of the two the policy leaves to PyTorch, torch's own sequence
    (``native_layer_norm`` then ``relu``; ``threshold_backward`` then
    ``native_layer_norm_backward``). Kato's backward recomputes the ReLU's mask from x and the
    saved float32 mean and rstd, which can differ from the forward's where the pre-activation
    is within their rounding of 0 (about 2**-24 |mean| rstd |w|; relu's gradient is ambiguous
    there)."""
    normalized_shape = tuple(normalized_shape)
    if (
        len(normalized_shape) != 1
        or x.dim() == 0
        or normalized_shape[0] != x.shape[-1]
        or weight is None
        or bias is None
        or x.dtype not in _FLOATS
    ):
        return _layer_norm_relu_torch(x, normalized_shape, weight, bias, eps)
    x, weight, bias = _autocast("float32", x, weight, bias)
    rows, cols = _rows_cols(x)
    if _use("layernorm_relu", (rows, cols), x) | _use("layernorm_relu_backward", (rows, cols), x):
        x2, (w, b) = _norm_inputs(x, weight, bias)
        y, _, _ = _layer_norm_relu(x2, w, b, float(eps))
        return y
    return _layer_norm_relu_torch(x, normalized_shape, weight, bias, eps)


# --- RMS norm ---------------------------------------------------------------------------------


def _rms_reference(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """PyTorch's (y, rstd): its fused kernel (what F.rms_norm runs on CUDA) where the types
    allow, else its math (float32 statistics, y in x's type, as F.rms_norm). The fallback of
    a Kato-decided key must cost what torch's op costs (the never-slower policy)."""
    if weight.dtype == x.dtype:
        y, rstd = torch._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd.reshape(-1).float()
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1) + eps)
    return (x32 * rstd[..., None] * weight.float()).to(x.dtype), rstd.reshape(-1)


@KatoOp.define("rms_norm")
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd) of a contiguous (rows, cols) x; rstd float32 per row."""
    rows, cols = _rows_cols(x)
    if not _use("rmsnorm", (rows, cols), x) or x.numel() == 0:
        return _rms_reference(x, weight, eps)
    y, rstd = torch.empty_like(x), _empty_rows(x, rows)
    _run("rmsnorm", (rows, cols), x, [x, weight, y, rstd, rows, cols, eps])
    return y, rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    rows, _ = _rows_cols(x)
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@KatoOp.define("rms_norm_backward")
def _rms_norm_backward(
    x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor]:
    """(dx, dweight) from the forward's input and rstd."""
    rows, cols = _rows_cols(x)
    if not _use("rmsnorm_backward", (rows, cols), x) or x.numel() == 0:
        if x.is_cuda and weight.dtype == x.dtype:  # torch's fused backward (CUDA only)
            return torch.ops.aten._fused_rms_norm_backward(
                dy, x, [cols], rstd.view(*x.shape[:-1], 1), weight, [True, True]
            )
        x32, dy32, r = x.reshape(rows, cols).float(), dy.reshape(rows, cols).float(), rstd[:, None]
        xhat = x32 * r
        g = dy32 * weight.float()
        dx = r * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
        return dx.reshape(x.shape).to(x.dtype), (dy32 * xhat).sum(dim=0).to(weight.dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(weight)
    partials = torch.empty(rmsnorm_partial_rows(rows) * cols, device=x.device, dtype=torch.float32)
    nparts = torch.empty(1, device=x.device, dtype=torch.int32)
    _run("rmsnorm_backward", (rows, cols), x,
         [x, weight, rstd, dy, dx, dw, partials, nparts, rows, cols])  # fmt: skip
    return dx, dw


@_rms_norm_backward.register_fake
def _(x, weight, rstd, dy):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(x, weight, rstd, dy.contiguous())
    return dx, dw, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def _rms_eps(x: Tensor, eps: float | None) -> float:
    return float(torch.finfo(x.dtype).eps if eps is None else eps)


@remembers_fallbacks(
    lambda x, normalized_shape, weight=None, eps=None: torch.nn.functional.rms_norm(
        x, tuple(normalized_shape), weight, eps
    )
)
def rms_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """``torch.nn.functional.rms_norm``; Kato's kernels over the last dim when ``weight`` is
    given (``eps`` None: the dtype's machine epsilon, as PyTorch)."""
    normalized_shape = tuple(normalized_shape)
    if (
        len(normalized_shape) != 1
        or x.dim() == 0
        or normalized_shape[0] != x.shape[-1]
        or weight is None
        or x.dtype not in _FLOATS
    ):
        return torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
    x, weight = _autocast("float32", x, weight)
    rows, cols = _rows_cols(x)
    if _use("rmsnorm", (rows, cols), x) | _use("rmsnorm_backward", (rows, cols), x):
        x2, (w,) = _norm_inputs(x, weight)
        y, _ = _rms_norm(x2, w, _rms_eps(x, eps))
        return y
    return torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)


# --- residual add + norm ----------------------------------------------------------------------


@KatoOp.define("add_rms_norm")
def _add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(s = x + residual, rms_norm(s), rstd) of contiguous (rows, cols) tensors."""
    rows, cols = _rows_cols(x)
    if not _use("add_rmsnorm", (rows, cols), x) or x.numel() == 0:
        s = x + residual
        y, rstd = _rms_reference(s, weight, eps)
        return s, y, rstd
    s, y, rstd = torch.empty_like(x), torch.empty_like(x), _empty_rows(x, rows)
    _run("add_rmsnorm", (rows, cols), x, [x, residual, weight, s, y, rstd, rows, cols, eps])
    return s, y, rstd


@_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    rows, _ = _rows_cols(x)
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _ = inputs
    s, _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(s, weight, rstd)


def _add_rms_norm_grad(ctx, ds, dy, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(s, weight, rstd, dy.contiguous())
    total = dx if ds is None else dx + ds
    return total, total, dw, None


# An unused sum (a block's last residual) costs no zeros and no add.
_add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup, none_ok=(0,))


@_one_answer
def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float | None = None
) -> tuple[Tensor, Tensor]:
    """``s = x + residual; (s, rms_norm(s, (cols,), weight, eps))`` in one pass (a pre-norm
    transformer block's residual stream and its normalised input)."""
    if x.shape != residual.shape or x.dim() == 0 or x.dtype not in _FLOATS:
        s = x + residual
        return s, torch.nn.functional.rms_norm(s, (s.shape[-1],), weight, eps)
    rows, cols = _rows_cols(x)
    if not torch.is_autocast_enabled("cuda") and (
        _use("add_rmsnorm", (rows, cols), x) | _use("rmsnorm_backward", (rows, cols), x)
    ):
        x2, (r, w) = _norm_inputs(x, residual, weight)
        s, y, _ = _add_rms_norm(x2, r, w, _rms_eps(x, eps))
        return s.view(x.shape), y.view(x.shape)
    s = x + residual
    return s, rms_norm(s, (cols,), weight, eps)


@KatoOp.define("add_layer_norm")
def _add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(s = x + residual, layer_norm(s), mean, rstd) of contiguous (rows, cols) tensors."""
    rows, cols = _rows_cols(x)
    if not _use("add_layernorm", (rows, cols), x) or x.numel() == 0:
        s = x + residual
        y, mean, rstd = torch.native_layer_norm(s, (cols,), weight, bias, eps)
        return s, y, mean.reshape(rows).float(), rstd.reshape(rows).float()
    s, y = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = _empty_rows(x, rows), _empty_rows(x, rows)
    _run("add_layernorm", (rows, cols), x,
         [x, residual, weight, bias, s, y, mean, rstd, rows, cols, eps])  # fmt: skip
    return s, y, mean, rstd


@_add_layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    rows, _ = _rows_cols(x)
    stats = [x.new_empty(rows, dtype=torch.float32) for _ in range(2)]
    return torch.empty_like(x), torch.empty_like(x), *stats


def _add_layer_norm_setup(ctx, inputs, output):
    _, _, weight, _, _ = inputs
    s, _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(s, weight, mean, rstd)


def _add_layer_norm_grad(ctx, ds, dy, _dmean, _drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward(s, weight, mean, rstd, dy.contiguous())
    total = dx if ds is None else dx + ds
    return total, total, dw, db, None


# An unused sum (a block's last residual) costs no zeros and no add.
_add_layer_norm.register_autograd(
    _add_layer_norm_grad, setup_context=_add_layer_norm_setup, none_ok=(0,)
)


@_one_answer
def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """``s = x + residual; (s, layer_norm(s, (cols,), weight, bias, eps))`` in one pass."""
    if x.shape != residual.shape or x.dim() == 0 or x.dtype not in _FLOATS:
        s = x + residual
        return s, torch.nn.functional.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    rows, cols = _rows_cols(x)
    if not torch.is_autocast_enabled("cuda") and (
        _use("add_layernorm", (rows, cols), x) | _use("layernorm_backward", (rows, cols), x)
    ):
        x2, (r, w, b) = _norm_inputs(x, residual, weight, bias)
        s, y, _, _ = _add_layer_norm(x2, r, w, b, float(eps))
        return s.view(x.shape), y.view(x.shape)
    s = x + residual
    return s, layer_norm(s, (cols,), weight, bias, eps)


# --- cross-entropy ----------------------------------------------------------------------------


@KatoOp.define("cross_entropy")
def _cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(loss, lse) per row of contiguous (rows, cols) logits with int64 labels: loss =
    logsumexp - logit of the label (0 where the label is ``ignore_index``); both float32."""
    rows, cols = _rows_cols(logits)
    if not _use("cross_entropy", (rows, cols), logits) or logits.numel() == 0:
        lse = torch.logsumexp(logits.float(), dim=-1)
        loss = torch.nn.functional.cross_entropy(
            logits.float(), labels, reduction="none", ignore_index=ignore_index
        )
        return loss, lse
    loss, lse = _empty_rows(logits, rows), _empty_rows(logits, rows)
    partials = torch.empty(2 * ce_model.MAX_SPLIT * rows, device=logits.device,
                           dtype=torch.float32)  # fmt: skip
    _run("cross_entropy", (rows, cols), logits,
         [logits, labels, loss, lse, partials, rows, cols, ignore_index])  # fmt: skip
    return loss, lse


@_cross_entropy.register_fake
def _(logits, labels, ignore_index):
    rows, _ = _rows_cols(logits)
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)


@KatoOp.define("cross_entropy_backward")
def _cross_entropy_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, dloss: Tensor, ignore_index: int
) -> Tensor:
    """dlogits = (softmax(logits) - onehot(label)) * dloss per row; zero rows where ignored."""
    rows, cols = _rows_cols(logits)
    if not _use("cross_entropy_backward", (rows, cols), logits) or logits.numel() == 0:
        # PyTorch's own backward in the logits' type: softmax, minus one at the label, times
        # the row's gradient (scatter and where: no host sync from boolean indexing).
        p = torch.softmax(logits, -1)
        keep = labels != ignore_index
        p.scatter_add_(1, labels.clamp(0, cols - 1)[:, None], -keep[:, None].to(p.dtype))
        return p.mul_(torch.where(keep, dloss, 0.0).to(p.dtype)[:, None])
    dlogits = torch.empty_like(logits)
    _run("cross_entropy_backward", (rows, cols), logits,
         [logits, labels, lse, dloss, dlogits, rows, cols, ignore_index])  # fmt: skip
    return dlogits


@_cross_entropy_backward.register_fake
def _(logits, labels, lse, dloss, ignore_index):
    return torch.empty_like(logits)


def _cross_entropy_setup(ctx, inputs, output):
    logits, labels, ignore_index = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, labels, lse)
    ctx.ignore_index = ignore_index


def _cross_entropy_grad(ctx, dloss, _dlse):
    logits, labels, lse = ctx.saved_tensors
    dlogits = _cross_entropy_backward(
        logits, labels, lse, dloss.float().contiguous(), ctx.ignore_index
    )
    return dlogits, None, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


@remembers_fallbacks(
    lambda input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0: (
        torch.nn.functional.cross_entropy(
            input,
            target,
            weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )
    )
)
def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``torch.nn.functional.cross_entropy``; Kato's fused log-softmax + NLL (one pass over
    each row, float32) for (rows, classes) logits with class-index targets, no class weights
    and no label smoothing."""
    if (
        input.dim() != 2
        or target.dim() != 1
        or target.dtype not in (torch.int64, torch.int32)
        or weight is not None
        or label_smoothing != 0.0
        or reduction not in ("mean", "sum", "none")
        or input.dtype not in _FLOATS
    ):
        return torch.nn.functional.cross_entropy(
            input, target, weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing,
        )  # fmt: skip
    (input,) = _autocast("float32", input)
    rows, cols = input.shape
    # Kato's backward reads the forward's logsumexp, which PyTorch's forward does not produce:
    # the pair runs on Kato's operators only where the forward is Kato's (the backward is then
    # decided on its own, PyTorch's math where it is not faster).
    forward = _use("cross_entropy", (rows, cols), input)
    _use("cross_entropy_backward", (rows, cols), input)  # decided (and recorded) here too
    if forward:
        loss, _ = _cross_entropy(input.contiguous(), target.long().contiguous(), int(ignore_index))
        if reduction == "none":
            return loss.to(input.dtype)
        total = loss.sum()
        if reduction == "sum":
            return total.to(input.dtype)
        return (total / (target != ignore_index).sum()).to(input.dtype)
    return torch.nn.functional.cross_entropy(
        input, target, ignore_index=ignore_index, reduction=reduction
    )


# --- ReLU -------------------------------------------------------------------------------------


def _relu_masked(n: int, t: Tensor) -> bool:
    """Whether the tuned relu config for n elements saves a bit mask (else x) for backward."""
    return bool(bind("relu", (n,), _DTYPES[t.dtype], t.device.index).config.get("MASK", 1))


@KatoOp.define("relu")
def _relu(x: Tensor) -> tuple[Tensor, Tensor]:
    """(y, mask) of a contiguous x: mask holds ceil(n/32) int32 words, bit i of word w set where
    element 32w + i is positive (bitmask configs; zeros for plain configs and off the GPU)."""
    n = x.numel()
    words = (n + 31) // 32
    if not x.is_cuda or n == 0:
        return torch.relu(x), torch.zeros(words, device=x.device, dtype=torch.int32)
    # A plain config writes no mask: zeros, so the output is defined either way.
    masked = _relu_masked(n, x)
    mask = (
        torch.empty(words, device=x.device, dtype=torch.int32)
        if masked
        else torch.zeros(words, device=x.device, dtype=torch.int32)
    )
    y = torch.empty_like(x)
    args = [x, None, y, mask, None, n]
    # x may be a contiguous view a few elements into its storage: _run binds a narrower VEC of
    # the same config there, the same MASK (narrowing never invalidates a relu config).
    _run("relu", (n,), x, args, steps=[0])
    return y, mask


@_relu.register_fake
def _(x):
    return torch.empty_like(x), x.new_empty((x.numel() + 31) // 32, dtype=torch.int32)


@KatoOp.define("relu_backward")
def _relu_backward(x: Tensor, mask: Tensor, dy: Tensor) -> Tensor:
    """dx = dy where the forward's input was positive: from the bit mask (bitmask configs) or
    from x (plain configs; ``x`` is empty otherwise)."""
    n = dy.numel()
    if not dy.is_cuda or n == 0:
        return torch.where(x > 0, dy, torch.zeros((), dtype=dy.dtype, device=dy.device))
    dx = torch.empty_like(dy)
    masked = _relu_masked(n, dy)
    args = [None, dy, None, mask, dx, n] if masked else [x, dy, None, None, dx, n]
    _run("relu", (n,), dy, args, steps=[1])  # dy or x may be a view off a vector boundary
    return dx


@_relu_backward.register_fake
def _(x, mask, dy):
    return torch.empty_like(dy)


def _relu_setup(ctx, inputs, output):
    (x,) = inputs
    _, mask = output
    ctx.mark_non_differentiable(mask)
    # A bitmask config's backward reads 1 bit per element: x itself need not be kept alive.
    keep_x = not x.is_cuda or x.numel() == 0 or not _relu_masked(x.numel(), x)
    ctx.save_for_backward(x if keep_x else x.new_empty(0), mask)


def _relu_grad(ctx, dy, _dmask):
    x, mask = ctx.saved_tensors
    return _relu_backward(x, mask, dy.contiguous())


_relu.register_autograd(_relu_grad, setup_context=_relu_setup)


@remembers_fallbacks(lambda x, inplace=False: torch.relu_(x) if inplace else torch.relu(x))
def relu(x: Tensor, inplace: bool = False) -> Tensor:
    """``torch.relu``; Kato's ReLU, whose tuned variant saves a 1-bit-per-element mask for the
    backward pass instead of x. ``inplace=True`` runs PyTorch's in-place ReLU."""
    if inplace or x.dtype not in _FLOATS or x.numel() == 0:
        return torch.relu_(x) if inplace else torch.relu(x)
    # A 4-d input is laid out as a convolution's activation would be (_relayout).
    relayout = _relayout(x) if x.dim() == 4 else not x.is_contiguous()
    if _use("relu", (x.numel(),), x, relayout):
        y, _ = _relu(x.contiguous())
        return y.view(x.shape)
    return torch.relu(x)


# --- batch norm (training) -------------------------------------------------------------------


def _bn_forward_buffers(x: Tensor) -> tuple[Tensor, ...]:
    """(mean, invstd, new running mean, new running var, workspace, counters) of Kato's batch
    norm forwards on NCHW ``x``: float32 per channel, the kernels' workspace, and the
    last-block counters (uint32 zeros)."""
    c = x.shape[1]
    stats = [x.new_empty(c, dtype=torch.float32) for _ in range(4)]
    workspace = x.new_empty(bn_forward.workspace_floats(c), dtype=torch.float32)
    return (*stats, workspace, torch.zeros(c + 1, device=x.device, dtype=torch.int32))


def _bn_backward_buffers(x: Tensor) -> tuple[Tensor, Tensor]:
    """(workspace, counters) of Kato's batch norm backwards on NCHW ``x``."""
    c = x.shape[1]
    workspace = x.new_empty(bn_backward.workspace_floats(c), dtype=torch.float32)
    return workspace, torch.zeros(c + 1, device=x.device, dtype=torch.int32)


@KatoOp.define("batch_norm")
def _batch_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    momentum: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training-mode (y, mean, invstd, new running_mean, new running_var) of a contiguous
    NCHW x; weight, bias and the running statistics float32 (the variance's update unbiased),
    and so are mean and invstd. Functional (autograd needs it): the caller copies the new
    running statistics into its buffers."""
    n, c, h, w = x.shape
    if not _use("batchnorm", (n, c, h, w), x) or x.numel() == 0:
        new_mean, new_var = running_mean.clone(), running_var.clone()
        y, mean, invstd = torch.native_batch_norm(
            x, weight, bias, new_mean, new_var, True, momentum, eps
        )
        return y, mean.float(), invstd.float(), new_mean, new_var
    y = torch.empty_like(x)
    mean, invstd, new_mean, new_var, workspace, counters = _bn_forward_buffers(x)
    _run("batchnorm", (n, c, h, w), x,
         [x, weight, bias, running_mean, running_var, y, mean, invstd, new_mean, new_var,
          workspace, counters, n, c, h * w, eps, momentum])  # fmt: skip
    return y, mean, invstd, new_mean, new_var


@_batch_norm.register_fake
def _(x, weight, bias, running_mean, running_var, eps, momentum):
    c = x.shape[1]
    return torch.empty_like(x), *(x.new_empty(c, dtype=torch.float32) for _ in range(4))


@KatoOp.define("batch_norm_backward")
def _batch_norm_backward(
    x: Tensor, dy: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of training-mode batch norm from the forward's saved statistics."""
    n, c, h, w = x.shape
    if not _use("batchnorm_backward", (n, c, h, w), x) or x.numel() == 0:
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean, invstd, True, eps, (True, True, True)
        )
        return dx, dw.float(), db.float()
    dx, dw, db = torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)
    workspace, counters = _bn_backward_buffers(x)
    _run("batchnorm_backward", (n, c, h, w), x,
         [x, dy, mean, invstd, weight, dx, dw, db, workspace, counters, n, c, h * w])  # fmt: skip
    return dx, dw, db


@_batch_norm_backward.register_fake
def _(x, dy, mean, invstd, weight, eps):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _batch_norm_setup(ctx, inputs, output):
    x, weight, _, _, _, eps, _ = inputs
    _, mean, invstd, new_mean, new_var = output
    ctx.mark_non_differentiable(mean, invstd, new_mean, new_var)
    ctx.save_for_backward(x, mean, invstd, weight)
    ctx.eps = eps


def _batch_norm_grad(ctx, dy, _dmean, _dinvstd, _dnew_mean, _dnew_var):
    x, mean, invstd, weight = ctx.saved_tensors
    dx, dw, db = _batch_norm_backward(x, dy.contiguous(), mean, invstd, weight, ctx.eps)
    return dx, dw, db, None, None, None, None


_batch_norm.register_autograd(_batch_norm_grad, setup_context=_batch_norm_setup)


def _relayout(*tensors: Tensor | None) -> bool:
    """Whether Kato's batch-norm kernels, written for NCHW-contiguous activations, would need
    ``tensors`` copied into that layout (and their output copied back): a tensor that is not
    contiguous (channels-last, where cuDNN's own kernels take it as it is), eagerly or traced;
    in a ``torch.compile`` graph also whenever Inductor's layout optimisation is on, since it
    makes the activations of a graph with convolutions channels-last after tracing (traced
    strides are eager's) and copies them around a custom op that keeps its traced strides."""
    # The tensors first: a channels-last model compiled with the optimisation off keeps them.
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return True
    return torch.compiler.is_compiling() and _inductor_relayouts()


@torch.compiler.assume_constant_result
def _inductor_relayouts() -> bool:
    """Inductor's ``layout_optimization`` setting (on unless ``TORCHINDUCTOR_LAYOUT_OPTIMIZATION
    =0``); a constant for the trace."""
    from torch._inductor import config

    return bool(config.layout_optimization)


@remembers_fallbacks(torch.nn.functional.batch_norm, ignore=("momentum", "eps"))
def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """``torch.nn.functional.batch_norm``; Kato's kernels for training-mode NCHW batch norm
    with affine parameters and running statistics (Welford statistics, float32 parameters
    and accumulation; the running statistics updated in place)."""
    if (
        not training
        or input.dim() != 4
        or weight is None
        or bias is None
        or running_mean is None
        or running_var is None
        or input.dtype not in _FLOATS
    ):
        return torch.nn.functional.batch_norm(
            input, running_mean, running_var, weight, bias, training, momentum, eps
        )
    shape = tuple(input.shape)
    relayout = _relayout(input)
    if not (
        _use("batchnorm", shape, input, relayout)
        | _use("batchnorm_backward", shape, input, relayout)
    ):
        return torch.nn.functional.batch_norm(
            input, running_mean, running_var, weight, bias, training, momentum, eps
        )
    # Kato's statistics and parameters are float32 whatever the data's type (as cuDNN's).
    y, _, _, new_mean, new_var = _batch_norm(
        input.contiguous(), weight.float(), bias.float(), running_mean.float(),
        running_var.float(), float(eps), float(momentum),
    )  # fmt: skip
    with torch.no_grad():
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return y


# --- batch norm + relu (training), and + residual add + relu -----------------------------------


def _unfused_bn_relu(x, weight, bias, running_mean, running_var, eps, momentum, residual):
    """torch's unfused sequence on the running statistics' copies: native_batch_norm, then the
    add, then relu (as a model runs them); (y, mean, invstd, new_mean, new_var)."""
    new_mean, new_var = running_mean.clone(), running_var.clone()
    y, mean, invstd = torch.native_batch_norm(
        x, weight, bias, new_mean, new_var, True, momentum, eps
    )
    if residual is not None:
        y = y + residual
    return torch.relu(y), mean.float(), invstd.float(), new_mean, new_var


@KatoOp.define("batch_norm_relu")
def _batch_norm_relu(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    momentum: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training-mode (relu(bn(x) [+ residual]), mean, invstd, new running_mean, new
    running_var) of a contiguous NCHW x (residual: x's shape and type, contiguous, or None);
    as :func:`_batch_norm` otherwise. Kato's ``batchnorm_relu`` / ``batchnorm_add_relu`` where
    the policy picks it, else torch's unfused sequence."""
    n, c, h, w = x.shape
    operator = "batchnorm_relu" if residual is None else "batchnorm_add_relu"
    if not _use(operator, (n, c, h, w), x) or x.numel() == 0:
        return _unfused_bn_relu(x, weight, bias, running_mean, running_var, eps, momentum,
                                residual)  # fmt: skip
    y = torch.empty_like(x)
    mean, invstd, new_mean, new_var, workspace, counters = _bn_forward_buffers(x)
    inputs = [x] if residual is None else [x, residual]
    _run(operator, (n, c, h, w), x,
         [*inputs, weight, bias, running_mean, running_var, y, mean, invstd, new_mean, new_var,
          workspace, counters, n, c, h * w, eps, momentum])  # fmt: skip
    return y, mean, invstd, new_mean, new_var


@_batch_norm_relu.register_fake
def _(x, residual, weight, bias, running_mean, running_var, eps, momentum):
    c = x.shape[1]
    return torch.empty_like(x), *(x.new_empty(c, dtype=torch.float32) for _ in range(4))


def _unfused_bn_relu_backward(x, dy, y, mean, invstd, weight, eps):
    """torch's unfused backward: threshold_backward on relu's output y, then
    native_batch_norm_backward; (dx, dweight, dbias, g)."""
    g = torch.ops.aten.threshold_backward(dy, y, 0)
    dx, dw, db = torch.ops.aten.native_batch_norm_backward(
        g, x, weight, None, None, mean, invstd, True, eps, (True, True, True)
    )
    return dx, dw.float(), db.float(), g


@KatoOp.define("batch_norm_relu_backward")
def _batch_norm_relu_backward(
    x: Tensor,
    dy: Tensor,
    y: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of y = relu(bn(x)). Kato's kernel recomputes relu's mask from x
    (it does not read y); torch's sequence (the fallback) takes it from y."""
    n, c, h, w = x.shape
    if not _use("batchnorm_relu_backward", (n, c, h, w), x) or x.numel() == 0:
        return _unfused_bn_relu_backward(x, dy, y, mean, invstd, weight, eps)[:3]
    dx, dw, db = torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)
    workspace, counters = _bn_backward_buffers(x)
    _run("batchnorm_relu_backward", (n, c, h, w), x,
         [x, dy, mean, invstd, weight, bias, dx, dw, db, workspace, counters, n, c,
          h * w])  # fmt: skip
    return dx, dw, db


@_batch_norm_relu_backward.register_fake
def _(x, dy, y, mean, invstd, weight, bias, eps):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


@KatoOp.define("batch_norm_add_relu_backward")
def _batch_norm_add_relu_backward(
    x: Tensor, dy: Tensor, y: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias, dresidual) of y = relu(bn(x) + residual), relu's mask from y."""
    n, c, h, w = x.shape
    if not _use("batchnorm_add_relu_backward", (n, c, h, w), x) or x.numel() == 0:
        return _unfused_bn_relu_backward(x, dy, y, mean, invstd, weight, eps)
    dx, dres = torch.empty_like(x), torch.empty_like(x)
    dw, db = torch.empty_like(weight), torch.empty_like(weight)
    workspace, counters = _bn_backward_buffers(x)
    _run("batchnorm_add_relu_backward", (n, c, h, w), x,
         [x, dy, y, mean, invstd, weight, dx, dw, db, dres, workspace, counters, n, c,
          h * w])  # fmt: skip
    return dx, dw, db, dres


@_batch_norm_add_relu_backward.register_fake
def _(x, dy, y, mean, invstd, weight, eps):
    return (torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight),
            torch.empty_like(x))  # fmt: skip


def _batch_norm_relu_setup(ctx, inputs, output):
    x, residual, weight, bias, _, _, eps, _ = inputs
    y, mean, invstd, new_mean, new_var = output
    ctx.mark_non_differentiable(mean, invstd, new_mean, new_var)
    # y: relu's mask for torch's backward (and Kato's add-relu kernel); the next layer holds it
    # anyway, so saving it costs no memory.
    ctx.save_for_backward(x, y, mean, invstd, weight, bias)
    ctx.eps = eps
    ctx.residual = residual is not None


def _batch_norm_relu_grad(ctx, dy, _dmean, _dinvstd, _dnew_mean, _dnew_var):
    x, y, mean, invstd, weight, bias = ctx.saved_tensors
    dy = dy.contiguous()
    if ctx.residual:
        dx, dw, db, dres = _batch_norm_add_relu_backward(x, dy, y, mean, invstd, weight, ctx.eps)
    else:
        dx, dw, db = _batch_norm_relu_backward(x, dy, y, mean, invstd, weight, bias, ctx.eps)
        dres = None
    return dx, dres, dw, db, None, None, None, None


_batch_norm_relu.register_autograd(_batch_norm_relu_grad, setup_context=_batch_norm_relu_setup)


def _torch_batch_norm_relu(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    residual: Tensor | None = None,
) -> Tensor:
    """torch's own ``relu(batch_norm(input, ...) [+ residual])``: what the unfused model runs."""
    y = torch.nn.functional.batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps
    )
    if residual is not None:
        y = y + residual
    return torch.relu(y)


@remembers_fallbacks(_torch_batch_norm_relu, ignore=("momentum", "eps"))
def batch_norm_relu(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    residual: Tensor | None = None,
) -> Tensor:
    """``relu(torch.nn.functional.batch_norm(input, ...) + residual)`` (no add where
    ``residual`` is None) in one pass each way: Kato's ``batchnorm_relu`` /
    ``batchnorm_add_relu`` forward and their backwards for training-mode NCHW batch norm with
    affine parameters and running statistics (updated in place), where the policy picks them;
    torch's unfused sequence otherwise (other arguments, a residual of another shape or type,
    CPU tensors), which gives exactly the unfused model's values and gradients.

    Kato's forward rounds as torch's sequence does (bn(x) to the element type, then the sum);
    its ``batchnorm_relu`` backward recomputes relu's mask from x, which can differ from the
    forward's where bn(x) is within float32 rounding of 0 (relu's gradient is ambiguous
    there)."""
    if (
        not training
        or input.dim() != 4
        or weight is None
        or bias is None
        or running_mean is None
        or running_var is None
        or input.dtype not in _FLOATS
        or (
            residual is not None
            and (residual.shape != input.shape or residual.dtype != input.dtype)
        )
    ):
        return _torch_batch_norm_relu(
            input, running_mean, running_var, weight, bias, training, momentum, eps, residual
        )
    shape = tuple(input.shape)
    forward = "batchnorm_relu" if residual is None else "batchnorm_add_relu"
    relayout = _relayout(input, residual)
    if not (
        _use(forward, shape, input, relayout) | _use(f"{forward}_backward", shape, input, relayout)
    ):
        return _torch_batch_norm_relu(
            input, running_mean, running_var, weight, bias, training, momentum, eps, residual
        )
    y, _, _, new_mean, new_var = _batch_norm_relu(
        input.contiguous(), None if residual is None else residual.contiguous(), weight.float(),
        bias.float(), running_mean.float(), running_var.float(), float(eps), float(momentum),
    )  # fmt: skip
    with torch.no_grad():
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return y


# --- matmul and linear ------------------------------------------------------------------------

#: Kato's GEMM operator per layout: C = A @ B ("nn"), A @ B^T ("nt"), A^T @ B ("tn").
_LAYOUTS = {"nn": "matmul", "nt": "matmul_nt", "tn": "matmul_tn"}


def _mnk(a: Tensor, b: Tensor, layout: str) -> tuple[int, int, int]:
    if layout == "nn":
        return a.shape[0], b.shape[1], a.shape[1]
    if layout == "nt":
        return a.shape[0], b.shape[0], a.shape[1]
    return a.shape[1], b.shape[1], a.shape[0]


def _torch_mm(a: Tensor, b: Tensor, layout: str) -> Tensor:
    if layout == "nn":
        return a @ b
    if layout == "nt":
        return a @ b.t()
    return a.t() @ b


@KatoOp.define("mm")
def _mm(a: Tensor, b: Tensor, layout: str) -> Tensor:
    """C (M, N) of contiguous row-major operands in ``layout`` (see :data:`_LAYOUTS`)."""
    m, n, k = _mnk(a, b, layout)
    operator = _LAYOUTS[layout]
    if not _use(operator, (m, n, k), a) or a.numel() == 0 or b.numel() == 0:
        return _torch_mm(a, b, layout)
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    _run(operator, (m, n, k), a, [a, b, c, m, n, k])
    return c


@_mm.register_fake
def _(a, b, layout):
    m, n, _ = _mnk(a, b, layout)
    return a.new_empty((m, n))


def _mm_setup(ctx, inputs, output):
    a, b, layout = inputs
    ctx.save_for_backward(a, b)
    ctx.layout = layout


def _mm_grad(ctx, dc):
    a, b = ctx.saved_tensors
    dc = dc.contiguous()
    mm = _mm
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.layout == "nn":  # C = A B
        da = mm(dc, b, "nt") if need_a else None
        db = mm(a, dc, "tn") if need_b else None
    elif ctx.layout == "nt":  # C = A B^T
        da = mm(dc, b, "nn") if need_a else None
        db = mm(dc, a, "tn") if need_b else None
    else:  # C = A^T B
        da = mm(b, dc, "nt") if need_a else None
        db = mm(a, dc, "nn") if need_b else None
    return da, db, None


_mm.register_autograd(_mm_grad, setup_context=_mm_setup)


def _mm_uses_kato(a: Tensor, b: Tensor, layout: str) -> bool:
    """Whether any of the three GEMMs of this product's forward and backward runs Kato's."""
    m, n, k = _mnk(a, b, layout)
    backward = {"nn": (("nt", (m, k, n)), ("tn", (k, n, m))),
                "nt": (("nn", (m, k, n)), ("tn", (n, k, m))),
                "tn": (("nt", (k, m, n)), ("nn", (k, n, m)))}[layout]  # fmt: skip
    uses = _use(_LAYOUTS[layout], (m, n, k), a)
    for other, shape in backward:
        uses |= _use(_LAYOUTS[other], shape, a)
    return uses


@remembers_fallbacks(lambda a, b: torch.matmul(a, b))
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul`` of 2-D tensors of one dtype: Kato's GEMM (float32 on CUDA cores, no
    TF32; float16/bfloat16 on tensor cores with float32 accumulation), backward without
    materialised transposes where Kato has the transposed layouts."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype not in _FLOATS or b.dtype not in _FLOATS:
        return torch.matmul(a, b)
    # Cast first: under autocast, operands of different types (bf16 activations, float32
    # weights) are one type afterwards, as torch's autocast makes them.
    a, b = _autocast("lower", a, b)
    if a.dtype != b.dtype or a.shape[1] != b.shape[0] or not _mm_uses_kato(a, b, "nn"):
        return torch.matmul(a, b)
    return _mm(a.contiguous(), b.contiguous(), "nn")


#: Elements per 16 bytes of a 16-bit type: tensor-core GEMMs (cuBLAS's and Kato's) need rows
#: that start 16-byte aligned; an odd leading dimension falls back to far slower kernels.
_ALIGN = 8
#: Padding pays where the GEMM's work is large against the copies it adds (the weight, and
#: the output's gradient once): m*k / (k + 3m) estimates that ratio (see :func:`_pads_output`).
_PAD_MIN_RATIO = 160


def _pads_output(x2: Tensor, weight: Tensor) -> bool:
    """Whether ``linear`` should pad the output dim (``weight``'s rows) to :data:`_ALIGN`: a
    16-bit CUDA GEMM whose out_features is not a multiple of 8 (a vocabulary of 50257: cuBLAS
    then runs at 92-137 TFLOP/s instead of 650-710 on the H200, docs/results_h200.md) and whose
    size makes the extra copies cheap against what the aligned GEMM saves. The input's rows
    must be aligned already (in_features a multiple of 8). Policy ``"torch"`` for the GEMM
    (``matmul_nt``) means PyTorch's own op exactly: no padding."""
    m, k = x2.shape
    n = weight.shape[0]
    return (
        _policy.policy_for("matmul_nt") != "torch"
        and x2.is_cuda
        and x2.dtype in (torch.float16, torch.bfloat16)
        and n % _ALIGN != 0
        and k % _ALIGN == 0
        and m * k >= _PAD_MIN_RATIO * (k + 3 * m)
    )


def _padded_linear(x: Tensor, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear`` through a weight padded with zero rows to a multiple of 8: the output is a
    view of the aligned product (rows padded), and autograd's backward of the pad and the view
    keeps every GEMM of the backward aligned too (dX and dW of the padded problem)."""
    chose_kato()  # the padding is kato_torch's, whichever GEMM runs the padded product
    n = weight.shape[0]
    extra = -n % _ALIGN
    w = torch.nn.functional.pad(weight, (0, 0, 0, extra))
    b = None if bias is None else torch.nn.functional.pad(bias, (0, extra))
    y = linear(x2, w, b)[:, :n]
    return y.reshape(*x.shape[:-1], n)


@remembers_fallbacks(torch.nn.functional.linear)
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``torch.nn.functional.linear``: ``x @ weight^T + bias`` with Kato's A B^T GEMM over the
    flattened leading dims of x."""
    if x.dim() == 0 or weight.dim() != 2 or x.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        return torch.nn.functional.linear(x, weight, bias)
    x, weight, bias = _autocast("lower", x, weight, bias)  # first: see matmul
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x.shape[-1] == weight.shape[1] and _pads_output(x2, weight):
        return _padded_linear(x, x2, weight, bias)
    if x.shape[-1] != weight.shape[1] or not _mm_uses_kato(x2, weight, "nt"):
        return torch.nn.functional.linear(x, weight, bias)
    y = _mm(x2.contiguous(), weight.contiguous(), "nt")
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


# --- transpose --------------------------------------------------------------------------------


@KatoOp.define("transpose")
def _transpose(x: Tensor) -> Tensor:
    """A contiguous (cols, rows) copy of a contiguous (rows, cols) tensor."""
    rows, cols = x.shape
    if not _use("transpose", (rows, cols), x) or x.numel() == 0:
        # A copy even where x.t() is already contiguous (a row or a column): a custom op's
        # output may not alias its input.
        return x.t().clone(memory_format=torch.contiguous_format)
    y = torch.empty((cols, rows), device=x.device, dtype=x.dtype)
    _run("transpose", (rows, cols), x, [x, y, rows, cols])
    return y


@_transpose.register_fake
def _(x):
    return x.new_empty((x.shape[1], x.shape[0]))


def _transpose_setup(ctx, inputs, output):
    pass


def _transpose_grad(ctx, dy):
    return _transpose(dy.contiguous())


_transpose.register_autograd(_transpose_grad, setup_context=_transpose_setup)


@_one_answer
def transpose(x: Tensor) -> Tensor:
    """A contiguous transpose of a 2-D tensor, like ``x.t().contiguous()``."""
    if x.dim() != 2:
        raise ValueError(f"kato_torch.transpose takes a 2-D tensor, got {x.dim()} dimensions")
    if x.dtype in _DTYPES and _use("transpose", tuple(x.shape), x):
        return _transpose(x.contiguous())
    return x.t().contiguous()


__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "batch_norm_relu",
    "cross_entropy",
    "layer_norm",
    "layernorm",
    "linear",
    "matmul",
    "relu",
    "rms_norm",
    "softmax",
    "transpose",
]
