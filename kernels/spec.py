"""The operator-spec contract: everything Kato needs to tune and verify one operator.

A spec is pure Python + numpy. The tuner asks it for the parameter space, prunes invalid configs
with :meth:`OperatorSpec.check`, renders a config into CUDA source (tunable parameters become
``#define NAME value`` lines before the template, Kernel Tuner's convention), and gets the launch
geometry, inputs and float64 reference from it. Backends do the rest.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kato.errors import InvalidInput

#: A configuration: tunable parameter name -> value (ints or short strings).
Config = dict[str, Any]

#: Supported element types: name -> (numpy dtype, CUDA C type, bytes per element).
DTYPES: dict[str, tuple[np.dtype, str, int]] = {
    "float32": (np.dtype(np.float32), "float", 4),
    "float16": (np.dtype(np.float16), "__half", 2),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", 2),
    "int32": (np.dtype(np.int32), "int", 4),
}

#: CUDA C type of every numpy dtype an argument array may have (outputs included: a layernorm's
#: float32 mean, a ReLU's uint32 bit mask).
CUDA_TYPES: dict[np.dtype, str] = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "__half",
    np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16",
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "unsigned int",
    np.dtype(np.uint8): "unsigned char",
}


#: The shared CUDA helpers' folder (kernels/common): a template's quoted ``#include`` of a file
#: there is replaced by the file's text when it is rendered.
COMMON_HEADERS = Path(__file__).resolve().parent / "common"

_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def _shared_header(template: Path, name: str) -> Path | None:
    """The file of :data:`COMMON_HEADERS` that ``#include "name"`` in ``template`` names, or
    None (another header, or none)."""
    path = (template.parent / name).resolve()
    return path if path.parent == COMMON_HEADERS and path.is_file() else None


def included_headers(template: Path) -> list[Path]:
    """The shared headers (:data:`COMMON_HEADERS`) ``template`` includes by a quoted name
    relative to its folder, in order; other includes are left to the compiler."""
    found = (
        _shared_header(template, m.group(1)) for m in _QUOTED_INCLUDE.finditer(template.read_text())
    )
    return [path for path in found if path is not None]


def template_source(template: Path) -> str:
    """``template``'s text with every shared header it includes inlined in place of the
    ``#include`` line, so that the source compiles wherever it is written (PyCUDA, nvcc's
    cache, kato_torch, Kernel Tuner) and holds what the operator's version hashes."""

    def inline(match: re.Match[str]) -> str:
        path = _shared_header(template, match.group(1))
        return match.group(0) if path is None else path.read_text().rstrip("\n")

    return _QUOTED_INCLUDE.sub(inline, template.read_text())


#: Kato's packages installed under ``kato.`` (``kato.kernels``, ...): hashed under the names
#: they had before (``kernels``), so moving them under the namespace changed no version.
_NAMESPACED = re.compile(r"^kato\.(db|kernels|service|tuner)(?=\.|$)")


