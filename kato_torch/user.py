"""A user operator (``docs/user_kernels.md``) called on torch tensors.

    add = kato_torch.user_kernel("vector_add_test")
    c = add(a, b, a.numel())          # the spec's arguments in order, less its outputs

:func:`user_kernel` returns a :class:`UserKernel`: called with the operator's non-output
arguments in the spec's order (tensors for arrays, Python numbers for scalars), it reads the
problem's shape from them, allocates the outputs the spec declares (their sizes are the spec's
expressions of the shape), runs the config Kato serves for that shape (or the operator's
default) through :func:`kato_torch.bind` on torch's current stream, and returns the outputs.

The shape is read as the spec defines the arguments: a scalar whose ``value`` is a shape name
gives that dimension; an array whose ``size`` is a shape name gives it as its element count,
and one whose ``size`` is a product of shape names (``"m * k"``) with as many dimensions as
factors gives one each; a dimension that only appears with others or constants (``"n + 1"``)
is solved from the element count where one value fits. Everything the shape then implies is
checked (every size, every shape-dependent scalar). ``shape=`` gives it outright.

A user operator has no PyTorch equivalent, so under the policy ``"auto"`` its calls run Kato's
kernel (:func:`kato_torch.policy.without_framework_equivalent`); under ``"torch"``, or on
tensors that are not on a CUDA device, a call is an error saying so.

Each operator is also a ``torch.library`` custom op, ``torch.ops.kato_user.<name>_<version>``
(one per spec version: a changed spec registered under the same name is another op, and graphs
compiled against the old one keep it; ``_b<digest>`` appended where the spec has a
``[backward]`` section, which the version leaves out: one op per section), with a fake
implementation that reads the shape and sizes the outputs as a call does, in the shape's
SymInts. ``torch.compile``, ``torch.export``, ``make_fx`` and any dispatch mode see that op; a
plain eager call skips the dispatcher and runs the same code directly, as
:class:`kato_torch._op.KatoOp` does for Kato's own operators.

Gradients (docs/user_kernels.md, "Gradients"): the op's autograd formula calls the operator the
spec's ``[backward]`` section names, fed as it maps them, or a Python ``backward(saved,
*grads)`` given to :func:`user_kernel` (then the op is one of its own); an eager call whose
inputs need a gradient goes through the op, so the formula records it. Without either, the
outputs carry no gradient.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import keyword
import math
import numbers
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kato.kernels import InvalidInput, get_operator
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES
from kato.kernels.user.backward import backward_operator, source_argument
from kato.kernels.user.expr import Expression, ExpressionError
from kato.kernels.user.model import GRAD_PREFIX, ArgumentModel, numpy_dtype
from kato.kernels.user.spec import MAX_ELEMENTS, UserOperatorSpec

from kato_torch import policy as _policy
from kato_torch._kernels import MAX_VECTOR_BYTES, bind
from kato_torch._op import _direct, eager

_TORCH_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
    )  # fmt: skip
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
#: Initial contents of an allocated output, where the spec names a fixed one.
_FILLS = {"zeros": torch.zeros, "ones": torch.ones}
#: The ``torch.library`` namespace of user operators (``torch.ops.kato_user.<name>_<version>``).
NAMESPACE = "kato_user"
#: Registered custom ops by qualified name: one per operator name and spec version.
_OPS: dict[str, torch._ops.OpOverload] = {}
_OPS_LOCK = threading.Lock()
#: Schema names of the arguments a call takes besides the operator's own.
_EXTRA = ("shape", "dtype", "constants")
#: Python backward functions given to :func:`user_kernel`, by (op name, identity: see
#: :func:`_identity`): each has an op of its own (``<name>_<version>_py<k>``), as an op's
#: autograd formula is one per op. Kept here, so that an id is never reused for another function.
_PYTHON_BACKWARDS: dict[tuple[Any, ...], tuple[Callable[..., Any], int]] = {}
#: Python backward ops of one operator version past which each new one is warned about: ops are
#: never freed, so a new function per call (a lambda, a closure) piles them up.
MAX_PYTHON_BACKWARDS = 8
#: A Python backward: ``backward(saved, *grads)`` (see :class:`Saved`) -> the input gradients.
Backward = Callable[..., Any]


def _torch_dtype(arg: ArgumentModel, dtype: str) -> torch.dtype:
    return _TORCH_DTYPES[str(numpy_dtype(arg.dtype, dtype))]


def _factors(expression: Expression) -> list[str] | None:
    """The shape names of a size that is a plain product of names (``"m * k"``), else None."""
    names: list[str] = []

    def walk(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            names.append(node.id)
            return True
        return (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mult)
            and walk(node.left)
            and walk(node.right)
        )

    return names if walk(expression.tree.body) else None


@dataclass
class UserCall:
    """One call's plan: the shape and dtype read from the arguments, the allocated outputs
    (spec order) and every kernel argument in the spec's order (tensors and numbers)."""

    shape: tuple[int, ...]
    dtype: str
    outputs: list[torch.Tensor]
    arguments: list[Any]
    #: The constant-memory arrays (name -> tensor on the call's device).
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    #: (given, aligned copy) of each misaligned array of an operator without outputs: such a
    #: kernel works by writing its arrays, so the copies' contents go back after the launch.
    write_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class Saved:
    """What a Python backward (``user_kernel(name, backward=f)``) gets of the forward call:
    ``f(saved, *grads)``, ``grads`` one per output in the spec's order (contiguous; zeros for
    an output that was not used; None for an integer output, which has no gradient).

    ``saved.inputs``: the call's arguments less the outputs, in the spec's order (tensors and
    numbers, as the call was given them); ``saved.outputs``: the outputs; ``saved["x"]``: either by
    its name in the spec; ``saved.constants``: the constant-memory arrays by name;
    ``saved.dtype``: the request dtype; ``saved.needs_input_grad``: per input, whether its
    gradient is wanted (computing the others is wasted work, returning them is allowed)."""

    names: tuple[str, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[torch.Tensor, ...]
    output_names: tuple[str, ...]
    constants: dict[str, torch.Tensor]
    dtype: str
    needs_input_grad: tuple[bool, ...]

    def __getitem__(self, name: str) -> Any:
        if name in self.names:
            return self.inputs[self.names.index(name)]
        if name in self.output_names:
            return self.outputs[self.output_names.index(name)]
        raise KeyError(
            f"{name!r} is no argument of the call (inputs {', '.join(self.names) or 'none'}; "
            f"outputs {', '.join(self.output_names)})"
        )


class UserKernel:
    """A user operator callable on torch tensors. See the module docstring.

    ``backward``: a Python backward for the op's autograd formula (:func:`user_kernel`),
    instead of the spec's ``[backward]`` section."""

    def __init__(self, spec: UserOperatorSpec, backward: Backward | None = None):
        self.spec = spec
        self.name = spec.name
        self.arguments = list(spec.model.arguments)
        self.inputs = [a for a in self.arguments if not a.output]
        self.outputs = [a for a in self.arguments if a.output]
        expressions = spec.model.expressions()
        self._sizes: list[Expression] = expressions["arguments"]
        # Parsed once: parsing every expression of the spec took three quarters of a call.
        self._constant_sizes: list[Expression] = expressions["constants"]
        self._constant_names = [c.name for c in spec.model.constants]
        # Per input, what it is (a plain tuple: torch.compile traces the checks that read it).
        self._kinds = tuple(
            (a.name, "array" if a.size is not None else _scalar_kind(a), a.dtype, a.size)
            for a in self.inputs
        )
        _policy.without_framework_equivalent(spec.name)
        if backward is not None and not callable(backward):
            raise InvalidInput(
                f"{self.name}: backward= must be a function backward(saved, *grads), got "
                f"{type(backward).__name__}"
            )
        if backward is not None and not self.outputs:
            raise InvalidInput(
                f"{self.name} has no output (it writes its arrays): it takes no gradient, so no "
                "backward="
            )
        self._python_backward = backward
        #: Whether the op has an autograd formula computing gradients (a Python backward or
        #: the spec's ``[backward]`` section); without one its outputs carry none.
        self.differentiable = bool(self.outputs) and (
            backward is not None or spec.model.backward is not None
        )
        self._backward_kernel: UserKernel | None = None
        #: The ``torch.library`` custom op (an OpOverload) that traces and compiled graphs call.
        self.op = _custom_op(self)

    def __repr__(self) -> str:
        names = ", ".join(a.name for a in self.inputs)
        return f"kato_torch.user_kernel({self.name!r})({names}) -> {len(self.outputs)} output(s)"

    # --- planning (no GPU) --------------------------------------------------------------------

    def plan(
        self,
        *args: Any,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
        device: torch.device | str | None = None,
        constants: Mapping[str, Any] | None = None,
    ) -> UserCall:
        """Check ``args`` (the non-output arguments, in order), read the shape and dtype from
        them (or take ``shape`` / ``dtype``), and allocate the outputs on their device (or
        ``device``, where no argument is a tensor; default the current CUDA device). An input
        tensor whose data pointer is not 16-byte aligned (a view into its storage) is passed as
        an aligned copy: the kernel was verified on aligned buffers and may load 16-byte vectors.
        ``constants``: the values of the spec's constant-memory arrays, by name (tensors,
        arrays or sequences; copied to the device), required where the spec declares any.

        Raises:
            InvalidInput: a missing or extra argument, a number where an array goes or the
                reverse, a tensor of the wrong dtype, device or size, a non-contiguous tensor,
                a scalar that disagrees with the arrays, or a shape that cannot be read (each
                message names the argument and what to pass).
        """
        self._check_kinds(args)
        given, where, dtype = self._given(args, dtype, device)
        shape = self._shape(given, dtype) if shape is None else tuple(int(s) for s in shape)
        shape, env = self._checked(given, shape, dtype)
        outputs, arguments, write_back = [], [], []
        for arg, size in zip(self.arguments, self._sizes, strict=True):
            if not arg.output:
                value = given[arg.name]
                if arg.size is None:  # a Python number, as the launch's ctypes take it
                    kind = numpy_dtype(arg.dtype, dtype).kind
                    value = int(value) if kind in "iu" else float(value)
                elif value.data_ptr() % MAX_VECTOR_BYTES:
                    # A view a few elements into its storage: a user kernel may load vectors of
                    # up to 16 bytes (it was verified on fresh, aligned buffers), and nothing
                    # says which of its parameters could be narrowed, so it gets aligned copies.
                    copy = value.clone()
                    if not self.outputs:
                        write_back.append((value, copy))
                    value = copy
                arguments.append(value)
                continue
            dims = self._output_dims(size, env)
            fill = _FILLS.get(arg.init or "zeros", torch.empty)
            out = fill(dims, dtype=_torch_dtype(arg, dtype), device=where)
            if arg.init == "index":
                out = torch.arange(math.prod(dims), device=where).to(out.dtype).reshape(dims)
            outputs.append(out)
            arguments.append(out)
        return UserCall(
            shape,
            dtype,
            outputs,
            arguments,
            self._constants(constants, env, dtype, where),
            write_back,
        )

    def _check_kinds(self, args: Sequence[Any]) -> None:
        """Raise InvalidInput unless ``args`` are as many as the inputs, tensors for arrays and
        numbers for scalars."""
        if len(args) != len(self._kinds):
            raise InvalidInput(
                f"{self.name} takes {len(self.inputs)} arguments "
                f"({', '.join(a.name for a in self.inputs) or 'none'}; outputs "
                f"{', '.join(a.name for a in self.outputs) or 'none'} are allocated), "
                f"got {len(args)}"
            )
        for (name, kind, dtype, size), value in zip(self._kinds, args, strict=True):
            if kind == "array":
                if not isinstance(value, torch.Tensor):
                    raise InvalidInput(
                        f"{self.name}: argument {name} is an array ({dtype}, size {size}); "
                        f"pass a tensor, got {type(value).__name__}"
                    )
            elif not _is_number(value):
                raise InvalidInput(
                    f"{self.name}: argument {name} is a scalar ({dtype}); pass a number, "
                    f"got {type(value).__name__}"
                )

    def _given(
        self, args: Sequence[Any], dtype: str | None, device: Any
    ) -> tuple[dict[str, Any], torch.device, str]:
        """(the arguments by name, the device of the call, the request dtype), after checking
        the tensors' device, dtype and layout and the integer scalars."""
        spec = self.spec
        given = dict(zip((a.name for a in self.inputs), args, strict=True))
        devices = {v.device for v in args if isinstance(v, torch.Tensor)}
        if len(devices) > 1:
            raise InvalidInput(
                f"{self.name}: tensors on several devices: {sorted(map(str, devices))}"
            )
        where = devices.pop() if devices else torch.device(device or "cuda")
        dtype = dtype or self._dtype(given)
        if dtype not in spec.dtypes:
            raise InvalidInput(
                f"{self.name} takes dtype {', '.join(spec.dtypes)}; the arguments are {dtype}"
            )
        for arg in self.inputs:
            value = given[arg.name]
            if arg.size is None:
                if numpy_dtype(arg.dtype, dtype).kind in "iu" and not _integral(value):
                    raise InvalidInput(
                        f"{self.name}: scalar {arg.name} is {arg.dtype}; got {value!r}"
                    )
                continue
            want = _torch_dtype(arg, dtype)
            if value.dtype != want:
                raise InvalidInput(
                    f"{self.name}: argument {arg.name} must be {want}, got {value.dtype}"
                )
            if not value.is_contiguous():
                raise InvalidInput(
                    f"{self.name}: argument {arg.name} is not contiguous; pass .contiguous()"
                )
        return given, where, dtype

    def _checked(
        self, given: Mapping[str, Any], shape: Sequence[int], dtype: str, *, traced: bool = False
    ) -> tuple[tuple[int, ...], dict[str, Any]]:
        """(``shape`` validated, its environment), after checking every array's element count
        and every shape-dependent scalar against it. ``traced``: the sizes and scalars may be
        SymInts, compared here at the values they have now (the call checks them again)."""
        spec = self.spec
        shape = spec.validate(shape, dtype)
        env = self._env(shape, dtype)
        for arg, size in zip(self.arguments, self._sizes, strict=True):
            if arg.output:
                continue
            value = given[arg.name]
            if arg.size is not None:
                count = value.numel()
                if traced:
                    count = _hint(count)
                if count != (want := _value(size, env)):
                    raise InvalidInput(
                        f"{self.name}: argument {arg.name} has {count} elements; at shape "
                        f"{_named(spec, shape)} its size {arg.size} is {want}"
                    )
            elif size.names - {"itemsize"}:
                if traced:
                    value = _hint(value)
                if not _same(value, want := size.evaluate(env)):
                    raise InvalidInput(
                        f"{self.name}: scalar {arg.name} is {value!r}; at shape "
                        f"{_named(spec, shape)} it must be {arg.value} = {want}"
                    )
        return shape, env

    def _constants(
        self, given: Mapping[str, Any] | None, env: Mapping[str, Any], dtype: str, where: Any
    ) -> dict[str, torch.Tensor]:
        declared = self.spec.model.constants
        self._check_constant_names(given)
        out = {}
        for const, size in zip(declared, self._constant_sizes, strict=True):
            want = _value(size, env)
            value = torch.as_tensor((given or {})[const.name], device=where)
            value = value.to(_torch_dtype(const, dtype)).contiguous().reshape(-1)
            if value.numel() != want:
                raise InvalidInput(
                    f"{self.name}: constant {const.name} has {value.numel()} elements; its "
                    f"size {const.size} is {want}"
                )
            out[const.name] = value
        return out

    def _check_constant_names(self, given: Mapping[str, Any] | None) -> None:
        names = sorted(self._constant_names)
        if sorted(given or {}) != names:
            raise InvalidInput(
                f"{self.name}: constants= must give its constant-memory arrays "
                f"{names or 'none'}; got {sorted(given or {}) or 'none'}"
            )

    def _dtype(self, given: Mapping[str, Any]) -> str:
        """The request dtype: that of the arrays declared with the request's dtype."""
        seen = {
            _DTYPE_NAMES.get(given[a.name].dtype, str(given[a.name].dtype))
            for a in self.inputs
            if a.size is not None and a.dtype == "dtype"
        }
        if len(seen) > 1:
            raise InvalidInput(
                f"{self.name}: the arrays of the request's dtype disagree: {sorted(seen)}"
            )
        return seen.pop() if seen else self.spec.dtypes[0]

    def _env(self, shape: Sequence[int], dtype: str) -> dict[str, Any]:
        env: dict[str, Any] = dict(zip(self.spec.shape_names, shape, strict=True))
        env["itemsize"] = DTYPES[dtype][2] if dtype in DTYPES else 4
        return env

    def _shape(self, given: Mapping[str, Any], dtype: str) -> tuple[int, ...]:
        """The shape read from the arguments (see the module docstring)."""
        names = set(self.spec.shape_names)
        known: dict[str, int] = {}
        targets: list[tuple[Expression, int]] = []  # (expression, the value it must take)
        for arg, size in zip(self.arguments, self._sizes, strict=True):
            if arg.output:
                continue
            value = given[arg.name]
            if arg.size is None:
                if not _integral(value):
                    continue  # a float scalar tells no dimension
                # A SymInt (a trace) stays one: the outputs are sized in the shape's symbols.
                target = value if isinstance(value, torch.SymInt) else int(value)
                dims = None
            else:
                target, dims = value.numel(), tuple(value.shape)
            factors = _factors(size)
            if factors and set(factors) <= names and len(factors) == 1:
                known.setdefault(factors[0], target)
            elif factors and set(factors) <= names and dims and len(dims) == len(factors):
                for name, dim in zip(factors, dims, strict=True):
                    known.setdefault(name, dim)
            elif size.names & names:
                targets.append((size, target))
        progress = True
        while progress and names - set(known):
            progress = False
            for size, target in targets:
                unknown = (size.names & names) - set(known)
                if len(unknown) == 1:
                    (name,) = unknown
                    # Bisection needs numbers: in a trace, int() guards on (specialises) the
                    # sizes it reads, so a compiled graph is reused only where they are the same.
                    env = self._env_partial(
                        {n: int(known[n]) for n in size.names & known.keys()}, dtype
                    )
                    found = _solve(size, name, int(target), env)
                    if found is not None:
                        known[name] = found
                        progress = True
        missing = [n for n in self.spec.shape_names if n not in known]
        if missing:
            raise InvalidInput(
                f"{self.name}: cannot read {', '.join(missing)} of the shape "
                f"({'x'.join(self.spec.shape_names)}) from the arguments; pass shape=(...)"
            )
        return tuple(known[n] for n in self.spec.shape_names)

    def _env_partial(self, known: Mapping[str, int], dtype: str) -> dict[str, Any]:
        return {**known, "itemsize": DTYPES[dtype][2] if dtype in DTYPES else 4}

    def _output_dims(self, size: Expression, env: Mapping[str, Any]) -> tuple[int, ...]:
        """An output's dimensions: the factors of a product of shape names, else one."""
        factors = _factors(size)
        if factors and len(factors) > 1 and set(factors) <= set(self.spec.shape_names):
            return tuple(env[f] for f in factors)
        return (_value(size, env),)

    def _traced_dims(
        self, size: Expression, env: Mapping[str, Any], env_now: Mapping[str, Any]
    ) -> tuple[Any, ...]:
        """An output's dimensions in a trace: in the shape's SymInts where every step of its
        size is one :func:`_symbolic` follows and it agrees with the value at ``env_now``; else
        the value at the sizes the trace then guards on (int() of each symbol), so that the
        graph is reused only where they are the same."""
        if all(type(v) is not torch.SymInt for v in env.values()):
            return self._output_dims(size, env)
        factors = _factors(size)
        if factors and len(factors) > 1 and set(factors) <= set(self.spec.shape_names):
            return tuple(env[f] for f in factors)  # one shape name per dimension
        try:
            value = _symbolic(size.tree.body, env)
        except (_NotSymbolic, ZeroDivisionError):
            value = None
        if value is not None and _hint(value) == _value(size, env_now):
            return (value,)
        guarded = {k: int(v) if k in size.names else v for k, v in env.items()}
        return self._output_dims(size, guarded)

    # --- the custom op ------------------------------------------------------------------------

    def _fake(self, args: Sequence[Any]) -> Any:
        """The custom op's fake implementation: the checks of a call, the shape read from the
        arguments (SymInts where they are), and empty outputs of the sizes the call allocates,
        each an expression of the shape in SymInts where :func:`_symbolic` follows it."""
        count = len(self._kinds)
        inputs, (shape, dtype, constants) = args[:count], args[count:]
        given, where, dtype = self._given(inputs, dtype, None)
        traced = tuple(shape) if shape is not None else self._shape(given, dtype)
        now = tuple(_hint(s) for s in traced)
        _, env_now = self._checked(given, now, dtype, traced=True)
        for const, value, size in zip(
            self.spec.model.constants, constants, self._constant_sizes, strict=True
        ):
            if (elements := _hint(value.numel())) != (want := _value(size, env_now)):
                raise InvalidInput(
                    f"{self.name}: constant {const.name} has {elements} elements; its size "
                    f"{const.size} is {want}"
                )
        env = self._env(traced, dtype)
        outputs = []
        for arg, size in zip(self.arguments, self._sizes, strict=True):
            if arg.output:
                dims = self._traced_dims(size, env, env_now)
                outputs.append(torch.empty(dims, dtype=_torch_dtype(arg, dtype), device=where))
        return _returned(outputs)

    def _real(self, args: Sequence[Any]) -> Any:
        """The custom op's implementation: the eager call."""
        count = len(self._kinds)
        inputs, (shape, dtype, constants) = args[:count], args[count:]
        given = dict(zip(self._constant_names, constants, strict=True)) or None
        out = self._launch(*inputs, shape=shape, dtype=dtype, constants=given)
        return out if self.outputs else None

    def _call_op(
        self,
        args: Sequence[Any],
        shape: Sequence[int] | None,
        dtype: str | None,
        constants: Mapping[str, Any] | None,
    ) -> Any:
        """A call through the custom op (a trace, a dispatch mode, a tensor subclass): the
        checks that the schema would answer with a TypeError are made first, with Kato's
        messages; the scalars are converted as the schema takes them."""
        self._check_kinds(args)
        self._check_constant_names(constants)
        values = []
        for (name, kind, scalar_dtype, _), value in zip(self._kinds, args, strict=True):
            if kind == "int" and isinstance(value, float):
                if not value.is_integer():
                    raise InvalidInput(
                        f"{self.name}: scalar {name} is {scalar_dtype}; got {value!r}"
                    )
                value = int(value)
            elif kind == "float" and isinstance(value, int | torch.SymInt):
                value = torch.sym_float(value)
            values.append(value)
        tables = [
            v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
            for v in ((constants or {})[n] for n in self._constant_names)
        ]
        out = self.op(*values, None if shape is None else list(shape), dtype, tables)
        if not self.outputs:
            return ()
        return out

    # --- gradients ----------------------------------------------------------------------------

    def backward_kernel(self) -> UserKernel:
        """The user kernel of the spec's ``[backward]`` operator (itself where it names its own
        name), resolved from the registry on first use and checked against this one.

        Raises:
            InvalidInput: the spec has no backward section, its operator is not registered, or
                it does not fit this one (:func:`kato.kernels.user.backward.check_backward`).
        """
        if self._backward_kernel is None:
            if self.spec.model.backward is None:
                raise InvalidInput(f"{self.name}'s spec has no [backward] section")
            found = backward_operator(self.spec)
            self._backward_kernel = self if found is self.spec else UserKernel(found)
        return self._backward_kernel

    def _setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        """The op's autograd context: integer outputs marked non-differentiable; saved, the
        arguments the backward reads (the Python backward: all; a declared one: those its
        section names), the request dtype, the inputs' shapes and, for a declared backward
        with the same shape names, the call's shape."""
        count = len(self._kinds)
        args, (shape, dtype, constants) = inputs[:count], inputs[count:]
        outputs = output if isinstance(output, tuple) else (output,)
        fixed = [o for o in outputs if not o.dtype.is_floating_point]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        given = dict(zip((a.name for a in self.inputs), args, strict=True))
        dtype = dtype or self._dtype(given)
        section = self.spec.model.backward if self._python_backward is None else None
        ctx.kato_shape = None
        if section is not None:
            backward = self.backward_kernel()  # resolved (and checked) at the forward call
            wanted = {
                source_argument(self.spec.model, s)[0].name
                for s in section.inputs.values()
                if not s.startswith(GRAD_PREFIX)
            }
            if backward.spec.shape_names == self.spec.shape_names:
                ctx.kato_shape = tuple(shape) if shape is not None else self._shape(given, dtype)
        else:
            wanted = {a.name for a in self.arguments}
        tensors: list[torch.Tensor] = []
        slots: list[Any] = []  # per argument in spec order: ("t", i), ("v", value) or None
        ins, outs = iter(args), iter(outputs)
        for arg in self.arguments:
            value = next(outs) if arg.output else next(ins)
            if arg.name not in wanted:
                slots.append(None)
            elif isinstance(value, torch.Tensor):
                slots.append(("t", len(tensors)))
                tensors.append(value)
            else:
                slots.append(("v", value))
        ctx.kato_slots = slots
        ctx.kato_constants = len(constants)
        ctx.save_for_backward(*tensors, *constants)
        ctx.kato_dtype = dtype
        ctx.kato_input_shapes = tuple(
            tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in args
        )
        ctx.kato_outputs = tuple((tuple(o.shape), o.dtype, o.device) for o in outputs)

    def _saved(self, ctx: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(the saved arguments by name, the constants by name) of ``ctx``."""
        saved = ctx.saved_tensors
        constants = saved[len(saved) - ctx.kato_constants :]
        values = {}
        for arg, slot in zip(self.arguments, ctx.kato_slots, strict=True):
            if slot is not None:
                values[arg.name] = saved[slot[1]] if slot[0] == "t" else slot[1]
        return values, dict(zip(self._constant_names, constants, strict=True))

    def _backward(self, ctx: Any, *grads: Any) -> tuple[Any, ...]:
        """The op's backward: the input gradients from the Python backward or the declared
        backward operator, each shaped as its input; None for scalars, the shape, the dtype
        and the constants."""
        count = len(self._kinds)
        needs = tuple(ctx.needs_input_grad[:count])
        grads = tuple(
            None if g is None or not g.dtype.is_floating_point else g.contiguous() for g in grads
        )
        values, constants = self._saved(ctx)
        if self._python_backward is not None:
            saved = Saved(
                tuple(a.name for a in self.inputs),
                tuple(values[a.name] for a in self.inputs),
                tuple(values[a.name] for a in self.outputs),
                tuple(a.name for a in self.outputs),
                constants,
                ctx.kato_dtype,
                needs,
            )
            result = self._python_backward(saved, *grads)
            gradients = self._gradients_returned(result)
        elif any(needs):
            gradients = self._declared_backward(ctx, values, constants, grads, needs)
        else:
            gradients = [None] * count
        out: list[Any] = []
        for arg, grad, shape, wanted in zip(
            self.inputs, gradients, ctx.kato_input_shapes, needs, strict=True
        ):
            if grad is not None and shape is None:
                raise InvalidInput(
                    f"{self.name} backward: input {arg.name} is a scalar; its gradient must be None"
                )
            if grad is None or not wanted:
                out.append(None)
                continue
            if not isinstance(grad, torch.Tensor):
                raise InvalidInput(
                    f"{self.name} backward: the gradient of {arg.name} must be a tensor or None, "
                    f"got {type(grad).__name__}"
                )
            if grad.numel() != math.prod(shape):
                raise InvalidInput(
                    f"{self.name} backward: the gradient of {arg.name} has {grad.numel()} "
                    f"elements; {arg.name} has {math.prod(shape)} ({tuple(shape)})"
                )
            out.append(grad.reshape(shape))
        # shape, dtype, constants (a list: torch.library unflattens the gradients as inputs)
        return (*out, None, None, [None] * ctx.kato_constants)

    def _gradients_returned(self, result: Any) -> list[Any]:
        """A Python backward's answer as one entry per input: a sequence in the inputs' order,
        a mapping by name (missing names: None), or one tensor (or None) where there is one
        input."""
        names = [a.name for a in self.inputs]
        if isinstance(result, Mapping):
            unknown = sorted(set(result) - set(names))
            if unknown:
                raise InvalidInput(
                    f"{self.name} backward: returned gradients of {', '.join(map(str, unknown))}, "
                    f"which are not its inputs ({', '.join(names)})"
                )
            return [result.get(n) for n in names]
        if len(names) == 1 and (result is None or isinstance(result, torch.Tensor)):
            return [result]
        if not isinstance(result, Sequence) or len(result) != len(names):
            got = len(result) if isinstance(result, Sequence) else type(result).__name__
            raise InvalidInput(
                f"{self.name} backward: return one gradient (or None) per input "
                f"({', '.join(names)}), as a sequence or a dict by name; got {got}"
            )
        return list(result)

    def _declared_backward(
        self,
        ctx: Any,
        values: Mapping[str, Any],
        constants: Mapping[str, torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        needs: Sequence[bool],
    ) -> list[Any]:
        """Call the spec's backward operator as its section says; its outputs by input."""
        section = self.spec.model.backward
        assert section is not None
        backward = self.backward_kernel()
        out_names = [a.name for a in self.outputs]
        args = []
        for arg in backward.inputs:
            source = section.inputs[arg.name]
            if source.startswith(GRAD_PREFIX):
                name = source[len(GRAD_PREFIX) :]
                index = out_names.index(name)
                grad = grads[index]
                if grad is None:  # not materialised (the output was not used): zeros
                    shape, dtype, device = ctx.kato_outputs[index]
                    grad = torch.zeros(shape, dtype=dtype, device=device)
                args.append(grad)
            else:
                args.append(values[source])
        result = backward(
            *args,
            shape=ctx.kato_shape,
            dtype=ctx.kato_dtype,
            constants={c: constants[c] for c in backward._constant_names} or None,
        )
        results = result if isinstance(result, tuple) else (result,)
        gradients: list[Any] = [None] * len(self.inputs)
        index = {a.name: i for i, a in enumerate(self.inputs)}
        for arg, value in zip(backward.outputs, results, strict=True):
            gradients[index[section.gradients[arg.name]]] = value
        if (
            torch.is_grad_enabled()  # a double backward (create_graph=True) records this one
            and not backward.differentiable
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        ):
            gradients = _once_differentiable(
                gradients,
                f"{self.name} backward: its operator {backward.name} has no gradient of its own "
                "(no [backward] section), so the gradients it computed cannot be differentiated "
                "again (create_graph=True); give it a [backward] section, or differentiate once",
            )
        return gradients

    # --- running ------------------------------------------------------------------------------

    def __call__(
        self,
        *args: Any,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
        constants: Mapping[str, Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the operator on ``args`` (see :meth:`plan`); return its output (or outputs, a
        tuple in the spec's order). The constant-memory arrays are copied into the kernel's
        module on torch's current stream before the launch (ordered with it; calls of one
        operator at one shape on two streams at once with different constants would race).

        Under ``torch.compile`` (or ``torch.export``, ``make_fx``, a dispatch mode, a tensor
        subclass) the call is the custom op :attr:`op`, which runs the same code; in plain
        eager mode it skips the dispatcher.

        Raises:
            InvalidInput: what :meth:`plan` raises; tensors not on a CUDA device, or a policy
                of ``"torch"`` for this operator (there is no PyTorch implementation of it).
        """
        plain, needs_grad = _direct(args)
        if (
            not plain
            or not eager()
            or (needs_grad and self.differentiable and torch.is_grad_enabled())
        ):  # a gradient is recorded by the op's autograd formula
            return self._call_op(args, shape, dtype, constants)
        return self._launch(*args, shape=shape, dtype=dtype, constants=constants)

    def _launch(
        self,
        *args: Any,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
        constants: Mapping[str, Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The eager call: plan, check the device and the policy, bind and launch."""
        call = self.plan(*args, shape=shape, dtype=dtype, constants=constants)
        device = call.outputs[0].device if call.outputs else _device_of(args)
        if device.type != "cuda":
            raise InvalidInput(
                f"{self.name} is a user CUDA kernel with no PyTorch implementation; its "
                f"tensors must be on a CUDA device, not {device.type}"
            )
        if not _policy.decide(self.name, call.shape, call.dtype, device.type):
            raise InvalidInput(
                f"the kato_torch policy for {self.name!r} is 'torch', but a user operator has "
                "no PyTorch implementation; set it to 'auto' or 'kato'"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        bound = bind(self.name, call.shape, call.dtype, index, spec=self.spec)
        if call.constants:
            _upload_constants(bound, call.constants, index)
        bound.run(call.arguments)
        for given, copy in call.write_back:
            given.copy_(copy)
        if len(call.outputs) == 1:
            return call.outputs[0]
        return tuple(call.outputs)


def user_kernel(
    operator: str | UserOperatorSpec, *, backward: Backward | None = None
) -> UserKernel:
    """The user operator ``operator`` (a registered name, or a spec, which is registered) as
    a function of torch tensors (:class:`UserKernel`).

    Gradients (docs/user_kernels.md, "Gradients"): the spec's ``[backward]`` section, or
    ``backward``, a Python function ``backward(saved, *grads)`` given what the forward call saw
    (:class:`Saved`) and one gradient per output, returning the input gradients (a sequence in
    the inputs' order or a dict by name; None where there is none; each reshaped to its input).
    It runs where the call's backward runs, in this process, and may call user kernels itself.
    Without either, the outputs carry no gradient.

    Raises:
        InvalidInput: no operator of that name, or one that is not a user operator (Kato's
            own have their functions in :mod:`kato_torch.ops`); ``backward`` not callable, or
            given for an operator without outputs.
    """
    if isinstance(operator, UserOperatorSpec):
        try:
            current = get_operator(operator.name)
        except InvalidInput:
            current = None
        if current is not operator:
            register(operator)
        spec: Any = operator
    else:
        spec = get_operator(operator)
    if not isinstance(spec, UserOperatorSpec):
        raise InvalidInput(
            f"{spec.name!r} is one of Kato's own operators, not a user operator; call its "
            "function in kato_torch (e.g. kato_torch.softmax)"
        )
    return UserKernel(spec, backward=backward)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real | torch.SymInt | torch.SymFloat) and not isinstance(
        value, bool
    )


def _scalar_kind(arg: ArgumentModel) -> str:
    """ "int" or "float": how the schema takes a scalar argument (its dtype is fixed)."""
    return "int" if numpy_dtype(arg.dtype, "float32").kind in "iu" else "float"


def _hint(value: Any) -> Any:
    """A SymInt's (SymFloat's) value in the example the trace runs on, without a guard; a
    number as it is."""
    if isinstance(value, torch.SymInt | torch.SymFloat):
        hint = value.node.hint
        if hint is not None:
            return hint
        return int(value) if isinstance(value, torch.SymInt) else float(value)
    return value


def _non_differentiable(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """The custom op's autograd context: its outputs carry no gradient."""
    outputs = output if isinstance(output, tuple) else (output,)
    ctx.mark_non_differentiable(*(o for o in outputs if isinstance(o, torch.Tensor)))
    ctx.inputs = len(inputs)


def _no_gradient(ctx: Any, *grads: Any) -> tuple[None, ...]:
    return (None,) * ctx.inputs


def _returned(outputs: list[torch.Tensor]) -> Any:
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


class _NotSymbolic(Exception):
    """An expression :func:`_symbolic` does not follow in SymInts."""


_SYMBOLIC_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


def _symbolic(node: ast.AST, env: Mapping[str, Any]) -> Any:
    """The integer an expression's (already checked) tree gives over ``env``, whose values may
    be SymInts: names, integer constants, ``+ - * // %``, unary minus, ``min``/``max`` and
    ``ceil``/``floor`` of a quotient. Anything else raises :class:`_NotSymbolic`."""
    if isinstance(node, ast.Constant):
        if type(node.value) is int:
            return node.value
        raise _NotSymbolic
    if isinstance(node, ast.Name):
        value = env[node.id]
        if isinstance(value, int | torch.SymInt) and not isinstance(value, bool):
            return value
        raise _NotSymbolic
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLIC_BINARY:
        left, right = _symbolic(node.left, env), _symbolic(node.right, env)
        return _SYMBOLIC_BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _symbolic(node.operand, env)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name, args = node.func.id, node.args
        if name in ("min", "max") and args:
            values = [_symbolic(a, env) for a in args]
            pick = torch.sym_min if name == "min" else torch.sym_max
            out = values[0]
            for value in values[1:]:
                out = pick(out, value)
            return out
        if (
            name in ("ceil", "floor")
            and len(args) == 1
            and isinstance(args[0], ast.BinOp)
            and isinstance(args[0].op, ast.Div)
        ):
            top, bottom = _symbolic(args[0].left, env), _symbolic(args[0].right, env)
            return -((-top) // bottom) if name == "ceil" else top // bottom
    raise _NotSymbolic


def _schema_name(name: str, taken: set[str]) -> str:
    """An argument's name in the schema: the spec's, unless it is a Python keyword or one of
    the call's own arguments (then with underscores appended)."""
    while keyword.iskeyword(name) or name in ("self", "out", *_EXTRA) or name in taken:
        name += "_"
    taken.add(name)
    return name


def _custom_op(kernel: UserKernel) -> torch._ops.OpOverload:
    """The ``torch.library`` custom op of ``kernel``'s operator at its spec version and
    autograd formula: registered on first use (one definition per version and formula; a graph
    compiled against one keeps calling it). The version leaves the spec's ``[backward]``
    section out, and an op has one formula, so a section gets an op of its own
    (``<name>_<version>_b<digest of the section>``), as a Python backward does (``_py<k>``)."""
    spec = kernel.spec
    op_name = f"{re.sub(r'[^0-9a-zA-Z_]', '_', spec.name)}_{spec.version}"
    section = spec.model.backward
    with _OPS_LOCK:
        function = kernel._python_backward
        if function is not None:  # an op per backward function: one formula per op
            key = (op_name, *_identity(function))
            if key not in _PYTHON_BACKWARDS:
                number = 1 + sum(1 for k in _PYTHON_BACKWARDS if k[0] == op_name)
                _PYTHON_BACKWARDS[key] = (function, number)
                if number > MAX_PYTHON_BACKWARDS:
                    warnings.warn(
                        f"{spec.name}: {number} Python backward functions, each with an op of "
                        f"its own ({NAMESPACE}::{op_name}_py<k>, never freed): give "
                        "user_kernel the same function each time (one defined once), not a "
                        "new lambda or closure per call",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            op_name = f"{op_name}_py{_PYTHON_BACKWARDS[key][1]}"
        elif section is not None:
            digest = hashlib.sha256(section.model_dump_json().encode()).hexdigest()[:8]
            op_name = f"{op_name}_b{digest}"
        qualname = f"{NAMESPACE}::{op_name}"
        found = _OPS.get(qualname)
        if found is not None:
            return found
        taken: set[str] = set()
        mutable = not kernel.outputs  # no output: it can only work by writing its arrays
        params, mutated = [], []
        for i, (name, kind, _, _) in enumerate(kernel._kinds):
            schema_name = _schema_name(name, taken)
            if kind == "array":
                params.append(
                    f"Tensor(a{i}!) {schema_name}" if mutable else f"Tensor {schema_name}"
                )
                if mutable:
                    mutated.append(schema_name)
            else:
                params.append(f"{'SymInt' if kind == 'int' else 'float'} {schema_name}")
        params += ["SymInt[]? shape", "str? dtype", "Tensor[] constants"]
        returns = ", ".join("Tensor" for _ in kernel.outputs)
        returns = returns if len(kernel.outputs) == 1 else f"({returns})"
        schema = f"({', '.join(params)}) -> {returns}"
        # Inductor hands the op its inputs with the strides eager mode gives them, so a
        # non-contiguous array is refused compiled as it is in eager mode, not copied.
        exact = getattr(torch.Tag, "needs_exact_strides", None)
        custom = torch.library.custom_op(
            qualname,
            lambda *args: kernel._real(args),
            mutates_args=tuple(mutated),
            schema=schema,
            tags=(exact,) if exact is not None else None,
        )
        custom.register_fake(lambda *args: kernel._fake(args))
        if kernel.differentiable:  # the spec's [backward], or a Python backward
            custom.register_autograd(kernel._backward, setup_context=kernel._setup_context)
        elif not mutable:  # torch.library takes no formula for an op that mutates its inputs
            # No gradient, as an eager call's outputs have none; without a formula, compiling
            # a call on an input that requires grad failed ("no autograd formula registered").
            custom.register_autograd(_no_gradient, setup_context=_non_differentiable)
        op = getattr(getattr(torch.ops, NAMESPACE), op_name).default
        _OPS[qualname] = op
        return op


def _once_differentiable(gradients: list[Any], why: str) -> list[Any]:
    """``gradients`` whose own gradient raises ``why``, as those of a function marked
    ``torch.autograd.function.once_differentiable`` do: computed by a kernel that records no
    gradient, a double backward through them would otherwise leave their terms out silently
    (a gradient penalty's, say)."""
    at = [i for i, g in enumerate(gradients) if isinstance(g, torch.Tensor)]
    if not at:
        return gradients
    error = torch._C._functions.DelayedError(why.encode(), len(at))
    wrapped = error(*(gradients[i].detach().requires_grad_() for i in at))
    out = list(gradients)
    for i, value in zip(at, wrapped if isinstance(wrapped, tuple) else (wrapped,), strict=True):
        out[i] = value
    return out


def _identity(function: Callable[..., Any]) -> tuple[int, ...]:
    """Who a Python backward is: a bound method by its function and instance (each attribute
    access makes a new bound-method object: ``backward=self.grad`` is one backward for one
    ``self``), anything else by itself."""
    if inspect.ismethod(function):
        return id(function.__func__), id(function.__self__)
    return (id(function),)


def _same(value: Any, want: Any) -> bool:
    """Whether a scalar given is the one the shape implies (floats to float32's precision)."""
    if isinstance(want, float) or isinstance(value, float):
        return math.isclose(float(value), float(want), rel_tol=1e-6, abs_tol=1e-30)
    return value == want


def _integral(value: Any) -> bool:
    if isinstance(value, int | torch.SymInt):  # float() of a SymInt would guard on its value
        return True
    try:
        return float(value).is_integer()
    except (TypeError, ValueError, OverflowError):
        return False


def _value(expression: Expression, env: Mapping[str, Any]) -> int:
    value = expression.evaluate(env)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"{expression} is {value!r}, not an integer")
    return value


def _named(spec: UserOperatorSpec, shape: Sequence[int]) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(spec.shape_names, shape, strict=True))


def _device_of(args: Sequence[Any]) -> torch.device:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cuda")


def _upload_constants(bound: Any, constants: Mapping[str, torch.Tensor], index: int) -> None:
    """Copy ``constants`` into the ``__constant__`` globals of ``bound``'s module for torch's
    current stream (:meth:`BoundOperator.calls_on`; the module found from a loaded function:
    cuFuncGetModule), on that stream."""
    import ctypes

    from kato_torch import _driver

    lib = _driver._driver()
    _driver.ensure_context(index)
    handle = torch.cuda.current_stream(index).cuda_stream
    module = ctypes.c_void_p()
    _driver._check(
        lib.cuFuncGetModule(ctypes.byref(module), bound.calls_on(handle)[0].func),
        "cuFuncGetModule",
    )
    stream = ctypes.c_void_p(handle)
    for name, values in constants.items():
        pointer, size = ctypes.c_uint64(), ctypes.c_size_t()
        found = lib.cuModuleGetGlobal_v2(
            ctypes.byref(pointer), ctypes.byref(size), module, name.encode()
        )
        if found != 0:
            raise InvalidInput(f"{bound.spec.name}: the kernel declares no __constant__ {name}")
        nbytes = values.numel() * values.element_size()
        if size.value < nbytes:
            raise InvalidInput(
                f"{bound.spec.name}: __constant__ {name} holds {size.value} B; the array is "
                f"{nbytes} B"
            )
        _driver._check(
            lib.cuMemcpyDtoDAsync_v2(
                pointer, ctypes.c_uint64(values.data_ptr()), ctypes.c_size_t(nbytes), stream
            ),
            f"copying constant {name}",
        )


def _solve(expression: Expression, name: str, target: int, env: Mapping[str, Any]) -> int | None:
    """The one value of ``name`` from 1 to :data:`MAX_ELEMENTS` at which ``expression`` is
    ``target``, found by bisection (sizes grow with the dimensions), or None where none is or
    several neighbouring ones are (``ceil(n / 32)``: pass the shape)."""

    def at(v: int) -> float:
        try:
            value = expression.evaluate({**env, name: v})
        except ExpressionError:
            return math.nan
        return float(value) if isinstance(value, int | float) else math.nan

    lo, hi = 1, MAX_ELEMENTS
    if not at(lo) <= target <= at(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid) < target:
            lo = mid + 1
        else:
            hi = mid
    if at(lo) != target or at(lo + 1) == target:
        return None
    return lo
