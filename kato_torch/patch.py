"""Swap Kato's drop-in modules into an existing model, and back.

The drop-ins subclass the torch modules and add no state, so swapping is a change of each
module's class: parameters, buffers, hooks, optimizer references and state dicts stay exactly
as they were, and :func:`unpatch` restores the original classes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kato_torch.nn import DROP_INS

_ORIGINAL = {kato: torch_cls for torch_cls, kato in DROP_INS.items()}


def patch(
    model: torch.nn.Module, only: Iterable[type[torch.nn.Module]] | None = None
) -> torch.nn.Module:
    """Make every module of ``model`` whose class is exactly one of torch's classes in
    :data:`kato_torch.nn.DROP_INS` (or of those in ``only``) its Kato drop-in; returns
    ``model``. Subclasses of torch's modules are left alone (their forward may differ)."""
    wanted = set(DROP_INS) if only is None else set(only)
    unknown = wanted - set(DROP_INS)
    if unknown:
        names = ", ".join(sorted(c.__name__ for c in unknown))
        raise ValueError(f"kato_torch.patch has no drop-in for {names}")
    for module in model.modules():
        if type(module) in wanted:
            module.__class__ = DROP_INS[type(module)]
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every Kato drop-in in ``model`` becomes its torch class again."""
    for module in model.modules():
        original = _ORIGINAL.get(type(module))
        if original is not None:
            module.__class__ = original
    return model
