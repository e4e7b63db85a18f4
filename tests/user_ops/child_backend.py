"""A GPU-free backend built in the isolated child (``BackendSpec(kind="user_ops.child_backend:make",
operator=...)``): it answers from the operator the child's registry holds, so a test can see
which user operator reached the child."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
from kato.kernels import get_operator
from kato.tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus
from kato.tuner.space import SearchSpace


class RegistryEcho(Backend):
    name = "registry-echo"

    def __init__(self, operator: str, shape: tuple[int, ...], dtype: str):
        self.op = get_operator(operator)
        self.shape, self.dtype = shape, dtype

    def device(self) -> DeviceInfo:
        return DeviceInfo("test", "H200", (9, 0), "13.0")

    def space(self) -> SearchSpace:
        return SearchSpace(self.op.params, check=lambda c: self.op.check(c, self.shape, self.dtype))

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        """OK with the time the launch's grid; the operator's version as the error text."""
        launch = self.op.launch(config, self.shape, self.dtype)
        return TrialResult(
            config=dict(config), status=TrialStatus.OK, times_ms=[float(launch.grid[0])],
            error=self.op.version,
        )  # fmt: skip


def make(spec: Any) -> Backend:
    return RegistryEcho(spec.operator, tuple(spec.shape), spec.dtype)


class InputsEcho(RegistryEcho):
    """Answers with a digest of the problem the child's operator makes (its arguments' bytes
    and references), so a test can compare what reached the child with the parent's."""

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        problem = self.op.make_problem(self.shape, self.dtype, np.random.default_rng(0))
        return TrialResult(
            config=dict(config), status=TrialStatus.OK, times_ms=[float(problem.nbytes)],
            error=problem_digest(problem),
        )  # fmt: skip


def problem_digest(problem: Any) -> str:
    h = hashlib.sha256()
    for array in [*problem.args, *problem.references]:
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def make_inputs_echo(spec: Any) -> Backend:
    return InputsEcho(spec.operator, tuple(spec.shape), spec.dtype)


class CrashingInputsEcho(InputsEcho):
    """:class:`InputsEcho` whose child dies (``os._exit``) on a config with ``tile_size_x`` 1:
    the next config is measured by a replacement child."""

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        if config.get("tile_size_x") == 1:
            os._exit(3)
        return super().evaluate(config)


def make_crashing_inputs_echo(spec: Any) -> Backend:
    return CrashingInputsEcho(spec.operator, tuple(spec.shape), spec.dtype)


class RenderEcho(RegistryEcho):
    """Answers with the sha256 of the source the child's operator renders for the config (and
    the child's pid as the time), so a test can compare it with the parent's rendering."""

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        source = self.op.render(config, self.shape, self.dtype)
        return TrialResult(
            config=dict(config), status=TrialStatus.OK, times_ms=[float(os.getpid())],
            error=hashlib.sha256(source.encode()).hexdigest(),
        )  # fmt: skip


def make_render_echo(spec: Any) -> Backend:
    return RenderEcho(spec.operator, tuple(spec.shape), spec.dtype)
