"""Kernel Tuner's ``tune_kernel`` arguments as a Kato user operator.

:func:`operator_from_arguments` turns ``kernel_name, kernel_source, problem_size, arguments,
tune_params, restrictions, answer, grid_div_*, block_size_names, atol`` into a
:class:`~kernels.user.spec.UserOperatorSpec`: the arguments' numpy arrays give the dtypes and
sizes, ``answer``'s non-None entries are the outputs and their expected values, the rest of
the launch follows Kernel Tuner's conventions (:mod:`kernels.user.model`).

A ``kernel_source`` that is a code generator (a callable of the config's tunables returning
its source, as Kernel Tuner takes one) is called here, in the caller's process only, once per
config that passes the checks holding at every problem size (:func:`generated_sources`); the
operator is then a :class:`~kernels.user.generated.GeneratedOperatorSpec` holding the sources,
never the callable, and is one version at every problem size. Restriction functions (Kernel
Tuner's callable ``restrictions``, :func:`split_restrictions`) are called there too, locally
only, and a config they refuse is left out of the table; with a string source the operator is
then such a table of that one source.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kato.kernels.spec import DTYPES, InvalidInput
from kato.kernels.user import definition
from kato.kernels.user.generated import (
    MAX_GENERATED_CONFIGS,
    PLACEHOLDER,
    GeneratedOperatorSpec,
    returned_source,
)
from kato.kernels.user.model import ARRAY_DTYPES, OUTPUT_DTYPES, SCALAR_DTYPES
from kato.kernels.user.spec import UserOperatorSpec
from kato.tuner.space import ENUMERATE_MAX, FILTER_MAX, SearchSpace

#: What Kato's result key calls a dimension of ``problem_size``.
DIMENSION_NAMES = ("x", "y", "z")
_NAME = re.compile(r"[^a-z0-9_]+")
#: Why a code generator is refused through a service.
GENERATOR_LOCAL_ONLY = (
    "kernel_source is a code generator (Python of this process): generators run only in a "
    "local kato.tune_kernel, which calls it here for each config; a service's workers run no "
    "caller's Python. Through a service, pass the CUDA source as a string, or tune locally"
)

#: Why a restriction function is refused through a service.
RESTRICTION_FUNCTION_LOCAL_ONLY = (
    "restrictions holds a Python function: restriction functions run only in a local "
    "kato.tune_kernel, which calls them here for each config; a service's workers run no "
    "caller's Python. Through a service, write it as an expression string such as "
    "'block_size_x * tile_size_x <= 1024'"
)


class RestrictionFunction:
    """One of Kernel Tuner's restriction functions, called on a config: with a dict of the
    config where ``names`` is None, else with the values of ``names`` (tunables) in order.
    Its answer's truth decides, as in Kernel Tuner."""

    def __init__(self, function: Callable[..., Any], names: Sequence[str] | None):
        self.function = function
        self.names = None if names is None else tuple(names)

    def __call__(self, config: Mapping[str, Any]) -> bool:
        if self.names is None:
            return bool(self.function(dict(config)))
        return bool(self.function(*(config[name] for name in self.names)))

    def __str__(self) -> str:
        return getattr(self.function, "__qualname__", None) or repr(self.function)


def split_restrictions(
    restrictions: Any, tune_params: Mapping[str, Any]
) -> tuple[list[str], list[RestrictionFunction]]:
    """Kernel Tuner's ``restrictions`` as the spec's expression strings and the restriction
    functions: None, an expression, a function, or a list of expressions and functions. A
    function is called as Kernel Tuner calls its forms (:class:`RestrictionFunction`): one of
    a single parameter, with several tunables, gets the config's dict (its documented form,
    ``lambda p: p["block_size_x"] <= 512``); one whose parameters are all tunables' names
    gets those by name; any other every tunable's value in ``tune_params`` order.

    Raises:
        InvalidInput: an entry of another kind (python-constraint's ``Constraint`` objects,
            ``(function, names)`` pairs, which Kernel Tuner's tune_kernel refuses too).
    """
    if restrictions is None:
        return [], []
    items = list(restrictions) if isinstance(restrictions, list | tuple) else [restrictions]
    params = list(tune_params)
    texts: list[str] = []
    functions: list[RestrictionFunction] = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif callable(item) and type(item).__module__.split(".")[0] != "constraint":
            parameters = _parameters(item)
            if parameters is not None and len(parameters) == 1 and len(params) > 1:
                functions.append(RestrictionFunction(item, None))
            elif parameters and set(parameters) <= set(params):
                functions.append(RestrictionFunction(item, parameters))  # by their names
            else:
                functions.append(RestrictionFunction(item, params))
        else:
            raise InvalidInput(
                "restrictions must be expression strings such as 'block_size_x * tile <= "
                f"1024' or functions of the tunables, not {type(item).__name__} ({item!r})"
            )
    return texts, functions


