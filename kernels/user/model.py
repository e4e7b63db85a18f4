"""The declarative spec of a user operator: a pydantic model of its spec file (``kato.toml``).

A user operator is a folder: ``kato.toml`` (this model), a CUDA template and, optionally, a
reference CUDA kernel whose outputs every variant must match. The same document, as JSON with
the files' text beside it (:class:`OperatorDefinition`), is what ``POST /v1/operators`` takes and
what the database stores. Every expression is checked here (:mod:`kernels.user.expr`): a spec
that validates has no unknown name, no call of a function outside the whitelist and no
malformed expression anywhere.

Kernel Tuner's conventions hold where it has one: ``tune_params`` (name -> values, the key
order), ``restrictions`` (boolean expressions over the tunables, all must hold),
``problem_size``, ``grid_div_x``/``_y``/``_z`` (the grid is ``ceil(problem_size / product of the
divisors)``; a missing divisor list defaults to the block size name of that dimension where it
is a tunable, else 1), ``block_size_names`` (the tunables giving the block's x, y, z; a missing
one is 256 for x, 1 for y and z) and the macros a kernel sees (``grid_size_x``...,
``block_size_x``..., every tunable, ``kernel_tuner``).
"""

from __future__ import annotations

import itertools
import keyword
import re
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal

import numpy as np
from kato.kernels.spec import CUDA_TYPES, DTYPES
from kato.kernels.user import expr
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: An operator name: what the result key and recording file names can hold.
NAME_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
#: A C identifier (kernel entry points, macro and argument names).
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
#: A file of the folder: a plain name, no directories.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\.(cu|cuh)$")
#: A header beside the template, included by a quoted name (``#include "my_header.h"``).
_HEADER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\.(h|cuh|hpp|hh|inc)$")
#: Most combinations of ``tune_params``: positions in the product are int64. Up to
#: ``tuner.space.FILTER_MAX`` (67M) the product is filtered whole (vectorised), beyond it the
#: search samples valid configs (``tuner.space``).
MAX_SPACE = 10**18
#: Most values of one tunable, tunables, arguments, dimensions.
MAX_VALUES = 1024
MAX_TUNABLES = 32
MAX_ARGUMENTS = 64
MAX_RANK = 8
#: Largest template or reference file, in bytes (UTF-8).
MAX_FILE_BYTES = 1 << 20
#: Largest template with its headers inlined, in characters, and most inlinings in it.
MAX_INLINED_CHARS = 4 * MAX_FILE_BYTES
MAX_INLININGS = 10_000
#: Names every expression may read besides the tunables and the shape: the element size of the
#: request's dtype in bytes.
BUILTIN_NAMES = ("itemsize",)
#: The block size names Kernel Tuner uses when none are given.
DEFAULT_BLOCK_SIZE_NAMES = ("block_size_x", "block_size_y", "block_size_z")
#: Element types an array argument may have ("dtype": the request's dtype).
ARRAY_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8",
)  # fmt: skip
#: Element types the on-device verifier compares (an output must have one).
OUTPUT_DTYPES = tuple(str(d) for d in CUDA_TYPES)
#: Types of a scalar argument (passed by value).
SCALAR_DTYPES = ("int32", "uint32", "int64", "uint64", "float32", "float64")

Expr = Annotated[str, Field(min_length=1, max_length=expr.MAX_LENGTH)]
ExprList = list[Expr]
Value = int | float | str


