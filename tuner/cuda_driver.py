"""The few CUDA driver API entry points Kato calls through ctypes (libcuda), for every launch
path that does not go through PyCUDA's own launcher: kato_torch's launches on PyTorch's stream,
and the PyCUDA backend's launches of kernels that take a TMA tensor map by value.

Why the backend needs it: PyCUDA passes a kernel's arguments as one packed buffer
(``CU_LAUNCH_PARAM_BUFFER_POINTER``), and on the H200 (driver of CUDA 13.0) a
``__grid_constant__ CUtensorMap`` argument passed that way does not reach the kernel intact
(its TMA loads never complete), while the same cubin, buffers and map bytes launched with
``kernelParams`` (one pointer per argument) verify. So launches with tensor maps use
:func:`launch_array` here. Nothing here creates a context: calls run in the thread's current one
(but :func:`retain_primary_context`, a measuring spare's warm-up).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

from kato.kernels.limits import needs_shared_opt_in

from kato.errors import KatoError

CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_quick: ctypes.PyDLL | None = None


class CudaDriverError(KatoError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error string."""


def library() -> ctypes.CDLL:
    """libcuda.so.1, loaded once per process, with ``cuLaunchKernel``'s argument types declared
    (so every caller's arguments convert the same way)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:  # pragma: no cover - depends on the machine
                raise CudaDriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc
            lib.cuLaunchKernel.argtypes = (
                [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            )
            lib.cuLaunchKernel.restype = ctypes.c_int
            _lib = lib
        return _lib


def quick_library() -> ctypes.PyDLL:
    """libcuda.so.1 for the context queries of every kato_torch launch (``cuCtxGetCurrent``,
    ``cuCtxGetDevice``, and the push/pop when another device's context is current), loaded as
    a ``PyDLL`` so that they keep the GIL: they never wait, and through :func:`library` ctypes
    releases and retakes the GIL around each one, a thread hand-off wherever another thread
    (autograd's backward thread) waits for it. Launches stay on :func:`library`: a launch into
    a full queue waits for the GPU, and must not hold every Python thread meanwhile (PyTorch's
    own ops release the GIL around their launches)."""
    global _quick
    if _quick is not None:
        return _quick
    library()  # the driver is loadable, or the error says so
    with _lock:
        if _quick is None:
            _quick = ctypes.PyDLL("libcuda.so.1")
        return _quick


def check(result: int, what: str) -> None:
    """Raise :class:`CudaDriverError` naming ``what`` unless ``result`` is CUDA_SUCCESS."""
    if result != 0:
        text = ctypes.c_char_p()
        library().cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else f"error {result}"
        raise CudaDriverError(f"{what} failed: {message}")


def retain_primary_context(device_index: int) -> None:
    """Start the driver and create (retain) device ``device_index``'s primary context, the one
    the PyCUDA backend retains, without making it current; the reference is held until
    :func:`release_primary_context` (:func:`tuner.backends.isolated._warm_up`: a spare
    measuring child creates its context before it knows its job, and the backend's own retain
    then finds it; the child drops it when it closes its backend)."""
    lib = library()
    check(lib.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")


def release_primary_context(device_index: int) -> None:
    """Drop one reference to device ``device_index``'s primary context (the one
    :func:`retain_primary_context` took); the driver destroys the context, and frees what it
    holds, when the last reference goes."""
    lib = library()
    device = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")


def load_module(cubin: bytes) -> ctypes.c_void_p:
    """Load a cubin into the current context. The caller owns the module: it stays loaded,
    with its device globals, until :func:`unload_module` or the context's end."""
    module = ctypes.c_void_p()
    check(library().cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
    return module


def unload_module(module: ctypes.c_void_p) -> None:
    """Unload a module of :func:`load_module` from the current context (its functions and
    globals are gone: no launch of them may still be queued)."""
    check(library().cuModuleUnload(module), "cuModuleUnload")


def get_function(module: ctypes.c_void_p, name: str, dynamic_shared: int = 0) -> ctypes.c_void_p:
    """An entry point of ``module``; opts in to ``dynamic_shared`` bytes when they and the
    function's static shared memory exceed 48 KiB together."""
    lib = library()
    func = ctypes.c_void_p()
    check(lib.cuModuleGetFunction(ctypes.byref(func), module, name.encode()), name)
    static = ctypes.c_int()
    check(
        lib.cuFuncGetAttribute(ctypes.byref(static), CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
        f"cuFuncGetAttribute({name})",
    )
    if needs_shared_opt_in(static.value, dynamic_shared):
        check(
            lib.cuFuncSetAttribute(
                func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared
            ),
            f"cuFuncSetAttribute({name})",
        )
    return func


def aligned_bytes(data: bytes, alignment: int) -> ctypes.Array:
    """A ctypes view of a copy of ``data`` starting at an ``alignment``-byte boundary (a
    tensor map's 64): the view keeps its over-allocated buffer alive."""
    raw = (ctypes.c_ubyte * (len(data) + alignment))()
    offset = -ctypes.addressof(raw) % alignment
    view = (ctypes.c_ubyte * len(data)).from_buffer(raw, offset)
    ctypes.memmove(view, data, len(data))
    return view


def argument_array(args: Sequence[ctypes._SimpleCData | ctypes.Array]) -> ctypes.Array:
    """The ``void*`` array of the arguments' addresses that ``cuLaunchKernel`` reads (the
    arguments must outlive every launch that uses it)."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])


def launch(
    func: ctypes.c_void_p,
    grid: Sequence[int],
    block: Sequence[int],
    shared_bytes: int,
    stream: int,
    args: Sequence[ctypes._SimpleCData | ctypes.Array],
) -> None:
    """``cuLaunchKernel`` with ``args`` (ctypes values: c_void_p for pointers, c_int, ...,
    a ``c_ubyte * 128`` for a tensor map)."""
    launch_array(func, grid, block, shared_bytes, stream, argument_array(args))


def launch_array(
    func: ctypes.c_void_p,
    grid: Sequence[int],
    block: Sequence[int],
    shared_bytes: int,
    stream: int,
    params: ctypes.Array,
) -> None:
    """``cuLaunchKernel`` with a prepared :func:`argument_array` (``grid`` and ``block``: three
    ints each, as :class:`kernels.spec.Launch` holds them). The hot path of kato_torch's bound
    operators: the argument types are declared once (:func:`library`), so ctypes converts in C."""
    result = library().cuLaunchKernel(func, *grid, *block, shared_bytes, stream, params, None)
    if result != 0:
        check(result, "cuLaunchKernel")
