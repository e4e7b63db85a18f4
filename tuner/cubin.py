"""What a compiled CUDA module (a cubin: an ELF file) holds, read without a GPU or a driver.

:func:`has_device_globals` says whether a module has ``__device__`` variables: state that
every launch of the loaded module shares (a split row's partials and tickets, say). Two calls
that overlap on one loaded module, on two streams at once, would mix that state, so whoever
launches on several streams loads such a module once per stream (``kato_torch``); modules
without it are shared freely. ``__constant__`` data is read-only on the device and does not
count.
"""

from __future__ import annotations

import struct

#: ELF sections where nvcc places ``__device__`` variables: uninitialised (NOBITS) and
#: initialised (PROGBITS) ones.
DEVICE_GLOBAL_SECTIONS = (b".nv.global", b".nv.global.init")


def section_names(cubin: bytes) -> list[bytes]:
    """The section names of a 64-bit little-endian ELF image (what nvcc writes for every
    target it supports). Raises ValueError for anything else."""
    if cubin[:4] != b"\x7fELF" or len(cubin) < 64:
        raise ValueError("not an ELF image")
    if cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    if shoff == 0 or shnum == 0 or shentsize < 64 or shoff + shnum * shentsize > len(cubin):
        raise ValueError("ELF image without a readable section table")

    def header(index: int) -> tuple[int, int, int]:
        base = shoff + index * shentsize
        name = struct.unpack_from("<I", cubin, base)[0]
        offset, size = struct.unpack_from("<QQ", cubin, base + 0x18)
        return name, offset, size

    _, strings_at, strings_size = header(shstrndx)
    strings = cubin[strings_at : strings_at + strings_size]
    names = []
    for index in range(shnum):
        name = header(index)[0]
        end = strings.find(b"\0", name)
        names.append(strings[name : end if end >= 0 else len(strings)])
    return names


def has_device_globals(cubin: bytes) -> bool:
    """Whether the module declares ``__device__`` variables (see the module docstring)."""
    return any(name in DEVICE_GLOBAL_SECTIONS for name in section_names(cubin))