def numpy_dtype(name: str, request_dtype: str) -> np.dtype:
    """The numpy dtype of an argument's ``dtype`` field ("dtype": the request's)."""
    if name == "dtype":
        return DTYPES[request_dtype][0]
    if name == "bfloat16":
        return DTYPES["bfloat16"][0]
    return np.dtype(name)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArgumentModel(_Strict):
    """One kernel argument, in the kernel's parameter order.

    An array has ``size`` (elements, an expression of the shape); a scalar has ``value`` (an
    expression of the shape). ``output``: the kernel writes it and it is compared with the
    reference. ``init``: how an input is filled (``normal``: N(0, 1), no exact zeros;
    ``uniform``: U[low, high); ``randint``: integers in [low, high); ``zeros``, ``ones``,
    ``index``: 0, 1, 2, ...); outputs start as zeros unless said.
    """

    name: str
    dtype: str
    size: Expr | None = None
    value: Expr | None = None
    output: bool = False
    init: Literal["normal", "uniform", "randint", "zeros", "ones", "index"] | None = None
    low: float = 0.0
    high: float = 1.0
    #: ``[atol, rtol]`` for this output, overriding the operator's tolerance.
    tolerance: tuple[float, float] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(f"argument name {value!r} must be a C identifier")
        return value

    @model_validator(mode="after")
    def _kind(self) -> ArgumentModel:
        if (self.size is None) == (self.value is None):
            raise ValueError(
                f"argument {self.name!r}: give size (an array's elements) or value (a scalar), "
                "exactly one"
            )
        if self.size is not None:
            if self.dtype not in (*ARRAY_DTYPES, "dtype"):
                raise ValueError(
                    f"argument {self.name!r}: dtype {self.dtype!r} is not one of "
                    f"{', '.join(ARRAY_DTYPES)} or 'dtype' (the request's)"
                )
            if self.output and self.dtype not in (*OUTPUT_DTYPES, "dtype"):
                raise ValueError(
                    f"output {self.name!r}: dtype {self.dtype!r} cannot be verified; outputs "
                    f"are one of {', '.join(OUTPUT_DTYPES)} or 'dtype'"
                )
        else:
            if self.dtype not in SCALAR_DTYPES:
                raise ValueError(
                    f"scalar {self.name!r}: dtype {self.dtype!r} is not one of "
                    f"{', '.join(SCALAR_DTYPES)}"
                )
            if self.output or self.init is not None:
                raise ValueError(f"scalar {self.name!r} cannot be an output or have an init")
        if self.init in ("uniform", "randint") and not self.low < self.high:
            raise ValueError(f"argument {self.name!r}: low must be below high")
        if self.tolerance is not None and (not self.output or min(self.tolerance) < 0):
            raise ValueError(
                f"argument {self.name!r}: a tolerance [atol, rtol] (both >= 0) is for outputs"
            )
        return self


class ReferenceModel(_Strict):
    """A reference CUDA kernel in the folder: simple and untuned, run once per problem on the
    GPU (in the measuring process); its outputs are what every variant must match. It takes the
    operator's argument list; ``grid`` and ``block`` are expressions of the shape."""

    template: str
    kernel_name: str
    block: ExprList = Field(default_factory=lambda: ["256"], min_length=1, max_length=3)
    grid: ExprList = Field(min_length=1, max_length=3)
    defines: dict[str, Expr] = Field(default_factory=dict)


#: The prefix of a backward input fed the gradient of one of the operator's outputs.
GRAD_PREFIX = "grad:"


def differentiable(dtype: str, request_dtypes: Collection[str]) -> bool:
    """Whether an array of ``dtype`` ("dtype": the request's) is a floating-point one at every
    request dtype the operator takes: only those carry a gradient."""
    bfloat16 = DTYPES["bfloat16"][0]
    return all(
        (np_dtype := numpy_dtype(dtype, d)).kind == "f" or np_dtype == bfloat16
        for d in request_dtypes
    )


