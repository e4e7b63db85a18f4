"""Safe evaluation of the expressions in a user operator's spec (restrictions, sizes, geometry).

A spec sent to the API is never run as Python: its expressions are parsed with :mod:`ast` and
evaluated by walking a whitelist of node types. What is allowed: numbers, short string
constants, names bound to the tunables and the problem size, ``+ - * / // % **``, the integer
bit operators, comparisons (chained), ``and``/``or``/``not``, the conditional expression,
``in``/``not in`` over a literal tuple, list or set, and calls of a few pure functions
(:data:`FUNCTIONS`) with positional arguments. Everything else (attributes, subscripts, calls of
other names, lambdas, comprehensions, dunder names, keyword arguments, f-strings) is an
:class:`ExpressionError` naming the offending part.

The work of one evaluation is bounded: the text's length, the number of syntax nodes, the size of
an exponent or shift, and the size of every integer result (Python's integers are unbounded, and
``9**9**9`` would otherwise take minutes and gigabytes). Arithmetic applies to numbers only, so no
expression can build a large string (``'a' * 10**9``).

No well-kept library fit better: ``simpleeval`` allows attribute access on objects by default and
is a thin wrapper over the same walk; ``asteval`` is a whole interpreter (loops, function
definitions), far more than a restriction needs.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kato.kernels.spec import InvalidInput

#: Longest expression text accepted, in characters.
MAX_LENGTH = 1000
#: Most syntax nodes in one expression.
MAX_NODES = 200
#: Largest exponent of ``**`` and largest shift of ``<<`` / ``>>``.
MAX_EXPONENT = 64
#: Largest integer an evaluation may produce, in bits (a result beyond it is an error).
MAX_INT_BITS = 256
#: Longest string constant, in characters.
MAX_STRING = 64
#: The characters a string constant may hold.
_PRINTABLE = re.compile(r"[ -\[\]-~]*")


class ExpressionError(InvalidInput):
    """An expression that is not allowed or cannot be evaluated; the message names the part
    and the whole expression."""


def _ceil(x: Any) -> int:
    return math.ceil(x)


def _floor(x: Any) -> int:
    return math.floor(x)


def _int(x: Any) -> int:
    return int(x)


def _log2(x: Any) -> float:
    return math.log2(x)


def _sqrt(x: Any) -> float:
    return math.sqrt(x)


#: The functions an expression may call: name -> (function, least and most arguments).
FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "min": (min, 2, 16),
    "max": (max, 2, 16),
    "abs": (abs, 1, 1),
    "ceil": (_ceil, 1, 1),
    "floor": (_floor, 1, 1),
    "int": (_int, 1, 1),
    "log2": (_log2, 1, 1),
    "sqrt": (_sqrt, 1, 1),
}

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
}
_INTEGER_ONLY = (ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor)
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_SYMBOLS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|",
    ast.BitXor: "^",
}  # fmt: skip
#: What the refused node types are called in errors.
_DESCRIBED = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripts",
    ast.Lambda: "lambdas",
    ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.JoinedStr: "f-strings",
    ast.NamedExpr: "assignment expressions (:=)",
    ast.Starred: "starred arguments",
    ast.Dict: "dicts",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
    ast.Slice: "slices",
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float)  # bool is an int: True + 1 is 2, as in Python


@dataclass(frozen=True)
class Expression:
    """One parsed, checked expression. ``names`` are the free names it reads.

    Build it with :func:`parse`; evaluate it with :meth:`evaluate` (any number of times).
    """

    text: str
    tree: ast.Expression
    names: frozenset[str]

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """The value for the names in ``env``.

        Raises:
            ExpressionError: a name unbound in ``env``, division by zero, a result out of
                bounds, an operation on values of the wrong type: saying which part.
        """
        return _Evaluator(self.text, env).visit(self.tree.body)

    def __str__(self) -> str:
        return self.text


def parse(text: str, names: Iterable[str], *, what: str = "expression") -> Expression:
    """Parse and check ``text`` against the whitelist; ``names`` are the names it may read.

    ``what`` says in errors where the expression came from (``"restriction 2"``).

    Raises:
        ExpressionError: the text is too long, not an expression, uses something not allowed
            (named in the message) or a name not in ``names`` (the known ones listed).
    """
    if not isinstance(text, str):
        raise ExpressionError(f"{what} must be a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(
            f"{what} is {len(text)} characters long; at most {MAX_LENGTH}: {text[:60]!r}..."
        )
    if not text.strip():
        raise ExpressionError(f"{what} is empty")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"{what} {text!r} is not a valid expression: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ExpressionError(f"{what} {text[:60]!r} is nested too deeply") from None
    allowed = frozenset(names)
    # A literal tuple is allowed only as the right side of 'in' / 'not in'.
    members = {
        id(right)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for op, right in zip(node.ops, node.comparators, strict=True)
        if isinstance(op, ast.In | ast.NotIn)
    }
    used: set[str] = set()
    for count, node in enumerate(ast.walk(tree), 1):
        if count > MAX_NODES:
            raise ExpressionError(f"{what} {text[:60]!r} has more than {MAX_NODES} parts")
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and id(node) not in members:
            raise ExpressionError(
                f"{what} {text!r}: tuples and lists are allowed only after 'in' "
                f"({_segment(text, node)!r})"
            )
        _check_node(node, text, what, allowed, used)
    return Expression(text.strip(), tree, frozenset(used))


def _segment(text: str, node: ast.AST) -> str:
    part = ast.get_source_segment(text.strip(), node) or type(node).__name__
    return part if len(part) <= 60 else part[:57] + "..."


def _check_node(node: ast.AST, text: str, what: str, allowed: frozenset[str], used: set) -> None:
    def refuse(reason: str) -> ExpressionError:
        return ExpressionError(f"{what} {text!r}: {reason}")

    if isinstance(node, ast.Name):
        if node.id.startswith("__") or node.id.endswith("__"):
            raise refuse(f"dunder names are not allowed ({node.id})")
        return  # checked where it is read: a function name is checked at its call
    if isinstance(node, ast.Call):
        func = node.func
        if not isinstance(func, ast.Name):
            raise refuse(f"only the functions {', '.join(FUNCTIONS)} may be called, "
                         f"not {_segment(text, func)!r}")  # fmt: skip
        if func.id not in FUNCTIONS:
            raise refuse(
                f"unknown function {func.id!r}; the functions allowed are {', '.join(FUNCTIONS)}"
            )
        if node.keywords:
            raise refuse(f"keyword arguments are not allowed ({_segment(text, node)!r})")
        _, least, most = FUNCTIONS[func.id]
        if not least <= len(node.args) <= most:
            takes = str(least) if least == most else f"{least} to {most}"
            raise refuse(f"{func.id}() takes {takes} arguments, got {len(node.args)}")
        for arg in node.args:
            _note_names(arg, text, what, allowed, used)
        return
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str) and len(value) > MAX_STRING:
            raise refuse(f"string constants are at most {MAX_STRING} characters")
        if isinstance(value, str) and not _PRINTABLE.fullmatch(value):
            # A define's value is written into a "#define" line: a line break or a backslash
            # in it would start a directive of the user's there (an #include of a host file).
            raise refuse(f"string constant {value!r} may hold printable ASCII only, no backslash")
        if not isinstance(value, int | float | str) or isinstance(value, complex):
            raise refuse(f"constant {value!r} is not a number or a string")
        return
    if isinstance(node, ast.Compare):
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, ast.In | ast.NotIn) and right is not node.comparators[-1]:
                # Python would compare the literal tuple itself with what follows.
                raise refuse(
                    "'in' must end its chain of comparisons; put it in parentheses, e.g. "
                    f"(x in (1, 2)) == y, not {_segment(text, node)!r}"
                )
            if isinstance(op, ast.In | ast.NotIn):
                if not isinstance(right, ast.Tuple | ast.List | ast.Set) or not all(
                    isinstance(e, ast.Constant) for e in right.elts
                ):
                    raise refuse(
                        "'in' takes a literal tuple of constants on its right, e.g. "
                        f"x in (1, 2, 4), not {_segment(text, right)!r}"
                    )
            elif type(op) not in _COMPARE:
                raise refuse(f"comparison {type(op).__name__} is not allowed ('is'?)")
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return  # the right side of 'in', checked there: its elements are constants
    if isinstance(node, ast.BinOp) and type(node.op) not in _BINARY:
        raise refuse(f"operator {type(node.op).__name__} is not allowed")
    if type(node) in _DESCRIBED:
        raise refuse(f"not allowed: {_DESCRIBED[type(node)]} ({_segment(text, node)!r})")
    allowed_types = (
        ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp,
        ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.Load,
    )  # fmt: skip
    if not isinstance(node, allowed_types):
        raise refuse(f"{type(node).__name__} is not allowed ({_segment(text, node)!r})")
    if isinstance(node, ast.UnaryOp) and not isinstance(
        node.op, ast.UAdd | ast.USub | ast.Not | ast.Invert
    ):
        raise refuse(f"operator {type(node.op).__name__} is not allowed")
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Name):
            _note_names(child, text, what, allowed, used)


def _note_names(node: ast.AST, text: str, what: str, allowed: frozenset[str], used: set) -> None:
    """Record a name read as a value (not a called function's name); refuse unknown ones."""
    if not isinstance(node, ast.Name):
        return
    if node.id.startswith("__") or node.id.endswith("__"):
        raise ExpressionError(f"{what} {text!r}: dunder names are not allowed ({node.id})")
    if node.id not in allowed:
        known = ", ".join(sorted(allowed)) or "none"
        raise ExpressionError(f"{what} {text!r}: unknown name {node.id!r}; known names: {known}")
    used.add(node.id)


class _Evaluator:
    """Walks a checked tree; every operation bounded (see the module docstring)."""

    def __init__(self, text: str, env: Mapping[str, Any]):
        self.text, self.env = text, env

    def fail(self, reason: str) -> ExpressionError:
        return ExpressionError(f"expression {self.text!r}: {reason}")

    def bounded(self, value: Any) -> Any:
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise self.fail(f"an intermediate value exceeds {MAX_INT_BITS} bits")
        if isinstance(value, float) and not math.isfinite(value) and value == value:
            raise self.fail("an intermediate value overflows")
        if isinstance(value, complex):  # (-8) ** 0.5: Python answers with a complex number
            raise self.fail("the result is not a real number")
        return value

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in self.env:
                raise self.fail(f"name {node.id!r} has no value here")
            return self.env[node.id]
        if isinstance(node, ast.BinOp):
            return self.binary(node)
        if isinstance(node, ast.UnaryOp):
            value = self.visit(node.operand)
            if isinstance(node.op, ast.Not):
                return not value
            if not _number(value):
                raise self.fail(f"unary operator on {type(value).__name__} {value!r}")
            if isinstance(node.op, ast.Invert):
                if not isinstance(value, int):
                    raise self.fail("~ takes an integer")
                return ~value
            return -value if isinstance(node.op, ast.USub) else +value
        if isinstance(node, ast.BoolOp):
            is_and = isinstance(node.op, ast.And)
            value: Any = None
            for item in node.values:
                value = self.visit(item)
                if bool(value) != is_and:
                    return value
            return value
        if isinstance(node, ast.Compare):
            left = self.visit(node.left)
            for op, right_node in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn):
                    assert isinstance(right_node, ast.Tuple | ast.List | ast.Set)
                    members = [e.value for e in right_node.elts]  # type: ignore[attr-defined]
                    ok = left in members
                    if isinstance(op, ast.NotIn):
                        ok = not ok
                    right = None
                else:
                    right = self.visit(right_node)
                    if isinstance(left, str) != isinstance(right, str) and not isinstance(
                        op, ast.Eq | ast.NotEq
                    ):
                        raise self.fail(f"cannot order {left!r} and {right!r}")
                    ok = _COMPARE[type(op)](left, right)
                if not ok:
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self.visit(node.body) if self.visit(node.test) else self.visit(node.orelse)
        if isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            fn = FUNCTIONS[node.func.id][0]
            args = [self.visit(a) for a in node.args]
            if not all(_number(a) for a in args):
                raise self.fail(f"{node.func.id}() takes numbers, got {args!r}")
            try:
                value = fn(*args)
            except (ValueError, OverflowError) as exc:
                raise self.fail(f"{node.func.id}({', '.join(map(repr, args))}): {exc}") from None
            return self.bounded(value)
        raise self.fail(f"{type(node).__name__} is not allowed")  # parse() refused it already

    def binary(self, node: ast.BinOp) -> Any:
        left, right = self.visit(node.left), self.visit(node.right)
        symbol = _SYMBOLS[type(node.op)]
        if not (_number(left) and _number(right)):
            raise self.fail(f"{left!r} {symbol} {right!r}: arithmetic takes numbers only")
        if isinstance(node.op, _INTEGER_ONLY) and not (
            isinstance(left, int) and isinstance(right, int)
        ):
            raise self.fail(f"{left!r} {symbol} {right!r}: {symbol} takes integers")
        if isinstance(node.op, ast.Pow | ast.LShift | ast.RShift) and abs(right) > MAX_EXPONENT:
            raise self.fail(f"{left!r} {symbol} {right!r}: at most {MAX_EXPONENT} on the right")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise self.fail(f"{left!r} {symbol} {right!r}: division by zero")
        if isinstance(node.op, ast.LShift | ast.RShift) and right < 0:
            raise self.fail(f"{left!r} {symbol} {right!r}: negative shift")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (OverflowError, ZeroDivisionError, ValueError) as exc:
            raise self.fail(f"{left!r} {symbol} {right!r}: {exc}") from None
        return self.bounded(value)
