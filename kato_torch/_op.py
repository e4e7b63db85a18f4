"""One Kato operator, callable two ways with the same implementation and autograd formula.

:class:`KatoOp` registers the implementation as a ``torch.library`` custom op
(``torch.ops.kato.<name>``, with its fake implementation and backward), which is what
``torch.compile``, ``torch.export`` and any dispatch mode (fake tensors, functionalization,
FlopCounter, vmap) see. In plain eager mode a call skips the dispatcher's Python layers and runs
the implementation directly, under a :class:`torch.autograd.Function` built from the same
``setup_context`` and backward where a gradient is needed: the custom op's Python dispatch
costs far more than the kernel launch it wraps (see docs/results_h200.md, "kato_torch host
cost"), and a training step launches a few hundred of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode


def eager() -> bool:
    """Whether a call runs as plain eager PyTorch: not traced by torch.compile/export or
    torch.jit.trace, under no dispatch mode and no functorch transform (those need the
    registered custom op: a trace would not see a kernel launched through ctypes)."""
    return not (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or _get_current_dispatch_mode() is not None
        or torch._C._are_functorch_transforms_active()
    )


#: Tensor types the direct path handles; anything else goes through the dispatcher.
_PLAIN = (Tensor, torch.nn.Parameter)


def _direct(args: Iterable[Any]) -> tuple[bool, bool]:
    """(whether every tensor in ``args``, or in a list or tuple among them, is a plain tensor
    the direct path may take, whether any of them requires a gradient): one loop, no
    generator, as this runs on every call."""
    needs_grad = False
    for arg in args:
        for item in arg if isinstance(arg, list | tuple) else (arg,):
            if isinstance(item, Tensor):
                if type(item) not in _PLAIN:
                    return False, False
                needs_grad = needs_grad or item.requires_grad
    return True, needs_grad


def _zero_specs(
    ctx: Any, output: Any, none_ok: tuple[int, ...] = ()
) -> list[tuple[torch.Size, torch.dtype, torch.device] | None]:
    """Per output: (shape, dtype, device) of the zeros its gradient defaults to, or None for
    an output marked non-differentiable in ``ctx`` or whose index is in ``none_ok`` (its
    backward argument stays None)."""
    outputs = output if isinstance(output, tuple) else (output,)
    fixed = {id(t) for t in getattr(ctx, "non_differentiable", None) or ()}
    return [
        (o.shape, o.dtype, o.device)
        if isinstance(o, Tensor) and id(o) not in fixed and i not in none_ok
        else None
        for i, o in enumerate(outputs)
    ]


class KatoOp:
    """``torch.library.custom_op(f"kato::{name}")`` of ``impl``, plus the direct eager path.

    Use as a decorator (``@KatoOp.define("softmax")``); then :meth:`register_fake` and
    :meth:`register_autograd` as on a custom op. Calling the object is calling the operator:
    through ``torch.ops.kato.<name>`` when :func:`eager` is False, else ``impl`` itself (no
    gradient needed) or the equivalent :class:`torch.autograd.Function`. Both paths run the
    same code on the same stream, so results are identical.
    """

    def __init__(self, name: str, impl: Callable[..., Any]):
        self.name = name
        self.impl = impl
        self.custom = torch.library.custom_op(f"kato::{name}", mutates_args=())(impl)
        self.op = getattr(torch.ops.kato, name)
        self._function: type[torch.autograd.Function] | None = None

    @classmethod
    def define(cls, name: str) -> Callable[[Callable[..., Any]], KatoOp]:
        return lambda impl: cls(name, impl)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        return self.custom.register_fake(fake)

    def register_autograd(
        self,
        backward: Callable[..., Any],
        *,
        setup_context: Callable[..., None],
        none_ok: tuple[int, ...] = (),
    ) -> None:
        """The custom op's autograd formula, and the eager Function made of the same two.

        ``none_ok``: indices of differentiable outputs whose gradient ``backward`` takes as
        None when the output was not used (it must also take a tensor: the custom op's path
        may hand it zeros); the others get zeros, as autograd's default."""
        self.custom.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        # The forward takes ctx itself: a Function with a separate setup_context binds its
        # arguments with inspect.signature on every call (tens of microseconds).
        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                output = impl(*args)
                setup_context(ctx, args, output)
                # Autograd would hand the backward a zero tensor for every output without a
                # gradient, statistics and masks included (an allocation and a fill kernel
                # each, every step): only a differentiable output gets one, when unused.
                ctx.set_materialize_grads(False)
                ctx.kato_zeros = _zero_specs(ctx, output, none_ok)
                return output

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                if any(grad is None for grad in grads):  # not `None in`: Tensor.__eq__
                    grads = tuple(
                        torch.zeros(spec[0], dtype=spec[1], device=spec[2])
                        if grad is None and spec is not None
                        else grad
                        for grad, spec in zip(grads, ctx.kato_zeros, strict=True)
                    )
                return backward(ctx, *grads)

        Function.__name__ = Function.__qualname__ = f"Kato_{self.name}"
        self._function = Function

    def __call__(self, *args: Any) -> Any:
        # One pass over the tensors (this runs on every call): a tensor subclass (DTensor, a
        # FakeTensor outside its mode, a quantised wrapper) must reach its __torch_dispatch__
        # through the registered op, not our data_ptr().
        plain, needs_grad = _direct(args)
        if not plain or not eager():
            return self.op(*args)
        if needs_grad and torch.is_grad_enabled():
            if self._function is None:  # no autograd formula (a backward op, double backward):
                return self.op(*args)  # the custom op raises as it always did
            return self._function.apply(*args)
        return self.impl(*args)  # no input needs a gradient: nothing to record