class BackwardModel(_Strict):
    """The ``[backward]`` section: another registered user operator that computes the
    gradients of this one's inputs (docs/user_kernels.md, "Gradients").

    ``inputs``: each of the backward operator's non-output arguments (its name) -> what feeds
    it: a name of this operator's arguments (an input, or an output as the call returned it),
    or ``"grad:<output>"``, the gradient of one of this operator's outputs. ``gradients``: each
    of the backward operator's outputs (its name) -> the input of this operator whose gradient
    it is. Plain names only: nothing here is an expression."""

    operator: str = Field(pattern=NAME_PATTERN)
    inputs: dict[str, str] = Field(min_length=1, max_length=MAX_ARGUMENTS)
    gradients: dict[str, str] = Field(min_length=1, max_length=MAX_ARGUMENTS)

    @model_validator(mode="after")
    def _names(self) -> BackwardModel:
        for key in (*self.inputs, *self.gradients):
            if not _IDENTIFIER.match(key):
                raise ValueError(f"backward argument name {key!r} must be a C identifier")
        both = sorted(set(self.inputs) & set(self.gradients))
        if both:
            raise ValueError(
                f"backward arguments {', '.join(both)} are both in inputs and in gradients: an "
                "argument of the backward operator is fed (an input) or gives a gradient (an "
                "output)"
            )
        return self

    def check_against(self, forward: OperatorModel) -> None:
        """Raise ValueError unless every name refers to an argument of ``forward`` as it
        must: a source is one of its arguments or ``grad:`` of a floating-point output; a
        gradient is of a floating-point array input, each at most once."""
        args = {a.name: a for a in forward.arguments}
        outputs = [a.name for a in forward.arguments if a.output]
        if not outputs:
            raise ValueError(
                "backward: the operator has no output, so nothing to differentiate (an operator "
                "that only writes its arrays takes no gradient)"
            )
        for key, source in self.inputs.items():
            where = f"backward.inputs.{key}"
            if source.startswith(GRAD_PREFIX):
                name = source[len(GRAD_PREFIX) :]
                arg = args.get(name)
                if arg is None or not arg.output:
                    raise ValueError(
                        f"{where}: {source!r} names no output of {forward.name} (its outputs: "
                        f"{', '.join(outputs)})"
                    )
                if not differentiable(arg.dtype, forward.dtypes):
                    raise ValueError(
                        f"{where}: output {name} is {arg.dtype}, not floating point at every "
                        f"dtype of {forward.name} ({', '.join(forward.dtypes)}): it has no "
                        "gradient"
                    )
            elif source not in args:
                raise ValueError(
                    f"{where}: {source!r} is not an argument of {forward.name} (give one of "
                    f"{', '.join(args)}, or 'grad:<output>')"
                )
        seen: dict[str, str] = {}
        for key, target in self.gradients.items():
            where = f"backward.gradients.{key}"
            arg = args.get(target)
            if arg is None or arg.output:
                inputs = [a.name for a in forward.arguments if not a.output]
                raise ValueError(
                    f"{where}: {target!r} is not an input of {forward.name} (its inputs: "
                    f"{', '.join(inputs) or 'none'})"
                )
            if arg.size is None:
                raise ValueError(
                    f"{where}: input {target} is a scalar, passed as a number: it has no "
                    "gradient (only array inputs do)"
                )
            if not differentiable(arg.dtype, forward.dtypes):
                raise ValueError(
                    f"{where}: input {target} is {arg.dtype}, not floating point at every "
                    f"dtype of {forward.name} ({', '.join(forward.dtypes)}): it has no gradient"
                )
            if target in seen:
                raise ValueError(
                    f"{where}: the gradient of {target} is already {seen[target]}'s; each input "
                    "has one"
                )
            seen[target] = key


