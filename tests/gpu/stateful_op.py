"""A copy operator whose faulty modes hinge on buffer state, for the backend's verification
tests (importable as ``stateful_op``: pytest puts tests/gpu on sys.path). Not registered: the
tests hand it to the backend. See ``stateful_copy.cu`` for the modes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels.spec import Config, Launch, OperatorSpec, Problem


class StatefulCopySpec(OperatorSpec):
    name = "stateful_copy"
    description = "test only: a float32 copy with modes that depend on buffer state"
    dtypes = ("float32",)
    rank = 1
    shape_names = ("n",)
    params = {"MODE": (0, 1, 2)}
    template = Path(__file__).with_name("stateful_copy.cu")
    kernel_name = "stateful_copy"

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        return self.check_params(config)

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        return {"MODE": 0}

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        return Launch(grid=(1, 1, 1), block=(256, 1, 1))

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        (n,) = shape
        x = rng.standard_normal(n, dtype=np.float32) + 2.0
        return Problem(
            args=[
                x,
                np.full(n, np.nan, dtype=np.float32),  # y
                np.full(n, np.nan, dtype=np.float32),  # scratch
                np.zeros(1, dtype=np.uint32),  # counter
                np.int32(n),
            ],
            outputs=[1],
            references=[x.astype(np.float64)],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        return 12 * shape[0]