def _parameters(function: Callable[..., Any]) -> list[str] | None:
    """The names of a function's plain parameters; None where it has others (``*args``,
    keyword-only) or no signature to read (a builtin)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in plain for p in parameters):
        return None
    return [p.name for p in parameters]


def operator_name(kernel_name: str) -> str:
    """The Kato operator name of a kernel: lower case, other characters as ``_``."""
    name = _NAME.sub("_", kernel_name.lower()).strip("_") or "kernel"
    if not name[0].isalpha():
        name = "k_" + name
    return name[:64]


def kernel_source_text(kernel_source: Any) -> str:
    """The source: a string of code, or a file name (or a list whose first entry is one), as
    Kernel Tuner takes it."""
    if isinstance(kernel_source, list | tuple):
        if not kernel_source:
            raise InvalidInput("kernel_source is an empty list")
        kernel_source = kernel_source[0]
    if isinstance(kernel_source, Path) or (
        isinstance(kernel_source, str) and "\n" not in kernel_source
        and kernel_source.endswith((".cu", ".cuh", ".c", ".cpp")) and Path(kernel_source).is_file()
    ):  # fmt: skip
        return Path(kernel_source).read_text()
    if not isinstance(kernel_source, str):
        raise InvalidInput("kernel_source must be CUDA code or the name of a file holding it")
    return kernel_source


def code_generator(kernel_source: Any) -> Any:
    """Kernel Tuner's code generator where ``kernel_source`` is one (a callable, or a list
    whose first entry is one: the kernel's), else None."""
    if isinstance(kernel_source, list | tuple) and kernel_source:
        kernel_source = kernel_source[0]
    return kernel_source if callable(kernel_source) else None


def generated_sources(
    op: UserOperatorSpec,
    generator: Any,
    dtype: str,
    functions: Sequence[RestrictionFunction] = (),
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[dict[str, Any], str]]:
    """Each config of ``op`` that passes the checks holding at every problem size
    (:meth:`~kernels.user.spec.UserOperatorSpec.check_any_size`: the restrictions and launch
    limits that read no shape name) and every restriction function of ``functions``, in
    ``tune_params`` order, with ``generator(config)``: called here, in this process, once per
    config, with a fresh dict of its tunables as Kernel Tuner calls it. No problem size is
    asked for: the table is the same at every size (a config refused at a size by a check
    left out here is refused there by ``op.check``). The restriction functions are called
    first, on every config that passes the checks, at most :data:`~tuner.space.ENUMERATE_MAX`;
    whatever they read, their answers are in the table, so in the version. ``progress``
    (optional) is called with (sources generated, sources to generate) after each call.

    Raises:
        InvalidInput: more than :data:`~kernels.user.generated.MAX_GENERATED_CONFIGS` such
            configs (:data:`~tuner.space.ENUMERATE_MAX` before restriction functions), or a
            product of ``tune_params`` too large to count them (over
            :data:`~tuner.space.FILTER_MAX`), before the generator is called; a generator or
            a restriction function that raises for a config (the config and the exception
            named, the exception chained), a generator that returns anything but a string (at
            that config's call).
    """
    space = SearchSpace(
        op.params,
        check=lambda c: op.check_any_size(c, dtype),
        screen=op.screen_any_size(dtype),
    )
    narrow = (
        f"a code generator is run up front for every config that may be valid at some problem "
        f"size, at most {MAX_GENERATED_CONFIGS}: narrow tune_params or add restrictions"
    )
    if len(space) > FILTER_MAX:
        raise InvalidInput(
            f"tune_params has {len(space)} combinations, too many to count the valid ones "
            f"(at most {FILTER_MAX}); {narrow}"
        )
    count = space.count_valid()
    most = ENUMERATE_MAX if functions else MAX_GENERATED_CONFIGS
    if count is not None and count > most:
        raise InvalidInput(
            f"{count} configs pass the restrictions and limits that hold at every problem "
            + (
                f"size, too many to call restriction functions on (at most {most}): write "
                "restrictions as expressions, or narrow tune_params"
                if functions
                else f"size; {narrow}"
            )
        )
    configs = [c for c in space.valid_configs() if all(_holds(f, c) for f in functions)]
    if len(configs) > MAX_GENERATED_CONFIGS:
        raise InvalidInput(
            f"{len(configs)} configs pass the restrictions and limits that hold at every "
            f"problem size and the restriction functions; {narrow}"
        )
    out = []
    for config in configs:
        try:
            text = generator(dict(config))
        except Exception as exc:  # the user's code: any error names its config
            raise InvalidInput(
                f"the code generator raised {type(exc).__name__} for config {config}: {exc}"
            ) from exc
        # Checked at once, not after every other config's call.
        out.append((config, returned_source(config, text)))
        if progress is not None:
            progress(len(out), len(configs))
    return out


