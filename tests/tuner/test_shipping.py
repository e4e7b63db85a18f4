"""tuner.backends.shipping: objects with large arrays reach a spawned process through one
shared-memory block, intact and writable; small ones inside the pickle."""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing import shared_memory

import numpy as np
import pytest
from kato.tuner.backends import shipping


def _receive(conn, package):
    """In the spawned child: open, report every array's digest, dtype, shape and whether it is
    writable, write into one (its own view), then wait to be told to exit."""
    objs = package.open()
    arrays = objs[0]["arrays"]
    report = [(a.tobytes(), str(a.dtype), a.shape, a.flags.writeable) for a in arrays]
    arrays[0][...] = 0
    conn.send((report, objs[0]["name"], float(arrays[0].sum())))
    conn.recv()


def _arrays():
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal(1 << 19).astype(np.float32),  # 2 MiB
        np.arange(3 * 5 * 7, dtype=np.int64).reshape(3, 5, 7),
        np.asfortranarray(rng.standard_normal((300, 200))),  # Fortran order: out of band too
        rng.integers(0, 255, size=1001, dtype=np.uint8),  # an odd byte count between others
    ]


def test_large_arrays_travel_in_one_block_and_arrive_intact_and_writable():
    arrays = _arrays()
    package = shipping.pack(({"arrays": arrays, "name": "op"},))
    assert package.block is not None
    assert sum(package.sizes) == sum(a.nbytes for a in arrays)
    assert len(package.payload) < 4096  # the arrays are not in the pickle
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_receive, args=(child, package))
    process.start()
    try:
        report, name, zeroed = parent.recv()
        package.release()  # the child's mapping outlives the name
        parent.send("exit")
    finally:
        process.join(30)
    assert process.exitcode == 0
    assert name == "op" and zeroed == 0.0
    for (data, dtype, shape, writable), a in zip(report, arrays, strict=True):
        assert data == a.tobytes() and dtype == str(a.dtype) and shape == a.shape and writable
    assert arrays[0].any()  # the child wrote into its own copy, not the sender's array
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=package.block)


def test_small_payloads_travel_inside_the_pickle():
    objs = ({"x": np.arange(10, dtype=np.float32), "n": 3},)
    package = shipping.pack(objs)
    assert package.block is None and package.sizes == ()
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


def test_without_room_for_shared_memory_large_arrays_travel_inside_the_pickle(
    monkeypatch, tmp_path
):
    """Where the shared-memory tmpfs is missing or too small for the arrays (a container's 64 MB
    /dev/shm), writing a block could kill the sender: the pickle carries them instead."""
    monkeypatch.setattr(shipping, "SHM_DIR", str(tmp_path / "absent"))
    assert shipping.shared_room() == 0
    arrays = _arrays()
    package = shipping.pack(({"arrays": arrays, "name": "op"},))
    assert package.block is None and len(package.payload) > sum(a.nbytes for a in arrays)
    (opened,) = package.open()
    for got, a in zip(opened["arrays"], arrays, strict=True):
        assert np.array_equal(got, a) and got.dtype == a.dtype
