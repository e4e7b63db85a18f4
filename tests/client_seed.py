"""Best configs the client tests seed (importable as ``client_seed``: a conftest import is
ambiguous under xdist)."""

from __future__ import annotations

#: (shape, dtype, config, time_ms) seeded for softmax on the H200.
SEEDED = [
    ((4096, 4096), "float16", {"BLOCK_SIZE": 128, "VEC": 8, "STRATEGY": 1, "CACHE": 2,
                               "MIN_BLOCKS": 4, "LANES": 32}, 0.020),
    ((65536, 1024), "float16", {"BLOCK_SIZE": 32, "VEC": 8, "STRATEGY": 0, "CACHE": 2,
                                "MIN_BLOCKS": 0, "LANES": 32}, 0.070),
    ((1024, 1024), "float32", {"BLOCK_SIZE": 256, "VEC": 4, "STRATEGY": 0, "CACHE": 0,
                               "MIN_BLOCKS": 0, "LANES": 32}, 0.010),
]  # fmt: skip
