"""A user operator registered only in the parent reaches the isolated measuring child."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest
from kato.kernels.registry import register
from kato.kernels.user import load_folder
from kato.kernels.user.spec import UserOperatorSpec
from kato.tuner.backends import shipping
from kato.tuner.backends.isolated import BackendSpec, IsolatedBackend

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


def test_a_tune_kernel_operators_large_arguments_reach_the_child_through_shared_memory(
    monkeypatch,
):
    """Kernel Tuner's arguments (here 3 x 16 MiB) travel to the child in a shared-memory block
    (tuner.backends.shipping), not pickled through the pipe: the child's problem is the
    parent's, byte for byte, and the block is gone once the child has started."""
    n = 1 << 22
    rng = np.random.default_rng(3)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    tune_params = {"block_size_x": [128, 256], "tile_size_x": [1, 2]}
    op, _ = operator_from_arguments(
        "vector_add_big", KERNEL, n, [np.zeros_like(a), a, b, np.int32(n)], tune_params,
        grid_div_x=["block_size_x", "tile_size_x"], answer=[a + b, None, None, None],
    )  # fmt: skip
    register(op)
    package = shipping.pack((op,))
    assert package.block is not None and sum(package.sizes) >= 3 * n * 4
    package.release()
    shape = problem_shape(n, [np.zeros_like(a), a, b, np.int32(n)])[0]
    expected = problem_digest(op.make_problem(shape, "float32", np.random.default_rng(0)))
    created: list[str] = []
    real_pack = shipping.pack

    def watched(objs):
        package = real_pack(objs)
        created.append(package.block)
        return package

    monkeypatch.setattr(shipping, "pack", watched)
    backend = IsolatedBackend(
        BackendSpec(
            kind="user_ops.child_backend:make_inputs_echo", operator=op.name, shape=shape,
            dtype="float32",
        ),
        trial_timeout_s=60,
    )  # fmt: skip
    try:
        result = backend.evaluate({"block_size_x": 128, "tile_size_x": 2})
        assert result.ok, result.error
        assert result.error == expected
        assert result.times_ms == [float(3 * n * 4)]  # c, a and b
    finally:
        backend.close()
    assert len(created) == 1 and created[0] is not None
    with pytest.raises(FileNotFoundError):  # unlinked once the child was ready
        shared_memory.SharedMemory(name=created[0])