def _holds(function: RestrictionFunction, config: Mapping[str, Any]) -> bool:
    try:
        return function(config)
    except Exception as exc:  # the user's code: any error names its config
        raise InvalidInput(
            f"the restriction function {function} raised {type(exc).__name__} for config "
            f"{dict(config)}: {exc}"
        ) from exc


def problem_dims(problem_size: Any) -> tuple[int, ...]:
    """``problem_size`` as Kato's shape (an int, or a tuple of 1 to 3 ints)."""
    dims = (problem_size,) if isinstance(problem_size, int | np.integer) else problem_size
    try:
        out = tuple(int(d) for d in dims)
    except (TypeError, ValueError):
        raise InvalidInput(
            f"problem_size must be an int or a tuple of ints, got {problem_size!r} (the "
            "shape is part of the result key)"
        ) from None
    if not 1 <= len(out) <= 3 or min(out) < 1:
        raise InvalidInput(f"problem_size must have 1 to 3 dimensions >= 1, got {out}")
    return out


def problem_shape(
    problem_size: Any, arguments: Sequence[Any], shape: Any = None
) -> tuple[tuple[int, ...], list[str] | None]:
    """Kato's shape (the result key) and the spec's ``problem_size`` expressions (None: the
    shape itself) of Kernel Tuner's ``problem_size``.

    ``problem_size`` is an int or a tuple of ints (the shape), or a string, or a tuple holding
    strings: expressions of the tunables (its reduction example's ``"num_blocks"``), evaluated
    per config by :mod:`kernels.user.expr` (never ``eval``). The shape is then ``shape``
    where given, else the element count of the largest array argument (one dimension): the
    data a lookup is for.

    Raises:
        InvalidInput: a callable, or anything else that is neither ints nor expressions.
    """
    entries = problem_size if isinstance(problem_size, list | tuple) else (problem_size,)
    if callable(problem_size) or any(callable(e) for e in entries):
        raise InvalidInput(
            "problem_size must be ints or expression strings of the tunables such as "
            "'num_blocks' (a Python function cannot be sent to a service or evaluated safely)"
        )
    if not any(isinstance(e, str) for e in entries):
        return problem_dims(problem_size), None
    if not 1 <= len(entries) <= 3 or not all(
        isinstance(e, str | int | np.integer) and not isinstance(e, bool) for e in entries
    ):
        raise InvalidInput(
            f"problem_size must be 1 to 3 ints or expression strings, got {problem_size!r}"
        )
    if shape is not None:
        return problem_dims(shape), [str(e) for e in entries]
    sizes = [a.size for a in arguments if isinstance(a, np.ndarray)]
    return (max(sizes, default=1) or 1,), [str(e) for e in entries]


