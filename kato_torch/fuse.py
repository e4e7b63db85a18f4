"""Rewrite a model's ``norm -> [add ->] activation`` sequences into Kato's fused functions.

:func:`fuse` traces the ``forward`` of every module of a model that has a fusable norm as a
direct child (``torch.fx``, one level: its child modules stay calls), finds each norm call whose
output feeds only an activation, or only an add whose result feeds only the activation, and
calls the fused function in their place (:data:`FUSIONS`). The module keeps its class,
parameters, buffers, submodules and state dict (the same objects); only its ``forward`` is
replaced, by the rewritten graph's code run on the module itself, so ``.to()``, optimizers and
``torch.compile`` see the module they saw. A module whose forward does not trace (control flow
on tensor values, unsupported Python) or has nothing to fuse is left alone. :func:`unfuse`
restores the original forwards.

The table is :data:`FUSIONS`: a norm matcher, whether the add is part of the pattern, the
activation matcher and the fused call. Its entries: ``BatchNorm2d -> ReLU``, ``BatchNorm2d ->
add -> ReLU`` and ``LayerNorm -> ReLU``; another pattern is one more entry with its own call.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, fx

from kato_torch import nn as kato_nn
from kato_torch import ops

#: The attribute a fused module keeps its rewritten graph's code in (see :func:`fused`).
_MARK = "_kato_fused_code"


# --- what the rewritten graphs call -----------------------------------------------------------


def batch_norm_relu_module(bn: torch.nn.BatchNorm2d, x: Tensor, residual: Tensor | None = None):
    """``relu(bn(x) [+ residual])`` for a BatchNorm2d module, with torch's
    ``_BatchNorm.forward`` bookkeeping (num_batches_tracked, the cumulative momentum, eval mode
    and untracked statistics) and :func:`kato_torch.batch_norm_relu` for the rest."""
    bn._check_input_dim(x)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # a cumulative moving average
            factor = 1.0 / float(bn.num_batches_tracked)
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    return ops.batch_norm_relu(
        x,
        bn.running_mean if track else None,
        bn.running_var if track else None,
        bn.weight,
        bn.bias,
        use_batch,
        factor,
        bn.eps,
        residual,
    )


def layer_norm_relu_module(ln: torch.nn.LayerNorm, x: Tensor, residual: None = None) -> Tensor:
    """``relu(ln(x))`` for a LayerNorm module with :func:`kato_torch.layer_norm_relu` (which
    runs torch's exact sequence where the module has no affine parameters or the policy says
    so). ``residual``: the table's signature; this pattern has none."""
    return ops.layer_norm_relu(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


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


def fuse(model: torch.nn.Module) -> torch.nn.Module:
    """Run :data:`FUSIONS`' fused functions in place of their unfused sequences in every module
    of ``model`` whose own forward has one (see the module docstring); returns ``model``.
    Idempotent; values and gradients are those of the fused functions, which fall back to the
    exact unfused sequence wherever Kato's policy does not pick its kernels."""
    for module in list(model.modules()):
        if _MARK in module.__dict__:
            continue
        children = dict(module.named_children())
        if not any(f.norm(c) for c in children.values() for f in FUSIONS):
            continue
        try:
            graph = _OneLevel().trace(module)
        except Exception:  # noqa: BLE001 - any untraceable forward: leave the module alone
            continue
        modules = dict(module.named_modules())
        if not _rewrite(graph, modules):
            continue
        graph.lint()
        gm = fx.GraphModule(module, graph)
        # The generated forward reads every attribute through `self`: bound to the module
        # itself, it always sees the module's current parameters, buffers and children.
        forward = types.MethodType(type(gm).forward, module)
        object.__setattr__(module, "forward", forward)
        object.__setattr__(module, _MARK, gm.code)
    return model


def fused(module: torch.nn.Module) -> str | None:
    """The code of the rewritten forward :func:`fuse` gave ``module``, or None."""
    return module.__dict__.get(_MARK)


def unfuse(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`fuse`: every module of ``model`` runs its class's forward again."""
    for module in model.modules():
        if _MARK in module.__dict__:
            del module.__dict__["forward"]
            del module.__dict__[_MARK]
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
