"""Calls that ran PyTorch's own op, remembered per key so that the next such call goes straight
to it.

A public function of :mod:`kato_torch.ops` checks its arguments, casts for autocast and asks the
policy for each operator its forward and backward could run before it falls back to PyTorch's
op: tens of microseconds of Python, which a step bound by the host (a small model) pays on
every call. :func:`remembers_fallbacks` wraps such a function: a call whose key (the function,
every tensor's shape, dtype and device, the other arguments, autocast and its dtype, the
policy's generation) ran PyTorch's op before runs it at once. A call is a fallback when it made no
choice for Kato: :func:`chose_kato` is called wherever one is made (a policy decision for Kato,
a padded GEMM). A fallback that a ``WHEN_BUSY`` verdict made (:func:`waited`: the GPU kept up
with the host that time) asks :func:`kato_torch._backlog.lagging` again before it runs
PyTorch's op, and takes the full path when the GPU has fallen behind. Traced calls
(``torch.compile``) and calls inside a :func:`kato_torch.record` block always take the full
path, so compiled graphs and recorded keys are what they were.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from kato_torch import policy as _policy
from kato_torch._backlog import lagging

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()
#: Key of a remembered fallback -> whether a WHEN_BUSY verdict made it (see :func:`waited`).
_keys: dict[tuple, bool] = {}
_generation = -1
#: Keys kept at most (an argument that changes every call, a cumulative batch-norm momentum,
#: would grow the set without end): past it the set starts again.
MAX_KEYS = 4096


def chose_kato() -> None:
    """Mark the current call as one that runs something of Kato's (not a fallback)."""
    _local.choices = getattr(_local, "choices", 0) + 1


def waited() -> None:
    """Mark the current call as one where a ``WHEN_BUSY`` verdict ran PyTorch's op because the
    GPU kept up with the host: remembered, it asks the backlog again on its next call."""
    _local.waits = getattr(_local, "waits", 0) + 1


def _cuda_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.is_cuda:
            return value
    return None


def _describe(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (value.shape, value.dtype, value.device)
    if isinstance(value, list | tuple):
        return tuple(_describe(v) for v in value)
    return value


def _key(name: str, args: tuple, kwargs: dict, ignore: frozenset[str]) -> tuple | None:
    global _generation
    if torch.compiler.is_compiling() or _policy.recording():
        return None
    generation = _policy.generation()
    if generation != _generation:
        _keys.clear()
        _generation = generation
    autocast = torch.is_autocast_enabled("cuda")
    # The generation is part of the key: a call that began under an older policy and adds its
    # key after another thread moved on must not be found under the new one.
    key = (name, generation, torch.get_autocast_dtype("cuda") if autocast else None,
           *map(_describe, args))  # fmt: skip
    if kwargs:
        key += tuple(sorted((k, _describe(v)) for k, v in kwargs.items() if k not in ignore))
    return key  # an unhashable argument raises TypeError at the caller's lookup


def remembers_fallbacks(
    torch_op: Callable[..., Any], ignore: tuple[str, ...] = ()
) -> Callable[[F], F]:
    """Decorate a public function whose fallback is ``torch_op`` called with the same
    arguments (the function's own signature). ``ignore``: parameters no choice depends on
    (left out of the key, e.g. a momentum that changes every call); each is then passed by
    keyword to the wrapped function."""
    ignored = frozenset(ignore)

    def wrap(fn: F) -> F:
        name = fn.__qualname__
        positions = {p: i for i, p in enumerate(inspect.signature(fn).parameters)}

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # A traced call takes the full path; skipping the bookkeeping also keeps dynamo
                # from guarding on this thread's choice counter (a recompile on every call).
                return fn(*args, **kwargs)
            if ignored:  # by keyword, so that they leave the key whichever way they came
                cut = min((positions[p] for p in ignored if positions[p] < len(args)),
                          default=len(args))  # fmt: skip
                kwargs = {**dict(zip(list(positions)[cut:], args[cut:], strict=False)), **kwargs}
                args = args[:cut]
            # One lookup (get, not `in` then []): the key's hash walks every argument, and
            # another thread may clear _keys between two lookups (KeyError).
            try:
                key = _key(name, args, kwargs, ignored)
                remembered = None if key is None else _keys.get(key)  # None: not known
            except TypeError:  # an unhashable argument: decide afresh
                key, remembered = None, None
            if remembered is not None:
                if not remembered:  # a plain fallback (True: a WHEN_BUSY one)
                    return torch_op(*args, **kwargs)
                t = _cuda_tensor(args, kwargs)
                if t is None or not lagging(t):
                    return torch_op(*args, **kwargs)
            before = getattr(_local, "choices", 0)
            waits = getattr(_local, "waits", 0)
            out = fn(*args, **kwargs)
            if key is not None and getattr(_local, "choices", 0) == before:
                if len(_keys) >= MAX_KEYS:
                    _keys.clear()
                _keys[key] = getattr(_local, "waits", 0) != waits
            return out

        return call  # type: ignore[return-value]

    return wrap
