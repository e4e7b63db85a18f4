"""ReLU forward + backward as one timed pair: the spec of ``relu.cu``.

One call is two launches (:meth:`ReluSpec.steps`): ``relu_forward`` (y = max(x, 0), and for
MASK=1 one bit per element, x > 0) then ``relu_backward`` (dx = dy * (x > 0), from x for MASK=0
or from the bits for MASK=1).

Parameter space (Kernel Tuner key order):

- ``MASK``: 0 = plain (the backward reads x and dy), 1 = bitmask (the forward also writes
  ``ceil(n/32)`` uint32 words, bit i of word w = element 32w + i; the backward reads them and dy:
  32x fewer bytes than x for float32, 16x for 16-bit types).
- ``BLOCK_SIZE``: threads per block (both kernels).
- ``VEC``: elements per vector load/store (at most 16 bytes); any n (the partial last vector
  is handled element by element).
- ``UNROLL``: vectors per thread per grid-stride step, all loaded before use (bytes in flight).
- ``BLOCKS_PER_SM``: grid = ``min(BLOCKS_PER_SM * 132, blocks needed)``; 0 = blocks needed
  (one step per thread, no grid-stride iterations). Launch geometry only: not in the source.

Values are selected, never computed: y is x or +0, dx is dy or +0, so both outputs are compared
exactly. Problem arguments: ``[x, dy, y, mask (uint32[ceil(n/32)]), dx, n (int64)]``; outputs
are y and dx only (the mask is not written by MASK=0; tests/gpu/test_relu_gpu.py checks its
packing against :func:`pack_mask` separately).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kato.kernels import limits
from kato.kernels.parallel import fill_rows
from kato.kernels.registry import register
from kato.kernels.spec import DTYPES, Config, InvalidInput, Launch, OperatorSpec, Problem, Step

MAX_N = 2**62
#: Registers a thread needs besides the UNROLL vectors it keeps in flight (64-bit slot indices
#: per vector, bits, pointers). Fit to ptxas on sm_80/sm_90: at 1024 threads (cap 64) 128 bytes
#: in flight per thread (32 registers) spill, 64 bytes do not.
REGISTER_OVERHEAD = 33

_CUDA_FLAGS = {"float32": (0, 0), "float16": (1, 0), "bfloat16": (0, 1)}  # IS_HALF, IS_BF16


def mask_words(n: int) -> int:
    return (n + 31) // 32


def pack_mask(positive: np.ndarray) -> np.ndarray:
    """uint32 words with bit i of word w = ``positive[32w + i]`` (bits past the end 0)."""
    n = positive.size
    bits = np.zeros(mask_words(n) * 32, dtype=np.uint64)
    bits[:n] = positive.astype(np.uint64)
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    return (bits.reshape(-1, 32) * weights).sum(axis=1).astype(np.uint32)


class ReluSpec(OperatorSpec):
    """ReLU forward (y, optional bitmask) + backward (dx), timed as one call."""

    name = "relu"
    description = "ReLU forward + backward pair (plain, or a 1-bit-per-element mask between them)"
    dtypes = ("float32", "float16", "bfloat16")
    rank = 1
    shape_names = ("n",)
    params = {
        "MASK": (0, 1),
        "BLOCK_SIZE": (128, 256, 512, 1024),
        "VEC": (1, 2, 4, 8),
        "UNROLL": (1, 2, 4, 8),
        "BLOCKS_PER_SM": (0, 2, 4, 8, 16),
    }
    template = Path(__file__).with_name("relu.cu")
    kernel_name = "relu_forward"
    kernel_names = ("relu_forward", "relu_backward")

    def validate(self, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
        shape = super().validate(shape, dtype)
        if shape[0] > MAX_N:
            raise InvalidInput(f"relu takes up to 2**62 elements, got n={shape[0]}")
        return shape

    def check(self, config: Config, shape: Sequence[int], dtype: str) -> str | None:
        """Rejects: parameters missing, unknown or outside the space; vectors over 16 bytes;
        vectors in flight that need more registers than the launch bounds leave (``UNROLL *
        vector bytes / 4 + REGISTER_OVERHEAD > 65536 / BLOCK_SIZE``: it would spill; only
        1024 threads with 128 bytes in flight). Any n works with any VEC."""
        reason = self.check_params(config)
        if reason:
            return reason
        try:
            self.validate(shape, dtype)
        except InvalidInput as exc:
            return str(exc)
        vector_bytes = config["VEC"] * DTYPES[dtype][2]
        if reason := limits.vector_width_error(config["VEC"], vector_bytes, dtype):
            return reason
        data_registers = config["UNROLL"] * max(vector_bytes // 4, 1)
        cap = limits.launch_bounds_register_cap(config["BLOCK_SIZE"], 0)
        if data_registers + REGISTER_OVERHEAD > cap:
            return (
                f"UNROLL={config['UNROLL']} vectors of {vector_bytes} bytes in flight take "
                f"{data_registers} registers per thread, but {config['BLOCK_SIZE']} threads leave "
                f"{cap}: it would spill"
            )
        return None

    def default_config(self, shape: Sequence[int], dtype: str) -> Config:
        """Bitmask, 16-byte vectors, one vector per thread and a block per 256 threads' worth
        of the array (no grid-stride loop: the recorded spaces' best, docs/defaults.md)."""
        self.validate(shape, dtype)
        vec = 16 // DTYPES[dtype][2]
        return {"MASK": 1, "BLOCK_SIZE": 256, "VEC": vec, "UNROLL": 1, "BLOCKS_PER_SM": 0}

    def defines(self, config: Config, shape: Sequence[int], dtype: str) -> dict[str, object]:
        """The code-shaping tunables (not BLOCKS_PER_SM), DTYPE, IS_HALF, IS_BF16."""
        is_half, is_bf16 = _CUDA_FLAGS[dtype]
        macros: dict[str, object] = {
            name: config[name] for name in self.params if name != "BLOCKS_PER_SM"
        }
        macros["DTYPE"] = DTYPES[dtype][1]
        macros["IS_HALF"] = is_half
        macros["IS_BF16"] = is_bf16
        return macros

    def grid(self, config: Config, shape: Sequence[int]) -> int:
        (n,) = shape
        slots = math.ceil(n / config["VEC"])
        needed = min(
            math.ceil(slots / (config["BLOCK_SIZE"] * config["UNROLL"])), limits.MAX_GRID_X
        )
        if config["BLOCKS_PER_SM"] == 0:
            return max(1, needed)
        return max(1, min(config["BLOCKS_PER_SM"] * limits.NUM_SMS, needed))

    def launch(self, config: Config, shape: Sequence[int], dtype: str) -> Launch:
        return Launch(grid=(self.grid(config, shape), 1, 1), block=(config["BLOCK_SIZE"], 1, 1))

    def steps(self, config: Config, shape: Sequence[int], dtype: str) -> list[Step]:
        """Forward on (x, y, mask, n), then backward on (mask, dy, dx, n) for MASK=1 or on
        (x, dy, dx, n) for MASK=0 (what the forward saved); same geometry."""
        launch = self.launch(config, shape, dtype)
        saved = 3 if config["MASK"] == 1 else 0
        return [
            Step("relu_forward", launch, (0, 2, 3, 5)),
            Step("relu_backward", launch, (saved, 1, 4, 5)),
        ]

    def make_problem(self, shape: Sequence[int], dtype: str, rng: np.random.Generator) -> Problem:
        """x, dy ~ N(0, 1) in ``dtype`` with no exact zeros (a zero would be replaced by 1);
        y and dx pre-filled with NaN, the mask with 0xFFFFFFFF. References: y = max(x, 0) and
        dx = dy * (x > 0) in float64 (exact in every dtype)."""
        (n,) = self.validate(shape, dtype)
        np_dtype = DTYPES[dtype][0]
        x = np.empty(n, dtype=np_dtype)
        dy = np.empty(n, dtype=np_dtype)
        y_ref = np.empty(n, dtype=np.float64)
        dx_ref = np.empty(n, dtype=np.float64)
        y = np.empty(n, dtype=np_dtype)
        dx = np.empty(n, dtype=np_dtype)

        def fill(chunk: slice, gen: np.random.Generator) -> None:
            y[chunk] = np.nan
            dx[chunk] = np.nan
            _nonzero_normal(gen, x[chunk], y_ref[chunk])
            _nonzero_normal(gen, dy[chunk], dx_ref[chunk])
            nonpositive = y_ref[chunk] < 0  # no exact zeros: x > 0 or x < 0
            np.maximum(y_ref[chunk], 0.0, out=y_ref[chunk])
            dx_ref[chunk][nonpositive] = 0.0

        fill_rows(rng, n, 1, fill)
        return Problem(
            args=[
                x,
                dy,
                y,
                np.full(mask_words(n), 0xFFFFFFFF, dtype=np.uint32),
                dx,
                np.int64(n),
            ],
            outputs=[2, 4],
            references=[y_ref, dx_ref],
        )

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """Exact: the kernels select values, they never compute new ones."""
        if dtype not in self.dtypes:
            raise InvalidInput(f"relu does not support dtype {dtype!r}")
        return (0.0, 0.0)

    def bytes_moved(self, shape: Sequence[int], dtype: str) -> int:
        """The bitmask pair's minimum: x read, y written, the mask written and read back, dy
        read, dx written: ``4 * n * itemsize + 2 * 4 * ceil(n / 32)``."""
        (n,) = shape
        return 4 * n * DTYPES[dtype][2] + 8 * mask_words(n)

    def buffer_bytes(self, shape: Sequence[int], dtype: str) -> int:
        """x, dy, y, dx and the mask."""
        (n,) = shape
        return 4 * n * DTYPES[dtype][2] + 4 * mask_words(n)


RELU = register(ReluSpec())

__all__ = ["RELU", "ReluSpec", "mask_words", "pack_mask"]


def _nonzero_normal(rng: np.random.Generator, out: np.ndarray, out64: np.ndarray) -> None:
    """Fill ``out`` with N(0, 1) rounded to its dtype, every exact zero replaced by 1, and
    ``out64`` with the same values in float64 (exact). Zeros are found in float64: float16 and
    bfloat16 comparisons are emulated, several times slower."""
    out[...] = rng.standard_normal(out.shape, dtype=np.float32)
    out64[...] = out
    zero = np.flatnonzero(out64 == 0)
    out[zero] = 1.0
    out64[zero] = 1.0
