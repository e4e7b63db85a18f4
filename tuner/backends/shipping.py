"""Objects sent to a measuring child with their large arrays in shared memory, not in the pipe.

A user operator built by ``kato.tune_kernel`` holds the caller's argument arrays (Kernel
Tuner's ``reduction.py`` passes 800 million floats, 3.2 GB), and the measuring child
(:mod:`tuner.backends.isolated`) needs the operator. Pickled whole, such an operator was
serialised twice (once to check that it pickles, once by the spawn) and copied through a pipe:
25.8 s for a 3.2 GB array on the development machine, paid again by every ``tune_kernel`` call.

:func:`pack` pickles with protocol 5 and copies every out-of-band buffer (contiguous numpy
arrays; at least :data:`SHARED_MIN_BYTES` in all, and at most half the free shared memory,
:func:`shared_room`) into one :class:`multiprocessing.shared_memory` block, each at a
:data:`ALIGN`-byte offset: one copy in the sender, none in the pipe. :meth:`Package.open` in
the child rebuilds the objects on views of that block (zero copy) and keeps it mapped for the
life of the process. The sender unlinks the block (:meth:`Package.release`) when it no longer
starts children from the package: POSIX keeps a child's mapping until it exits. Otherwise the
package carries the objects themselves, pickled once, by the spawn.

Contract (tests/tuner/test_shipping.py): ``pack(objs).open()`` equals ``objs`` (values, dtypes,
shapes, and aligned arrays; non-contiguous arrays arrive C-contiguous, as through a plain
pickle, and arrays in a block arrive writable where they were); objects that do not pickle
raise :class:`Unshippable` from :func:`pack`, before any block exists; a block that cannot be
made or filled (no tmpfs, no room: ``posix_fallocate`` fails instead of a later SIGBUS) leaves
no block and falls back to the pickle; :meth:`Package.release` may be called any number of
times, and a released package's block cannot be opened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

#: Out-of-band buffers below this many bytes in all travel inside the pickle.
SHARED_MIN_BYTES = 1 << 20
#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"
#: Offset alignment of each buffer in a block (numpy's aligned flag; a cache line).
ALIGN = 64

#: Blocks opened in this process: their views back the objects :meth:`Package.open` returned.
_OPENED: list[shared_memory.SharedMemory] = []

log = logging.getLogger(__name__)


class Unshippable(Exception):
    """The objects cannot be pickled (a lambda, a lock, an open file among them)."""


@dataclass
class Package:
    """Objects for another process: in ``objects`` (pickled by whoever sends the package), or
    as ``payload`` with their buffers in the shared block ``block`` at ``spans`` (offset,
    bytes), in pickling order."""

    objects: Any = None
    payload: bytes | None = None
    block: str | None = None
    spans: tuple[tuple[int, int], ...] = ()
    _shm: shared_memory.SharedMemory | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # The sender's handle stays with the sender: the receiver attaches by name.
        return {**self.__dict__, "_shm": None}

    def open(self) -> Any:
        """The objects, rebuilt (in the receiving process) on views of the shared block."""
        if self.block is None:
            return self.objects
        shm = _attach(self.block)
        _OPENED.append(shm)  # the arrays below are views of its mapping
        views = [shm.buf[offset : offset + size] for offset, size in self.spans]
        return pickle.loads(self.payload or b"", buffers=views)

    def release(self) -> None:
        """The sender's part: unlink the block (mappings already made stay valid)."""
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            with contextlib.suppress(FileNotFoundError):  # unlinked already (tests)
                shm.unlink()


def pack(objs: Any) -> Package:
    """``objs`` for another process: pickled (protocol 5) with their out-of-band buffers in a
    shared-memory block where they are :data:`SHARED_MIN_BYTES` or more and fit, else carried
    as they are.

    Raises:
        Unshippable: ``objs`` cannot be pickled (the error's text says why).
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        payload = pickle.dumps(objs, protocol=5, buffer_callback=buffers.append)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise Unshippable(f"{type(exc).__name__}: {exc}") from exc
    raws = [buffer.raw() for buffer in buffers]
    spans, end = [], 0
    for raw in raws:
        offset = -(-end // ALIGN) * ALIGN
        spans.append((offset, raw.nbytes))
        end = offset + raw.nbytes
    total = sum(raw.nbytes for raw in raws)
    if total < SHARED_MIN_BYTES:
        return Package(objects=objs)
    room = shared_room()
    if end > room // 2:
        log.info(
            "%.2f GB of arrays for the measuring process: more than half the %.2f GB free in "
            "%s, sent through the pipe", total / 1e9, room / 1e9, SHM_DIR,
        )  # fmt: skip
        return Package(objects=objs)
    shm = _reserve(end)
    if shm is None:
        return Package(objects=objs)
    try:
        for raw, (offset, size) in zip(raws, spans, strict=True):
            shm.buf[offset : offset + size] = raw
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return Package(payload=payload, block=shm.name, spans=tuple(spans), _shm=shm)


def _reserve(size: int) -> shared_memory.SharedMemory | None:
    """A new block of ``size`` bytes, its pages allocated now (``posix_fallocate``: a full
    tmpfs answers ENOSPC here instead of killing the writer with SIGBUS later), or None (logged)
    where the system cannot give one."""
    try:
        shm = shared_memory.SharedMemory(create=True, size=max(1, size))
    except OSError as exc:
        log.info("no shared-memory block of %.2f GB (%s): sent through the pipe", size / 1e9, exc)
        return None
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(shm._fd, 0, max(1, size))  # type: ignore[attr-defined]
    except OSError as exc:
        shm.close()
        shm.unlink()
        log.info("no room for a %.2f GB shared-memory block (%s): sent through the pipe",
                 size / 1e9, exc)  # fmt: skip
        return None
    return shm


def shared_room() -> int:
    """Bytes free for shared memory (the tmpfs at :data:`SHM_DIR`), 0 where unknown. Writing
    past a full tmpfs kills the writer (SIGBUS), and containers often mount 64 MB there, so
    :func:`pack` uses a block only where it takes at most half of this."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


class _Mapped(shared_memory.SharedMemory):
    """A block attached for good: the arrays :meth:`Package.open` made are views of it until
    the process ends, so it is never closed (closing with views alive raises, even from
    ``__del__`` at the interpreter's exit); the system unmaps it at exit."""

    def __del__(self) -> None:
        pass


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to the sender's block. Before Python 3.13 (no ``track``) attaching registers the
    block with the resource tracker too; a spawned child shares its parent's tracker, which
    holds names as a set, so that is a no-op, and the sender's unlink unregisters it."""
    if sys.version_info >= (3, 13):
        return _Mapped(name=name, track=False)  # type: ignore[call-arg]
    return _Mapped(name=name)
