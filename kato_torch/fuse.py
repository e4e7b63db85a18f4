"""Rewrite a model's ``norm -> [add ->] activation`` sequences into Kato's fused functions.

:func:`fuse` traces the ``forward`` of every module of a model that has a fusable norm as a
direct child (``torch.fx``, one level: its child modules stay calls), finds each norm call whose
output feeds only an activation, or only an add whose result feeds only the activation, and
calls the fused function in their place (:data:`FUSIONS`). The module keeps its parameters,
buffers, submodules and state dict (the same objects); its class becomes a subclass of its own
whose ``forward`` is the rewritten graph's code, so ``.to()``, optimizers, ``deepcopy``,
``nn.DataParallel``'s replicas and ``torch.compile`` see the module they saw. A module whose
forward does not trace (control flow on tensor values, unsupported Python), traces differently
in training and eval mode, takes defaulted or variadic arguments, or has nothing to fuse is left
alone. :func:`unfuse` restores the original classes. A fused model pickles by its state dict.

The table is :data:`FUSIONS`: a norm matcher, whether the add is part of the pattern, the
activation matcher and the fused call. Its entries: ``BatchNorm2d -> ReLU``, ``BatchNorm2d ->
add -> ReLU`` and ``LayerNorm -> ReLU``; another pattern is one more entry with its own call.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, fx

from kato_torch import nn as kato_nn
from kato_torch import ops
from kato_torch._fallbacks import module_call

#: Attributes of a fused module's class: the rewritten graph's code (see :func:`fused`) and the
#: class it was (see :func:`unfuse`).
_MARK = "_kato_fused_code"
_UNFUSED = "_kato_unfused_class"


# --- what the rewritten graphs call -----------------------------------------------------------


def batch_norm_relu_module(bn: torch.nn.BatchNorm2d, x: Tensor, residual: Tensor | None = None):
    """``relu(bn(x) [+ residual])`` for a BatchNorm2d module, with torch's
    ``_BatchNorm.forward`` bookkeeping (num_batches_tracked, the cumulative momentum, eval mode
    and untracked statistics: :func:`kato_torch.nn.batch_norm_step`) and
    :func:`kato_torch.batch_norm_relu` for the rest."""
    running_mean, running_var, use_batch, factor = kato_nn.batch_norm_step(bn, x)
    weight, bias = bn.weight, bn.bias
    key = (x.shape, x.dtype, x.device, x.is_contiguous(), use_batch, weight is None,
           bias is None, running_mean is None, running_var is None,
           None if residual is None
           else (residual.shape, residual.dtype, residual.is_contiguous()))  # fmt: skip
    return module_call(bn, "_kato_batch_norm_relu", key, ops._torch_batch_norm_relu,
                       ops.batch_norm_relu, x, running_mean, running_var, weight, bias,
                       use_batch, factor, bn.eps, residual)  # fmt: skip


def layer_norm_relu_module(ln: torch.nn.LayerNorm, x: Tensor, residual: None = None) -> Tensor:
    """``relu(ln(x))`` for a LayerNorm module with :func:`kato_torch.layer_norm_relu` (which
    runs torch's exact sequence where the module has no affine parameters or the policy says
    so). ``residual``: the table's signature; this pattern has none."""
    shape, weight, bias = ln.normalized_shape, ln.weight, ln.bias
    key = (x.shape, x.dtype, x.device, shape, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype)  # fmt: skip
    return module_call(ln, "_kato_layer_norm_relu", key, ops._layer_norm_relu_torch,
                       ops.layer_norm_relu, x, shape, weight, bias, ln.eps)  # fmt: skip


# --- the pattern table ------------------------------------------------------------------------

_RELU_FUNCTIONS = (torch.relu, torch.relu_, torch.nn.functional.relu)
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)


def _is_relu(node: fx.Node, modules: dict[str, torch.nn.Module]) -> bool:
    """A ReLU call on its first argument: an ``nn.ReLU`` module (Kato's drop-in included; no
    hooks), ``torch.relu(_)``, ``F.relu`` or ``x.relu(_)()``."""
    if node.op == "call_module":
        m = modules.get(str(node.target))
        return type(m) in (torch.nn.ReLU, kato_nn.ReLU) and not _hooked(m)
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS and len(node.args) >= 1
    if node.op == "call_method":
        return node.target in ("relu", "relu_") and len(node.args) == 1 and not node.kwargs
    return False


def _is_add(node: fx.Node) -> bool:
    """``a + b`` (``+=`` included: on a fused norm's temporary result it changes nothing
    else), ``torch.add(a, b)`` or ``a.add(_)(b)``, without alpha or out."""
    if node.kwargs or len(node.args) != 2:
        return False
    if node.op == "call_function":
        return node.target in _ADD_FUNCTIONS
    return node.op == "call_method" and node.target in ("add", "add_")


def _in_place(node: fx.Node) -> bool:
    """An add that writes its first argument (``+=``, ``a.add_(b)``)."""
    return (node.op == "call_function" and node.target is operator.iadd) or (
        node.op == "call_method" and node.target == "add_"
    )


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


@dataclass(frozen=True)
class Fusion:
    """One fusable pattern: ``norm(x) -> activation`` or, with ``residual``,
    ``norm(x) -> add(., r) -> activation``.

    Attributes:
        name: what the pattern is (Kato's forward operator it runs).
        norm: whether a child module is this pattern's norm (exact classes: a subclass may
            have its own forward).
        activation: whether a graph node is the activation applied to its first argument.
        residual: whether an add sits between the norm and the activation.
        call: the fused function, ``call(norm_module, x, residual_or_None) -> Tensor``.
    """

    name: str
    norm: Callable[[torch.nn.Module], bool]
    activation: Callable[[fx.Node, dict[str, torch.nn.Module]], bool]
    residual: bool
    call: Callable[..., Tensor]


