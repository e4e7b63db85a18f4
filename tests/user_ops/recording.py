"""A recorded space of a user operator for the replay backend (a stand-in for a GPU): every
valid config of the spec at one shape with a time from a simple roofline-like model (bytes
over a bandwidth that grows with the threads in flight, plus a per-block cost), written in
Kernel Tuner's cache format with Kato's metadata, as ``kato export --format kt`` writes it."""

from __future__ import annotations

import itertools
from pathlib import Path

from kato.kernels.spec import OperatorSpec

from kato.shared.kt_cache import KernelTunerCache, save_cache


def model_time_ms(spec: OperatorSpec, config: dict, shape: tuple[int, ...]) -> float:
    launch = spec.launch(config, shape, "float32")
    threads = launch.threads_per_block * launch.grid[0] * launch.grid[1] * launch.grid[2]
    in_flight = min(threads, 132 * 2048) * config.get("tile_size_x", 1)
    bandwidth = 4.0e9 * min(1.0, in_flight / (132 * 1024))  # bytes per ms
    blocks = launch.grid[0] * launch.grid[1] * launch.grid[2]
    return spec.bytes_moved(shape, "float32") / bandwidth + 2e-6 * blocks


def record(spec: OperatorSpec, shape: tuple[int, ...], path: Path) -> tuple[Path, dict]:
    """Write the recording; return its path and the fastest config."""
    entries = {}
    for values in itertools.product(*spec.params.values()):
        config = dict(zip(spec.params, values, strict=True))
        if spec.check(config, shape, "float32") is None:
            t = model_time_ms(spec, config, shape)
            entries[",".join(map(str, values))] = {**config, "time": t, "times": [t] * 3}
    cache = KernelTunerCache(
        device_name="NVIDIA H200",
        kernel_name=spec.kernel_name,
        problem_size=list(shape),
        tune_params={k: list(v) for k, v in spec.params.items()},
        entries=entries,
        extra={
            "kato": {
                "operator": spec.name,
                "operator_version": spec.version,
                "shape": list(shape),
                "dtype": "float32",
                "gpu_model": "H200",
            }
        },
    )
    save_cache(cache, path)
    best = min(entries.values(), key=lambda e: e["time"])
    return path, {k: best[k] for k in spec.params}
