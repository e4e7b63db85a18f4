"""A user operator's ``[backward]`` section checked against the operator it names.

The section itself (:class:`~kernels.user.model.BackwardModel`) is checked with the spec: its
names are the operator's arguments, its gradients are of floating-point array inputs. What it
says about the *backward* operator can only be checked once that one is known: where it is
registered (``POST /v1/operators``, ``kato operator add``: it must be registered first) and
where ``kato_torch`` builds the gradient (:func:`check_backward`, both times).

Nothing is evaluated as Python: sizes are compared by evaluating the spec's checked
expressions (:mod:`kernels.user.expr`) at a few sample shapes, where the two operators share
their shape names (the backward then runs at the forward's shape); with other shape names the
backward reads its shape from its arguments when it runs, and its call checks the sizes then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kato.kernels.registry import get_operator
from kato.kernels.spec import DTYPES, InvalidInput
from kato.kernels.user.expr import ExpressionError
from kato.kernels.user.model import GRAD_PREFIX, ArgumentModel, OperatorModel, numpy_dtype
from kato.kernels.user.spec import UserOperatorSpec

#: Shapes the sizes of both operators are compared at (per dimension; distinct primes and a
#: round number, so that a size off by a constant or a swapped dimension shows).
SAMPLE_DIMS = ((17, 29, 41, 53, 67, 79, 97, 101), (64, 96, 128, 160, 192, 224, 256, 288))


def source_argument(forward: OperatorModel, source: str) -> tuple[ArgumentModel, bool]:
    """(the forward's argument a ``backward.inputs`` value names, whether it is ``grad:``)."""
    grad = source.startswith(GRAD_PREFIX)
    name = source[len(GRAD_PREFIX) :] if grad else source
    return next(a for a in forward.arguments if a.name == name), grad


def check_backward(forward: OperatorModel, backward: OperatorModel) -> None:
    """Raise :class:`InvalidInput` unless ``backward`` (the operator ``forward.backward``
    names) can be called as the section says: every one of its inputs fed once, every one of
    its outputs a gradient, arrays fed arrays and scalars scalars of the same element type at
    every dtype of ``forward`` (which it must take), its constant-memory arrays among
    ``forward``'s, and, where both have the same shape names, the same sizes."""
    section = forward.backward
    if section is None:
        return
    where, bname = f"{forward.name} backward", backward.name
    if section.operator != bname:
        raise InvalidInput(f"{where}: names {section.operator!r}, not {bname!r}")
    b_inputs = [a.name for a in backward.arguments if not a.output]
    b_outputs = [a.name for a in backward.arguments if a.output]
    for key in section.inputs:
        if key in b_outputs:
            raise InvalidInput(
                f"{where}.inputs.{key}: {key} is an output of {bname}: map it in "
                "backward.gradients to the input whose gradient it is"
            )
        if key not in b_inputs:
            raise InvalidInput(
                f"{where}.inputs.{key}: {bname} has no input {key} (its inputs: "
                f"{', '.join(b_inputs) or 'none'})"
            )
    for key in section.gradients:
        if key not in b_outputs:
            raise InvalidInput(
                f"{where}.gradients.{key}: {bname} has no output {key} (its outputs: "
                f"{', '.join(b_outputs) or 'none'})"
            )
    if missing := [n for n in b_inputs if n not in section.inputs]:
        raise InvalidInput(
            f"{where}.inputs: {bname}'s inputs {', '.join(missing)} are not fed; map each to an "
            f"argument of {forward.name} or to 'grad:<output>'"
        )
    if missing := [n for n in b_outputs if n not in section.gradients]:
        raise InvalidInput(
            f"{where}.gradients: {bname}'s outputs {', '.join(missing)} are no input's "
            f"gradient; map each to an input of {forward.name}"
        )
    if missing := sorted(set(forward.dtypes) - set(backward.dtypes)):
        raise InvalidInput(
            f"{where}: {bname} takes dtypes {', '.join(backward.dtypes)}, but {forward.name} "
            f"runs at {', '.join(missing)} too (the backward runs at the call's dtype)"
        )
    forward_constants = {c.name: c for c in forward.constants}
    for const in backward.constants:
        mine = forward_constants.get(const.name)
        if mine is None:
            raise InvalidInput(
                f"{where}: {bname}'s constant-memory array {const.name} is not one of "
                f"{forward.name}'s ({', '.join(forward_constants) or 'none'}): the backward gets "
                "the call's constants by name"
            )
        _same_dtype(f"{where}: constant {const.name}", const, mine, forward.dtypes, bname,
                    forward.name)  # fmt: skip
    b_args = {a.name: a for a in backward.arguments}
    for key, source in section.inputs.items():
        target = b_args[key]
        arg, grad = source_argument(forward, source)
        if target.size is None and (grad or arg.size is not None):
            raise InvalidInput(
                f"{where}.inputs.{key}: {bname}'s {key} is a scalar; {source!r} is an array"
            )
        if target.size is not None and arg.size is None:
            raise InvalidInput(
                f"{where}.inputs.{key}: {bname}'s {key} is an array; {source!r} is a scalar"
            )
        _same_dtype(f"{where}.inputs.{key}", target, arg, forward.dtypes, bname, forward.name)
    for key, name in section.gradients.items():
        arg = next(a for a in forward.arguments if a.name == name)
        _same_dtype(f"{where}.gradients.{key}", b_args[key], arg, forward.dtypes, bname,
                    forward.name)  # fmt: skip
    if tuple(backward.shape) == tuple(forward.shape):
        _check_sizes(forward, backward, where)


def _same_dtype(
    where: str,
    target: ArgumentModel,
    source: ArgumentModel,
    dtypes: Sequence[str],
    bname: str,
    fname: str,
) -> None:
    for dtype in dtypes:
        want, have = numpy_dtype(target.dtype, dtype), numpy_dtype(source.dtype, dtype)
        if want != have:
            raise InvalidInput(
                f"{where}: {bname}'s {target.name} is {_named(want)}, {fname}'s {source.name} is "
                f"{_named(have)} (at dtype {dtype}); their element types must be the same"
            )


def _named(np_dtype) -> str:
    for name, (value, _, _) in DTYPES.items():
        if value == np_dtype:
            return name
    return str(np_dtype)


def _check_sizes(forward: OperatorModel, backward: OperatorModel, where: str) -> None:
    """Each fed array (and shape-dependent scalar) and each gradient has the same size in both
    operators at :data:`SAMPLE_DIMS` (an expression that fails at a sample is left to the
    call, which checks every size)."""
    section = forward.backward
    assert section is not None
    f_exprs = dict(
        zip((a.name for a in forward.arguments), forward.expressions()["arguments"], strict=True)
    )
    b_exprs = dict(
        zip((a.name for a in backward.arguments), backward.expressions()["arguments"], strict=True)
    )
    pairs = [(f"inputs.{k}", k, source_argument(forward, s)[0].name)
             for k, s in section.inputs.items()]  # fmt: skip
    pairs += [(f"gradients.{k}", k, name) for k, name in section.gradients.items()]
    rank = len(forward.shape)
    for dims in SAMPLE_DIMS:
        for dtype in forward.dtypes:
            env = dict(zip(forward.shape, dims[:rank], strict=True))
            env["itemsize"] = DTYPES[dtype][2]
            for field, key, name in pairs:
                mine, theirs = b_exprs[key], f_exprs[name]
                if not (mine.names - {"itemsize"}) or not (theirs.names - {"itemsize"}):
                    continue  # a scalar given as the caller likes: nothing of the shape
                try:
                    want, have = mine.evaluate(env), theirs.evaluate(env)
                except ExpressionError:
                    continue
                if want != have:
                    at = ", ".join(f"{k}={v}" for k, v in env.items() if k != "itemsize")
                    raise InvalidInput(
                        f"{where}.{field}: {backward.name}'s {key} is {mine} = {want} at {at}, "
                        f"{forward.name}'s {name} is {theirs} = {have}; they must agree"
                    )


def backward_operator(forward: UserOperatorSpec) -> UserOperatorSpec | None:
    """The registered user operator ``forward``'s backward section names, checked against it
    (:func:`check_backward`); ``forward`` itself where the section names its own name; None
    where it has no backward section.

    Raises:
        InvalidInput: no operator of that name is registered (register the backward operator
            first), it is one of Kato's own, or :func:`check_backward` refuses it.
    """
    section = forward.model.backward
    if section is None:
        return None
    if section.operator == forward.name:
        found: Any = forward
    else:
        try:
            found = get_operator(section.operator)
        except InvalidInput:
            raise InvalidInput(
                f"{forward.name} backward: operator {section.operator!r} is not registered; "
                "register the backward operator first (it is an operator of its own, tuned "
                "under its own name)"
            ) from None
        if not isinstance(found, UserOperatorSpec):
            raise InvalidInput(
                f"{forward.name} backward: {section.operator!r} is one of Kato's own operators; "
                "a backward operator is a user operator"
            )
    check_backward(forward.model, found.model)
    return found
