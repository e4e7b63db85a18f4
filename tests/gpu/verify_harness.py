"""Verify many variants of an operator on the GPU through the pycuda backend (gpu tests only).

The backend's own path is used (compile, load, poison outputs, run every step, compare every
output element with the float64 reference on the device), so what these tests accept is exactly
what a tuning job would accept.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from kato.kernels.spec import OperatorSpec


def verify_variants(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    *,
    max_configs: int | None = None,
    seed: int = 0,
    where: Callable[[dict[str, Any]], bool] | None = None,
) -> tuple[int, list[tuple[dict[str, Any], str]]]:
    """Verify the valid configs of ``spec`` at ``shape``/``dtype`` (those ``where`` accepts;
    a seeded sample of ``max_configs`` of them, the default config always included). Returns
    ``(checked, failures)`` with one ``(config, error)`` per failing config."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=seed)
    try:
        valid = [c for c in backend.space().valid_configs() if where is None or where(c)]
        assert valid, f"no valid config for {spec.name} {tuple(shape)} {dtype}"
        if max_configs is not None and len(valid) > max_configs:
            valid = random.Random(seed).sample(valid, max_configs)
        default = spec.default_config(shape, dtype)
        if default not in valid:
            valid = [default, *valid]
        backend.precompile(valid)  # nvcc runs in parallel; verification waits per config
        failures = []
        for config in valid:
            error = _verify(backend, spec, shape, dtype, config)
            if error:
                failures.append((config, error))
        return len(valid), failures
    finally:
        backend.close()


def verify_config(
    spec: OperatorSpec, shape: Sequence[int], dtype: str, config: dict[str, Any], seed: int = 7
) -> str | None:
    """Verify one valid config (asserted valid) on fresh inputs: the error, None if it passes."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    assert spec.check(config, shape, dtype) is None, config
    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=seed)
    try:
        return _verify(backend, spec, shape, dtype, config)
    finally:
        backend.close()


def verify_configs(
    spec: OperatorSpec,
    shape: Sequence[int],
    dtype: str,
    configs: Sequence[dict[str, Any]],
    seed: int = 7,
) -> list[tuple[dict[str, Any], str]]:
    """Verify several valid configs (asserted valid) on one problem: ``(config, error)`` per
    failing one. One backend, so a large problem is made once."""
    from kato.tuner.backends.pycuda import PyCudaBackend

    for config in configs:
        assert spec.check(config, shape, dtype) is None, config
    backend = PyCudaBackend(spec, shape, dtype, repeats=1, warmup=0, seed=seed)
    try:
        backend.precompile(list(configs))
        failures = []
        for config in configs:
            if error := _verify(backend, spec, shape, dtype, config):
                failures.append((dict(config), error))
        return failures
    finally:
        backend.close()


def _verify(backend, spec: OperatorSpec, shape, dtype: str, config: dict[str, Any]) -> str | None:
    calls = backend.load(backend.compile(config), spec.steps(config, shape, dtype))
    return backend.verify(calls)
