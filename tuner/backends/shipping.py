"""Objects sent to a measuring child with their large arrays in shared memory, not in the pipe.

A user operator built by ``kato.tune_kernel`` holds the caller's argument arrays (Kernel
Tuner's ``reduction.py`` passes 800 million floats, 3.2 GB), and the measuring child
(:mod:`tuner.backends.isolated`) needs the operator. Pickled whole, such an operator was
serialised twice (once to check that it pickles, once by the spawn) and copied through a pipe:
25.8 s for a 3.2 GB array on the development machine, paid again by every ``tune_kernel`` call
and by every replacement of a crashed child.

:func:`pack` pickles with protocol 5 and takes every out-of-band buffer (numpy arrays of at
least :data:`SHARED_MIN_BYTES` in all, and at most half the free shared memory,
:func:`shared_room`) into one :class:`multiprocessing.shared_memory` block: one copy in the
sender, none in the pipe. :meth:`Package.open` in the child rebuilds
the objects on views of that block (zero copy), and keeps the block mapped for the life of the
process. The sender unlinks the block (:meth:`Package.release`) once the child has said it is
ready: POSIX keeps the child's mapping until it exits. Small payloads travel in the pickle.

Contract (tests/tuner/test_shipping.py): ``pack(objs).open()`` equals ``objs`` (arrays equal,
dtypes and shapes kept, writable); an object that does not pickle raises :class:`Unshippable`
from :func:`pack` at the cost of pickling its small part only; :meth:`Package.release` may be
called any number of times, and a package released before it was opened cannot be opened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

#: Out-of-band buffers below this many bytes in all travel inside the pickle.
SHARED_MIN_BYTES = 1 << 20
#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"

#: Blocks opened in this process: their views back the objects :meth:`Package.open` returned.
_OPENED: list[shared_memory.SharedMemory] = []

log = logging.getLogger(__name__)


class Unshippable(Exception):
    """The objects cannot be pickled (a lambda, a lock, an open file among them)."""


@dataclass
class Package:
    """Pickled objects and, where their buffers are large, the shared-memory block holding
    them (``block``: its name; ``sizes``: each buffer's bytes, in pickling order)."""

    payload: bytes
    block: str | None = None
    sizes: tuple[int, ...] = ()
    _shm: shared_memory.SharedMemory | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # The sender's handle stays with the sender: the child attaches by name.
        return {"payload": self.payload, "block": self.block, "sizes": self.sizes, "_shm": None}

    def open(self) -> Any:
        """The objects, rebuilt (in the receiving process) on views of the shared block."""
        if self.block is None:
            return pickle.loads(self.payload)
        shm = _attach(self.block)
        _OPENED.append(shm)  # the arrays below are views of its mapping
        views, offset = [], 0
        for size in self.sizes:
            views.append(shm.buf[offset : offset + size])
            offset += size
        return pickle.loads(self.payload, buffers=views)

    def release(self) -> None:
        """The sender's part: unlink the block (mappings already made stay valid)."""
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            with contextlib.suppress(FileNotFoundError):  # unlinked already (tests)
                shm.unlink()


def pack(objs: Any) -> Package:
    """``objs`` pickled (protocol 5), their out-of-band buffers in a shared-memory block when
    they are :data:`SHARED_MIN_BYTES` or more.

    Raises:
        Unshippable: ``objs`` cannot be pickled (the error's text says why).
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        payload = pickle.dumps(objs, protocol=5, buffer_callback=buffers.append)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise Unshippable(f"{type(exc).__name__}: {exc}") from exc
    raws = [buffer.raw() for buffer in buffers]
    total = sum(raw.nbytes for raw in raws)
    room = shared_room()
    if total < SHARED_MIN_BYTES or total > room // 2:
        if total >= SHARED_MIN_BYTES:
            log.info(
                "%.2f GB of arrays for the measuring process: more than half the %.2f GB free "
                "in %s, sent through the pipe", total / 1e9, room / 1e9, SHM_DIR,
            )  # fmt: skip
        # One pickle with the buffers inside (no block to create and unlink).
        return Package(pickle.dumps(objs, protocol=5))
    shm = shared_memory.SharedMemory(create=True, size=max(1, total))
    offset = 0
    try:
        for raw in raws:
            shm.buf[offset : offset + raw.nbytes] = raw
            offset += raw.nbytes
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return Package(payload, shm.name, tuple(raw.nbytes for raw in raws), shm)


class _Mapped(shared_memory.SharedMemory):
    """A block attached for good: the arrays :meth:`Package.open` made are views of it until
    the process ends, so it is never closed (closing with views alive raises, even from
    ``__del__`` at the interpreter's exit); the system unmaps it at exit."""

    def __del__(self) -> None:
        pass


def shared_room() -> int:
    """Bytes free for shared memory (the tmpfs at :data:`SHM_DIR`), 0 where unknown. Writing
    past a full tmpfs kills the writer (SIGBUS), and containers often mount 64 MB there, so
    :func:`pack` uses a block only where it takes at most half of this."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to the sender's block. Before Python 3.13 (no ``track``) attaching registers the
    block with the resource tracker too; a spawned child shares its parent's tracker, which
    holds names as a set, so that is a no-op, and the sender's unlink unregisters it."""
    try:
        return _Mapped(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:  # Python < 3.13
        return _Mapped(name=name)
