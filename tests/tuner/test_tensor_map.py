"""TMA tensor maps on the launch paths, without a GPU: the driver call's arguments, its errors,
the cache, the PyCUDA parameter format and kato_torch's argument slots."""

from __future__ import annotations

import ctypes

import pytest
from kato.kernels.spec import TensorMap
from kato.tuner import tensor_map
from kato.tuner.backends.pycuda import argument_format
from kato.tuner.tensor_map import MAP_BYTES, MapCache, TensorMapError, encode, encode_arguments

A = TensorMap(0, "bfloat16", rows=1000, cols=264, box_rows=128, box_cols=64)
B = TensorMap(1, "float16", rows=264, cols=136, box_rows=64, box_cols=64, swizzle=128)


def test_encode_arguments_are_innermost_first_with_byte_strides():
    args = encode_arguments(A)
    assert args.dims == (264, 1000) and args.strides_bytes == (528,)
    assert args.box == (64, 128) and args.element_strides == (1, 1)
    assert (args.data_type, args.swizzle, args.interleave, args.oob_fill) == (9, 3, 0, 0)
    assert encode_arguments(B).data_type == 6
    plain = TensorMap(0, "float32", rows=4, cols=4, box_rows=4, box_cols=4, swizzle=0)
    assert (encode_arguments(plain).data_type, encode_arguments(plain).swizzle) == (7, 0)


class FakeDriver:
    """Records cuTensorMapEncodeTiled's arguments and writes a pattern into the map."""

    def __init__(self, result: int = 0):
        self.result, self.calls = result, []

    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, elem, *rest):
        self.calls.append(
            {
                "out": out.value,
                "dtype": dtype.value,
                "rank": rank.value,
                "address": address.value,
                "dims": list(dims),
                "strides": list(strides),
                "box": list(box),
                "elem": list(elem),
                "rest": [r.value for r in rest],
            }
        )
        ctypes.memset(out.value, 0xAB, MAP_BYTES)
        return self.result


def test_encode_passes_the_declaration_and_returns_the_aligned_map():
    lib = FakeDriver()
    data = encode(A, 0x7F0000001000, lib)
    (call,) = lib.calls
    assert data == b"\xab" * MAP_BYTES
    assert call["out"] % 64 == 0  # CUtensorMap is 64-byte aligned
    assert call["address"] == 0x7F0000001000 and call["rank"] == 2 and call["dtype"] == 9
    assert call["dims"] == [264, 1000] and call["strides"] == [528]
    assert call["box"] == [64, 128] and call["elem"] == [1, 1]
    assert call["rest"] == [0, 3, 3, 0]  # no interleave, 128-byte swizzle, L2 256 B, zeros


def test_a_refused_map_is_an_error_naming_it():
    with pytest.raises(TensorMapError, match=r"1000 x 264 bfloat16 matrix at 0x1001.*16-byte"):
        encode(A, 0x1001, FakeDriver(result=1))


def test_cache_encodes_once_per_declaration_and_pointer_and_forgets_the_oldest():
    lib = FakeDriver()
    cache = MapCache(capacity=2, lib=lib)
    cache.get(A, 0x1000)
    cache.get(B, 0x1000)  # another declaration over the same buffer
    cache.get(A, 0x1000)
    assert len(lib.calls) == 2
    cache.get(A, 0x2000)  # another buffer: evicts (B, 0x1000), the least recently used
    assert len(lib.calls) == 3 and len(cache) == 2
    cache.get(A, 0x1000)
    assert len(lib.calls) == 3
    cache.get(B, 0x1000)
    assert len(lib.calls) == 4


def test_missing_driver_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(tensor_map, "_lib", None)

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(tensor_map.ctypes, "CDLL", no_driver)
    with pytest.raises(TensorMapError, match="libcuda"):
        encode(A, 0x1000)


def test_pycuda_format_is_the_step_arguments_formats_in_order():
    formats = ["P", "P", "P", "i", "i", "i"]
    assert argument_format(formats, (0, 1, 2)) == "PPP"
    assert argument_format(formats, (3, 0, 5)) == "iPi"


def test_kato_torch_slots_give_each_map_an_aligned_slot_of_its_own():
    from kato_torch._driver import ArgumentSlots

    signature = [None, None, None, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    slots = ArgumentSlots(signature, [(A, B, 2, 3, 4, 5), (0, 1, 2)])
    (map_a, addr_a), (map_b, addr_b) = slots.maps[0]
    assert (map_a, map_b) == (A, B) and slots.maps[1] == []
    assert addr_a % 64 == 0 and addr_b % 64 == 0 and abs(addr_b - addr_a) >= MAP_BYTES
    params = list(slots.params[0])
    assert params[:2] == [addr_a, addr_b]
    assert params[2:] == [ctypes.addressof(slots.values[i]) for i in (2, 3, 4, 5)]
    assert list(slots.params[1]) == [ctypes.addressof(slots.values[i]) for i in (0, 1, 2)]


def test_driver_arguments_point_at_each_value_and_a_map_at_an_aligned_copy():
    """What the backend's tensor-map launches hand cuLaunchKernel (tuner.cuda_driver): one
    address per argument, holding the value's bytes; a map's 128 bytes 64-byte aligned."""
    import ctypes

    from kato.tuner import cuda_driver

    encoded = bytes(range(128))
    values = [
        cuda_driver.aligned_bytes(encoded, 64),
        ctypes.c_void_p(0xDEADBEEF000),
        ctypes.c_int32(-7),
        ctypes.c_uint64(2**40 + 3),
        ctypes.c_float(1.5),
    ]
    params = cuda_driver.argument_array(values)
    assert params[0] % 64 == 0 and ctypes.string_at(params[0], 128) == encoded
    assert ctypes.c_void_p.from_address(params[1]).value == 0xDEADBEEF000
    assert ctypes.c_int32.from_address(params[2]).value == -7
    assert ctypes.c_uint64.from_address(params[3]).value == 2**40 + 3
    assert ctypes.c_float.from_address(params[4]).value == 1.5
