"""A user operator registered only in the parent reaches the isolated measuring child."""

from __future__ import annotations

from kato.kernels.registry import register
from kato.kernels.user import load_folder
from kato.kernels.user.spec import UserOperatorSpec
from kato.tuner.backends.isolated import BackendSpec, IsolatedBackend


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
