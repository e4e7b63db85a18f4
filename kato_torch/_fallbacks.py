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
with the host that time) asks the backlog again before it runs PyTorch's op, through a
:class:`kato_torch._backlog.Backoff` of its own (a host-bound step stops asking on most calls),
and takes the full path when the GPU has fallen behind, with that answer for every question the
call asks (:func:`kato_torch._backlog.enter`). Traced calls (``torch.compile``) and calls inside
a :func:`kato_torch.record` block always take the full path, so compiled graphs and recorded
keys are what they were.

The drop-in modules (:mod:`kato_torch.nn`, :mod:`kato_torch.fuse`) go one step further with
:func:`module_call`: each module keeps its last call's key (the input's shape, dtype and device,
its parameters' and settings' that a choice depends on, autocast, the policy's generation) and
what it ran, so a module whose call ran PyTorch's op calls torch's functional directly after
one comparison, instead of the public function's generic key. A call with another key (a
module's first, a ``nn.DataParallel`` replica's: a fresh copy of the module each forward) looks
its key up among every module's fallbacks (by function and key) before that generic key.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from kato_torch import _backlog
from kato_torch import policy as _policy
from kato_torch._backlog import Backoff

F = TypeVar("F", bound=Callable[..., Any])


class _Counts(threading.local):
    """Per thread: choices made for Kato, and ``WHEN_BUSY`` verdicts that ran PyTorch's op."""

    choices = 0
    waits = 0


_local = _Counts()
#: What a remembered fallback runs: PyTorch's op at once (:data:`PLAIN`), or PyTorch's op unless
#: its :class:`~kato_torch._backlog.Backoff` finds the GPU lagging (a ``WHEN_BUSY`` verdict's).
PLAIN = False
#: Key of a remembered fallback -> PLAIN or its Backoff.
_keys: dict[tuple, Any] = {}
_generation = -1
#: Keys kept at most (an argument that changes every call, a cumulative batch-norm momentum,
#: would grow the set without end): past it the set starts again.
MAX_KEYS = 4096


def chose_kato() -> None:
    """Mark the current call as one that runs something of Kato's (not a fallback)."""
    _local.choices += 1


def waited() -> None:
    """Mark the current call as one where a ``WHEN_BUSY`` verdict ran PyTorch's op because the
    GPU kept up with the host: remembered, it asks the backlog again on its next call."""
    _local.waits += 1


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    """The call's first tensor: the one its ``WHEN_BUSY`` verdict asked the backlog about
    (every public function's data comes first)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value
    return None


def _describe(value: Any) -> Any:
    if isinstance(value, Tensor):
        # Contiguity too: a channels-last activation runs PyTorch's batch norm, an NCHW one
        # of the same shape may not (kato_torch.ops._relayout).
        return (value.shape, value.dtype, value.device, value.is_contiguous())
    if isinstance(value, list | tuple):
        return tuple(_describe(v) for v in value)
    return value


def _autocast() -> torch.dtype | None:
    """CUDA autocast's dtype where it is enabled, else None (what the functions cast for)."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def _key(name: str, args: tuple, kwargs: dict, ignore: frozenset[str]) -> tuple | None:
    global _generation
    if _policy._recorders:
        return None
    generation = _policy._generation
    if generation != _generation:
        _keys.clear()
        _generation = generation
    # The generation is part of the key: a call that began under an older policy and adds its
    # key after another thread moved on must not be found under the new one.
    key = (name, generation, _autocast(), *map(_describe, args))
    if kwargs:
        key += tuple(sorted((k, _describe(v)) for k, v in kwargs.items() if k not in ignore))
    return key  # an unhashable argument raises TypeError at the caller's lookup


def _remember(key: tuple, remembered: Any) -> None:
    """Keep ``remembered`` (:data:`PLAIN` or a Backoff) under ``key`` in :data:`_keys`."""
    if len(_keys) >= MAX_KEYS:
        _keys.clear()
    _keys[key] = remembered


def _full(fn: Callable[..., Any], args: tuple, kwargs: dict, answer: bool | None) -> tuple:
    """``fn(*args, **kwargs)`` (the full path), as one call of the backlog's (``answer``: its
    answer where the caller asked already); returns (its output, what to remember of it:
    None where something of Kato's ran, :data:`PLAIN`, or a new Backoff for a ``WHEN_BUSY``
    verdict's fallback)."""
    outer = _backlog.enter(answer)
    choices, waits = _local.choices, _local.waits
    try:
        out = fn(*args, **kwargs)
    finally:
        _backlog.leave(outer)
    if _local.choices != choices:
        return out, None
    return out, (Backoff(noes=1) if _local.waits != waits else PLAIN)