def _without_namespace(tree: ast.AST) -> None:
    """Module names in ``tree`` (imports, string constants) as they were before ``kato.``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            node.module = _NAMESPACED.sub(r"\1", node.module)
        elif isinstance(node, ast.alias):
            node.name = _NAMESPACED.sub(r"\1", node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = _NAMESPACED.sub(r"\1", node.value)


def code_fingerprint(source: str) -> bytes:
    """Python source as its syntax tree without docstrings: what the code does, not how it is
    commented or laid out (a comment, a docstring or a reformat gives the same bytes)."""
    tree = ast.parse(source)
    _without_namespace(tree)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return _serialize(tree).encode()


def _serialize(node: Any) -> str:
    """A syntax tree as text, stable across Python versions: fields that are None or empty are
    left out, so a field a newer Python adds (3.12's ``type_params=[]``) changes nothing."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={_serialize(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return f"[{','.join(_serialize(item) for item in node)}]"
    return repr(node)


#: Modules of the package every spec uses, left out of :attr:`OperatorSpec.version`: a change
#: there would otherwise change every operator's version at once.
_PLUMBING = frozenset({"kato.kernels", "kato.kernels.spec", "kato.kernels.registry"})


def _kernel_helpers(module: Any) -> set[Any]:
    """The other modules of the ``kernels`` package whose functions or classes (or which, as
    modules) ``module`` imported, as module objects."""
    out = set()
    for value in vars(module).values():
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if not isinstance(name, str) or not (inspect.ismodule(value) or callable(value)):
            continue
        if name.startswith("kato.kernels.") and name not in _PLUMBING and name != module.__name__:
            helper = sys.modules.get(name)
            if helper is not None:
                out.add(helper)
    return out


@dataclass(frozen=True)
class Launch:
    """Launch geometry of one kernel call."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0  # dynamic shared memory per block

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


#: Swizzle widths (bytes) a :class:`TensorMap` may ask for; 0 = none.
TENSOR_MAP_SWIZZLES = (0, 32, 64, 128)


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map (``CUtensorMap``, 128 bytes, 64-byte aligned) that a kernel takes by
    value (``const __grid_constant__`` parameter), declared in :attr:`Step.args` in place of an
    argument index: the backend encodes it (``cuTensorMapEncodeTiled``) from the device pointer
    of the array argument ``array`` before the launch, so every launch path builds it the same
    way, for whichever copy of the inputs it launches on.

    The array is read as a row-major matrix of ``rows`` x ``cols`` elements of ``dtype`` (a
    :data:`DTYPES` name), rows ``cols`` elements apart; a copy moves a box of ``box_rows`` x
    ``box_cols`` elements (each at most 256) at element coordinates ``{col, row}`` (innermost
    first), elements outside the matrix read as zero; ``swizzle``: the shared-memory swizzle in
    bytes (:data:`TENSOR_MAP_SWIZZLES`). TMA needs the row pitch in bytes to be a multiple of
    16 and, with a swizzle, a box row of at most ``swizzle`` bytes: both are checked here; the
    array's address must be 16-byte aligned (the encoder's error says so).
    """

    array: int
    dtype: str
    rows: int
    cols: int
    box_rows: int
    box_cols: int
    swizzle: int = 128

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor map dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        itemsize = DTYPES[self.dtype][2]
        if self.rows < 1 or self.cols < 1:
            raise ValueError(f"tensor map of a {self.rows} x {self.cols} matrix")
        if (self.cols * itemsize) % 16:
            raise ValueError(
                f"tensor map rows of {self.cols} {self.dtype} are not a multiple of 16 bytes"
            )
        if not (1 <= self.box_rows <= 256 and 1 <= self.box_cols <= 256):
            raise ValueError(f"tensor map box {self.box_rows} x {self.box_cols}: 1..256 each")
        if (self.box_cols * itemsize) % 16:
            raise ValueError(f"tensor map box rows of {self.box_cols} elements: 16-byte multiples")
        if self.swizzle not in TENSOR_MAP_SWIZZLES:
            raise ValueError(f"tensor map swizzle {self.swizzle} not in {TENSOR_MAP_SWIZZLES}")
        if self.swizzle and self.box_cols * itemsize > self.swizzle:
            raise ValueError(
                f"a box row of {self.box_cols * itemsize} bytes exceeds the {self.swizzle}-byte "
                "swizzle"
            )


@dataclass(frozen=True)
class Step:
    """One kernel launch in an operator's call (most operators have one; a two-phase reduction
    or a forward + backward pair have several, launched in order on one stream).

    ``kernel`` is an ``extern "C"`` entry point of the rendered source (one module holds every
    kernel of the operator); ``args`` are, in the kernel's parameter order, indices into
    :attr:`Problem.args` or :class:`TensorMap` declarations over one of them (None: all of the
    problem's args, in order).
    """

    kernel: str
    launch: Launch
    args: tuple[int | TensorMap, ...] | None = None

    @property
    def tensor_maps(self) -> tuple[TensorMap, ...]:
        """The tensor maps among :attr:`args`, in order."""
        return tuple(a for a in self.args or () if isinstance(a, TensorMap))


@dataclass
class Problem:
    """One concrete problem instance: kernel arguments, which of them are outputs, references.

    ``args`` is the kernel's argument list in order: numpy arrays (copied to the device) and
    numpy scalars (passed by value). ``outputs`` are indices into ``args`` of the arrays the kernel
    writes; a backend poisons them before a verification launch. ``references`` holds one float64
    array per output (same order), computed from the inputs.
    """

    args: list[np.ndarray | np.generic]
    outputs: list[int]
    references: list[np.ndarray] = field(default_factory=list)
    #: Per-output ``(atol, rtol)`` overriding :meth:`OperatorSpec.tolerance` (None: the spec's
    #: tolerance for every output). Integer outputs are always compared exactly.
    tolerances: list[tuple[float, float]] | None = None
    #: Values of the kernel's constant-memory arrays (name -> array), which a backend copies
    #: into each module's ``__constant__`` globals before it runs (user operators' ``cmem_args``;
    #: empty for the built-in operators).
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.args if isinstance(a, np.ndarray))


