"""PyTorch's own op for every built-in operator, run on an operator's problem, checked against
its float64 references and timed the way Kato times a kernel.

The one module of Kato's packages that imports torch at module level
(``tests/test_torch_isolation.py`` names it): nothing imports it but :mod:`tuner.framework`'s
measuring child, the benchmarks' torch side (``benchmarks/torch_ops``) and tests, each only
where torch is wanted.

Each operator has an :class:`Equivalent` in :data:`EQUIVALENTS`: ``prepare`` takes the problem's
arguments as torch values (:func:`as_torch`: the spec's ``Problem.args`` in order, the order
each ``kernels/<op>/__init__.py`` lists under "Kernel arguments"; arrays become tensors on the
device, numpy scalars Python numbers) and returns what torch's op reads, including what
torch's forward would have saved for a backward op (untimed); ``run`` calls torch's op on it
(timed) and returns one value per ``Problem.outputs`` entry: the tensor torch computes for that
output, or None where torch's op does not produce it (Kato's cross_entropy also writes the
row's logsumexp). Backward ops call the ATen op autograd runs for them (``native_layer_norm_
backward``, ``_softmax_backward_data``...), not the autograd engine, whose host time is not
the GPU's. Adding an operator is one entry.

:func:`check_outputs` compares with the references by Kato's rule (``|out - ref| <= atol + rtol
* |ref|``, or equal; NaN and inf fail; integers exact) at the problem's tolerances, widened by
two roundings of torch's output type where it is narrower than Kato's output (torch returns a
bfloat16 loss for bfloat16 logits, Kato a float32 one: the loss and the log-softmax it is read
from are each rounded), and by what an equivalent's ``extra_rtol`` says torch's algorithm loses
(cross_entropy's backward reads a log-softmax saved in the logits' type). :func:`time_calls` is
:meth:`tuner.backends.pycuda.PyCudaBackend.time` for torch: CUDA events around batches of
calls (about 1 ms, at most 200), each batch queued behind ``torch.cuda._sleep`` for twice the
host's time to queue it, rotating over enough input copies that a batch streams twice the L2,
the per-call time of each batch; :func:`measure` puts it together.

:func:`measure_compiled` does the same for the equivalent's ``run`` compiled by
``torch.compile`` (:func:`compile_equivalent`: Inductor, default mode, ``dynamic=False``,
``fullgraph`` unless dynamo must break the graph), the compiled baseline: what Inductor runs in
place of Kato's op inside a compiled graph. ``prepare`` stays outside the compiled function,
as it stays outside the timing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kato.kernels.layernorm import EPS as LAYERNORM_EPS
from kato.kernels.spec import OperatorSpec, Problem
from kato.tuner.framework import MISMATCH, OK, SKIPPED, FrameworkResult

from kato.shared.gpus import find_gpu, normalize_gpu_name

#: A torch value of a problem argument: a tensor (arrays) or a Python number (scalars).
Value = Any

#: Per-call batches, as Kato's timer: long enough that event resolution and launch gaps vanish.
BATCH_TARGET_MS = 1.0
MAX_BATCH = 200
MAX_COPIES = MAX_BATCH
SPIN_FACTOR = 2.0
SPIN_MARGIN_MS = 0.05
SPIN_RETRIES = 3
#: L2 assumed for a GPU the catalog does not list (the largest supported: H200, 60 MiB).
DEFAULT_L2_BYTES = 64 << 20


@dataclass(frozen=True)
class Equivalent:
    """Torch's op for one operator. ``what`` says what ``run`` calls; ``cuda_only`` marks ops
    torch implements for CUDA tensors only (``batch_norm_stats``)."""

    run: Callable[[Any], Sequence[Any]]
    what: str
    prepare: Callable[[list[Value]], Any] = tuple
    cuda_only: bool = False
    #: Relative error torch's algorithm may add beyond Kato's tolerance, from the problem and
    #: dtype (None: none beyond the rounding of a narrower output type, see check_outputs).
    extra_rtol: Callable[[Problem, str], float] | None = None


def _ce_backward_state(a: list[Value]) -> tuple[Any, ...]:
    """What autograd holds for cross_entropy's backward: the log-softmax output (in the logits'
    type, as torch's forward saved it), the labels, dloss in the loss's type (the logits')."""
    logits, labels, lse, dloss, _dx, _rows, _cols, ignore = a
    logp = (logits.float() - lse[:, None]).to(logits.dtype)
    total_weight = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return dloss.to(logits.dtype), logp, labels, ignore, total_weight


def _batchnorm(s: tuple[Any, ...]) -> tuple[Any, ...]:
    """Training batch norm as F.batch_norm runs it; the running statistics are updated in
    place, and are outputs."""
    x, weight, bias, running_mean, running_var, momentum, eps = s
    y, mean, invstd, _, _ = torch._batch_norm_impl_index(
        x, weight, bias, running_mean, running_var, True, momentum, eps,
        torch.backends.cudnn.enabled,
    )  # fmt: skip
    return y, mean, invstd, running_mean, running_var


def _batchnorm_backward_state(a: list[Value]) -> tuple[Any, ...]:
    """What autograd holds for batch norm's backward: the forward's implementation (cuDNN or
    native: its index and reserve space, from one forward on x, untimed) and Kato's saved mean
    and invstd, as the backward reads them."""
    x, dy, mean, invstd, weight = a[:5]
    *_, reserve, impl = torch._batch_norm_impl_index(
        x, weight, torch.zeros_like(weight), None, None, True, 0.1, 1e-5,
        torch.backends.cudnn.enabled,
    )  # fmt: skip
    mask = [True, True, True]
    return impl, x, dy, weight, None, None, mean, invstd, True, 1e-5, mask, reserve


def _batchnorm_relu(s: tuple[Any, ...]) -> tuple[Any, ...]:
    """torch's unfused batch norm + [add +] relu, as a model runs them (F.batch_norm's
    implementation, then ``y + residual``, then ``relu``)."""
    *bn, residual = s
    y, mean, invstd, running_mean, running_var = _batchnorm(tuple(bn))
    if residual is not None:
        y = y + residual
    return torch.relu(y), mean, invstd, running_mean, running_var


def _batchnorm_relu_backward_state(a: list[Value], residual: bool) -> tuple[Any, ...]:
    """What autograd holds for the unfused sequence's backward: relu's output y (the problem's
    own for the add variant; else relu of one untimed forward on x with weight and bias), and
    batch norm's implementation and reserve with Kato's saved mean and invstd (as
    :func:`_batchnorm_backward_state`)."""
    if residual:
        x, dy, y, mean, invstd, weight = a[:6]
        bias = torch.zeros_like(weight)
    else:
        x, dy, mean, invstd, weight, bias = a[:6]
    out, _, _, reserve, impl = torch._batch_norm_impl_index(
        x, weight, bias, None, None, True, 0.1, 1e-5, torch.backends.cudnn.enabled,
    )  # fmt: skip
    if not residual:
        y = torch.relu(out)
    mask = [True, True, True]
    return y, (impl, x, dy, weight, None, None, mean, invstd, True, 1e-5, mask, reserve), residual


def _batchnorm_relu_backward(s: tuple[Any, ...]) -> tuple[Any, ...]:
    """threshold_backward on relu's output, then batch norm's backward of that gradient (and
    the gradient itself: the residual's, for the add variant)."""
    y, (impl, x, dy, *rest), residual = s
    g = torch.ops.aten.threshold_backward(dy, y, 0)
    dx, dw, db = torch.ops.aten._batch_norm_impl_index_backward(impl, x, g, *rest)
    return (dx, dw, db, g) if residual else (dx, dw, db)


def _ce_backward_rtol(problem: Problem, dtype: str) -> float:
    """Torch saves the log-softmax in the logits' type: an error of ``u * |logp|`` in logp is
    one of ``u * |logp|`` relative in ``p = exp(logp)``, so in dlogits; plus dloss and the
    output rounded to that type (u: the type's unit roundoff)."""
    u = _unit_roundoff(torch_dtype(problem.args[0].dtype))
    if not u or u <= _unit_roundoff(torch.float32):
        return 0.0
    logits = np.asarray(problem.args[0], np.float64)
    lse = np.asarray(problem.args[2], np.float64)
    worst = float(np.max(np.abs(logits - lse[:, None]), initial=0.0))
    return u * (worst + 2)


def _layernorm_relu(s: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """relu(layer_norm(x)) as eager PyTorch runs it: native_layer_norm, then relu."""
    y, mean, rstd = torch.native_layer_norm(s[0], (s[7],), s[1], s[2], s[8])
    return torch.relu(y), mean, rstd


def _layernorm_relu_backward_state(a: list[Value]) -> tuple[Any, ...]:
    """What autograd holds for relu(layer_norm(x))'s backward: relu's output (from one forward
    on x, weight and bias, untimed) for threshold_backward, then layer norm's x, Kato's saved
    mean and rstd, weight and bias."""
    x, weight, bias, mean, rstd, dy = a[:6]
    cols = a[12]
    y = torch.relu(torch.native_layer_norm(x, (cols,), weight, bias, LAYERNORM_EPS)[0])
    return dy, y, x, [cols], *_saved_stats(x, mean, rstd), weight, bias


def _layernorm_relu_backward(s: tuple[Any, ...]) -> tuple[Any, ...]:
    dy, y, x, shape, mean, rstd, weight, bias = s
    g = torch.ops.aten.threshold_backward(dy, y, 0)
    return torch.ops.aten.native_layer_norm_backward(
        g, x, shape, mean, rstd, weight, bias, [True, True, True]
    )


def _ce_backward(s: tuple[Any, ...]) -> tuple[Any]:
    dloss, logp, labels, ignore, total_weight = s
    grad = torch.ops.aten.nll_loss_backward(dloss, logp, labels, None, 0, ignore, total_weight)
    return (torch.ops.aten._log_softmax_backward_data(grad, logp, 1, logp.dtype),)


EQUIVALENTS: dict[str, Equivalent] = {
    # args: x, y, rows, cols
    "softmax": Equivalent(lambda s: (torch.softmax(s[0], dim=-1),), "torch.softmax(x, dim=-1)"),
    # args: y, dy, dx, rows, cols
    "softmax_backward": Equivalent(
        lambda s: (torch.ops.aten._softmax_backward_data(s[1], s[0], -1, s[0].dtype),),
        "torch._softmax_backward_data(dy, y, -1, dtype)",
    ),
    # args: x, weight, bias, y, mean, rstd, rows, cols, eps
    "layernorm": Equivalent(
        lambda s: torch.native_layer_norm(s[0], (s[7],), s[1], s[2], s[8]),
        "torch.native_layer_norm(x, (cols,), weight, bias, eps)",
    ),
    # args: x, weight, mean, rstd, dy, dx, dweight, dbias, partials, nparts, rows, cols
    "layernorm_backward": Equivalent(
        lambda s: torch.ops.aten.native_layer_norm_backward(*s, [True, True, True]),
        "torch.ops.aten.native_layer_norm_backward(dy, x, (cols,), mean, rstd, weight, bias)",
        prepare=lambda a: (
            a[4],
            a[0],
            [a[11]],
            *_saved_stats(a[0], a[2], a[3]),
            a[1],
            torch.zeros_like(a[1]),
        ),
    ),
    # args: x, weight, bias, y, mean, rstd, rows, cols, eps
    "layernorm_relu": Equivalent(
        _layernorm_relu,
        "torch.native_layer_norm(x, (cols,), weight, bias, eps), then torch.relu(y)",
    ),
    # args: x, weight, bias, mean, rstd, dy, dx, dweight, dbias, partials, nparts, rows, cols
    "layernorm_relu_backward": Equivalent(
        _layernorm_relu_backward,
        "g = threshold_backward(dy, relu's y, 0); native_layer_norm_backward(g, x, (cols,), "
        "mean, rstd, weight, bias)",
        prepare=_layernorm_relu_backward_state,
    ),
    # args: x, weight, y, rstd, rows, cols, eps
    "rmsnorm": Equivalent(
        lambda s: torch._fused_rms_norm(s[0], [s[5]], s[1], s[6]),
        "torch._fused_rms_norm(x, [cols], weight, eps) (F.rms_norm on CUDA)",
    ),
    # args: x, weight, rstd, dy, dx, dweight, partials, nparts, rows, cols
    "rmsnorm_backward": Equivalent(
        lambda s: torch.ops.aten._fused_rms_norm_backward(*s, [True, True]),
        "torch.ops.aten._fused_rms_norm_backward(dy, x, [cols], rstd, weight)",
        prepare=lambda a: (a[3], a[0], [a[9]], a[2].view(-1, 1), a[1]),
        cuda_only=True,
    ),
    # args: x, residual, weight, s, y, rstd, rows, cols, eps
    "add_rmsnorm": Equivalent(
        lambda s: (sum_ := s[0] + s[1], *torch._fused_rms_norm(sum_, [s[7]], s[2], s[8])),
        "s = x + residual; torch._fused_rms_norm(s, [cols], weight, eps)",
    ),
    # args: x, residual, weight, bias, s, y, mean, rstd, rows, cols, eps
    "add_layernorm": Equivalent(
        lambda s: (
            sum_ := s[0] + s[1],
            *torch.native_layer_norm(sum_, (s[9],), s[2], s[3], s[10]),
        ),
        "s = x + residual; torch.native_layer_norm(s, (cols,), weight, bias, eps)",
    ),
    # args: logits, labels, loss, lse, partials, rows, cols, ignore_index
    "cross_entropy": Equivalent(
        lambda s: (
            torch.nn.functional.cross_entropy(s[0], s[1], reduction="none", ignore_index=s[7]),
            None,  # torch's op does not return the row's logsumexp
        ),
        "F.cross_entropy(logits, labels, reduction='none', ignore_index)",
    ),
    # args: logits, labels, lse, dloss, dlogits, rows, cols, ignore_index
    "cross_entropy_backward": Equivalent(
        _ce_backward,
        "nll_loss_backward then _log_softmax_backward_data (autograd of F.cross_entropy)",
        prepare=_ce_backward_state,
        extra_rtol=_ce_backward_rtol,
    ),
    # args: x, dy, y, mask, dx, n
    "relu": Equivalent(
        lambda s: (y := torch.relu(s[0]), torch.ops.aten.threshold_backward(s[1], y, 0)),
        "y = torch.relu(x); torch.ops.aten.threshold_backward(dy, y, 0)",
    ),
    # args: x, y, rows, cols
    "transpose": Equivalent(lambda s: (s[0].t().contiguous(),), "x.t().contiguous()"),
    # args: a, b, c, M, N, K (torch's default float32 matmul: no TF32, as Kato's FFMA kernel)
    "matmul": Equivalent(lambda s: (torch.matmul(s[0], s[1]),), "torch.matmul(a, b)"),
    # args: a (M, K), b (N, K), c, M, N, K
    "matmul_nt": Equivalent(lambda s: (torch.matmul(s[0], s[1].t()),), "torch.matmul(a, b.t())"),
    # args: a (K, M), b (K, N), c, M, N, K
    "matmul_tn": Equivalent(lambda s: (torch.matmul(s[0].t(), s[1]),), "torch.matmul(a.t(), b)"),
    # args: x, out, rows, cols
    "reduce_sum": Equivalent(
        lambda s: (torch.sum(s[0], dim=-1, dtype=torch.float32),),
        "torch.sum(x, dim=-1, dtype=torch.float32)",
    ),
    # args: x, out, workspace, counters, n
    "reduce_sum_all": Equivalent(
        lambda s: (torch.sum(s[0], dtype=torch.float32),), "torch.sum(x, dtype=torch.float32)"
    ),
    # args: x, mean, var, invstd, workspace, counters, N, C, HW, eps
    "batchnorm_stats": Equivalent(
        lambda s: (*_mean_none_invstd(torch.batch_norm_stats(s[0], s[9])),),
        "torch.batch_norm_stats(x, eps) (mean, invstd; no variance)",
        cuda_only=True,
    ),
    # args: x, weight, bias, running_mean_in, running_var_in, y, mean, invstd, running_mean,
    # running_var, workspace, counters, N, C, HW, eps, momentum
    "batchnorm": Equivalent(
        _batchnorm,
        "torch._batch_norm_impl_index(x, weight, bias, running_mean, running_var, True, "
        "momentum, eps, cudnn) (F.batch_norm(training=True): cuDNN where it applies)",
        prepare=lambda a: (a[0], a[1], a[2], a[3].clone(), a[4].clone(), a[16], a[15]),
    ),
    # args: x, dy, mean, invstd, weight, dx, dweight, dbias, workspace, counters, N, C, HW
    "batchnorm_backward": Equivalent(
        lambda s: torch.ops.aten._batch_norm_impl_index_backward(*s),
        "torch._batch_norm_impl_index_backward (autograd of F.batch_norm(training=True))",
        prepare=_batchnorm_backward_state,
    ),
    # args: x, weight, bias, running_mean_in, running_var_in, y, mean, invstd, running_mean,
    # running_var, workspace, counters, N, C, HW, eps, momentum
    "batchnorm_relu": Equivalent(
        _batchnorm_relu,
        "torch._batch_norm_impl_index(x, weight, bias, running_mean, running_var, True, "
        "momentum, eps, cudnn), then torch.relu (the unfused F.batch_norm -> relu)",
        prepare=lambda a: (a[0], a[1], a[2], a[3].clone(), a[4].clone(), a[16], a[15], None),
    ),
    # args: x, residual, weight, bias, running_mean_in, running_var_in, y, mean, invstd,
    # running_mean, running_var, workspace, counters, N, C, HW, eps, momentum
    "batchnorm_add_relu": Equivalent(
        _batchnorm_relu,
        "torch._batch_norm_impl_index(x, weight, bias, running_mean, running_var, True, "
        "momentum, eps, cudnn), then y + residual, then torch.relu (the unfused sequence)",
        prepare=lambda a: (a[0], a[2], a[3], a[4].clone(), a[5].clone(), a[17], a[16], a[1]),
    ),
    # args: x, dy, mean, invstd, weight, bias, dx, dweight, dbias, workspace, counters, N, C, HW
    "batchnorm_relu_backward": Equivalent(
        _batchnorm_relu_backward,
        "torch.ops.aten.threshold_backward(dy, relu's output, 0), then "
        "torch._batch_norm_impl_index_backward (autograd of relu(F.batch_norm(...)))",
        prepare=lambda a: _batchnorm_relu_backward_state(a, residual=False),
    ),
    # args: x, dy, y, mean, invstd, weight, dx, dweight, dbias, dresidual, workspace, counters,
    # N, C, HW
    "batchnorm_add_relu_backward": Equivalent(
        _batchnorm_relu_backward,
        "torch.ops.aten.threshold_backward(dy, y, 0), then "
        "torch._batch_norm_impl_index_backward (autograd of relu(F.batch_norm(...) + r))",
        prepare=lambda a: _batchnorm_relu_backward_state(a, residual=True),
    ),
    # args: x, y, rows, cols, ...
    "sort": Equivalent(lambda s: (torch.sort(s[0], dim=-1).values,), "torch.sort(x, dim=-1)"),
    # args: x, y, n, ...
    "sort_1d": Equivalent(lambda s: (torch.sort(s[0]).values,), "torch.sort(x)"),
    # args: x, v, y, w, n, ...
    "sort_1d_pairs": Equivalent(
        lambda s: _stable_sort_pairs(s[0], s[1]),
        "torch.sort(keys, stable=True) (float keys as ordered int32 bits: -0.0 before +0.0), "
        "values gathered by its indices",
    ),
}


def _stable_sort_pairs(x: Any, values: Any) -> tuple[Any, Any]:
    """Keys sorted stably and the values in that order, with Kato's key order: float keys are
    sorted as int32 bit patterns whose order is the float order with -0.0 before +0.0 (torch
    ties the two)."""
    keys = x
    if x.dtype == torch.float32:
        bits = x.view(torch.int32)
        keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    order = torch.sort(keys, stable=True).indices
    return x[order], values[order]


def _saved_stats(x: Any, mean: Any, rstd: Any) -> tuple[Any, Any]:
    """Kato's per-row mean and rstd (float32) as torch's layer norm saves them: ``(rows, 1)``,
    float32 on CUDA (the accumulation type), the input's type on the CPU."""
    kind = torch.float32 if x.is_cuda else x.dtype
    return mean.view(-1, 1).to(kind), rstd.view(-1, 1).to(kind)


def _mean_none_invstd(stats: tuple[Any, Any]) -> tuple[Any, None, Any]:
    mean, invstd = stats
    return mean, None, invstd


def equivalent(operator: str) -> Equivalent:
    """The torch equivalent of ``operator``.

    Raises:
        LookupError: it has none (a user operator, or a new one without its entry).
    """
    try:
        return EQUIVALENTS[operator]
    except KeyError:
        raise LookupError(f"no torch equivalent of operator {operator!r}") from None


# --- problems as torch values ------------------------------------------------------------------


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy one (ml_dtypes' bfloat16 included)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def as_torch(value: Any, device: str | torch.device) -> Value:
    """A problem argument as torch sees it: an array as a tensor of its dtype on ``device``
    (bfloat16 through its bits), a numpy scalar as a Python number."""
    if isinstance(value, np.ndarray):
        host = np.ascontiguousarray(value)
        if host.dtype.name == "bfloat16":
            tensor = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(host)
        return tensor.to(device)
    if isinstance(value, np.generic):
        return value.item()
    return value


def problem_values(problem: Problem, device: str | torch.device) -> list[Value]:
    """Every argument of ``problem`` as :func:`as_torch` makes it, in order."""
    return [as_torch(arg, device) for arg in problem.args]


def run_equivalent(operator: str, values: list[Value]) -> tuple[Any, ...]:
    """Torch's op on a problem's arguments (:func:`problem_values`): one value per output of
    the problem (None where torch does not produce it)."""
    eq = equivalent(operator)
    return tuple(eq.run(eq.prepare(values)))


def float64_disagreement(
    spec: OperatorSpec, dtype: str, problem: Problem, device: str | torch.device
) -> str | None:
    """Why torch's op, run on float64 copies of ``problem``'s floating inputs, disagrees with
    the references (:func:`check_outputs` at the tolerances of ``dtype``, the problem's), or
    None.

    Tells a wrong equivalent from a precise one: where torch's op fails the check in the
    problem's dtype but agrees here, it computes the operator's function and only loses more
    precision than Kato's tolerance allows on these inputs (torch's layer norm subtracts a
    float32 mean, so rows with a large offset lose digits that Kato's pivoted kernel keeps).
    """
    values = [
        v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for v in problem_values(problem, device)
    ]
    eq = equivalent(spec.name)
    with torch.no_grad():
        outputs = tuple(eq.run(eq.prepare(values)))
    return check_outputs(spec, dtype, problem, outputs)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point else 0.0


def check_outputs(
    spec: OperatorSpec, dtype: str, problem: Problem, outputs: Sequence[Any]
) -> str | None:
    """Why torch's ``outputs`` (one per ``problem.outputs`` entry, None: not produced) disagree
    with the problem's references, or None. At least one output must be produced. Floating
    outputs pass where equal to the reference or finite and within ``atol + rtol * |ref|``
    (the problem's tolerances, else the spec's for ``dtype``), ``rtol`` plus twice the unit
    roundoff of torch's output type where that type is narrower than Kato's output, plus the
    equivalent's ``extra_rtol``; integer outputs must be equal. A shape that differs only in
    unit dimensions (torch's ``(rows, 1)`` mean) is compared element by element."""
    if len(outputs) != len(problem.outputs):
        return f"torch gave {len(outputs)} outputs, the problem has {len(problem.outputs)}"
    tolerances = problem.tolerances or [spec.tolerance(dtype)] * len(problem.outputs)
    eq = EQUIVALENTS.get(spec.name)
    extra = eq.extra_rtol(problem, dtype) if eq is not None and eq.extra_rtol else 0.0
    compared = 0
    for position, (index, reference, out, (atol, rtol)) in enumerate(
        zip(problem.outputs, problem.references, outputs, tolerances, strict=True)
    ):
        if out is None:
            continue
        compared += 1
        kato_dtype = problem.args[index].dtype
        if out.numel() != reference.size:
            return (
                f"output {index}: torch gave {tuple(out.shape)} elements, "
                f"the reference has {reference.shape}"
            )
        got = out.detach().reshape(-1)
        if kato_dtype.kind in "iu" or not out.dtype.is_floating_point:
            expected = torch.from_numpy(np.ascontiguousarray(reference).reshape(-1))
            bad = int((got.to("cpu", torch.float64) != expected.to(torch.float64)).sum())
            if bad:
                return f"output {index}: {bad} of {reference.size} elements differ"
            continue
        if torch.finfo(out.dtype).eps > torch.finfo(torch_dtype(kato_dtype)).eps:
            rtol = rtol + 2 * _unit_roundoff(out.dtype)  # the output, and an intermediate
        rtol = rtol + extra
        ref = torch.from_numpy(np.ascontiguousarray(reference, np.float64).reshape(-1))
        ref = ref.to(got.device)
        y = got.to(torch.float64)
        err = (y - ref).abs()
        ok = (y == ref) | (torch.isfinite(y) & (err <= atol + rtol * ref.abs()))
        bad = int((~ok).sum())
        if bad:
            worst = float(torch.where(torch.isfinite(err), err, math.inf).max())
            return (
                f"output {index} (#{position}): {bad} of {reference.size} elements outside "
                f"tolerance (atol={atol:g}, rtol={rtol:g}); max abs error {worst:.3g}"
            )
    if not compared:
        return "torch's op produced none of the operator's outputs"
    return None


# --- timing ------------------------------------------------------------------------------------


def input_copies(bytes_per_call: int, l2_bytes: int, max_copies: int = MAX_COPIES) -> int:
    """How many input copies to rotate over so that one pass streams >= 2x the L2."""
    return max(1, min(max_copies, math.ceil(2 * l2_bytes / max(bytes_per_call, 1))))


def rotating(
    make_inputs: Callable[[], Any],
    run: Callable[[Any], object],
    bytes_per_call: int,
    *,
    l2_bytes: int = DEFAULT_L2_BYTES,
    max_copies: int = MAX_COPIES,
) -> Callable[[], object]:
    """A zero-argument function calling ``run`` on the next of :func:`input_copies` copies
    made by ``make_inputs`` (the benchmarks' eager torch side, ``benchmarks/torch_ops``)."""
    copies = [make_inputs() for _ in range(input_copies(bytes_per_call, l2_bytes, max_copies))]
    turn = {"i": 0}

    def call() -> object:
        turn["i"] = (turn["i"] + 1) % len(copies)
        return run(copies[turn["i"]])

    return call


def graphed(
    make_inputs: Callable[[], Any],
    run: Callable[[Any], object],
    bytes_per_call: int,
    *,
    l2_bytes: int = DEFAULT_L2_BYTES,
    max_copies: int = MAX_COPIES,
) -> Callable[[], object]:
    """:func:`rotating` replayed from CUDA graphs, one captured call per input copy (outputs
    live in the graphs' memory pool): what torch's kernels cost on the GPU alone, for an op of
    a few microseconds or one run through the autograd engine, where eager calls time the
    host's launch rate."""
    # One side stream for the inputs, the warm-up and the captures: autograd runs a backward op
    # on the stream its forward op ran on, and capturing it must not touch the legacy stream.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    count = input_copies(bytes_per_call, l2_bytes, max_copies)
    with torch.cuda.stream(stream):
        copies = [make_inputs() for _ in range(count)]
        for inputs in copies:
            run(inputs)
    stream.synchronize()
    graphs = []
    for inputs in copies:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run(inputs)
        graphs.append(graph)
    torch.cuda.synchronize()
    turn = {"i": 0}

    def call() -> object:
        turn["i"] = (turn["i"] + 1) % len(graphs)
        return graphs[turn["i"]].replay()

    return call


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, tuple | list):
        return type(state)(_clone(item) for item in state)
    return state


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, tuple | list):
        return sum(_state_bytes(item) for item in state)
    return 0


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000
    for _ in range(2):  # the first may include the clock ramping up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def time_calls(
    run: Callable[[Any], object],
    states: Sequence[Any],
    *,
    repeats: int = 15,
    warmup: int = 3,
    device: torch.device | None = None,
) -> list[float]:
    """Per-call milliseconds of each of ``repeats`` batches of ``run`` on the CUDA device,
    rotating over ``states`` across batches (see the module docstring)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    turn = {"i": 0}

    def call() -> None:
        run(states[turn["i"] % len(states)])
        turn["i"] += 1

    with torch.cuda.device(device):
        for _ in range(warmup):
            call()
        torch.cuda.synchronize()
        cycles_per_ms = _sleep_cycles_per_ms(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        t0 = _now_ms()
        start.record()
        call()
        end.record()
        host_ms = _now_ms() - t0
        end.synchronize()
        single = max(start.elapsed_time(end), 1e-3)
        batch = max(1, min(MAX_BATCH, math.ceil(BATCH_TARGET_MS / single)))
        spin_ms = SPIN_FACTOR * batch * host_ms + SPIN_MARGIN_MS
        times = []
        for _ in range(repeats):
            for _ in range(SPIN_RETRIES):
                torch.cuda._sleep(int(spin_ms * cycles_per_ms))
                start.record()
                t0 = _now_ms()
                for _ in range(batch):
                    call()
                queued_ms = _now_ms() - t0
                end.record()
                overtaken = start.query()  # the GPU began the batch before it was all queued
                end.synchronize()
                if not overtaken:
                    break
                spin_ms = max(2 * spin_ms, SPIN_FACTOR * queued_ms)
            times.append(start.elapsed_time(end) / batch)
    return times


def _now_ms() -> float:
    import time

    return time.perf_counter() * 1e3


def measure(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    *,
    device_index: int = 0,
    problem: Problem | None = None,
    seed: int | None = None,
    repeats: int = 15,
    warmup: int = 3,
    l2_bytes: int | None = None,
) -> FrameworkResult:
    """Torch's op for ``spec`` at ``shape``/``dtype`` on CUDA device ``device_index``: made
    from ``problem`` (default: ``spec.make_problem`` with a fresh generator from ``seed``),
    checked with :func:`check_outputs`, then timed by :func:`time_calls` over input copies
    (within half the device's free memory). Outputs outside Kato's tolerance make the result a
    ``mismatch`` that is timed all the same (see :mod:`tuner.framework`).

    Raises:
        LookupError: the operator has no torch equivalent.
    """
    eq = equivalent(spec.name)

    def first(state: Any) -> tuple[Callable[[Any], Sequence[Any]], Sequence[Any], str]:
        return eq.run, tuple(eq.run(state)), eq.what

    return _measure(
        spec, shape, dtype, f"torch {torch.__version__}", first, device_index=device_index,
        problem=problem, seed=seed, repeats=repeats, warmup=warmup, l2_bytes=l2_bytes,
    )  # fmt: skip


def compiled_label() -> str:
    """What the compiled baseline times, as stored: ``"torch.compile <version> inductor"``."""
    return f"torch.compile {torch.__version__} inductor"


class CompileUnavailable(Exception):
    """``torch.compile`` cannot compile an equivalent here (no Triton for the device, or it
    raised); the message says why."""


def compile_equivalent(
    eq: Equivalent, state: Any, *, backend: str | Callable[..., Any] = "inductor"
) -> tuple[Callable[[Any], Sequence[Any]], Sequence[Any], str]:
    """``eq.run`` compiled by ``torch.compile`` (``backend``, default mode, ``dynamic=False``:
    the key's shapes are static) and called once on ``state`` (which compiles it): the
    compiled function, its outputs and what it ran. ``fullgraph=True`` first; an op dynamo
    cannot trace whole is compiled again with graph breaks (``what`` then says so). The
    function answered raises rather than compile again (``fail_on_recompile``): a copy of the
    state that missed the first graph's guards would otherwise time another graph, or eager
    torch once dynamo's recompile limit is reached.

    Raises:
        CompileUnavailable: Inductor has no Triton for the state's CUDA device, or compiling
            (or the first call) raised.
    """
    import torch._dynamo

    if backend == "inductor" and _on_cuda(state):
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileUnavailable("torch.compile: Inductor has no Triton for this device")
    what = f"torch.compile({eq.what})"
    try:
        try:
            run = torch.compile(eq.run, backend=backend, dynamic=False, fullgraph=True)
            outputs = tuple(run(state))
        except torch._dynamo.exc.Unsupported:
            torch._dynamo.reset()  # the failed fullgraph attempt's cache entries
            run = torch.compile(eq.run, backend=backend, dynamic=False)
            outputs = tuple(run(state))
            what = f"{what} (graph breaks)"
        # Made only now: building set_stance sets the process's stance at once (only the
        # wrapped function's calls restore it), and the first call above must compile.
        return torch.compiler.set_stance("fail_on_recompile")(run), outputs, what
    except Exception as exc:  # any compiler fault: the baseline is unavailable, not the job's
        reason = f"torch.compile raised {type(exc).__name__}: {exc}"
        raise CompileUnavailable(reason[:2000]) from exc


def _on_cuda(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return state.is_cuda
    if isinstance(state, tuple | list):
        return any(_on_cuda(item) for item in state)
    return False


def measure_compiled(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    *,
    device_index: int = 0,
    problem: Problem | None = None,
    seed: int | None = None,
    repeats: int = 15,
    warmup: int = 3,
    l2_bytes: int | None = None,
    before_timing: Callable[[], object] | None = None,
) -> FrameworkResult:
    """:func:`measure` for torch's op compiled by ``torch.compile`` (:func:`compile_equivalent`):
    the same problem (the same ``seed`` makes the same one), the same check against its
    references and the same timing; ``framework`` is :func:`compiled_label`. ``skipped`` where
    torch.compile is unavailable (:class:`CompileUnavailable`, the reason in ``detail``).
    ``before_timing`` is called once compiled and checked, just before the timing (the
    measuring child waits for the GPU's turn there: compiling takes seconds of host time).

    Raises:
        LookupError: the operator has no torch equivalent.
    """
    eq = equivalent(spec.name)
    try:
        return _measure(
            spec, shape, dtype, compiled_label(), lambda state: compile_equivalent(eq, state),
            device_index=device_index, problem=problem, seed=seed, repeats=repeats,
            warmup=warmup, l2_bytes=l2_bytes, before_timing=before_timing,
        )  # fmt: skip
    except CompileUnavailable as exc:
        torch.cuda.empty_cache()
        return FrameworkResult(SKIPPED, compiled_label(), detail=str(exc))


def _measure(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    framework: str,
    first: Callable[[Any], tuple[Callable[[Any], Sequence[Any]], Sequence[Any], str]],
    *,
    device_index: int,
    problem: Problem | None,
    seed: int | None,
    repeats: int,
    warmup: int,
    l2_bytes: int | None,
    before_timing: Callable[[], object] | None = None,
) -> FrameworkResult:
    """:func:`measure`'s steps, the op given by ``first``: called once on the prepared state,
    it answers the function to time, its outputs and what it runs; ``before_timing`` is called
    once those outputs are checked, before the input copies are made and timed (the compiled
    baseline's compile and first call, seconds of host time, run before it)."""
    eq = equivalent(spec.name)
    device = torch.device("cuda", device_index)
    if problem is None:
        problem = spec.make_problem(tuple(shape), dtype, np.random.default_rng(seed))
    with torch.cuda.device(device), torch.no_grad():
        state = eq.prepare(problem_values(problem, device))
        run, outputs, what = first(state)
        error = check_outputs(spec, dtype, problem, tuple(outputs))
        # The GPU's turn before the input copies (up to half its free memory) and the
        # timing: another job measuring on this GPU must not see either.
        if before_timing is not None:
            before_timing()
        if l2_bytes is None:
            gpu = find_gpu(normalize_gpu_name(torch.cuda.get_device_name(device)))
            l2_bytes = gpu.l2_bytes if gpu is not None and gpu.l2_bytes else DEFAULT_L2_BYTES
        copies = input_copies(spec.bytes_moved(tuple(shape), dtype), l2_bytes)
        free, _ = torch.cuda.mem_get_info(device)
        copies = max(1, min(copies, int(0.5 * free // max(_state_bytes(state), 1))))
        states = [state] + [_clone(state) for _ in range(copies - 1)]
        del problem  # the host copies and references: not needed for timing
        times = time_calls(run, states, repeats=repeats, warmup=warmup, device=device)
    torch.cuda.empty_cache()
    if error:
        return FrameworkResult(MISMATCH, framework, what, tuple(times), detail=error)
    return FrameworkResult(
        OK, framework, what, tuple(times), detail=f"verified; {len(states)} input copies"
    )