def _is_batch_norm_2d(m: torch.nn.Module) -> bool:
    return type(m) in (torch.nn.BatchNorm2d, kato_nn.BatchNorm2d) and not _hooked(m)


def _is_layer_norm(m: torch.nn.Module) -> bool:
    return type(m) in (torch.nn.LayerNorm, kato_nn.LayerNorm) and not _hooked(m)


#: The patterns, tried in order for each norm call (the longer one first).
FUSIONS: list[Fusion] = [
    Fusion("batchnorm_add_relu", _is_batch_norm_2d, _is_relu, True, batch_norm_relu_module),
    Fusion("batchnorm_relu", _is_batch_norm_2d, _is_relu, False, batch_norm_relu_module),
    Fusion("layernorm_relu", _is_layer_norm, _is_relu, False, layer_norm_relu_module),
]


# --- tracing and rewriting --------------------------------------------------------------------


class _OneLevel(fx.Tracer):
    """Traces one module's own forward: every child module is a call, whatever its class."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _rewrite(graph: fx.Graph, modules: dict[str, torch.nn.Module]) -> list[str]:
    """Replace every match of :data:`FUSIONS` in ``graph`` (in place); the patterns' names."""
    done = []
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        norm = modules.get(str(node.target))
        after = _only_user(node)
        if norm is None or after is None:
            continue
        for fusion in FUSIONS:
            if not fusion.norm(norm):
                continue
            residual, add = None, None
            act = after
            if fusion.residual:
                if not _is_add(after):
                    continue
                a, b = after.args
                other = b if a is node else a
                if not isinstance(other, fx.Node) or other is node:
                    continue
                if _in_place(after) and a is not node:
                    continue  # `r += bn(x)` changes r, which later code may read
                residual, add, act = other, after, _only_user(after)
                if act is None:
                    continue
            feeds = node if add is None else add
            if not fusion.activation(act, modules) or act.args[0] is not feeds:
                continue
            with graph.inserting_before(act):
                module_ref = graph.get_attr(str(node.target))
                fused = graph.call_function(fusion.call, (module_ref, node.args[0], residual))
            act.replace_all_uses_with(fused)
            for dead in (act, add, node):
                if dead is not None:
                    graph.erase_node(dead)
            done.append(fusion.name)
            break
    return done


def _plain_forward(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` takes only required positional arguments: fx fixes a
    defaulted argument (``scale=None``) to its default and ``*args`` to what it traced."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in parameters
    )


def _trace(module: torch.nn.Module) -> fx.Graph | None:
    """``module``'s own forward traced one level deep, or None where the trace would not hold
    for every call: it does not trace, or its Python branches on ``self.training`` (fx runs
    them once) trace differently in training and in eval mode. Every submodule's mode is
    restored."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        graphs = []
        for training in (True, False):
            module.train(training)
            graphs.append(_OneLevel().trace(module))
    except Exception:  # noqa: BLE001 - any untraceable forward: leave the module alone
        return None
    finally:
        for m, training in modes:
            m.training = training
    if graphs[0].python_code("self").src != graphs[1].python_code("self").src:
        return None
    return graphs[0]


def fuse(model: torch.nn.Module) -> torch.nn.Module:
    """Run :data:`FUSIONS`' fused functions in place of their unfused sequences in every module
    of ``model`` whose own forward has one (see the module docstring); returns ``model``.
    Idempotent; values and gradients are those of the fused functions, which fall back to the
    exact unfused sequence wherever Kato's policy does not pick its kernels.

    A fused module's class becomes a subclass of its own whose ``forward`` is the rewritten
    graph's code (so replicas, copies and ``torch.compile`` run it on their own module). Left
    alone: modules whose forward does not trace, branches on ``self.training``, or takes
    defaulted, ``*args`` or ``**kwargs`` arguments (fx would fix them to what it traced).
    Other Python-level branches (on a flag set at construction) are fixed as traced: change
    such a flag on an unfused model."""
    for module in list(model.modules()):
        if _MARK in type(module).__dict__:
            continue
        children = dict(module.named_children())
        if not any(f.norm(c) for c in children.values() for f in FUSIONS):
            continue
        if not _plain_forward(module):
            continue
        graph = _trace(module)
        if graph is None:
            continue
        modules = dict(module.named_modules())
        if not _rewrite(graph, modules):
            continue
        graph.lint()
        gm = fx.GraphModule(module, graph)
        cls = type(module)
        # The generated forward reads every attribute through `self`: on the module itself,
        # it always sees the module's current parameters, buffers and children.
        module.__class__ = type(cls.__name__, (cls,), {
            "forward": type(gm).forward, _MARK: gm.code, _UNFUSED: cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        })  # fmt: skip
    return model


def fused(module: torch.nn.Module) -> str | None:
    """The code of the rewritten forward :func:`fuse` gave ``module``, or None."""
    return type(module).__dict__.get(_MARK)


def unfuse(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`fuse`: every module of ``model`` is of its own class again."""
    for module in model.modules():
        if _MARK in type(module).__dict__:
            module.__class__ = type(module).__dict__[_UNFUSED]
    return model


__all__ = [
    "FUSIONS",
    "Fusion",
    "batch_norm_relu_module",
    "fuse",
    "fused",
    "layer_norm_relu_module",
    "unfuse",
]
