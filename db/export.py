"""Export measurements in Kernel Tuner's cache format, so they replay anywhere.

A job's trials become one cache file: the operator's parameter space as ``tune_params``, one
entry per measured config with ``time`` (the median, in ms), ``times`` (every timed batch),
``compile_time`` (ms) and Kato's resource fields; a failed config's ``time`` is Kernel Tuner's
failure marker. Configs the job did not measure are absent, which a replay reads as invalid.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from db import queries
from kernels import get_operator
from tuner.gpus import find_gpu
from tuner.kt_cache import KernelTunerCache

_MARKERS = {"compile_error": "CompilationFailedConfig", "invalid": "InvalidConfig"}
_RESOURCES = (
    "registers",
    "shared_static_bytes",
    "shared_dynamic_bytes",
    "local_bytes",
    "blocks_per_sm",
    "occupancy",
)


def job_to_cache(session: Session, job_id: str) -> KernelTunerCache:
    """The trials of job ``job_id`` as a Kernel Tuner cache.

    Raises:
        KeyError: if there is no such job.
    """
    job = queries.get_job(session, job_id)
    if job is None:
        raise KeyError(f"no job {job_id}")
    spec = get_operator(job.operator)
    gpu = find_gpu(job.gpu_model)
    best = queries.lookup_best_config(
        session,
        operator=job.operator,
        operator_version=job.operator_version,
        shape=job.shape,
        dtype=job.dtype,
        gpu_model=job.gpu_model,
    )[0]
    cache = KernelTunerCache(
        device_name=gpu.full_name if gpu else job.gpu_model,
        kernel_name=spec.kernel_name,
        problem_size=list(job.shape),
        tune_params={k: list(v) for k, v in spec.params.items()},
        extra={
            "kato_operator": job.operator,
            "kato_operator_version": job.operator_version,
            "dtype": job.dtype,
            "compute_capability": best.compute_capability if best else None,
            "cuda_version": best.cuda_version if best else None,
        },
    )
    for trial in queries.job_trials(session, job_id):
        entry: dict[str, Any] = dict(trial.config)
        if trial.status == "ok":
            entry["time"] = trial.time_ms
            entry["times"] = list(trial.times_ms or [])
        else:
            entry["time"] = _MARKERS.get(trial.status, "RuntimeFailedConfig")
            entry["error"] = trial.error
        if trial.compile_time_s is not None:
            entry["compile_time"] = trial.compile_time_s * 1000.0
        for field in _RESOURCES:
            entry[field] = getattr(trial, field)
        cache.entries[cache.key(trial.config)] = entry
    return cache
