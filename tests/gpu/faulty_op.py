"""A planted-faults operator for the GPU fault-isolation test (importable as ``faulty_op``:
pytest puts tests/gpu on sys.path, and the measuring child inherits it). Importing registers
``faulty_copy``; the service never imports it.

Space: ``MODE`` (0 correct copy; 1 out-of-bounds write; 2 infinite loop; 3 ``__trap()``;
4 misaligned address) x ``BLOCK_SIZE``. Faulty modes are valid only with BLOCK_SIZE 256, so the
space holds 3 correct configs and 4 faulty ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels.registry import register
from kato.kernels.spec import Config, Launch, OperatorSpec, Problem

FAULTS = {1: "out-of-bounds write", 2: "infinite loop", 3: "__trap()", 4: "misaligned address"}


class FaultyCopySpec(OperatorSpec):
    name = "faulty_copy"
    description = "test only: a float32 copy with planted faults"
    dtypes = ("float32",)
    rank = 1
    shape_names = ("n",)
    params = {"MODE": (0, 1, 2, 3, 4), "BLOCK_SIZE": (128, 256, 512)}
    template = Path(__file__).with_name("faulty_copy.cu")
    kernel_name = "faulty_copy"

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        if config["MODE"] != 0 and config["BLOCK_SIZE"] != 256:
            return "faults are planted with BLOCK_SIZE 256 only"
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        return {"MODE": 0, "BLOCK_SIZE": 256}

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        block = config["BLOCK_SIZE"]
        return Launch(grid=(math.ceil(shape[0] / block), 1, 1), block=(block, 1, 1))

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        x = rng.standard_normal(shape[0], dtype=np.float32) + 2.0
        y = np.full(shape[0], np.nan, dtype=np.float32)
        return Problem(
            args=[x, y, np.int32(shape[0])], outputs=[1], references=[x.astype(np.float64)]
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        return 8 * shape[0]


FAULTY_COPY = register(FaultyCopySpec())