def _size_expression(size: int, shape: tuple[int, ...]) -> str:
    """An array's size as an expression of the problem size where it is one (the product of
    the dimensions, or one of them), else the number: then the operator's version is the same
    at every problem size, so its results at one size are the nearest answer and the warm start
    at another."""
    names = DIMENSION_NAMES[: len(shape)]
    if size == math.prod(shape):
        return " * ".join(names)
    for name, dim in zip(names, shape, strict=True):
        if size == dim:
            return name
    return str(size)


def _divisors(value: Any, what: str) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise InvalidInput(f"{what} must be expression strings (Kato runs no callables)")
    return items


def operator_from_arguments(
    kernel_name: str,
    kernel_source: Any,
    problem_size: Any,
    arguments: Sequence[Any],
    tune_params: Mapping[str, Sequence[Any]],
    *,
    restrictions: Any = None,
    answer: Sequence[Any] | None = None,
    atol: float = 1e-6,
    grid_div_x: Any = None,
    grid_div_y: Any = None,
    grid_div_z: Any = None,
    block_size_names: Sequence[str] | None = None,
    smem_args: Mapping[str, Any] | None = None,
    cmem_args: Mapping[str, Any] | None = None,
    defines: Mapping[str, Any] | None = None,
    name: str | None = None,
    fixed: bool = True,
    shape: Any = None,
    verify: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[UserOperatorSpec, dict[str, Any]]:
    """The operator (with the given arguments and answer when ``fixed``) and the spec dict
    it was built from (what a service is sent). ``shape``: Kato's shape where
    ``problem_size`` holds expressions (:func:`problem_shape`). ``verify``: Kernel Tuner's
    verify function; it then decides (no output is compared with the answer on the device,
    and the answer's entries may have any size, as Kernel Tuner allows).

    ``kernel_source`` may be a code generator (:func:`code_generator`), with ``fixed`` only:
    it is called for every config that may be valid at some problem size
    (:func:`generated_sources`) and the operator is a
    :class:`~kernels.user.generated.GeneratedOperatorSpec` of its sources,
    each rendered with Kato's macros (``block_size_names``, ``grid_div_*``: Kernel Tuner's
    rules) as a string source would be. ``restrictions`` may hold functions
    (:func:`split_restrictions`), with ``fixed`` only: they are called with the generator (a
    string source is then a generator of itself), and the configs they refuse are left out
    of the table (the operator's ``checks_every_size`` is then False). ``progress``: told
    how far the generator is (:func:`generated_sources`).

    Raises:
        InvalidInput: an argument Kato cannot pass, a restriction that is neither an
            expression nor a function, an answer of the wrong length, and every error of the
            declarative spec; a code generator or a restriction function without ``fixed`` (a
            service's spec), and every error of :func:`generated_sources` and of a generated
            source.
    """
    shape, problem_exprs = problem_shape(problem_size, arguments, shape)
    restrictions, functions = split_restrictions(restrictions, tune_params)
    if functions and not fixed:
        raise InvalidInput(RESTRICTION_FUNCTION_LOCAL_ONLY)
    if answer is not None and len(answer) != len(arguments):
        raise InvalidInput(
            f"answer has {len(answer)} entries for {len(arguments)} arguments (None where "
            "an argument is not checked)"
        )
    args_spec = []
    dtype = None
    for index, value in enumerate(arguments):
        out = answer is not None and answer[index] is not None and verify is None
        if isinstance(value, np.ndarray):
            dt = str(value.dtype)
            if dt not in ARRAY_DTYPES:
                raise InvalidInput(f"argument {index}: arrays of {dt} are not supported")
            if out and dt not in OUTPUT_DTYPES:
                raise InvalidInput(
                    f"argument {index}: an answer for a {dt} array cannot be checked; outputs "
                    f"are {', '.join(OUTPUT_DTYPES)}"
                )
            if out and np.asarray(answer[index]).size != value.size:
                raise InvalidInput(f"answer {index} has another size than argument {index}")
            size = _size_expression(value.size, shape)
            args_spec.append({"name": f"arg{index}", "dtype": dt, "size": size, "output": out})
            if dtype is None and dt in DTYPES and (out or dt.startswith(("float", "bfloat"))):
                dtype = dt
        elif isinstance(value, np.generic) and str(value.dtype) in SCALAR_DTYPES:
            args_spec.append({"name": f"arg{index}", "dtype": str(value.dtype), "value": "0"})
        else:
            raise InvalidInput(
                f"argument {index} is a {type(value).__name__}; give numpy arrays and numpy "
                f"scalars ({', '.join(SCALAR_DTYPES)}), e.g. np.int32(n)"
            )
    dtype = dtype or "float32"
    constants = _constants(cmem_args, shape)
    shared = None
    if smem_args:
        size = smem_args.get("size")
        if not isinstance(size, int | str):
            raise InvalidInput("smem_args['size'] must be bytes or an expression of the tunables")
        shared = str(size)
    spec: dict[str, Any] = {
        "name": name or operator_name(kernel_name),
        "description": f"{kernel_name} through kato.tune_kernel",
        "template": "kernel.cu",
        "kernel_name": kernel_name,
        "shape": list(DIMENSION_NAMES[: len(shape)]),
        "problem_size": problem_exprs,
        "dtypes": [dtype],
        "tune_params": {k: list(v) for k, v in tune_params.items()},
        "restrictions": list(restrictions),
        "grid_div_x": _divisors(grid_div_x, "grid_div_x"),
        "grid_div_y": _divisors(grid_div_y, "grid_div_y"),
        "grid_div_z": _divisors(grid_div_z, "grid_div_z"),
        "block_size_names": list(block_size_names) if block_size_names else None,
        "shared_memory": shared,
        "defines": {k: str(v) for k, v in (defines or {}).items()},
        "arguments": args_spec,
        "constants": [entry for entry, _ in constants.values()] or None,
        "tolerance": [float(atol), 1e-5],  # np.allclose's rtol, as Kernel Tuner compares
        "verify": False,  # the answer is the reference, where there is one
    }
    spec = {k: v for k, v in spec.items() if v is not None}
    generator = code_generator(kernel_source)
    if generator is not None and not fixed:
        raise InvalidInput(GENERATOR_LOCAL_ONLY)
    if generator is None and functions:
        # Restriction functions are answered up front into a table, as a generator's sources
        # are: a string source is a generator of that one source.
        source = kernel_source_text(kernel_source)
        generator = lambda params: source  # noqa: E731
    text = PLACEHOLDER if generator is not None else kernel_source_text(kernel_source)
    defn = definition(spec, {"kernel.cu": text}, "tune_kernel")
    if not fixed:
        return UserOperatorSpec(defn), spec
    values = [v.item() if isinstance(v, np.generic) else v for v in arguments]
    options: dict[str, Any] = dict(
        arguments=values, answer=list(answer) if answer else None,
        constants={k: v for k, (_, v) in constants.items()} if constants else None,
        verify=verify,
    )  # fmt: skip
    op = UserOperatorSpec(defn, **options)
    if generator is None:
        return op, spec
    # The spec's checks that hold at every size decide which configs are rendered (so the
    # version is one at every size); the generator is called here and the operator keeps only
    # what it returned.
    sources = generated_sources(op, generator, op.dtypes[0], functions, progress)
    return GeneratedOperatorSpec(defn, sources, by_functions=bool(functions), **options), spec


def _constants(
    cmem_args: Mapping[str, Any] | None, shape: tuple[int, ...]
) -> dict[str, tuple[dict[str, Any], np.ndarray]]:
    """Kernel Tuner's ``cmem_args`` (``__constant__`` name -> numpy array or scalar) as the
    spec's constant-memory arrays and their values."""
    out: dict[str, tuple[dict[str, Any], np.ndarray]] = {}
    if cmem_args is None:
        return out
    if not isinstance(cmem_args, Mapping):
        raise InvalidInput("cmem_args must map __constant__ names to numpy arrays")
    for key, value in cmem_args.items():
        if not isinstance(value, np.ndarray | np.generic):
            raise InvalidInput(
                f"cmem_args[{key!r}] is a {type(value).__name__}; give a numpy array"
            )
        array = np.ascontiguousarray(value).ravel()
        if str(array.dtype) not in ARRAY_DTYPES:
            raise InvalidInput(f"cmem_args[{key!r}]: arrays of {array.dtype} are not supported")
        spec = {"name": key, "dtype": str(array.dtype),
                "size": _size_expression(array.size, shape)}  # fmt: skip
        out[key] = (spec, array)
    return out
