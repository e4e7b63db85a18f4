"""Compiled Kato kernels for PyTorch tensors: config lookup, compile and load once per shape.

A :class:`BoundOperator` is one operator at one (shape, dtype) on one device: the config Kato
serves for it (through the configured client and its caches, or the operator's default config),
compiled with nvcc for the device's arch (on-disk cache), loaded into PyTorch's context, and its
launch steps. :func:`bind` caches them, so a training loop pays the lookup and the compile once
per shape.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kato.kernels import InvalidInput, get_operator
from kato.kernels.spec import DTYPES, Launch, OperatorSpec, TensorMap
from kato.tuner.cubin import has_device_globals
from kato.tuner.nvcc import compile_kernel
from kato.tuner.tensor_map import MAP_BYTES, MapCache

from kato_torch import _driver
from kato_torch import policy as _policy

log = logging.getLogger(__name__)

_SCALAR_TYPES: dict[type, type[ctypes._SimpleCData]] = {
    np.int32: ctypes.c_int,
    np.uint32: ctypes.c_uint,
    np.int64: ctypes.c_longlong,
    np.uint64: ctypes.c_ulonglong,
    np.float32: ctypes.c_float,
    np.float64: ctypes.c_double,
}

_lock = threading.Lock()
_bound: dict[tuple[Any, ...], BoundOperator] = {}
_signatures: dict[tuple[str, str, str], list[type[ctypes._SimpleCData] | None]] = {}
#: Tensor maps of the bound operators' TMA arguments per (declaration, pointer): a training
#: loop reuses its buffers, so a launch encodes only on a new one.
_maps = MapCache()


def configure(
    client: Any = None, gpu: str | None = None, policy: str | Mapping[str, str] = "auto"
) -> None:
    """Use ``client`` (a :class:`KatoClient`, or anything with ``lookup`` or ``config(operator,
    shape, dtype, gpu=...)``) for config lookups, for GPU model ``gpu`` (None: the client's
    default, i.e. the local device's model), under ``policy`` (:mod:`kato_torch.policy`:
    ``"auto"`` runs Kato's kernel only where it is known faster than PyTorch's op, ``"kato"``
    always, ``"torch"`` never; or a mapping per operator). Without a client every operator
    runs its default config (``"kato"``) or PyTorch's op (``"auto"``). Clears the caches of
    bound operators and decisions."""
    with _lock:
        _policy.set_settings(client, gpu, policy)
        _bound.clear()


class MisalignedArguments(InvalidInput):
    """An array handed to :meth:`BoundOperator.run` starts off the alignment its caller asked
    for (``aligned_to``): nothing was launched; bind for :func:`pointer_alignment` instead."""


@dataclass(frozen=True)
class _Call:
    kernel: str
    func: ctypes.c_void_p
    launch: Launch
    args: tuple[int | TensorMap, ...]


@dataclass
class BoundOperator:
    """An operator compiled for one shape and dtype, ready to launch on torch tensors.

    ``calls`` are the steps' functions in the module loaded at bind time. A module with
    ``__device__`` variables (``per_stream``: :func:`kato.tuner.cubin.has_device_globals`, a
    split row's partials, say) keeps per-call state in them, so calls on two streams at once
    must not share it: each stream that launches gets a module of its own (``cubin`` loaded
    again, once per stream; :meth:`calls_on`). Calls on one stream are ordered by it.

    Limits of that: modules are kept for the process's life and keyed by the stream's handle
    (a stream destroyed with work in flight, whose handle a new stream gets, shares its
    module); CUDA graphs captured on one stream (``torch.cuda.graph``'s default capture stream
    is one per process) share its module, so two such graphs replayed at once on two streams
    mix their state; and the first call on a capture stream loads its module during the
    capture (module loading is capture-safe from CUDA 12.3's driver on)."""

    spec: OperatorSpec
    shape: tuple[int, ...]
    dtype: str
    config: dict[str, Any]
    source: str  # where the config came from: the client's answer, or "default"
    calls: list[_Call]
    signature: list[type[ctypes._SimpleCData] | None]  # None = a device pointer
    device_index: int
    cubin: bytes = field(default=b"", repr=False)
    per_stream: bool = False
    _slots_by_thread: dict[int, _driver.ArgumentSlots] = field(
        default_factory=dict, repr=False, compare=False
    )
    _calls_by_stream: dict[int, list[_Call]] = field(
        default_factory=dict, repr=False, compare=False
    )
    # Its own lock: bind's module lock is held across nvcc compiles of other operators.
    _stream_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def calls_on(self, stream: int) -> list[_Call]:
        """The steps' functions to launch on ``stream`` (a ``cudaStream_t`` handle): those of
        the module loaded at bind time, or for a ``per_stream`` operator the module of that
        stream (loaded at its first call there, the first stream taking the bind-time one)."""
        if not self.per_stream:
            return self.calls
        calls = self._calls_by_stream.get(stream)
        if calls is not None:
            return calls
        with self._stream_lock:
            calls = self._calls_by_stream.get(stream)
            if calls is None:
                if not self._calls_by_stream:
                    calls = self.calls
                else:
                    with _driver.on_device(self.device_index):
                        module = _driver.load_module(self.cubin)
                        calls = [
                            _Call(c.kernel, _driver.get_function(module, c.kernel,
                                                                 c.launch.shared_bytes),
                                  c.launch, c.args)
                            for c in self.calls
                        ]  # fmt: skip
                self._calls_by_stream[stream] = calls
        return calls

    def run(
        self, args: Sequence[Any], steps: Sequence[int] | None = None, *, aligned_to: int = 1
    ) -> None:
        """Launch the steps (all, or those whose indices are in ``steps``) on the current torch
        stream. ``args`` follow the spec's ``make_problem`` argument order: tensors for arrays
        (contiguous, on this device), Python numbers for scalars; an array no launched step
        reads may be None (e.g. the gradients in a forward-only launch).

        Raises:
            MisalignedArguments: an array's data pointer is not a multiple of ``aligned_to``
                bytes (a power of two; checked while the pointers are read, before any launch).
        """

        if len(args) != len(self.signature):
            raise TypeError(
                f"{self.spec.name} takes {len(self.signature)} arguments, got {len(args)}"
            )
        slots = self._slots()
        missing = False
        bits = 0  # every pointer OR'd: its low bits say the least aligned one
        for value, arg, ctype in zip(slots.values, args, self.signature, strict=True):
            if arg is None:
                missing = True
            elif ctype is None:
                value.value = pointer = arg.data_ptr()
                bits |= pointer
            else:
                value.value = arg
        if bits & (aligned_to - 1):
            # Before calls_on: a refused call loads no module for a new stream.
            raise MisalignedArguments(
                f"{self.spec.name}: an array is only {bits & -bits}-byte aligned, "
                f"the caller asked for {aligned_to}"
            )
        stream = _current_stream(self.device_index)
        calls = self.calls_on(stream)
        if steps is None and not missing and not slots.has_maps:
            # Every step, every argument given, no tensor map to encode: nothing to check.
            with _driver.on_device(self.device_index):
                for call, params in zip(calls, slots.params, strict=True):
                    launch = call.launch
                    _driver.launch_params(
                        call.func, launch.grid, launch.block, launch.shared_bytes, stream, params
                    )
            return
        given = [arg is not None for arg in args]
        launches = []
        for index, call in enumerate(calls):
            if steps is not None and index not in steps:
                continue
            if not all(given[a.array if isinstance(a, TensorMap) else a] for a in call.args):
                raise TypeError(
                    f"{self.spec.name}: kernel {call.kernel} needs an argument given None"
                )
            for declaration, address in slots.maps[index]:
                pointer = slots.values[declaration.array].value or 0
                ctypes.memmove(address, _maps.get(declaration, pointer), MAP_BYTES)
            launches.append((call, slots.params[index]))
        # Autograd's backward threads have no context current, a multi-GPU process may have
        # another device's: launch in this device's (PyTorch's), where the module was loaded.
        with _driver.on_device(self.device_index):
            for call, params in launches:
                launch = call.launch
                _driver.launch_params(
                    call.func, launch.grid, launch.block, launch.shared_bytes, stream, params
                )

    def _slots(self) -> _driver.ArgumentSlots:
        """This thread's argument storage (autograd runs backward ops on its own threads).
        Keyed by the OS thread, not a threading.local: a C++ thread that enters Python may get
        a fresh thread state per call, which would rebuild the slots every time."""
        ident = threading.get_ident()
        slots = self._slots_by_thread.get(ident)
        if slots is None:
            slots = _driver.ArgumentSlots(self.signature, [call.args for call in self.calls])
            self._slots_by_thread[ident] = slots
        return slots


def _current_stream(device_index: int) -> int:
    """The ``cudaStream_t`` of torch's current stream on the device: the raw getter Inductor's
    generated code calls (no Stream object built), else the public API."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream
        )
    return _raw_stream(device_index)


_raw_stream: Any = None


def _signature(spec: OperatorSpec, dtype: str) -> list[type[ctypes._SimpleCData] | None]:
    """Argument kinds of the operator's kernels, read from a one-element problem instance."""
    key = (spec.name, spec.version, dtype)  # a user operator's changed spec: its own
    if key not in _signatures:
        problem = None
        for size in (1, 2, 8):  # the smallest shape the operator accepts (batchnorm needs 2)
            try:
                problem = spec.make_problem((size,) * spec.rank, dtype, np.random.default_rng(0))
                break
            except InvalidInput:
                continue
        if problem is None:
            raise InvalidInput(f"{spec.name}: no small problem to read its argument types from")
        _signatures[key] = [
            None if isinstance(a, np.ndarray) else _SCALAR_TYPES[type(a)] for a in problem.args
        ]
    return _signatures[key]


def _lookup(
    spec: OperatorSpec, shape: tuple[int, ...], dtype: str, arch: str, sm_count: int
) -> tuple[dict, str]:
    """The config to run: the client's answer if it is valid for this shape, the device's
    arch (``"sm_90"``) and its multiprocessors, else the default."""
    answer = _policy.served(spec.name, shape, dtype)
    if answer is not None:
        config, source = _policy.served_config(answer)
        reason = (
            spec.check(config, shape, dtype)
            or spec.check_arch(config, arch)
            or spec.check_sms(config, sm_count)
        )
        if reason is None:
            return config, source
        log.warning("served %s config is invalid for %s %s: %s", spec.name, shape, dtype, reason)
    return spec.default_config(shape, dtype), "default"


def prepare(keys: Sequence[Any], device_index: int = 0, workers: int | None = None) -> int:
    """Compile and load, in parallel, the configs of ``keys`` (``kato_torch.Key``s, e.g. a
    :func:`kato_torch.record`'s) that the policy runs on Kato's kernels, so that the first
    training step (or a CUDA-graph capture) pays no compile; returns how many were bound.
    nvcc runs in subprocesses, so threads overlap the compiles; :func:`bind` then loads each
    from the on-disk cache."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor}"
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    chosen = [
        k for k in keys if _policy.verdict(k.operator, k.shape, k.dtype, "cuda") != _policy.TORCH
    ]

    def build(key: Any) -> None:
        spec = get_operator(key.operator)
        config, _ = _lookup(spec, tuple(key.shape), key.dtype, arch, sms)
        compile_kernel(spec.render(config, key.shape, key.dtype), spec.main_kernel(config),
                       arch=spec.arch_for(config, arch))  # fmt: skip

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 4) as pool:
        list(pool.map(build, chosen))
    for key in chosen:
        bind(key.operator, key.shape, key.dtype, device_index)
    return len(chosen)


#: Bytes of the widest vector a template loads (16: ``uint4``); what cudaMalloc and torch's
#: allocator align every tensor to.
MAX_VECTOR_BYTES = 16


def pointer_alignment(tensors: Sequence[Any]) -> int:
    """The largest power of two, at most :data:`MAX_VECTOR_BYTES`, that divides the data
    pointer of every tensor in ``tensors`` (other values are skipped): 16 for any fresh
    allocation, less for a view that starts a few elements into its storage."""
    # The lowest set bit of the pointers' OR is the smallest alignment among them (one pass,
    # no min per tensor: this runs on every launch).
    bits = 0
    for t in tensors:
        data_ptr = getattr(t, "data_ptr", None)
        if data_ptr is not None:
            bits |= data_ptr()
    return min(MAX_VECTOR_BYTES, bits & -bits) if bits else MAX_VECTOR_BYTES


#: Parameters that are a vector width in elements of the operator's arrays: ``VEC``, and the
#: batchnorm family's ``APPLY_VEC`` (its elementwise pass loads x and stores y with its own).
VECTOR_PARAMS = ("VEC", "APPLY_VEC")


def fit_alignment(
    spec: OperatorSpec, config: dict[str, Any], shape: tuple[int, ...], dtype: str, alignment: int
) -> dict[str, Any] | None:
    """``config`` with each of its :data:`VECTOR_PARAMS` narrowed so that a vector of that many
    elements is no wider than ``alignment`` bytes (a narrower vector is a valid variant of every
    operator whose template has them: any VEC runs on any row length or plane); None if that
    config is not valid."""
    if alignment >= MAX_VECTOR_BYTES or not any(p in config for p in VECTOR_PARAMS):
        return config
    itemsize = DTYPES[dtype][2]
    narrowed = dict(config)
    for param in VECTOR_PARAMS:
        if param not in config:
            continue
        vec = config[param]
        while vec > 1 and vec * itemsize > alignment:
            vec //= 2
        narrowed[param] = vec
    return narrowed if spec.check(narrowed, shape, dtype) is None else None


def _same_version(bound: OperatorSpec, spec: OperatorSpec) -> bool:
    return bound is spec or bound.version == spec.version


def bind(
    operator: str,
    shape: Sequence[int],
    dtype: str,
    device_index: int,
    alignment: int = MAX_VECTOR_BYTES,
    spec: OperatorSpec | None = None,
) -> BoundOperator:
    """The operator compiled for ``shape``/``dtype`` on ``device_index`` (cached), for arrays
    whose data pointers are ``alignment``-byte aligned (:func:`pointer_alignment`): where that
    is less than a vector of the served config, the same config with a narrower VEC (else the
    default config's), so that a view a few elements into its storage runs a valid variant
    instead of faulting on a misaligned vector. ``spec``: that version of the operator (a user
    operator whose name may since have been registered with a changed spec), else the one
    registered under ``operator``; a cached one of another version is replaced."""
    import torch

    shape = tuple(int(s) for s in shape)  # a SymInt (a trace, opcheck) specialises here
    alignment = min(alignment, MAX_VECTOR_BYTES)
    # A user operator's calls name their spec: two versions of one name alternating at one
    # shape each keep their own binding rather than rebinding on every call.
    key = (operator, shape, dtype, device_index, alignment, spec.version if spec else None)
    bound = _bound.get(key)
    if bound is not None and (spec is None or _same_version(bound.spec, spec)):
        return bound
    with _lock:
        bound = _bound.get(key)
        if bound is not None and (spec is None or _same_version(bound.spec, spec)):
            return bound
        spec = spec or get_operator(operator)
        spec.validate(shape, dtype)
        major, minor = torch.cuda.get_device_capability(device_index)
        arch = f"sm_{major}{minor}"
        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        config, source = _lookup(spec, shape, dtype, arch, sms)
        if alignment < MAX_VECTOR_BYTES:
            fitted = fit_alignment(spec, config, shape, dtype, alignment)
            if fitted is None:
                default = spec.default_config(shape, dtype)
                fitted = fit_alignment(spec, default, shape, dtype, alignment)
                source = "default"
            if fitted is None:
                raise InvalidInput(
                    f"{operator}: no valid config for arrays aligned to {alignment} bytes"
                )
            config = fitted
        compiled = compile_kernel(
            spec.render(config, shape, dtype),
            spec.main_kernel(config),
            arch=spec.arch_for(config, arch),
        )
        signature = _signature(spec, dtype)
        calls = []
        with _driver.on_device(device_index):
            module = _driver.load_module(compiled.cubin)
            for step in spec.steps(config, shape, dtype):
                func = _driver.get_function(module, step.kernel, step.launch.shared_bytes)
                indices = step.args if step.args is not None else tuple(range(len(signature)))
                calls.append(_Call(step.kernel, func, step.launch, indices))
        bound = BoundOperator(
            spec, shape, dtype, config, source, calls, signature, device_index,
            cubin=compiled.cubin, per_stream=has_device_globals(compiled.cubin),
        )  # fmt: skip
        _bound[key] = bound
        return bound