def remembers_fallbacks(
    torch_op: Callable[..., Any], ignore: tuple[str, ...] = ()
) -> Callable[[F], F]:
    """Decorate a public function whose fallback is ``torch_op`` called with the same
    arguments (the function's own signature). ``ignore``: parameters no choice depends on
    (left out of the key, e.g. a momentum that changes every call); each is then passed by
    keyword to the wrapped function. The decorated function's ``__wrapped__`` is the function
    itself (the full path, which :func:`module_call` takes with its own memory)."""
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
            answer = None
            if remembered is not None:
                if remembered is PLAIN:
                    return torch_op(*args, **kwargs)
                t = _first_tensor(args, kwargs)
                answer = t is not None and remembered.lagging(t)
                if not answer:
                    waited()  # for a caller that remembers its own fallbacks
                    return torch_op(*args, **kwargs)
            out, remember = _full(fn, args, kwargs, answer)
            if key is not None and remembered is None and remember is not None:
                _remember(key, remember)
            return out

        return call  # type: ignore[return-value]

    return wrap


class _Memo:
    """A drop-in module's last call (:func:`module_call`): its key (the policy's generation,
    autocast's dtype, the module's key) and what it ran (:data:`PLAIN` or a Backoff). A copy
    of the module (``deepcopy``, a pickle) forgets it: a generation number means nothing in
    another process. ``nn.DataParallel``'s replicas (a copy of the module's ``__dict__`` per
    forward, the original never called on several GPUs) start from the original's and drop
    what they write with the replica: their calls find what to run in the process's memory
    of drop-in calls instead (:func:`module_call`)."""

    __slots__ = ("key", "remembered")

    def __init__(self, key: tuple, remembered: Any):
        self.key, self.remembered = key, remembered

    def __reduce__(self) -> tuple:
        return type(None), ()


def module_call(
    module: torch.nn.Module,
    slot: str,
    key: tuple,
    torch_op: Callable[..., Any],
    fn: Callable[..., Any],
    *args: Any,
) -> Any:
    """``fn(*args)`` for a drop-in module's call (``fn``: a public function decorated with
    :func:`remembers_fallbacks`), or ``torch_op(*args)`` (the torch functional the module's
    torch class calls, with the same results) where a call of ``fn`` with this ``key`` ran
    PyTorch's op before under the same policy generation and autocast state and, for a
    ``WHEN_BUSY`` fallback, the GPU still keeps up with the host (its Backoff). ``key``:
    whatever of the call (the input's shape, dtype and device, the parameters', the module's
    settings) the function's choices depend on, so that any module's call with it runs the
    same; ``slot``: the name ``module``'s last call is kept under in its ``__dict__`` (one per
    kind of call the module makes), checked first. A call whose key is not the module's last
    looks it up in the process's memory of drop-in calls (by ``fn`` and key: another module's
    call, or a ``nn.DataParallel`` replica's, each replica a fresh copy of the module; a
    ``WHEN_BUSY`` fallback's Backoff is then shared by every module calling with that key,
    one per device) and, where no call with it ran PyTorch's op, goes through ``fn`` with its
    own memory. Traced calls and calls inside a :func:`kato_torch.record` block take ``fn``'s
    own path. Thread-safe (replicas run in threads)."""
    if torch.compiler.is_compiling() or _policy._recorders:
        return fn(*args)
    key = (_policy._generation, _autocast(), key)
    memo = module.__dict__.get(slot)
    if memo is None or memo.key != key:
        try:
            remembered = _keys.get((fn, key))
        except TypeError:  # a symbolic shape (a trace's SymInt) is no key to keep
            module.__dict__[slot] = None
            return _full(fn, args, {}, None)[0]
        if remembered is None:
            # No module's call with this key ran PyTorch's op: the public function decides,
            # through its own memory (by argument key) or the full path.
            out, remembered = _full(fn, args, {}, None)
            if remembered is not None:
                _remember((fn, key), remembered)
            # Replaced, never changed in place: replicas of the module share the old one.
            module.__dict__[slot] = None if remembered is None else _Memo(key, remembered)
            return out
        memo = module.__dict__[slot] = _Memo(key, remembered)
    remembered = memo.remembered
    if remembered is PLAIN or not remembered.lagging(args[0]):
        return torch_op(*args)
    return _full(fn.__wrapped__, args, {}, True)[0]  # the GPU lags: Kato's kernels
