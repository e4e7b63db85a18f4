"""A minimal CUDA driver API binding (ctypes) for launching Kato's kernels on PyTorch's stream.

PyTorch owns the device's primary context; loading our cubins into that same context and
launching with ``cuLaunchKernel`` on ``torch.cuda.current_stream().cuda_stream`` keeps every
launch ordered with the caller's PyTorch work, with no extra context, no synchronisation and no
PyCUDA. Only the handful of entry points Kato needs are bound.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kato.kernels.spec import TensorMap
from kato.tuner import cuda_driver
from kato.tuner.tensor_map import MAP_ALIGN, MAP_BYTES

# The generic entry points live in tuner.cuda_driver (the backend launches tensor-map kernels
# through them too); these names are kato_torch's own spelling of them.
_driver = cuda_driver.library
# Context queries and switches never wait: they keep the GIL (cuda_driver.quick_library).
_quick = cuda_driver.quick_library
_check = cuda_driver.check
CudaDriverError = cuda_driver.CudaDriverError
load_module = cuda_driver.load_module
get_function = cuda_driver.get_function
launch = cuda_driver.launch
launch_params = cuda_driver.launch_array


_primary: dict[int, ctypes.c_void_p] = {}


def _primary_context(device_index: int) -> ctypes.c_void_p:
    """``device_index``'s primary context (PyTorch's), retained once per process."""
    context = _primary.get(device_index)
    if context is None:
        lib = _driver()
        device, context = ctypes.c_int(), ctypes.c_void_p()
        _check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        _check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain"
        )
        _primary[device_index] = context
    return context


def ensure_context(device_index: int) -> None:
    """Make ``device_index``'s primary context current on this thread if none is (autograd's
    threads); a launch should rather run inside :func:`on_device`, which also handles another
    device's context being current."""
    lib = _quick()
    current = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        _check(lib.cuCtxSetCurrent(_primary_context(device_index)), "cuCtxSetCurrent")


@contextmanager
def on_device(device_index: int) -> Iterator[None]:
    """Run the block in ``device_index``'s primary context (the one PyTorch uses there).

    No context current on this thread (autograd's backward threads): make it current, as
    PyTorch itself would. Another device's context current (a process using several GPUs):
    push this one for the block and pop it after, so the thread's current device is unchanged.
    """
    lib = _quick()
    current = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        _check(lib.cuCtxSetCurrent(_primary_context(device_index)), "cuCtxSetCurrent")
        yield
        return
    device = ctypes.c_int()
    _check(lib.cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
    if device.value == device_index:
        yield
        return
    _check(lib.cuCtxPushCurrent_v2(_primary_context(device_index)), "cuCtxPushCurrent_v2")
    try:
        yield
    finally:
        popped = ctypes.c_void_p()
        _check(lib.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent_v2")


class ArgumentSlots:
    """Reusable ctypes storage for one kernel signature's arguments, and per launch step the
    ``void*`` array of their addresses that ``cuLaunchKernel`` reads: a launch writes the values
    in place instead of building ctypes objects (tens of microseconds a call in Python).
    A step's :class:`~kernels.spec.TensorMap` argument gets a 128-byte slot of its own (64-byte
    aligned), listed in :attr:`maps` with its declaration, which the launch fills from the
    array's pointer before each launch.
    Not thread-safe: each thread keeps its own (BoundOperator keys them by OS thread)."""

    def __init__(
        self,
        signature: Sequence[type[ctypes._SimpleCData] | None],
        steps: Sequence[Sequence[int | TensorMap]],
    ):
        self.values = [ctypes.c_void_p() if kind is None else kind() for kind in signature]
        #: Per step: (declaration, address of its slot) of every tensor-map argument.
        self.maps: list[list[tuple[TensorMap, int]]] = []
        self._map_storage: list[ctypes.Array] = []
        self.params = []
        for step in steps:
            addresses, maps = [], []
            for arg in step:
                if isinstance(arg, TensorMap):
                    raw = (ctypes.c_ubyte * (MAP_BYTES + MAP_ALIGN))()
                    self._map_storage.append(raw)
                    address = (ctypes.addressof(raw) + MAP_ALIGN - 1) & ~(MAP_ALIGN - 1)
                    maps.append((arg, address))
                    addresses.append(address)
                else:
                    addresses.append(ctypes.addressof(self.values[arg]))
            self.maps.append(maps)
            self.params.append((ctypes.c_void_p * len(addresses))(*addresses))
        #: Whether any step takes a tensor map (encoded per launch from its array's pointer).
        self.has_maps = any(self.maps)
