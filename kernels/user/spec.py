"""``UserOperatorSpec``: an :class:`~kernels.spec.OperatorSpec` built from a declarative
definition (:class:`~kernels.user.model.OperatorDefinition`), so the search, replay, jobs and
export/import treat a user's kernel as they treat a built-in one.

The reference is one of: a reference CUDA kernel of the definition (run on the GPU by the
backend, :meth:`UserOperatorSpec.device_reference`), a Python function (operators that a
package registers: ``reference=``), or fixed expected outputs (``kato.tune_kernel``'s
``answer``); None entries of the expected outputs are not checked.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from kato.kernels import limits
from kato.kernels.spec import (
    DTYPES,
    Config,
    InvalidInput,
    Launch,
    OperatorSpec,
    Problem,
    code_fingerprint,
)
from kato.kernels.user import vector
from kato.kernels.user.expr import ExpressionError
from kato.kernels.user.model import (
    DEFAULT_BLOCK_SIZE_NAMES,
    OperatorDefinition,
    OperatorModel,
    include_error,
    inline_headers,
    numpy_dtype,
)

from kato.shared.paths import compile_cache_dir

#: ``(atol, rtol)`` per dtype where the spec gives none (float32 results of a differently
#: ordered float32 sum; 16-bit types rounded once more).
DEFAULT_TOLERANCES = {
    "float32": (1e-5, 1e-4),
    "float16": (1e-3, 1e-2),
    "bfloat16": (1e-2, 2e-2),
    "int32": (0.0, 0.0),
}
#: Most elements of one array argument, and bytes of one problem.
MAX_ELEMENTS = 1 << 34
#: CUDA's constant memory: the most bytes a module's ``__constant__`` globals hold together.
MAX_CONSTANT_BYTES = 64 << 10
#: Combinations ``default_config`` checks one at a time at most when the spec declares no
#: valid default and its expressions cannot be screened on numpy columns (about 0.2 s).
MAX_DEFAULT_SCAN = 10_000
#: Combinations ``default_config`` screens (:meth:`UserOperatorSpec.screen`, about a
#: microsecond each on a loaded 2-core host) in ``tune_params`` order, then as many more drawn
#: at random from the rest (a fixed seed: every host serves the same default): 0.5 s at most.
DEFAULT_SCREEN = 1 << 18
#: The first chunk screened for a default, grown eightfold after each chunk without one: the
#: first combination is valid in most spaces, answered in well under a millisecond.
DEFAULT_CHUNK = 1 << 10
DEFAULT_SEED = 0x6B61746F
#: (shape, dtype) answers of ``default_config`` kept per operator.
MAX_CACHED_DEFAULTS = 1024
#: CUDA's limits on a block's dimensions and a grid's.
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (limits.MAX_GRID_X, limits.MAX_GRID_Y, limits.MAX_GRID_Y)
#: Kernel Tuner's marker for a tunable that sets a ``#pragma unroll`` count.
UNROLL_NAME = "loop_unroll_factor"
#: The modules whose code decides what a user operator's variants are and how they are checked.
_HASHED_MODULES = (
    "kato.kernels.limits",
    "kato.kernels.user.expr",
    "kato.kernels.user.model",
    "kato.kernels.user.spec",
    "kato.kernels.user.vector",
)
#: Spec fields left out of the version (reset to their defaults before the spec is hashed, so
#: a spec without them hashes as before): they decide nothing about a variant's code, launch,
#: check or timing (``description`` is prose, ``backward`` the autograd binding), and editing
#: one must not orphan the results stored under the version (``db.operators`` updates them).
UNVERSIONED_FIELDS = ("description", "backward")
#: Function computing float64 references: ``reference(args, shape, dtype) -> [array per
#: output]`` (``args`` as :meth:`UserOperatorSpec.make_problem` made them).
PythonReference = Callable[[list[Any], tuple[int, ...], str], Sequence[np.ndarray]]
#: Kernel Tuner's custom verification: ``verify(answer, result_host, atol=None) -> bool``.
VerifyFunction = Callable[..., Any]


def versioned_spec(model: OperatorModel) -> OperatorModel:
    """``model`` with its :data:`UNVERSIONED_FIELDS` at their defaults: what of a spec its
    version hashes."""
    fields = OperatorModel.model_fields
    defaults = {
        name: fields[name].get_default(call_default_factory=True) for name in UNVERSIONED_FIELDS
    }
    return model.model_copy(update=defaults)


@dataclass
class UserProblem(Problem):
    """A problem with the values of the operator's constant-memory arrays (name -> array),
    which a backend copies into each module's ``__constant__`` globals before it runs."""

    constants: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceReference:
    """A reference kernel to run once per problem on the GPU (by the measuring backend): its
    rendered ``source``, entry point, launch and the problem arguments it takes (all, in
    order). After it ran, the outputs' contents are the references."""

    source: str
    kernel_name: str
    launch: Launch