class OperatorModel(_Strict):
    """The spec file. See the module docstring and ``docs/user_kernels.md``."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field(default="", max_length=500)
    template: str
    kernel_name: str
    shape: list[str] = Field(min_length=1, max_length=MAX_RANK)
    dtypes: list[str] = Field(default_factory=lambda: ["float32"], min_length=1)
    tune_params: dict[str, list[Value]] = Field(min_length=1, max_length=MAX_TUNABLES)
    restrictions: ExprList = Field(default_factory=list, max_length=256)
    problem_size: ExprList | None = Field(default=None, max_length=3)
    block_size_names: list[str] | None = Field(default=None, max_length=3)
    grid_div_x: ExprList | None = None
    grid_div_y: ExprList | None = None
    grid_div_z: ExprList | None = None
    shared_memory: Expr | None = None
    defines: dict[str, Expr] = Field(default_factory=dict)
    #: A macro naming the request dtype's CUDA type (``"T"`` -> ``#define T float``).
    dtype_macro: str | None = None
    arguments: list[ArgumentModel] = Field(min_length=1, max_length=MAX_ARGUMENTS)
    #: Arrays in constant memory: ``__constant__`` globals the template declares, uploaded
    #: into each variant's module before it runs (Kernel Tuner's ``cmem_args``).
    constants: list[ArgumentModel] = Field(default_factory=list, max_length=MAX_ARGUMENTS)
    #: ``[atol, rtol]`` for every float output, or dtype -> ``[atol, rtol]``.
    tolerance: tuple[float, float] | dict[str, tuple[float, float]] | None = None
    bytes: Expr | None = None
    flops: Expr | None = None
    reference: ReferenceModel | None = None
    #: Headers beside the template (plain names), which it and the reference may include by a
    #: quoted name; their text is inlined where they are included when a variant is rendered.
    headers: list[str] = Field(default_factory=list, max_length=64)
    #: False: no reference (outputs unchecked); only said explicitly.
    verify: bool = True
    default: dict[str, Value] | None = None
    #: Another user operator computing this one's input gradients (:class:`BackwardModel`).
    backward: BackwardModel | None = None

    @field_validator("restrictions", "grid_div_x", "grid_div_y", "grid_div_z", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # Kernel Tuner takes either

    @model_validator(mode="after")
    def _consistent(self) -> OperatorModel:
        for kernel in (self.kernel_name, *([self.reference.kernel_name] if self.reference else [])):
            if not _IDENTIFIER.match(kernel):
                raise ValueError(f"kernel name {kernel!r} must be a C identifier")
        files = [self.template] + ([self.reference.template] if self.reference else [])
        for file in files:
            if not _FILE_NAME.match(file):
                raise ValueError(f"file {file!r} must be a plain .cu or .cuh name in the folder")
        for header in self.headers:
            if not _HEADER_NAME.match(header):
                raise ValueError(
                    f"header {header!r} must be a plain .h, .cuh, .hpp, .hh or .inc name in the "
                    "folder (no directories)"
                )
        if len(set(self.headers)) != len(self.headers) or set(self.headers) & set(files):
            raise ValueError("headers must be distinct files, other than the templates")
        names: list[str] = []
        for dim in self.shape:
            if not _IDENTIFIER.match(dim) or keyword.iskeyword(dim):
                raise ValueError(f"shape name {dim!r} must be an identifier")
            names.append(dim)
        for param, values in self.tune_params.items():
            if not _IDENTIFIER.match(param) or keyword.iskeyword(param) or param.startswith("__"):
                raise ValueError(f"tunable {param!r} must be a C identifier")
            if not 1 <= len(values) <= MAX_VALUES:
                raise ValueError(f"tunable {param!r} needs 1 to {MAX_VALUES} values")
            if len({repr(v) for v in values}) != len(values):
                raise ValueError(f"tunable {param!r} lists a value twice")
            for v in values:
                if isinstance(v, str) and not _IDENTIFIER.match(v) and not _NUMBER.match(v):
                    raise ValueError(
                        f"tunable {param!r}: string value {v!r} must be an identifier or a number"
                    )
            names.append(param)
        clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(BUILTIN_NAMES)))
        if clash:
            raise ValueError(f"names used twice (shape, tunables, builtins): {', '.join(clash)}")
        space = 1
        for values in self.tune_params.values():
            space *= len(values)
        if space > MAX_SPACE:
            raise ValueError(f"tune_params make {space} combinations; at most {MAX_SPACE}")
        unknown = sorted(set(self.dtypes) - set(DTYPES))
        if unknown:
            raise ValueError(f"dtypes {unknown} unknown; supported: {', '.join(DTYPES)}")
        if self.dtype_macro is not None and not _IDENTIFIER.match(self.dtype_macro):
            raise ValueError(f"dtype_macro {self.dtype_macro!r} must be a C identifier")
        for name in self.defines:
            if not _IDENTIFIER.match(name):
                raise ValueError(f"define {name!r} must be a C identifier")
        arg_names = [a.name for a in self.arguments]
        if len(set(arg_names)) != len(arg_names):
            raise ValueError("argument names must be distinct")
        for constant in self.constants:
            if constant.size is None or constant.output or constant.tolerance is not None:
                raise ValueError(
                    f"constant {constant.name!r}: a constant-memory array has a size and is "
                    "read only (no value, output or tolerance)"
                )
        constant_names = [c.name for c in self.constants]
        clash = sorted(
            {n for n in constant_names if constant_names.count(n) > 1}
            | (set(constant_names) & set(arg_names + names + list(self.defines)))
        )
        if clash:
            raise ValueError(
                f"constant names must be distinct from each other, the arguments, the shape, "
                f"the tunables and the defines: {', '.join(clash)}"
            )
        if self.verify and not any(a.output for a in self.arguments):
            raise ValueError("no argument is an output: mark the ones the kernel writes")
        if self.verify and self.reference is None:
            raise ValueError(
                "no reference: add [reference] (a reference CUDA kernel in the folder), or set "
                "verify = false to leave the outputs unchecked"
            )
        if self.block_size_names is not None:
            for name in self.block_size_names:
                if not _IDENTIFIER.match(name):
                    raise ValueError(f"block size name {name!r} must be an identifier")
        if self.tolerance is not None:
            values = (
                list(self.tolerance.values())
                if isinstance(self.tolerance, dict)
                else [self.tolerance]
            )
            if any(min(t) < 0 for t in values):
                raise ValueError("tolerances [atol, rtol] must be >= 0")
            if isinstance(self.tolerance, dict) and set(self.tolerance) - set(self.dtypes):
                raise ValueError("tolerance names a dtype the operator does not take")
        self.expressions()  # every expression parses and reads known names only
        if self.default is not None:
            missing = set(self.tune_params) ^ set(self.default)
            bad = [k for k, v in self.default.items() if v not in self.tune_params.get(k, [])]
            if missing or bad:
                raise ValueError("default must give every tunable one of its values")
        if self.backward is not None:
            self.backward.check_against(self)
        return self

    # --- expressions ----------------------------------------------------------------------

    @property
    def shape_names(self) -> tuple[str, ...]:
        return tuple(self.shape)

    def expressions(self) -> dict[str, Any]:
        """Every expression of the spec, parsed: what reads the config and what reads only the
        shape. Raises :class:`~kernels.user.expr.ExpressionError` naming the first bad one."""
        config_names = (*self.shape, *self.tune_params, *BUILTIN_NAMES)
        shape_names = (*self.shape, *BUILTIN_NAMES)

        def parse_all(texts: list[str] | None, what: str, names: tuple[str, ...]) -> Any:
            if texts is None:
                return None
            return [expr.parse(t, names, what=f"{what} {i + 1}") for i, t in enumerate(texts)]

        out: dict[str, Any] = {
            "restrictions": parse_all(self.restrictions, "restriction", config_names),
            "problem_size": parse_all(self.problem_size, "problem_size", config_names),
            "grid_div": [
                parse_all(getattr(self, f"grid_div_{d}"), f"grid_div_{d}", config_names)
                for d in "xyz"
            ],
            "shared_memory": self.shared_memory
            and expr.parse(self.shared_memory, config_names, what="shared_memory"),
            "defines": {
                k: expr.parse(v, config_names, what=f"define {k}") for k, v in self.defines.items()
            },
            "bytes": self.bytes and expr.parse(self.bytes, shape_names, what="bytes"),
            "flops": self.flops and expr.parse(self.flops, shape_names, what="flops"),
            "arguments": [
                expr.parse(a.size or a.value or "", shape_names, what=f"argument {a.name}")
                for a in self.arguments
            ],
            "constants": [
                expr.parse(c.size or "", shape_names, what=f"constant {c.name}")
                for c in self.constants
            ],
        }
        if self.reference is not None:
            ref = self.reference
            out["reference_block"] = parse_all(ref.block, "reference block", shape_names)
            out["reference_grid"] = parse_all(ref.grid, "reference grid", shape_names)
            out["reference_defines"] = {
                k: expr.parse(v, shape_names, what=f"reference define {k}")
                for k, v in ref.defines.items()
            }
        return out

    def combinations(self) -> itertools.product:
        return itertools.product(*self.tune_params.values())


_NUMBER = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")


#: An ``#include`` a template may hold: a system or CUDA header by a relative name
#: (``<cuda_fp16.h>``, ``<cooperative_groups/reduce.h>``).
_SYSTEM_INCLUDE = re.compile(r"<[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*>")
#: Trigraphs (ISO C++17 mode may honour them): ``??=`` is ``#``, ``??/`` a backslash.
_TRIGRAPH = re.compile(r"\?\?[=/'()!<>-]")
_TRIGRAPHS = dict(zip("=/'()!<>-", "#\\^[]|{}~", strict=True))
#: A line splice as GCC makes one: a backslash, blanks, then a line end of any kind.
_SPLICE = re.compile(r"\\[ \t\f\v]*(?:\r\n|\r|\n)")
#: ``#`` or its digraph ``%:`` anywhere (not only at a line's start: a lone CR ends a line, and
#: what looks like a string or a comment to a regex may not be one to the preprocessor), then
#: blanks, then a comment (refused: ``#/**/include``) or a directive's name.
_DIRECTIVE = re.compile(r"(?:#|%:)\s*(?:(/\*)|(include_next|include|import|embed|line)\b)")
#: What may follow ``#include``: a system header by name, then the line's end or a comment.
_INCLUDED = re.compile(rf"[ \t\f\v]*({_SYSTEM_INCLUDE.pattern})[ \t\f\v]*(?=\r|\n|//|/\*|$)")
#: Or a quoted plain name (allowed where it is one of the operator's headers).
_QUOTED = re.compile(r'[ \t\f\v]*"([A-Za-z0-9_][A-Za-z0-9_.-]*)"[ \t\f\v]*(?=\r|\n|//|/\*|$)')
#: A quoted include as :func:`inline_headers` replaces it: a whole line of its own.
_INCLUDE_LINE = re.compile(r'(?m)^[ \t]*#[ \t]*include[ \t]*"([^"\r\n]*)"[ \t]*(?://[^\r\n]*)?\r?$')
_PRAGMA_ONCE = re.compile(r"(?m)^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*\r?$")


#: What to do instead of a quoted include, for a template file: its own headers are listed.
HEADERS_ADVICE = "list the file beside the template in headers, or include system headers by <name>"


def include_error(
    name: str, text: str, headers: Collection[str] = (), advice: str = HEADERS_ADVICE
) -> str | None:
    """Why a template's preprocessor lines are refused, or None: an ``#include`` of anything
    but a system header by a relative name (a path, a quoted or computed name), and
    ``#include_next``, ``#import``, ``#embed``, ``#line``. nvcc runs on the workers, and its
    errors are shown to the user: an include of a host file would echo the file. A quoted
    plain name among ``headers`` (the operator's own, inlined by :func:`inline_headers`) is
    allowed; another is refused with ``advice`` (a source without a folder, a code
    generator's, has no headers to list).

    The text is searched everywhere, after trigraphs and line splices are undone, for ``#`` or
    ``%:`` before such a name: a preprocessor's idea of lines, comments and strings differs
    from a regex's (form feeds, lone carriage returns, ``"/*"`` in a string), so no directive
    is judged by where it stands. One in a string or a comment is refused too; rename it.
    Linear in the text's length (templates are up to a megabyte)."""
    text = _SPLICE.sub("", _TRIGRAPH.sub(lambda m: _TRIGRAPHS[m.group()[2]], text))
    for match in _DIRECTIVE.finditer(text):
        if match.group(1):
            return (
                f"file {name!r}: a comment right after '#' is not allowed "
                f"({text[match.start() : match.start() + 40]!r})"
            )
        directive = match.group(2)
        included = _INCLUDED.match(text, match.end()) if directive == "include" else None
        if included and ".." not in included.group(1):
            continue
        quoted = _QUOTED.match(text, match.end()) if directive == "include" else None
        if quoted and quoted.group(1) in headers:
            continue  # one of the operator's own headers, inlined when rendered
        if quoted:
            return (
                f"file {name!r}: '#include \"{quoted.group(1)}\"' is not allowed: it names none "
                f"of the operator's headers ({', '.join(headers) or 'none'}); {advice}"
            )
        rest = (text[match.end() : match.end() + 60].splitlines() or [""])[0]
        return (
            f"file {name!r}: '#{directive} {rest.strip()}' is not allowed; a template may "
            "include system and CUDA headers by name only (#include <cuda_fp16.h>)"
        )
    return None


def inline_headers(name: str, text: str, files: Mapping[str, str], headers: Collection[str]) -> str:
    """``text`` (the file ``name``) with each ``#include "header"`` line replaced by that
    header's text (inlined the same way), as the preprocessor would include it: a header
    holding ``#pragma once`` only at its first include (the pragma dropped), others at each.
    The result holds no quoted include; one written in another form (a digraph, a splice)
    stays and is refused by :func:`include_error` afterwards.

    Raises:
        ValueError: an include of a name that is not among ``headers``, a cycle of includes,
            or a result over :data:`MAX_INLINED_CHARS` or :data:`MAX_INLININGS` inlinings.
    """
    once: set[str] = set()
    count = 0

    def expand(current: str, body: str, stack: tuple[str, ...]) -> str:
        nonlocal count
        out: list[str] = []
        size, pos = 0, 0
        for match in _INCLUDE_LINE.finditer(body):
            header = match.group(1)
            if header not in headers:
                raise ValueError(
                    f"file {current!r}: '#include \"{header}\"' names none of the operator's "
                    f"headers ({', '.join(headers) or 'none'}); list it in headers"
                )
            if header in stack:
                raise ValueError(f"headers include each other: {' -> '.join((*stack, header))}")
            count += 1
            if count > MAX_INLININGS:
                raise ValueError(f"file {name!r}: more than {MAX_INLININGS} header inclusions")
            piece = body[pos : match.start()]
            header_text = files[header]
            if _PRAGMA_ONCE.search(header_text):
                header_text = "" if header in once else _PRAGMA_ONCE.sub("", header_text)
                once.add(header)
            piece += expand(header, header_text, (*stack, header)) if header_text else ""
            size += len(piece)
            if size > MAX_INLINED_CHARS:
                raise ValueError(
                    f"file {name!r} with its headers inlined is over {MAX_INLINED_CHARS} characters"
                )
            out.append(piece)
            pos = match.end()
        out.append(body[pos:])
        return "".join(out)

    return expand(name, text, (name,))


class OperatorDefinition(_Strict):
    """A user operator as stored and sent: the spec and the text of the files it names."""

    spec: OperatorModel
    files: dict[str, str]

    @model_validator(mode="after")
    def _files(self) -> OperatorDefinition:
        templates = {self.spec.template} | (
            {self.spec.reference.template} if self.spec.reference else set()
        )
        needed = templates | set(self.spec.headers)
        missing = sorted(needed - set(self.files))
        if missing:
            raise ValueError(f"files named by the spec are missing: {', '.join(missing)}")
        extra = sorted(set(self.files) - needed)
        if extra:
            raise ValueError(f"files the spec does not name: {', '.join(extra)}")
        for name, text in self.files.items():
            if len(text.encode("utf-8", errors="surrogatepass")) > MAX_FILE_BYTES:
                raise ValueError(f"file {name!r} is over {MAX_FILE_BYTES} bytes")
            if "\x00" in text:
                raise ValueError(f"file {name!r} holds a NUL character")
            if reason := include_error(name, text, self.spec.headers):
                raise ValueError(reason)
        for name in sorted(templates):  # what nvcc will read: no include left after inlining
            inlined = inline_headers(name, self.files[name], self.files, self.spec.headers)
            if reason := include_error(name, inlined):
                raise ValueError(reason)
        return self
