"""Vectorised evaluation of a spec's expressions over many configs at once (numpy columns).

:func:`evaluate` walks the same checked tree as :meth:`kernels.user.expr.Expression.evaluate`,
but on arrays: one element per config. It answers, per config, what the scalar walk answers:
the value, or that the walk would raise (``failed``: a division by zero, an overflow, a
function outside its domain, arithmetic on a string), which makes that config invalid.

Where numpy's semantics could differ from Python's (an integer past 2**53, where int64 and float
comparisons stop being exact; strings in arithmetic or ordering; a column mixing types), it
raises :class:`NotVectorised` instead of answering, and the caller evaluates those configs one
by one with the scalar walk: slower, never different. Nothing here evaluates user text either:
it walks the tree :func:`kernels.user.expr.parse` checked against the whitelist.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

import numpy as np
from kato.kernels.user.expr import _COMPARE, MAX_EXPONENT, Expression

#: Integers are exact in float64 (and numpy's int/float comparisons agree with Python's) up to
#: here; an intermediate value beyond it hands the chunk to the scalar walk.
EXACT = float(2**53)


class NotVectorised(Exception):
    """The expression cannot be evaluated on these columns with Python's exact semantics."""


def evaluate(
    expression: Expression, columns: Mapping[str, Any], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(values, failed)`` of ``expression`` for ``n`` configs: ``columns`` maps each name it
    reads to an array of ``n`` values (int64, float64, bool or str) or to one Python value (the
    shape, ``itemsize``). ``values`` is meaningful only where ``failed`` is false.

    Raises:
        NotVectorised: see the module docstring.
    """
    walker = _Walker(columns, n)
    with np.errstate(all="ignore"):  # overflows and domain errors are read from the results
        values, failed = walker.visit(expression.tree.body)
    return np.broadcast_to(values, (n,)), np.broadcast_to(failed, (n,))


def truthy(values: np.ndarray) -> np.ndarray:
    """Python's ``bool()`` of each value."""
    if values.dtype.kind == "U":
        return np.char.str_len(values) > 0
    return values != 0 if values.dtype != bool else values


def may_be_bool(expression: Expression, columns: Mapping[str, Any]) -> bool:
    """Whether some config's value may be a Python ``bool`` (a comparison, ``not``, ``min`` of
    those...), which a size or a grid divisor refuses although numpy gives it as a number."""

    def walk(node: ast.AST) -> bool:
        if isinstance(node, ast.Compare) or (
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
        ):
            return True
        if isinstance(node, ast.BoolOp):
            return any(walk(v) for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd | ast.BitOr | ast.BitXor):
            return walk(node.left) and walk(node.right)  # True & True is True
        if isinstance(node, ast.IfExp):
            return walk(node.body) or walk(node.orelse)
        if isinstance(node, ast.Call) and node.func.id in ("min", "max"):  # type: ignore[attr-defined]
            return any(walk(a) for a in node.args)
        if isinstance(node, ast.Constant):
            return isinstance(node.value, bool)
        if isinstance(node, ast.Name):
            value = columns.get(node.id)
            return isinstance(value, bool) or (
                isinstance(value, np.ndarray) and value.dtype == bool
            )
        return False

    return walk(expression.tree.body)


def _kind(values: np.ndarray) -> str:
    """'s' (strings), 'b' (bool), 'i' (int64), 'f' (float64)."""
    kind = values.dtype.kind
    if kind == "U":
        return "s"
    if kind in "biuf":
        return {"u": "i"}.get(kind, kind)
    raise NotVectorised(f"a column of dtype {values.dtype}")


def _numeric(values: np.ndarray) -> np.ndarray:
    """Bools as int64 (``True + True`` is 2 in Python, True in numpy)."""
    return values.astype(np.int64) if values.dtype == bool else values


class _Walker:
    def __init__(self, columns: Mapping[str, Any], n: int):
        self.columns, self.n = columns, n
        self.none = np.zeros(n, dtype=bool)

    def constant(self, value: Any) -> np.ndarray:
        if isinstance(value, str):
            return np.full(self.n, value)
        if isinstance(value, bool):
            return np.full(self.n, value, dtype=bool)
        if isinstance(value, int):
            if abs(value) > EXACT:
                raise NotVectorised("an integer beyond 2**53")
            return np.full(self.n, value, dtype=np.int64)
        if isinstance(value, float):
            return np.full(self.n, value, dtype=np.float64)
        raise NotVectorised(f"a value of type {type(value).__name__}")

    def visit(self, node: ast.AST) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(node, ast.Constant):
            return self.constant(node.value), self.none
        if isinstance(node, ast.Name):
            if node.id not in self.columns:
                return self.constant(0), ~self.none  # unbound: the scalar walk raises
            value = self.columns[node.id]
            if isinstance(value, np.ndarray):
                _kind(value)
                if value.dtype.kind in "iu" and value.size and np.abs(value).max() > EXACT:
                    raise NotVectorised("an integer beyond 2**53")
                return value, self.none
            return self.constant(value), self.none
        if isinstance(node, ast.BinOp):
            return self.binary(node)
        if isinstance(node, ast.UnaryOp):
            value, failed = self.visit(node.operand)
            if isinstance(node.op, ast.Not):
                return ~truthy(value), failed
            kind = _kind(value)
            if kind == "s":
                return self.constant(0), ~self.none  # a unary operator on a string raises
            value = _numeric(value)
            if isinstance(node.op, ast.Invert):
                if kind == "f":
                    return self.int_only(failed, value)
                return ~value, failed
            return (-value if isinstance(node.op, ast.USub) else value), failed
        if isinstance(node, ast.BoolOp):
            return self.boolean(node)
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.IfExp):
            test, f_test = self.visit(node.test)
            body, f_body = self.visit(node.body)
            other, f_other = self.visit(node.orelse)
            take = truthy(test)
            return _where(take, body, other), f_test | np.where(take, f_body, f_other)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise NotVectorised(type(node).__name__)  # parse() refused it already

    def boolean(self, node: ast.BoolOp) -> tuple[np.ndarray, np.ndarray]:
        """``and``/``or``: the first value that decides, as Python returns it; a later operand's
        failure counts only where the walk reaches it."""
        is_and = isinstance(node.op, ast.And)
        value, failed = self.visit(node.values[0])
        decided = truthy(value) != is_and
        for item in node.values[1:]:
            nxt, f_next = self.visit(item)
            failed = failed | (~decided & f_next)
            value = _where(decided, value, nxt)
            decided = decided | (truthy(nxt) != is_and)
        return value, failed

    def compare(self, node: ast.Compare) -> tuple[np.ndarray, np.ndarray]:
        """A chain stops at its first false link: later links' failures count only where it
        gets there."""
        left, failed = self.visit(node.left)
        result = np.ones(self.n, dtype=bool)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, ast.In | ast.NotIn):
                members = [e.value for e in right_node.elts]  # type: ignore[attr-defined]
                ok = np.zeros(self.n, dtype=bool)
                left_str = _kind(left) == "s"
                for m in members:
                    if isinstance(m, str) == left_str:
                        ok |= left == m
                right = left
                if isinstance(op, ast.NotIn):
                    ok = ~ok
            else:
                right, f_right = self.visit(right_node)
                failed = failed | (result & f_right)
                kinds = {_kind(left) == "s", _kind(right) == "s"}
                if len(kinds) == 2:
                    if isinstance(op, ast.Eq | ast.NotEq):  # a string never equals a number
                        ok = np.full(self.n, isinstance(op, ast.NotEq))
                    else:  # cannot order a string and a number: the walk raises
                        ok = np.zeros(self.n, dtype=bool)
                        failed = failed | result
                else:
                    ok = np.asarray(_COMPARE[type(op)](left, right), dtype=bool)
            result = result & ok
            left = right
        return result, failed

    def call(self, node: ast.Call) -> tuple[np.ndarray, np.ndarray]:
        name = node.func.id  # type: ignore[attr-defined]
        args, failed = [], self.none
        for arg in node.args:
            value, f = self.visit(arg)
            failed = failed | f
            if _kind(value) == "s":  # the functions take numbers: the walk raises
                return self.constant(0), ~self.none
            args.append(value)
        if name in ("min", "max"):
            if any(_kind(a) == "f" for a in args) and any(_kind(a) != "f" for a in args):
                raise NotVectorised("min/max of ints and floats")  # Python keeps the type
            pick = np.less if name == "min" else np.greater
            value = args[0]
            for a in args[1:]:  # the first extreme, as Python's min() and max() return
                value = _where(pick(a, value), a, value)
            return value, failed | _infinite(value)
        x = _numeric(args[0])
        if name == "abs":
            value = np.abs(x)
            return value, failed | _infinite(value)
        if name in ("ceil", "floor", "int"):
            if _kind(x) == "i":
                return x, failed
            bad = ~np.isfinite(x)  # math.ceil(inf), int(nan): ValueError / OverflowError
            rounded = {"ceil": np.ceil, "floor": np.floor, "int": np.trunc}[name](
                np.where(bad, 0.0, x)
            )
            if np.abs(rounded).max(initial=0) > EXACT:
                raise NotVectorised("an integer beyond 2**53")
            return rounded.astype(np.int64), failed | bad
        x = x.astype(np.float64)
        bad = x <= 0 if name == "log2" else x < 0  # math's domain errors
        safe = np.where(bad, 1.0, x)
        value = np.log2(safe) if name == "log2" else np.sqrt(safe)
        if _kind(args[0]) == "i" and np.abs(args[0]).max(initial=0) > EXACT:
            raise NotVectorised("an integer beyond 2**53")
        return value, failed | bad | _infinite(value)

    def binary(self, node: ast.BinOp) -> tuple[np.ndarray, np.ndarray]:
        left, f_left = self.visit(node.left)
        right, f_right = self.visit(node.right)
        failed = f_left | f_right
        kinds = {_kind(left), _kind(right)}
        if "s" in kinds:  # arithmetic takes numbers only: the walk raises
            return self.constant(0), ~self.none
        a, b = _numeric(left), _numeric(right)
        ints = kinds <= {"i", "b"}
        op = node.op
        if isinstance(op, ast.LShift | ast.RShift | ast.BitAnd | ast.BitOr | ast.BitXor):
            if not ints:
                return self.int_only(failed, a, b)
            if isinstance(op, ast.LShift | ast.RShift):
                bad = (b < 0) | (b > MAX_EXPONENT)
                b = np.where(bad, 0, b)
                if isinstance(op, ast.LShift):
                    self.exact(a.astype(np.float64) * np.exp2(b.astype(np.float64)))
                    return a << b, failed | bad
                return a >> b, failed | bad
            fn = {ast.BitAnd: np.bitwise_and, ast.BitOr: np.bitwise_or,
                  ast.BitXor: np.bitwise_xor}[type(op)]  # fmt: skip
            return fn(a, b), failed
        if isinstance(op, ast.Add | ast.Sub | ast.Mult):
            fn = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply}[type(op)]
            if ints:
                self.exact(fn(a.astype(np.float64), b.astype(np.float64)))
                return fn(a, b), failed
            value = fn(a.astype(np.float64), b.astype(np.float64))
            return value, failed | np.isinf(value)
        if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod):
            zero = b == 0
            b = np.where(zero, 1, b)
            if isinstance(op, ast.Div):
                value = np.true_divide(a, b)
                return value, failed | zero | np.isinf(value)
            fn = np.floor_divide if isinstance(op, ast.FloorDiv) else np.remainder
            if ints:
                return fn(a, b), failed | zero
            value = fn(a.astype(np.float64), b.astype(np.float64))
            return value, failed | zero | np.isinf(value)
        if isinstance(op, ast.Pow):
            bad = np.abs(b) > MAX_EXPONENT
            b = np.where(bad, 0, b)
            if ints and not (b < 0).any():
                self.exact(np.power(a.astype(np.float64), b.astype(np.float64)))
                return np.power(a, b), failed | bad
            # A negative integer exponent gives a float in Python, as both floats' power does.
            af, bf = a.astype(np.float64), b.astype(np.float64)
            bad |= (af == 0) & (bf < 0)  # ZeroDivisionError
            bad |= (af < 0) & (bf != np.floor(bf))  # a complex result
            with np.errstate(all="ignore"):
                value = np.power(np.where(bad, 1.0, af), np.where(bad, 1.0, bf))
            if ints:  # an int where the exponent is not negative: exact in Python
                self.exact(np.where(bad | (bf < 0), 0.0, value))
            return value, failed | bad | np.isinf(value)
        raise NotVectorised(type(op).__name__)

    def int_only(self, failed: np.ndarray, *operands: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An operator that takes integers (``~ << >> & | ^``) given a float column: the
        scalar walk raises for each config where an operand is a float, but a whole value may
        have been an int in that config (``(f or 1) << b``, ``2 ** (a - 1)``: numpy keeps one
        type per column, Python one per value), so such columns go to the scalar walk."""
        maybe_ints = ~failed
        for value in operands:
            maybe_ints &= is_finite_int(value)
        if maybe_ints.any():
            raise NotVectorised("an integer operator on a column of ints and floats")
        return self.constant(0), ~self.none

    def exact(self, approx: np.ndarray) -> None:
        """An integer result must stay where int64 and float64 agree with Python's ints."""
        with np.errstate(all="ignore"):
            if approx.size and not (np.abs(approx) <= EXACT).all():
                raise NotVectorised("an integer beyond 2**53")


def _infinite(values: np.ndarray) -> np.ndarray:
    """Where a function's result is infinite: the scalar walk's bound refuses it."""
    if values.dtype.kind != "f":
        return np.zeros(values.shape, dtype=bool)
    return np.isinf(values)


def _where(take: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` where ``take``, else ``b``; the two kinds must mix as Python's values would."""
    ka, kb = _kind(a), _kind(b)
    if ka != kb and "s" in (ka, kb):
        raise NotVectorised("a choice between a string and a number")
    if {ka, kb} == {"b", "i"} or {ka, kb} == {"b", "f"}:
        # Python keeps True as a bool; as a number it is the same (1), which is all that is
        # read from it here (sizes refuse a bool, checked by may_be_bool).
        a, b = _numeric(a), _numeric(b)
    return np.where(take, a, b)


def is_finite_int(values: np.ndarray) -> np.ndarray:
    """Whether each value is an integer (an int, or a float with an integral value)."""
    if values.dtype.kind in "iub":
        return np.ones(values.shape, dtype=bool)
    with np.errstate(all="ignore"):
        return np.isfinite(values) & (values == np.floor(values))


__all__ = ["EXACT", "NotVectorised", "evaluate", "is_finite_int", "may_be_bool", "truthy"]