class OperatorSpec(ABC):
    """An operator Kato can tune. Subclasses set the class attributes and implement the methods.

    Attributes:
        name: registry name, e.g. ``"softmax"``.
        description: one line for ``GET /v1/operators``.
        dtypes: the element types it accepts.
        rank: number of dimensions of its shape.
        shape_names: one name per dimension (``("rows", "cols")``), for docs and errors.
        params: the tunable parameters, name -> allowed values, in Kernel Tuner key order.
        template: path of the CUDA template rendered by :meth:`render`.
        kernel_name: the main ``extern "C"`` entry point in the template (resources and
            occupancy are reported for it).
        kernel_names: every entry point of the template when there are several (the steps of
            :meth:`steps`); empty means just :attr:`kernel_name`.
        extra_templates: further templates some configs render from instead of
            :attr:`template` (:meth:`template_for`); hashed into :attr:`version` with it.
    """

    name: str
    description: str
    dtypes: tuple[str, ...]
    rank: int
    shape_names: tuple[str, ...]
    params: dict[str, tuple[Any, ...]]
    template: Path
    kernel_name: str
    kernel_names: tuple[str, ...] = ()
    extra_templates: tuple[Path, ...] = ()
    #: A host function that judges a config's outputs instead of the comparison with the
    #: references (Kernel Tuner's ``verify(answer, result_host, atol=None) -> bool``; a user
    #: operator's). None, the default: outputs are compared with :attr:`Problem.references`.
    verify_function: Any = None

    # --- identity -----------------------------------------------------------------------------

    @cached_property
    def version(self) -> str:
        """Hash of the template source (and the shared headers it includes), the parameter
        space and the Python code that renders, launches and verifies it (12 hex digits).

        Part of every stored result's key: change the kernel, its space, or the spec's defines,
        launch geometry, checks, inputs or tolerances, and old results stop matching instead of
        serving a stale winner. The code is hashed as syntax (:func:`code_fingerprint`) of the
        spec's own module(s), of :mod:`kernels.limits` and of every other module of the
        ``kernels`` package they take functions or classes from (:mod:`kernels.parallel`, which
        fills the inputs; another operator's helpers), so comments, docstrings and formatting do
        not count. The shared plumbing (``kernels.spec``, ``kernels.registry``) is not hashed.
        """
        h = hashlib.sha256()
        for template in (self.template, *self.extra_templates):
            h.update(template.read_bytes())
            for header in included_headers(template):
                h.update(header.read_bytes())
        h.update(json.dumps(self.params, sort_keys=True, default=str).encode())
        modules = {
            sys.modules[cls.__module__]
            for cls in type(self).__mro__
            if issubclass(cls, OperatorSpec) and cls is not OperatorSpec
        }
        modules.add(sys.modules["kato.kernels.limits"])
        modules |= {helper for module in list(modules) for helper in _kernel_helpers(module)}
        for module in sorted(modules, key=lambda m: m.__name__):
            h.update(code_fingerprint(Path(inspect.getfile(module)).read_text()))
        return h.hexdigest()[:12]

    # --- validation ---------------------------------------------------------------------------

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        """Check a request's shape and dtype; return the shape as a tuple of ints.

        Raises:
            InvalidInput: with a message that says what to fix.
        """
        if dtype not in self.dtypes:
            raise InvalidInput(
                f"operator {self.name!r} does not support dtype {dtype!r}; "
                f"supported: {', '.join(self.dtypes)}"
            )
        shape = tuple(int(s) for s in shape)
        if len(shape) != self.rank:
            raise InvalidInput(
                f"operator {self.name!r} takes a shape of rank {self.rank} "
                f"({'x'.join(self.shape_names)}), got {len(shape)} dimension(s): {shape}"
            )
        bad = [f"{n}={s}" for n, s in zip(self.shape_names, shape, strict=True) if s < 1]
        if bad:
            raise InvalidInput(f"every dimension must be at least 1, got {', '.join(bad)}")
        return shape

    def check_params(self, config: Config) -> str | None:
        """Why ``config`` is not a point of :attr:`params` (a parameter missing, unknown, or with a
        value outside its list), or None. Every :meth:`check` starts with it."""
        for name, values in self.params.items():
            if name not in config:
                return f"missing parameter {name}"
            if config[name] not in values:
                return f"{name}={config[name]!r} is not one of {values}"
        if len(config) != len(self.params):  # every parameter is present: the rest are extra
            unknown = sorted(set(config) - set(self.params))
            return f"unknown parameter(s) {', '.join(unknown)}"
        return None

    @abstractmethod
    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Return ``None`` if ``config`` is valid for this shape and dtype, else the reason.

        Must reject, before anything is compiled, every config that cannot be correct or cannot
        launch on any supported GPU (threads per block > 1024, shared memory over the 227 KiB
        opt-in maximum of the largest GPU, vector width not dividing what it must, ...).
        Device-specific limits (a smaller GPU's shared memory) are checked by the tuner with the
        GPU catalog.
        """

    def candidates(self, shape: Sequence[int], dtype: str) -> list[Config] | None:
        """Configs of :attr:`params` holding every one :meth:`check` accepts for this shape and
        dtype (others too, maybe), in the product order of :attr:`params`; None: the whole
        product. A space whose code paths pin each other's parameters lists each path's own
        product, many times smaller than the whole (the tuner still checks every config)."""
        return None

    def screen(
        self,
        shape: Sequence[int],
        dtype: str,
        *,
        max_threads: int | None = None,
        max_shared: int | None = None,
    ) -> Callable[[Mapping[str, np.ndarray]], np.ndarray] | None:
        """:meth:`check` for many configs at once, or None (the default: the tuner checks one
        config at a time). Where given: a function of columns (parameter -> array of values,
        one element per config) answering a bool array, true exactly where :meth:`check`
        accepts and the launch fits ``max_threads`` threads and ``max_shared`` bytes of
        dynamic shared memory (where given). A space of millions of combinations is filtered
        (and a larger one sampled) through it: :mod:`tuner.space`."""
        return None

    @abstractmethod
    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """A valid, reasonable config for any shape: what is served when nothing was tuned."""

    # --- rendering and launching --------------------------------------------------------------

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, Any]:
        """Preprocessor macros for a config: the tunable parameters plus anything derived.

        The default renders every tunable parameter as is; subclasses add derived values
        (element type, problem-size constants) by overriding and extending.
        """
        return dict(config)

    def template_for(self, config: Config) -> Path:
        """The template ``config`` renders from: :attr:`template`, or one of
        :attr:`extra_templates` for an operator whose configs choose between algorithms."""
        return self.template

    def main_kernel(self, config: Config) -> str:
        """The entry point whose resources and occupancy stand for ``config`` (the kernel
        :meth:`launch` describes): :attr:`kernel_name` unless the config's template has
        another."""
        return self.kernel_name

    def arch_for(self, config: Config, arch: str) -> str:
        """The nvcc target to build ``config`` for on a GPU whose native target is ``arch``
        (``"sm_90"``): ``arch`` itself unless the config's code needs the arch-specific
        variant (``"sm_90a"``: wgmma, setmaxnreg). Only asked for configs that
        :meth:`check_arch` accepts on ``arch``."""
        return arch

    def check_arch(self, config: Config, arch: str) -> str | None:
        """Why ``config`` cannot run on a GPU of native target ``arch`` (an instruction that
        arch lacks), or None. The backends check it with the device's limits, before
        compiling; :meth:`check` stays device-independent."""
        return None

    def check_sms(self, config: Config, sm_count: int) -> str | None:
        """Why ``config`` cannot run on a GPU of ``sm_count`` multiprocessors (a grid whose
        CTAs must all be resident at once), or None. The backends check it with the device's
        limits (:meth:`check_arch`'s callers); :meth:`check` stays device-independent."""
        return None

    def render(self, config: Config, shape: Sequence[int], dtype: str) -> str:
        """Full CUDA source: ``#define NAME value`` lines, then the config's template with the
        shared headers it includes inlined (:func:`template_source`)."""
        lines = [f"#define {k} {v}" for k, v in self.defines(config, shape, dtype).items()]
        return "\n".join(lines) + "\n" + template_source(self.template_for(config))

    @abstractmethod
    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        """Grid, block and dynamic shared memory of the main kernel (:attr:`kernel_name`) for
        one call on ``shape``: what occupancy and the device limits are judged on."""

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """Every launch of one call, in order. Default: the main kernel alone, on all args.

        Multi-kernel operators override this; backends time the whole sequence as one call and
        verify the outputs after it. Every step must fit the device (threads, shared memory).
        """
        return [Step(self.kernel_name, self.launch(config, shape, dtype))]

    @abstractmethod
    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """Fresh random inputs (never zeros), output buffers and float64 references."""

    def device_reference(self, shape: Sequence[int], dtype: str) -> Any | None:
        """A reference kernel the backend runs once on the device to fill the problem's
        references (a user operator's ``reference`` kernel), or None, the default: the
        references come with :meth:`make_problem`."""
        return None

    @abstractmethod
    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` for comparing an output of this dtype with the float64 reference."""

    @abstractmethod
    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """Minimum bytes read + written in global memory, for achieved GB/s."""

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """Device memory one problem instance needs (inputs + outputs). The service rejects shapes
        whose buffers do not fit the GPU model's memory. Default: :meth:`bytes_moved`."""
        return self.bytes_moved(shape, dtype)

    def flops(self, shape: Sequence[int], dtype: str) -> int:
        """Floating-point operations (0 where bandwidth is the figure of merit)."""
        return 0

    # --- helpers for the service --------------------------------------------------------------

    def space_size(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def describe(self) -> dict[str, Any]:
        """JSON-ready description for ``GET /v1/operators``."""
        return {
            "name": self.name,
            "description": self.description,
            "version": self.version,
            "dtypes": list(self.dtypes),
            "rank": self.rank,
            "shape_names": list(self.shape_names),
            "params": {k: list(v) for k, v in self.params.items()},
            "space_size": self.space_size(),
        }