class UserOperatorSpec(OperatorSpec):
    """An operator from a declarative definition. See the module docstring.

    Args:
        definition: the spec and its files' text.
        reference: a Python reference (packages only; never for a definition from the API).
        arguments: fixed argument values (``kato.tune_kernel``): used as the problem instead of
            random inputs (scalars and arrays, in order, dtypes and sizes as declared).
        answer: fixed expected outputs, one entry per argument (None: not checked).
        constants: fixed values of the constant-memory arrays (name -> array; ``cmem_args``),
            instead of filling them by their ``init``.
        verify: a Python function deciding whether a variant's results are right, Kernel
            Tuner's ``verify(answer, result_host, atol=...)`` (local runs only: it runs in the
            measuring process, so it is never part of a definition sent or stored). It
            replaces the comparison with references: see :meth:`check_results`.
    """

    #: Read from the database (``db.operators``): such an operator may be replaced by a newer
    #: stored version; a built-in or installed one's name cannot be taken by a stored one.
    stored: bool = False
    #: Whether :meth:`check` decides a config's validity at every shape. False where code
    #: Kato cannot read decided some configs at one shape only (a restriction function of
    #: ``kato.tune_kernel``, :mod:`kernels.user.generated`): a winner tuned at one shape is
    #: then not served at another (``kato.lookup`` serves exact shapes only).
    checks_every_size: bool = True

    def __init__(
        self,
        definition: OperatorDefinition,
        *,
        reference: PythonReference | None = None,
        arguments: Sequence[Any] | None = None,
        answer: Sequence[Any] | None = None,
        source_dir: Path | None = None,
        constants: Mapping[str, Any] | None = None,
        verify: VerifyFunction | None = None,
    ):
        self.definition = definition
        self.verify_function = verify
        model = self.model = definition.spec
        self.name = model.name
        self.description = model.description or f"user operator {model.name}"
        self.dtypes = tuple(model.dtypes)
        self.rank = len(model.shape)
        self.shape_names = tuple(model.shape)
        self.params = {k: tuple(v) for k, v in model.tune_params.items()}
        self.kernel_name = model.kernel_name
        self.kernel_names = ()
        self._python_reference = reference
        self._arguments = list(arguments) if arguments is not None else None
        self._answer = list(answer) if answer is not None else None
        self._source_dir = source_dir
        self._expr = model.expressions()
        names = model.block_size_names or []
        self.block_size_names = tuple(names) + DEFAULT_BLOCK_SIZE_NAMES[len(names) :]
        if self._answer is not None and len(self._answer) != len(model.arguments):
            raise InvalidInput(
                f"answer has {len(self._answer)} entries; it needs one per argument "
                f"({len(model.arguments)}), None where not checked"
            )
        declared = {c.name for c in model.constants}
        if constants is not None and set(constants) != declared:
            raise InvalidInput(
                f"constants {sorted(constants)} are not the spec's constant-memory arrays "
                f"{sorted(declared)}"
            )
        self._constants = dict(constants) if constants is not None else None
        if model.verify and model.reference is None and reference is None and answer is None:
            raise InvalidInput(f"operator {self.name!r} has no reference")

    # --- identity ---------------------------------------------------------------------------

    @cached_property
    def template(self) -> Path:  # type: ignore[override]
        """The template as a file (the folder's, else written once to Kato's cache), with its
        headers inlined (then always a file in the cache): what a variant compiles."""
        name, headers = self.model.template, self.model.headers
        if not headers and self._source_dir is not None and (self._source_dir / name).is_file():
            return self._source_dir / name

        files = self.definition.files
        text = inline_headers(name, files[name], files, headers) if headers else files[name]
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        path = compile_cache_dir().parent / "user-operators" / digest / name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        return path

    @cached_property
    def version(self) -> str:
        """sha256 of the spec (canonical JSON, less :data:`UNVERSIONED_FIELDS`), the files'
        text, and the syntax of the code that renders, launches and verifies it (this package
        and :mod:`kernels.limits`): a changed folder or a changed Kato gives a new version (12
        hex digits); a changed description or ``[backward]`` section does not."""
        h = hashlib.sha256()
        h.update(versioned_spec(self.definition.spec).model_dump_json().encode())
        for name in sorted(self.definition.files):
            h.update(name.encode() + b"\0" + self.definition.files[name].encode() + b"\0")
        for module in _HASHED_MODULES:  # a fixed list: the same in every process
            file = inspect.getfile(importlib.import_module(module))
            h.update(code_fingerprint(Path(file).read_text()))
        for function in (self._python_reference, self.verify_function):
            if function is None:
                continue
            try:
                h.update(code_fingerprint(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):  # a lambda's line may not parse alone
                h.update(getattr(function, "__qualname__", "").encode())
        return h.hexdigest()[:12]

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["user"] = True
        backward = self.model.backward
        out["backward"] = None if backward is None else backward.model_dump(mode="json")
        return out

    # --- expressions ------------------------------------------------------------------------

    def _env(
        self, config: Mapping[str, Any] | None, shape: Sequence[int] | None, dtype: str
    ) -> dict:
        # shape None: no shape name is bound (the size-independent checks read none).
        env: dict[str, Any] = {}
        if shape is not None:
            env.update(zip(self.shape_names, shape, strict=True))
        env["itemsize"] = DTYPES[dtype][2] if dtype in DTYPES else 4
        if config is not None:
            env.update(config)
        return env

    def _truncated(self, expression: Any, env: Mapping[str, Any], what: str) -> int:
        """A number truncated to an int, as Kernel Tuner's ``int(eval(...))`` of a grid divisor
        or problem size does (``block_size_x / threads_per_row`` of 48 / 32 is 1)."""
        value = expression.evaluate(env)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ExpressionError(f"{what} ({expression}) must be a number, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ExpressionError(f"{what} ({expression}) is {value}")
        return int(value)

    def _int(self, expression: Any, env: Mapping[str, Any], what: str) -> int:
        value = expression.evaluate(env)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ExpressionError(f"{what} ({expression}) must be an integer, got {value!r}")
        return value

    def threads(self, config: Config) -> tuple[int, int, int]:
        """Kernel Tuner's block: the block size names' values (256, 1, 1 where absent)."""
        defaults = (256, 1, 1)
        return tuple(  # type: ignore[return-value]
            int(config.get(name, default))
            for name, default in zip(self.block_size_names, defaults, strict=True)
        )

    def _sized(self, expression: Any, shape: Sequence[int] | None) -> bool:
        """Whether ``expression`` cannot be evaluated for want of a shape: ``shape`` is None
        and it reads a shape name."""
        return shape is None and not expression.names.isdisjoint(self.shape_names)

    def problem_size(self, config: Config, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """``problem_size`` evaluated (default: the shape), padded to 3 dimensions with 1."""
        return tuple(self._problem_size(config, shape, dtype))  # type: ignore[arg-type]

    def _problem_size(
        self, config: Config, shape: Sequence[int] | None, dtype: str
    ) -> list[int | None]:
        """:meth:`problem_size`; with ``shape`` None, None for each dimension that depends on
        the shape (the others evaluated, their errors raised)."""
        env = self._env(config, shape, dtype)
        exprs = self._expr["problem_size"]
        sizes: list[int | None]
        if exprs is None and shape is None:
            sizes = [None] * min(self.rank, 3)
        elif exprs is None:
            sizes = list(shape[:3])  # type: ignore[index]
            if len(shape) > 3:  # type: ignore[arg-type]
                sizes[2] = math.prod(shape[2:])  # type: ignore[index]
        else:
            sizes = [
                None if self._sized(e, shape) else self._truncated(e, env, "problem_size")
                for e in exprs
            ]
        return sizes + [1] * (3 - len(sizes))

    def grid(self, config: Config, shape: Sequence[int], dtype: str) -> tuple[int, int, int]:
        """Kernel Tuner's grid: ``ceil(problem_size / divisor)`` per dimension, the divisor the
        product of ``grid_div_*`` (default: that dimension's block size name if a tunable)."""
        return tuple(self._grid(config, shape, dtype))  # type: ignore[return-value]

    def _grid(self, config: Config, shape: Sequence[int] | None, dtype: str) -> list[int | None]:
        """:meth:`grid`; with ``shape`` None, None for each dimension whose size or divisor
        depends on the shape (a divisor known below 1, or one failing to evaluate, raises)."""
        env = self._env(config, shape, dtype)
        size = self._problem_size(config, shape, dtype)
        grid: list[int | None] = []
        for dim, exprs in enumerate(self._expr["grid_div"]):
            divisor: int | None
            if exprs is None:
                name = self.block_size_names[dim]
                divisor = int(config[name]) if name in config else 1
            else:
                factors = [
                    None if self._sized(e, shape)
                    else self._truncated(e, env, f"grid_div_{'xyz'[dim]}")
                    for e in exprs
                ]  # fmt: skip
                divisor = None if None in factors else math.prod(factors)  # type: ignore[arg-type]
            if divisor is not None and divisor < 1:
                raise ExpressionError(f"grid_div_{'xyz'[dim]} is {divisor}; it must be >= 1")
            known = size[dim] is not None and divisor is not None
            grid.append(max(1, -(-size[dim] // divisor)) if known else None)  # type: ignore[operator]
        return grid

    # --- OperatorSpec -----------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        shape = super().validate(shape, dtype)
        env = self._env(None, shape, dtype)
        total = 0
        for arg, size_expr in zip(self.model.arguments, self._expr["arguments"], strict=True):
            n = self._int(size_expr, env, f"argument {arg.name}")
            if arg.size is not None:
                if not 0 <= n <= MAX_ELEMENTS:
                    raise InvalidInput(
                        f"argument {arg.name} has {n} elements at shape {shape}; 0 to "
                        f"{MAX_ELEMENTS} allowed"
                    )
                total += n * numpy_dtype(arg.dtype, dtype).itemsize
        if total > 1 << 40:
            raise InvalidInput(f"the arguments take {total} bytes at shape {shape}: too many")
        constant_bytes = 0
        for const, size_expr in zip(self.model.constants, self._expr["constants"], strict=True):
            n = self._int(size_expr, env, f"constant {const.name}")
            if n < 0:
                raise InvalidInput(f"constant {const.name} has {n} elements at shape {shape}")
            constant_bytes += n * numpy_dtype(const.dtype, dtype).itemsize
        if constant_bytes > MAX_CONSTANT_BYTES:
            raise InvalidInput(
                f"the constant-memory arrays take {constant_bytes} B at shape {shape}; CUDA's "
                f"constant memory holds {MAX_CONSTANT_BYTES} B"
            )
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters outside the space; a restriction that does not hold; a block of
        more than 1024 threads (or over CUDA's per-dimension limits); a grid over CUDA's limits;
        dynamic shared memory over the largest GPU's; an expression that cannot be evaluated
        for this config (its error)."""
        return self._check(config, shape, dtype)

    def check_any_size(self, config: Config, dtype: str) -> str | None:
        """The part of :meth:`check` that does not depend on the shape: the parameters, the
        block's limits, and each restriction, grid dimension, shared memory size and define
        that reads no shape name (by the names its expression reads, so a restriction naming
        ``x`` is left out whatever its value). A config refused here is refused by
        :meth:`check` at every shape; one accepted here may still be refused at a shape (by
        the checks left out). What a table of every size is built from (a code generator's,
        :mod:`kernels.user.generated`)."""
        return self._check(config, None, dtype)

    def _check(self, config: Config, shape: Sequence[int] | None, dtype: str) -> str | None:
        """:meth:`check` at ``shape``; with ``shape`` None, :meth:`check_any_size`: every
        expression reading a shape name is skipped (it might hold at some shape)."""
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            if shape is not None:
                shape = self.validate(shape, dtype)
            env = self._env(config, shape, dtype)
            for restriction in self._expr["restrictions"]:
                if not self._sized(restriction, shape) and not restriction.evaluate(env):
                    return f"restriction {restriction} does not hold"
            block = self.threads(config)
            if math.prod(block) > 1024 or any(
                not 1 <= b <= m for b, m in zip(block, MAX_BLOCK, strict=True)
            ):
                return f"block {block} is over CUDA's limits (1024 threads, {MAX_BLOCK})"
            grid = self._grid(config, shape, dtype)
            if any(g is not None and g > m for g, m in zip(grid, MAX_GRID, strict=True)):
                return f"grid {tuple(grid)} is over CUDA's limits {MAX_GRID}"
            e = self._expr["shared_memory"]
            if e and not self._sized(e, shape):
                shared = self._int(e, env, "shared_memory")
                if not 0 <= shared <= limits.MAX_SHARED_PER_BLOCK:
                    return (
                        f"{shared} B of dynamic shared memory; 0 to {limits.MAX_SHARED_PER_BLOCK}"
                    )
            for define in self._expr["defines"].values():
                if not self._sized(define, shape):
                    define.evaluate(env)
        except InvalidInput as exc:  # ExpressionError included
            return str(exc)
        return None

    def screen(
        self,
        shape: Sequence[int],
        dtype: str,
        *,
        max_threads: int | None = None,
        max_shared: int | None = None,
    ) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
        """:meth:`check` for many configs at once: a function of columns (tunable -> array of
        values, one element per config, every tunable) answering a bool array, true where
        :meth:`check` accepts the config and, where given, its block has at most
        ``max_threads`` threads and at most ``max_shared`` bytes of dynamic shared memory (a
        GPU's limits, as :func:`tuner.backends.pycuda.check_on_gpu` judges them).

        The expressions are walked on numpy arrays (:mod:`kernels.user.vector`), about a
        microsecond a config instead of a couple of hundred; columns it cannot evaluate with
        Python's exact semantics (mixed types, huge integers) are checked one config at a
        time, with the same answers."""
        try:
            shape = self.validate(shape, dtype)
        except InvalidInput:
            return lambda columns: np.zeros(len(next(iter(columns.values()))), dtype=bool)
        return self._mask(shape, dtype, max_threads, max_shared)

    def screen_any_size(self, dtype: str) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
        """:meth:`check_any_size` for many configs at once, as :meth:`screen` is
        :meth:`check`'s (the same columns, the same answers as one config at a time)."""
        return self._mask(None, dtype, None, None)

    def _mask(
        self,
        shape: Sequence[int] | None,
        dtype: str,
        max_threads: int | None,
        max_shared: int | None,
    ) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
        """:meth:`screen` at a validated ``shape``, or :meth:`screen_any_size` (None)."""
        base = self._env(None, shape, dtype)

        def one_by_one(columns: Mapping[str, np.ndarray], n: int) -> np.ndarray:
            out = np.zeros(n, dtype=bool)
            names = list(self.params)
            for i in range(n):
                config = {k: _python(columns[k][i]) for k in names}
                if shape is None:  # no GPU limits: there is no launch without a shape
                    out[i] = self.check_any_size(config, dtype) is None
                elif self.check(config, shape, dtype) is None:
                    launch = self.launch(config, shape, dtype)
                    out[i] = (max_threads is None or launch.threads_per_block <= max_threads) and (
                        max_shared is None or launch.shared_bytes <= max_shared
                    )
            return out

        def mask(columns: Mapping[str, np.ndarray]) -> np.ndarray:
            n = len(next(iter(columns.values())))
            try:
                return self._screen(columns, n, shape, dtype, base, max_threads, max_shared)
            except vector.NotVectorised:
                return one_by_one(columns, n)

        return mask

    def _screen(
        self,
        columns: Mapping[str, np.ndarray],
        n: int,
        shape: Sequence[int] | None,
        dtype: str,
        base: Mapping[str, Any],
        max_threads: int | None,
        max_shared: int | None,
    ) -> np.ndarray:
        # shape None: what check_any_size checks, each expression reading a shape name skipped
        # as _check skips it.
        env = {**base, **columns}
        ok = np.ones(n, dtype=bool)

        def value(e: Any) -> tuple[np.ndarray, np.ndarray]:
            return vector.evaluate(e, env, n)

        def truncated(e: Any) -> tuple[np.ndarray, np.ndarray]:  # _truncated, on arrays
            if vector.may_be_bool(e, env):
                raise vector.NotVectorised("a size that may be a bool")
            v, failed = value(e)
            if v.dtype.kind == "U":
                return np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)
            if v.dtype.kind == "f":
                bad = ~np.isfinite(v)
                v = np.trunc(np.where(bad, 0.0, v))
                if np.abs(v).max(initial=0) > vector.EXACT:
                    raise vector.NotVectorised("a size beyond 2**53")
                return v.astype(np.int64), failed | bad
            return v.astype(np.int64), failed

        for restriction in self._expr["restrictions"]:
            if self._sized(restriction, shape):
                continue
            v, failed = value(restriction)
            ok &= vector.truthy(v) & ~failed
        threads = np.ones(n, dtype=np.int64)
        for dim, (name, default) in enumerate(zip(self.block_size_names, (256, 1, 1), strict=True)):
            if name in columns:
                b = columns[name]
                if b.dtype.kind not in "iub":
                    raise vector.NotVectorised(f"block size {name} of dtype {b.dtype}")
                b = b.astype(np.int64)
            else:
                b = np.full(n, default, dtype=np.int64)
            ok &= (b >= 1) & (b <= MAX_BLOCK[dim])
            threads = threads * np.clip(b, 0, 1 << 20)
        ok &= threads <= (1024 if max_threads is None else min(1024, max_threads))
        exprs = self._expr["problem_size"]
        sizes: list[np.ndarray | None]
        if exprs is None:
            sizes = [
                None if s is None else np.full(n, s, dtype=np.int64)
                for s in self._problem_size({}, shape, dtype)
            ]
        else:
            sizes = []
            for e in exprs:
                if self._sized(e, shape):
                    sizes.append(None)
                    continue
                v, failed = truncated(e)
                ok &= ~failed
                sizes.append(v)
            sizes += [np.ones(n, dtype=np.int64)] * (3 - len(sizes))
        for dim, exprs in enumerate(self._expr["grid_div"]):
            divisor: np.ndarray | None
            if exprs is None:
                name = self.block_size_names[dim]
                divisor = (
                    columns[name].astype(np.int64) if name in columns else np.ones(n, np.int64)
                )
            else:
                divisor = np.ones(n, dtype=np.int64)
                for e in exprs:
                    if self._sized(e, shape):
                        divisor = None  # the other factors are still evaluated, as _grid does
                        continue
                    v, failed = truncated(e)
                    ok &= ~failed
                    if divisor is not None:
                        divisor = divisor * np.where(failed, 1, v)
                        if np.abs(divisor).max(initial=0) > vector.EXACT:
                            raise vector.NotVectorised("a grid divisor beyond 2**53")
            if divisor is None:
                continue
            good = divisor >= 1
            ok &= good
            size = sizes[dim]
            if size is not None:
                grid = np.maximum(1, -(-size // np.where(good, divisor, 1)))
                ok &= grid <= MAX_GRID[dim]
        e = self._expr["shared_memory"]
        if e and not self._sized(e, shape):
            if vector.may_be_bool(e, env):
                raise vector.NotVectorised("shared memory that may be a bool")
            v, failed = value(e)
            if v.dtype.kind == "U":
                return np.zeros(n, dtype=bool)
            failed = failed | ~vector.is_finite_int(v)
            shared = np.where(failed, 0, v)
            limit = limits.MAX_SHARED_PER_BLOCK
            ok &= ~failed & (shared >= 0) & (shared <= limit)
            if max_shared is not None:
                ok &= shared <= max_shared
        for define in self._expr["defines"].values():
            if not self._sized(define, shape):
                ok &= ~value(define)[1]
        return ok

    def _shared(self, env: Mapping[str, Any]) -> int:
        e = self._expr["shared_memory"]
        return self._int(e, env, "shared_memory") if e else 0

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """The spec's ``default`` where it is valid for the shape, else the first valid
        combination in ``tune_params`` order among the first :data:`DEFAULT_SCREEN`, else the
        first in that order among :data:`DEFAULT_SCREEN` more drawn at random from the rest
        (a fixed seed: the same answer on every host).

        A lookup of an untuned shape serves this, on the API host and for anyone who may read:
        the combinations are screened on numpy columns (:meth:`screen`, about a
        microsecond each), so a space of 10^12 combinations with valid ones only far from the
        first is answered in well under a second; where the expressions cannot be screened
        (mixed types, huge integers) at most :data:`MAX_DEFAULT_SCAN` combinations are checked
        one at a time. The answer is kept per (shape, dtype).

        Raises:
            InvalidInput: nothing valid: the message says whether every combination was
                refused, or how many were tried and to declare a ``default`` in the spec.
        """
        self.validate(shape, dtype)
        key = (tuple(int(s) for s in shape), dtype)
        if key not in self._defaults:
            try:
                found: Config | str = self._find_default(shape, dtype)
            except InvalidInput as exc:  # kept too: a repeated lookup must not rescan
                found = str(exc)
            if len(self._defaults) >= MAX_CACHED_DEFAULTS:
                self._defaults.clear()
            self._defaults[key] = found
        found = self._defaults[key]
        if isinstance(found, str):
            raise InvalidInput(found)
        return dict(found)

    @cached_property
    def _defaults(self) -> dict[tuple[tuple[int, ...], str], Config | str]:
        """(shape, dtype) -> the default config, or why there is none."""
        return {}

    def _find_default(self, shape: Sequence[int], dtype: str) -> Config:
        if self.model.default is not None and not self.check(
            dict(self.model.default), shape, dtype
        ):
            return dict(self.model.default)
        shape = self.validate(shape, dtype)
        values = [list(v) for v in self.params.values()]
        dims = tuple(len(v) for v in values)
        total = math.prod(dims)
        typed = [_column_values(v) for v in values]
        base = self._env(None, shape, dtype)
        scalar = [0]  # combinations checked one at a time so far

        def first_valid(flat: np.ndarray) -> int | None:
            """The first position of ``flat`` (ascending) holding a valid combination."""
            index = np.unravel_index(flat, dims)
            columns = {k: typed[j][index[j]] for j, k in enumerate(self.params)}
            try:
                ok = self._screen(columns, len(flat), shape, dtype, base, None, None)
            except vector.NotVectorised:
                for position in flat.tolist():
                    if scalar[0] >= MAX_DEFAULT_SCAN:
                        raise InvalidInput(
                            f"operator {self.name!r}: none of the {MAX_DEFAULT_SCAN} "
                            f"combinations of its tune_params checked is valid at shape "
                            f"{tuple(shape)} {dtype}; declare a valid `default` config in its "
                            "spec"
                        ) from None
                    scalar[0] += 1
                    if self.check(self._combination(position, dims), shape, dtype) is None:
                        return position
                return None
            hits = np.flatnonzero(ok)
            return int(flat[hits[0]]) if len(hits) else None

        start, chunk = 0, DEFAULT_CHUNK
        while start < min(total, DEFAULT_SCREEN):
            flat = np.arange(start, min(total, DEFAULT_SCREEN, start + chunk), dtype=np.int64)
            if (found := first_valid(flat)) is not None:
                return self._combination(found, dims)
            start, chunk = start + len(flat), chunk * 8
        if total <= DEFAULT_SCREEN:
            raise InvalidInput(
                f"operator {self.name!r} has no valid config at shape {tuple(shape)} {dtype}: "
                f"its restrictions (or launch limits) refuse all {total} combinations of its "
                "tune_params"
            )
        rng = np.random.default_rng(DEFAULT_SEED)
        # Sorted, so the first valid one found is the first in tune_params order (a repeat
        # draw costs one more check; numpy's unique took longer than the screen).
        drawn = np.sort(rng.integers(DEFAULT_SCREEN, total, DEFAULT_SCREEN, dtype=np.int64))
        for i in range(0, len(drawn), 1 << 16):
            if (found := first_valid(drawn[i : i + (1 << 16)])) is not None:
                return self._combination(found, dims)
        raise InvalidInput(
            f"operator {self.name!r}: none of the first {DEFAULT_SCREEN} combinations of its "
            f"{total} (tune_params order), nor of {len(drawn)} drawn at random from the rest, is "
            f"valid at shape {tuple(shape)} {dtype}; declare a valid `default` config in its "
            "spec (or narrow tune_params to the values the restrictions allow)"
        )

    def _combination(self, position: int, dims: Sequence[int]) -> Config:
        """The combination at ``position`` of the product of ``tune_params`` (its order)."""
        index = np.unravel_index(position, dims)
        return {k: v[int(i)] for (k, v), i in zip(self.params.items(), index, strict=True)}

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, Any]:
        """Kernel Tuner's macros (``grid_size_x/y/z``, the block size names, every tunable,
        ``kernel_tuner``), then the spec's ``defines`` and its ``dtype_macro``."""
        env = self._env(config, shape, dtype)
        out: dict[str, Any] = {}
        for name, value in zip(
            ("grid_size_x", "grid_size_y", "grid_size_z"), self.grid(config, shape, dtype),
            strict=True,
        ):  # fmt: skip
            out[name] = value
        for name, value in zip(self.block_size_names, self.threads(config), strict=True):
            out[name] = value
        out.update(config)
        out["kernel_tuner"] = 1
        for name, define in self._expr["defines"].items():
            out[name] = define.evaluate(env)
        if self.model.dtype_macro:
            out[self.model.dtype_macro] = DTYPES[dtype][1]
        return out

    def render(self, config: Config, shape: Sequence[int], dtype: str) -> str:
        """The macros, then the template; a template without ``extern "C"`` is wrapped in
        ``extern "C" { }`` (as PyCUDA's SourceModule does, which Kernel Tuner relies on)."""
        return _render(self.defines(config, shape, dtype), self.model.template, self.definition)

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        env = self._env(config, shape, dtype)
        return Launch(self.grid(config, shape, dtype), self.threads(config), self._shared(env))

    def tolerance(self, dtype: str) -> tuple[float, float]:
        tol = self.model.tolerance
        if isinstance(tol, dict) and dtype in tol:
            return tuple(tol[dtype])  # type: ignore[return-value]
        if isinstance(tol, tuple):
            return tol
        return DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))

    def _array_bytes(self, shape: Sequence[int], dtype: str) -> int:
        env = self._env(None, shape, dtype)
        total = 0
        for arg, e in zip(self.model.arguments, self._expr["arguments"], strict=True):
            if arg.size is not None:
                total += self._int(e, env, arg.name) * numpy_dtype(arg.dtype, dtype).itemsize
        return total

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """The spec's ``bytes``, else every array read or written once."""
        e = self._expr["bytes"]
        if e:
            return self._int(e, self._env(None, shape, dtype), "bytes")
        return self._array_bytes(shape, dtype)

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        return self._array_bytes(shape, dtype)

    def flops(self, shape: Sequence[int], dtype: str) -> int:
        e = self._expr["flops"]
        return self._int(e, self._env(None, shape, dtype), "flops") if e else 0

    # --- problem ----------------------------------------------------------------------------

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """The arguments (fixed ones as given, else filled by each argument's ``init``), the
        outputs that are checked, and their references: from the answer or the Python
        reference here; none yet for a reference kernel (:meth:`device_reference`: the
        backend runs it and fills :attr:`Problem.references`)."""
        shape = self.validate(shape, dtype)
        args = self._fixed_args(shape, dtype) if self._arguments is not None else [
            self._make_arg(i, shape, dtype, rng) for i in range(len(self.model.arguments))
        ]  # fmt: skip
        constants = self.make_constants(shape, dtype, rng)
        outputs = [i for i, a in enumerate(self.model.arguments) if a.output]
        tolerances = [
            tuple(self.model.arguments[i].tolerance or self.tolerance(dtype)) for i in outputs
        ]
        references: list[np.ndarray] = []
        if self.verify_function is not None:  # check_results decides, on the host
            outputs, tolerances = [], []
        elif self._answer is not None:
            checked = [i for i in outputs if self._answer[i] is not None]
            references = [np.asarray(self._answer[i], dtype=np.float64).ravel() for i in checked]
            tolerances = [tolerances[outputs.index(i)] for i in checked]
            outputs = checked
        elif self._python_reference is not None:
            extra = {"constants": constants} if constants else {}
            references = [
                np.asarray(r, dtype=np.float64).ravel()
                for r in self._python_reference(args, tuple(shape), dtype, **extra)
            ]
            if len(references) != len(outputs):
                raise InvalidInput(
                    f"the reference of {self.name!r} returned {len(references)} arrays for "
                    f"{len(outputs)} outputs"
                )
        elif not self.model.verify:
            outputs, tolerances = [], []
        for i, ref in zip(outputs, references, strict=False):
            if ref.size != args[i].size:
                raise InvalidInput(
                    f"the reference for {self.model.arguments[i].name} has {ref.size} elements, "
                    f"the argument {args[i].size}"
                )
        return UserProblem(
            args=args, outputs=outputs, references=references, tolerances=tolerances,
            constants=constants,
        )  # fmt: skip

    def make_constants(
        self, shape: Sequence[int], dtype: str, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        """The constant-memory arrays (name -> array, contiguous): the fixed ones as given,
        else filled by each one's ``init``.

        Raises:
            InvalidInput: a fixed array of another size than the spec's at this shape."""
        env = self._env(None, shape, dtype)
        out = {}
        for const, size in zip(self.model.constants, self._expr["constants"], strict=True):
            n = self._int(size, env, f"constant {const.name}")
            np_dtype = numpy_dtype(const.dtype, dtype)
            if self._constants is not None:
                values = np.ascontiguousarray(self._constants[const.name], dtype=np_dtype).ravel()
                if values.size != n:
                    raise InvalidInput(
                        f"constant {const.name} has {values.size} elements; the spec's size "
                        f"{const.size} is {n}"
                    )
            else:
                values = _filled(const, n, np_dtype, rng)
            out[const.name] = values
        return out

    def verified_arguments(self) -> list[int]:
        """The arguments a verify function receives (Kernel Tuner's ``result_host``): those
        with an answer, or every array where there is no answer."""
        if self._answer is not None:
            return [i for i, a in enumerate(self._answer) if a is not None]
        return [i for i, a in enumerate(self.model.arguments) if a.size is not None]

    def check_results(self, result_host: Sequence[Any], dtype: str) -> str | None:
        """Call the verify function as Kernel Tuner does, ``verify(answer, result_host,
        atol=atol)`` (``result_host``: the arguments after a call, as host arrays, None where
        not in :meth:`verified_arguments`); None where it returns true, else why not (its
        exception's text included)."""
        answer = None
        if self._answer is not None:
            answer = [None if a is None else np.asarray(a) for a in self._answer]
        atol = self.tolerance(dtype)[0]
        try:
            ok = self.verify_function(answer, list(result_host), atol=atol)  # type: ignore[misc]
        except Exception as exc:  # the user's function: its failure is the config's
            return f"the verify function raised {type(exc).__name__}: {exc}"
        return None if ok else "the verify function returned False"

    def device_reference(self, shape: Sequence[int], dtype: str) -> DeviceReference | None:
        """The reference kernel to run on the device for this problem, or None where the
        references come with the problem (answer, Python reference) or there is none."""
        ref = self.model.reference
        if (
            ref is None
            or self._answer is not None
            or self._python_reference is not None
            or (self.verify_function is not None)
        ):
            return None
        env = self._env(None, shape, dtype)
        block = [self._int(e, env, "reference block") for e in self._expr["reference_block"]]
        grid = [self._int(e, env, "reference grid") for e in self._expr["reference_grid"]]
        macros = {k: e.evaluate(env) for k, e in self._expr["reference_defines"].items()}
        if self.model.dtype_macro:
            macros[self.model.dtype_macro] = DTYPES[dtype][1]
        pad = [1, 1, 1]
        launch = Launch(
            tuple((grid + pad)[:3]),  # type: ignore[arg-type]
            tuple((block + pad)[:3]),  # type: ignore[arg-type]
        )
        return DeviceReference(
            _render(macros, ref.template, self.definition), ref.kernel_name, launch
        )

    def _make_arg(self, index: int, shape: Sequence[int], dtype: str, rng: np.random.Generator):
        arg = self.model.arguments[index]
        env = self._env(None, shape, dtype)
        n = self._int(self._expr["arguments"][index], env, f"argument {arg.name}")
        np_dtype = numpy_dtype(arg.dtype, dtype)
        if arg.size is None:
            return np_dtype.type(n)
        return _filled(arg, n, np_dtype, rng)

    def _fixed_args(self, shape: Sequence[int], dtype: str) -> list[Any]:
        out = []
        for arg, value in zip(self.model.arguments, self._arguments or [], strict=True):
            np_dtype = numpy_dtype(arg.dtype, dtype)
            if arg.size is None:
                out.append(np_dtype.type(value))
            else:
                out.append(np.array(value, dtype=np_dtype).ravel())
        return out


def _column_values(values: Sequence[Any]) -> np.ndarray:
    """A tunable's values as an array: of one numpy type where they share one Python type, else
    of objects (which the screen checks one config at a time), as ``tuner.space`` makes them."""
    kinds = {type(v) for v in values}
    typed = len(kinds) == 1 and kinds <= {int, float, str, bool}
    return np.array(values, dtype=None if typed else object)


def _python(value: Any) -> Any:
    """A numpy scalar of a column as the Python value a config holds."""
    return value.item() if isinstance(value, np.generic) else value


def _filled(arg: Any, n: int, np_dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """An array of ``n`` elements filled as the argument's ``init`` says."""
    init = arg.init or ("zeros" if arg.output else "normal")
    if init == "zeros":
        return np.zeros(n, dtype=np_dtype)
    if init == "ones":
        return np.ones(n, dtype=np_dtype)
    if init == "index":
        return np.arange(n).astype(np_dtype)
    if init == "randint" or np_dtype.kind in "iu":
        low, high = (arg.low, arg.high) if init == "randint" else (0, 100)
        return rng.integers(int(low), max(int(high), int(low) + 1), n).astype(np_dtype)
    if init == "uniform":
        return rng.uniform(arg.low, arg.high, n).astype(np_dtype)
    values = rng.standard_normal(n, dtype=np.float32).astype(np_dtype)
    values[values == 0] = 1  # no exact zeros: a zero hides a wrong index
    return values


def _render(macros: Mapping[str, Any], name: str, definition: OperatorDefinition) -> str:
    """The macros, then the file ``name`` of ``definition`` with its headers inlined
    (:func:`render_source`)."""
    files, headers = definition.files, definition.spec.headers
    try:
        template = inline_headers(name, files[name], files, headers) if headers else files[name]
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    return render_source(macros, template)


def render_source(macros: Mapping[str, Any], template: str) -> str:
    """The macros, then ``template`` (a whole source: headers already inlined), wrapped in
    ``extern "C" { }`` where it has no ``extern "C"``; checked for includes as a whole.

    A macro whose name holds ``loop_unroll_factor`` follows Kernel Tuner: a ``constexpr int``
    rather than a ``#define``, and at 0 the ``#pragma unroll <name>`` lines are dropped."""
    lines = []
    for k, v in macros.items():
        if UNROLL_NAME in k:
            # nvcc does not expand macros in "#pragma unroll N", so Kernel Tuner's rule holds:
            # 0 drops the pragma (the compiler decides), any other value is a constexpr int.
            if str(v) == "0":
                template = re.sub(rf"\n\s*#pragma\s+unroll\s+{k}\b", "\n", template)
            else:
                lines.append(f"constexpr int {k} = {v};")
        else:
            lines.append(f"#define {k} {v}")
    body = template if 'extern "C"' in template else f'extern "C" {{\n{template}\n}}'
    source = "\n".join(lines) + "\n" + body + "\n"
    # The template was checked when stored; the macros' values join it here, so what nvcc
    # reads is checked as a whole once more.
    if reason := include_error("rendered source", source):
        raise InvalidInput(reason)
    return source
