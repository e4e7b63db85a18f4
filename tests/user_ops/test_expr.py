"""The safe expression evaluator: what it computes, and that attacks are refused."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kato.kernels.user.expr import MAX_LENGTH, ExpressionError, parse

NAMES = ("block_size_x", "tile_size_x", "n", "method")


def ev(text: str, **env):
    return parse(text, NAMES).evaluate(env)


@pytest.mark.parametrize(
    ("text", "env", "value"),
    [
        ("block_size_x*tile_size_x <= 1024", {"block_size_x": 256, "tile_size_x": 4}, True),
        ("block_size_x*tile_size_x <= 1024", {"block_size_x": 512, "tile_size_x": 4}, False),
        ("n % (block_size_x * 4) == 0", {"n": 4096, "block_size_x": 256}, True),
        ("ceil(n / block_size_x)", {"n": 1000, "block_size_x": 256}, 4),
        ("floor(n / 3) + n // 3 + 2 ** 10", {"n": 10}, 1030),
        ("min(n, 7, 9) * max(2, n)", {"n": 5}, 25),
        ("tile_size_x in (1, 2, 4)", {"tile_size_x": 4}, True),
        ("tile_size_x not in [1, 2]", {"tile_size_x": 2}, False),
        ("1 < tile_size_x <= 4", {"tile_size_x": 4}, True),
        ("1 < tile_size_x <= 4", {"tile_size_x": 8}, False),
        ("n if n > 3 else -n", {"n": 2}, -2),
        ("not (n > 1 and n < 3) or n == 2", {"n": 2}, True),
        ("method == 'shared'", {"method": "shared"}, True),
        ("(n << 2) | 1", {"n": 3}, 13),
        ("abs(-n) + int(2.7) + log2(n)", {"n": 8}, 13.0),
    ],
)
def test_values(text, env, value):
    assert ev(text, **env) == value


def test_names_read():
    assert parse("block_size_x * tile_size_x <= 1024", NAMES).names == {
        "block_size_x",
        "tile_size_x",
    }
    assert parse("ceil(n / 2)", NAMES).names == {"n"}  # the function's name is not a name read


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("().__class__", "attribute access"),
        ("().__class__.__bases__[0].__subclasses__()", "may be called"),
        ("__import__('os').system('true')", "__import__"),
        ("open('/etc/passwd')", "unknown function 'open'"),
        ("eval('1')", "unknown function 'eval'"),
        ("n.real", "attribute access"),
        ("n[0]", "subscripts"),
        ("lambda: 1", "lambdas"),
        ("[x for x in (1, 2)]", "comprehensions"),
        ("(y := 3)", "assignment"),
        ("f'{n}'", "f-strings"),
        ("min(n, key=abs)", "keyword arguments"),
        ("(1, 2)", "tuples and lists are allowed only after 'in'"),
        ("n in (1, n)", "literal tuple of constants"),
        ("n is None", "comparison"),
        ("__builtins__", "dunder"),
        ("unknown_name > 1", "unknown name 'unknown_name'"),
        ("min(n)", "min() takes 2 to 16 arguments"),
        ("n ==", "not a valid expression"),
        ("x = 1", "not a valid expression"),
        ("", "empty"),
        ("{1: 2}", "dicts"),
        ("'" + "a" * 100 + "'", "string constants are at most"),
    ],
)
def test_refused_at_parse(text, says):
    with pytest.raises(ExpressionError) as info:
        parse(text, NAMES, what="restriction 1")
    assert says in str(info.value)
    assert "restriction 1" in str(info.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("9**9**9", "at most 64 on the right"),
        ("2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64", "exceeds 256 bits"),
        ("n << 100", "at most 64"),
        ("'a' * n", "arithmetic takes numbers only"),
        ("method + method", "arithmetic takes numbers only"),
        ("n / 0", "division by zero"),
        ("n % 0", "division by zero"),
        ("1e308 * 1e308", "overflows"),
        ("method < 3", "cannot order"),
        ("sqrt(-n)", "sqrt"),
    ],
)
def test_refused_at_evaluation(text, says):
    e = parse(text, NAMES)
    t0 = time.perf_counter()
    with pytest.raises(ExpressionError) as info:
        e.evaluate({"n": 5, "method": "abc"})
    assert says in str(info.value)
    assert time.perf_counter() - t0 < 1.0  # bounded work, not a slow failure


def test_huge_texts_refused_quickly():
    t0 = time.perf_counter()
    with pytest.raises(ExpressionError, match="characters long"):
        parse("1+" * 10**6 + "1", NAMES)
    with pytest.raises(ExpressionError, match="more than 200 parts"):
        parse("+".join(["n"] * 300)[:MAX_LENGTH], NAMES)
    with pytest.raises(ExpressionError):
        parse("(" * 400 + "1" + ")" * 400, NAMES)  # too long or nested too deeply
    with pytest.raises(ExpressionError):
        parse("-" * 900 + "1", NAMES)
    assert time.perf_counter() - t0 < 2.0


def test_unbound_name_at_evaluation():
    with pytest.raises(ExpressionError, match="'n' has no value"):
        parse("n + 1", NAMES).evaluate({})


def test_not_a_string():
    with pytest.raises(ExpressionError, match="must be a string"):
        parse(42, NAMES)  # type: ignore[arg-type]


ALPHABET = "abn_xyz0123456789 +-*/%()<>=!,.'\"[]{}:;~^&|@#λ\\\n"
WORDS = [
    "n",
    "method",
    "block_size_x",
    "min",
    "max",
    "ceil",
    "in",
    "not",
    "and",
    "or",
    "if",
    "else",
    "lambda",
    "__class__",
    "**",
    "//",
    "(",
    ")",
    ",",
    "1",
    "0",
    "64",
    "9",
    ".",
]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.one_of(st.text(ALPHABET, max_size=80), st.lists(st.sampled_from(WORDS), max_size=30)))
def test_any_text_parses_or_is_refused_cleanly(text):
    """Whatever the text, parse and evaluate either answer or raise ExpressionError, nothing
    else (no other exception, no hang)."""
    if isinstance(text, list):
        text = " ".join(text)
    try:
        e = parse(text, NAMES)
    except ExpressionError:
        return
    with contextlib.suppress(ExpressionError):
        e.evaluate({"n": 7, "method": "abc", "block_size_x": 128, "tile_size_x": 2})


@pytest.mark.parametrize("text", ["n in (1, 2) < 3", "n not in (1,) == 0", "n in (1,) in (True,)"])
def test_a_comparison_after_in_is_refused_when_parsed(text):
    """Python compares the literal tuple itself with what follows ``in`` (an error, or always
    false): refused at parse, never a TypeError when a config is checked."""
    with pytest.raises(ExpressionError, match="'in'"):
        parse(text, NAMES)
    assert parse("n < 3 in (True,)", NAMES).evaluate({"n": 1}) is False  # 3 in (True,)
