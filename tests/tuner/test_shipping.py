"""tuner.backends.shipping: objects with large arrays reach a spawned process through one
shared-memory block, intact, aligned and as views of the block; small ones, and large ones
without room, inside the pickle."""

from __future__ import annotations

import errno
import multiprocessing
import threading
from multiprocessing import shared_memory

import numpy as np
import pytest
from kato.tuner.backends import shipping


def _receive(conn, package):
    """In the spawned child: open; report every array's bytes, dtype, shape, writable and
    aligned flags; zero the first array, and report what the block holds at its offset (the
    array is a view of the block: the zeros are there); then wait to be told to exit."""
    objs = package.open()
    arrays = objs[0]["arrays"]
    report = [(a.tobytes(), str(a.dtype), a.shape, a.flags.writeable, a.flags.aligned)
              for a in arrays]  # fmt: skip
    arrays[0][...] = 0
    offset, size = package.spans[0]
    block = shared_memory.SharedMemory(name=package.block)
    in_block = bytes(block.buf[offset : offset + size])
    block.close()
    conn.send((report, objs[0]["name"], in_block == bytes(size)))
    conn.recv()


def _arrays():
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal(1 << 19).astype(np.float32),  # 2 MiB
        rng.integers(0, 255, size=1001, dtype=np.uint8),  # an odd byte count ...
        rng.standard_normal(1 << 15),  # ... before float64: must arrive aligned
        np.arange(3 * 5 * 7, dtype=np.int64).reshape(3, 5, 7),
        np.asfortranarray(rng.standard_normal((300, 200))),  # Fortran order: out of band too
    ]


def _check(arrays, got):
    for (data, dtype, shape, writable, aligned), a in zip(got, arrays, strict=True):
        assert data == a.tobytes() and dtype == str(a.dtype) and shape == a.shape
        assert writable and aligned


def test_large_arrays_travel_in_one_block_as_aligned_views_of_it():
    arrays = _arrays()
    package = shipping.pack(({"arrays": arrays, "name": "op"},))
    try:
        assert package.block is not None and package.objects is None
        assert [size for _, size in package.spans] == [a.nbytes for a in arrays]
        assert all(offset % shipping.ALIGN == 0 for offset, _ in package.spans)
        assert len(package.payload) < 4096  # the arrays are not in the pickle
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_receive, args=(child, package))
        process.start()
        try:
            report, name, zeroed_in_block = parent.recv()
            parent.send("exit")
        finally:
            process.join(30)
    finally:
        package.release()
    assert process.exitcode == 0
    assert name == "op" and zeroed_in_block
    _check(arrays, report)
    assert arrays[0].any()  # the child wrote into the block, not into the sender's array
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=package.block)


def test_small_payloads_travel_inside_the_pickle():
    objs = ({"x": np.arange(10, dtype=np.float32), "n": 3},)
    package = shipping.pack(objs)
    assert package.block is None and package.spans == ()
    (opened,) = package.open()
    assert opened["n"] == 3 and np.array_equal(opened["x"], objs[0]["x"])
    package.release()  # nothing to release: no error


def test_what_does_not_pickle_is_refused_before_any_block_is_made():
    with pytest.raises(shipping.Unshippable, match="lock"):
        shipping.pack(({"arrays": _arrays(), "lock": threading.Lock()},))


def test_release_is_idempotent_and_a_released_package_cannot_be_opened():
    package = shipping.pack(({"arrays": _arrays(), "name": "op"},))
    package.release()
    package.release()
    with pytest.raises(FileNotFoundError):
        package.open()


def _inline(package, arrays):
    assert package.block is None and package.payload is None
    (opened,) = package.open()
    for got, a in zip(opened["arrays"], arrays, strict=True):
        assert np.array_equal(got, a) and got.dtype == a.dtype


def test_without_room_for_shared_memory_large_arrays_travel_inside_the_pickle(
    monkeypatch, tmp_path
):
    """Where the shared-memory tmpfs is missing or too small for the arrays (a container's 64 MB
    /dev/shm), writing a block could kill the sender: the pickle carries them instead."""
    monkeypatch.setattr(shipping, "SHM_DIR", str(tmp_path / "absent"))
    assert shipping.shared_room() == 0
    arrays = _arrays()
    _inline(shipping.pack(({"arrays": arrays, "name": "op"},)), arrays)


def test_a_block_the_tmpfs_cannot_hold_is_unlinked_and_the_pickle_carries_the_arrays(monkeypatch):
    """The free space read and the block's allocation race with other processes: a failed
    allocation (ENOSPC from posix_fallocate, before any page is written) leaves no block."""
    made: list[str] = []
    real = shipping.shared_memory.SharedMemory

    def recording(*args, **kwargs):
        shm = real(*args, **kwargs)
        made.append(shm.name)
        return shm

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shipping.shared_memory, "SharedMemory", recording)
    monkeypatch.setattr(shipping.os, "posix_fallocate", full, raising=False)
    arrays = _arrays()
    _inline(shipping.pack(({"arrays": arrays, "name": "op"},)), arrays)
    monkeypatch.undo()
    assert len(made) == 1
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=made[0])
