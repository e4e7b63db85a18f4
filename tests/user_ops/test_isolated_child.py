"""A user operator registered only in the parent reaches the isolated measuring child."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest
from kato.kernels.registry import register
from kato.kernels.user import load_folder
from kato.kernels.user.spec import UserOperatorSpec
from kato.tuner.backends import shipping
from kato.tuner.backends.isolated import (
    BackendSpec,
    ChildStartError,
    IsolatedBackend,
    SpareChildren,
)

from kato.kernel_tuner import operator_from_arguments, problem_shape
from user_ops.child_backend import problem_digest
from user_ops.test_tune_kernel import KERNEL


def test_user_operator_reaches_the_child(vector_add_dir):
    d = load_folder(vector_add_dir)
    spec = d.spec.model_copy(update={"name": "child_echo_op"})
    op = register(UserOperatorSpec(type(d)(spec=spec, files=d.files)))
    backend = IsolatedBackend(
        BackendSpec(
            kind="user_ops.child_backend:make", operator=op.name, shape=(1000,), dtype="float32"
        ),
        trial_timeout_s=60,
    )
    try:
        result = backend.evaluate({"block_size_x": 128, "tile_size_x": 4})
        assert result.ok, result.error
        assert result.error == op.version  # the child built the same operator
        assert result.times_ms == [2.0]  # ceil(1000 / (128 * 4)) blocks
        assert "does not hold" in backend.space().check({"block_size_x": 1024, "tile_size_x": 8})
    finally:
        backend.close()


N_BIG = 1 << 22  # 16 MiB a float32 argument: over shipping.SHARED_MIN_BYTES


@pytest.fixture
def big_operator():
    """A kato.tune_kernel operator holding its caller's arrays (3 x 16 MiB), the shape of its
    problem, and the digest of the problem it makes in this process."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(N_BIG).astype(np.float32)
    b = rng.standard_normal(N_BIG).astype(np.float32)
    args = [np.zeros_like(a), a, b, np.int32(N_BIG)]
    op, _ = operator_from_arguments(
        "vector_add_big", KERNEL, N_BIG, args, {"block_size_x": [128, 256], "tile_size_x": [1, 2]},
        grid_div_x=["block_size_x", "tile_size_x"], answer=[a + b, None, None, None],
    )  # fmt: skip
    register(op)
    shape = problem_shape(N_BIG, args)[0]
    return op, shape, problem_digest(op.make_problem(shape, "float32", np.random.default_rng(0)))


@pytest.fixture
def packs(monkeypatch):
    """The blocks shipping.pack makes while the test runs (None for a package without one)."""
    if shipping.shared_room() < 8 * 3 * N_BIG * 4:
        pytest.skip(f"{shipping.SHM_DIR} has too little room for the test's blocks")
    made: list[str | None] = []
    real = shipping.pack

    def watched(objs):
        package = real(objs)
        made.append(package.block)
        return package

    monkeypatch.setattr(shipping, "pack", watched)
    return made


def _gone(name):
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    return True


def _spec(op, shape, kind="make_inputs_echo"):
    return BackendSpec(
        kind=f"user_ops.child_backend:{kind}", operator=op.name, shape=shape, dtype="float32"
    )


def test_large_arguments_reach_each_child_from_one_block_unlinked_at_close(big_operator, packs):
    """Kernel Tuner's arguments travel to the child in a shared-memory block
    (tuner.backends.shipping), not pickled through the pipe: the child's problem is the
    parent's, byte for byte, also in the child that replaces one that crashed, which maps the
    same block; the block is gone once the backend is closed."""
    op, shape, expected = big_operator
    backend = IsolatedBackend(_spec(op, shape, "make_crashing_inputs_echo"), trial_timeout_s=60)
    try:
        crashed = backend.evaluate({"block_size_x": 128, "tile_size_x": 1})
        result = backend.evaluate({"block_size_x": 128, "tile_size_x": 2})
    finally:
        backend.close()
    assert crashed.status.value == "crashed" and backend.restarts == 1
    assert result.ok and result.error == expected
    assert result.times_ms == [float(3 * N_BIG * 4)]  # c, a and b
    assert len(packs) == 1 and packs[0] is not None and _gone(packs[0])


def test_a_warm_spare_takes_the_packed_operator(big_operator, packs):
    op, shape, expected = big_operator
    pool = SpareChildren("user_ops.child_backend:make_inputs_echo")
    pool.start()
    try:
        backend = IsolatedBackend(_spec(op, shape), trial_timeout_s=60, spares=pool)
        try:
            result = backend.evaluate({"block_size_x": 256, "tile_size_x": 2})
        finally:
            backend.close()
    finally:
        pool.close()
    assert backend.spares_taken == 1
    assert result.ok and result.error == expected
    assert len(packs) == 1 and _gone(packs[0])


def test_a_child_that_cannot_start_leaves_no_block(big_operator, packs):
    op, shape, _ = big_operator
    with pytest.raises(ChildStartError, match="no_such_backend"):
        IsolatedBackend(_spec(op, shape, "no_such_backend"), trial_timeout_s=60)
    assert len(packs) == 1 and _gone(packs[0])
