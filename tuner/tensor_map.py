"""TMA tensor maps (``CUtensorMap``) for kernel launches: encoded with the CUDA driver's
``cuTensorMapEncodeTiled`` (ctypes, libcuda) from a :class:`kernels.spec.TensorMap`
declaration and a device pointer.

Every launch path (the PyCUDA backend, kato_torch) encodes through :func:`encode`, so a map
means the same wherever it is launched. Encoding is host-only (no GPU work, no context needed
beyond the driver being loaded) and a pure function of its arguments, so :class:`MapCache`
keeps the bytes per (declaration, pointer).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kato.kernels.spec import DTYPES, TensorMap

from kato.errors import KatoError

#: Size and alignment of a ``CUtensorMap`` (cuda.h: ``CU_TENSOR_MAP_NUM_QWORDS`` = 16, 64-aligned).
MAP_BYTES = 128
MAP_ALIGN = 64

# cuda.h enums (CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle,
# CUtensorMapL2promotion, CUtensorMapFloatOOBfill).
_DATA_TYPE = {"float16": 6, "bfloat16": 9, "float32": 7, "int32": 3}
_INTERLEAVE_NONE = 0
_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0


class TensorMapError(KatoError, RuntimeError):
    """``cuTensorMapEncodeTiled`` refused a map (a misaligned address, a bad box): the
    message names the map and the driver's error."""


@dataclass(frozen=True)
class EncodeArguments:
    """What :func:`encode` passes to ``cuTensorMapEncodeTiled`` for one map (2-D, innermost
    dimension first): the enums, sizes, the row stride in bytes, the box and element strides."""

    data_type: int
    dims: tuple[int, int]
    strides_bytes: tuple[int]
    box: tuple[int, int]
    element_strides: tuple[int, int]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def encode_arguments(spec: TensorMap) -> EncodeArguments:
    """The driver call's arguments for ``spec`` (no driver needed)."""
    itemsize = DTYPES[spec.dtype][2]
    return EncodeArguments(
        data_type=_DATA_TYPE[spec.dtype],
        dims=(spec.cols, spec.rows),
        strides_bytes=(spec.cols * itemsize,),
        box=(spec.box_cols, spec.box_rows),
        element_strides=(1, 1),
        interleave=_INTERLEAVE_NONE,
        swizzle=_SWIZZLE[spec.swizzle],
        l2_promotion=_L2_PROMOTION_256B,
        oob_fill=_OOB_FILL_ZERO,
    )


_lib_lock = threading.Lock()
_lib: Any = None


def _driver() -> Any:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                _lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise TensorMapError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc
        return _lib


def encode(spec: TensorMap, pointer: int, lib: Any = None) -> bytes:
    """The 128 bytes of the ``CUtensorMap`` of ``spec`` over the device array at ``pointer``.

    ``lib``: the driver library (a ``ctypes.CDLL``; None: libcuda.so.1).

    Raises:
        TensorMapError: the driver refused it (e.g. ``pointer`` not 16-byte aligned).
    """
    lib = lib or _driver()
    args = encode_arguments(spec)
    raw = (ctypes.c_ubyte * (MAP_BYTES + MAP_ALIGN))()
    address = (ctypes.addressof(raw) + MAP_ALIGN - 1) & ~(MAP_ALIGN - 1)
    result = lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(address),
        ctypes.c_int(args.data_type),
        ctypes.c_uint32(2),
        ctypes.c_void_p(pointer),
        (ctypes.c_uint64 * 2)(*args.dims),
        (ctypes.c_uint64 * 1)(*args.strides_bytes),
        (ctypes.c_uint32 * 2)(*args.box),
        (ctypes.c_uint32 * 2)(*args.element_strides),
        ctypes.c_int(args.interleave),
        ctypes.c_int(args.swizzle),
        ctypes.c_int(args.l2_promotion),
        ctypes.c_int(args.oob_fill),
    )
    if result != 0:
        raise TensorMapError(
            f"cuTensorMapEncodeTiled failed (CUresult {result}) for a {spec.rows} x {spec.cols} "
            f"{spec.dtype} matrix at 0x{pointer:x}, box {spec.box_rows} x {spec.box_cols}, "
            f"swizzle {spec.swizzle}: the address must be 16-byte aligned"
        )
    return ctypes.string_at(address, MAP_BYTES)


class MapCache:
    """Encoded maps per (declaration, pointer), the ``capacity`` most recent: a launch on the
    same buffers (a training loop, a timing loop over input copies) encodes once. Thread-safe."""

    def __init__(self, capacity: int = 1024, lib: Any = None):
        self.capacity = capacity
        self._lib = lib
        self._maps: OrderedDict[tuple[TensorMap, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: TensorMap, pointer: int) -> bytes:
        key = (spec, int(pointer))
        with self._lock:
            found = self._maps.get(key)
            if found is not None:
                self._maps.move_to_end(key)
                return found
        value = encode(spec, int(pointer), self._lib)
        with self._lock:
            self._maps[key] = value
            while len(self._maps) > self.capacity:
                self._maps.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._maps)
