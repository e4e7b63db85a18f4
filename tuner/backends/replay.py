"""The replay backend: answers evaluations from a recorded Kernel Tuner cache file.

It makes the whole tuning path run without a GPU (CI, search-quality benchmarks): the search
space is the file's ``tune_params``; a combination absent from the file violated the kernel's
restrictions and is invalid; an entry whose time is a failure marker is a failed trial.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus
from tuner.kt_cache import KernelTunerCache, load_cache
from tuner.space import SearchSpace

_FAILURES = {
    "CompilationFailedConfig": TrialStatus.COMPILE_ERROR,
    "RuntimeFailedConfig": TrialStatus.LAUNCH_ERROR,
    "InvalidConfig": TrialStatus.INVALID,
}

#: Optional per-entry fields this backend copies into a TrialResult (Kato writes them).
_RESOURCE_FIELDS = (
    "registers",
    "shared_static_bytes",
    "shared_dynamic_bytes",
    "local_bytes",
    "blocks_per_sm",
    "occupancy",
)


class ReplayBackend(Backend):
    """Replays ``cache`` (a :class:`KernelTunerCache` or a path to one).

    ``time_ms`` of a replayed trial is the file's objective value (Kernel Tuner stores the mean of
    its repeats as ``time``), so that "best found / best in file" compares like with like; for a
    file tuned for a rate to maximise (``"objective": "GFLOP/s"``) it is the entry's ``time``
    (:attr:`KernelTunerCache.time_field`), so the search still minimises a time.

    Raises:
        ValueError: the file's objective is a rate and its entries have no ``time``.
    """

    name = "replay"
    measures_out_of_process = True  # nothing is timed

    def __init__(
        self,
        cache: KernelTunerCache | str | Path,
        *,
        compute_capability=(0, 0),
        delay_s: float = 0.0,
    ):
        """``delay_s``: seconds each evaluation sleeps, to stand in for a real measurement's
        duration (crash, cancel and load tests need jobs that take a while)."""
        self.delay_s = delay_s
        self.cache = cache if isinstance(cache, KernelTunerCache) else load_cache(cache)
        self._space = SearchSpace(
            params={k: tuple(v) for k, v in self.cache.tune_params.items()},
            check=self._check,
            enumerate_valid=self._recorded_configs,
        )
        self._time_field = self.cache.time_field  # raises early for a file it cannot replay
        self._compute_capability = tuple(compute_capability)
        self.evaluations = 0  # how many times evaluate() was called (tests use it)

    def _check(self, config: dict[str, Any]) -> str | None:
        if self.cache.key(config) in self.cache.entries:
            return None
        return "combination absent from the recorded space (violates the kernel's restrictions)"

    def _recorded_configs(self) -> list[dict[str, Any]]:
        """The file's configs (its valid space), in the product order of ``tune_params``.

        Read from the entries rather than by checking every combination of ``tune_params``: a
        recorded space is often a small part of a large product. An entry whose key names a
        value outside ``tune_params`` is not part of the space (as ``check`` sees it too).
        """
        params = self.cache.tune_params
        lookup = [{str(v): (i, v) for i, v in enumerate(values)} for values in params.values()]
        found = []
        for key in self.cache.entries:
            parts = key.split(",")
            if len(parts) != len(lookup):
                continue
            picked = [table.get(part) for table, part in zip(lookup, parts, strict=True)]
            if all(p is not None for p in picked):
                found.append(picked)
        found.sort(key=lambda picked: [i for i, _ in picked])
        names = list(params)
        return [dict(zip(names, [v for _, v in picked], strict=True)) for picked in found]

    def device(self) -> DeviceInfo:
        from tuner.gpus import normalize_gpu_name

        cc = self.cache.extra.get("compute_capability")
        cc_tuple = tuple(int(x) for x in str(cc).split(".")) if cc else self._compute_capability
        return DeviceInfo(
            name=self.cache.device_name,
            model=normalize_gpu_name(self.cache.device_name),
            compute_capability=cc_tuple,  # type: ignore[arg-type]
            cuda_version=str(self.cache.extra.get("cuda_version", "replay")),
        )

    def space(self) -> SearchSpace:
        return self._space

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        self.evaluations += 1
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        entry = self.cache.entries.get(self.cache.key(config))
        if entry is None:
            return TrialResult(
                config=dict(config),
                status=TrialStatus.INVALID,
                error="combination absent from the recorded space",
            )
        value = entry.get(self._time_field)
        compile_ms = entry.get("compile_time")
        compile_s = compile_ms / 1000.0 if isinstance(compile_ms, int | float) else None
        resources = {f: entry[f] for f in _RESOURCE_FIELDS if f in entry}
        if isinstance(value, str) or value is None:
            status = _FAILURES.get(str(value), TrialStatus.LAUNCH_ERROR)
            return TrialResult(
                config=dict(config),
                status=status,
                compile_time_s=compile_s,
                error=entry.get("error", str(value)),
                **resources,
            )
        return TrialResult(
            config=dict(config),
            status=TrialStatus.OK,
            times_ms=[float(value)],
            compile_time_s=compile_s,
            **resources,
        )

    def best_time_ms(self) -> float:
        """The lowest time in the file (the optimum of the space; see
        :attr:`KernelTunerCache.time_field`)."""
        return float(self.cache.best()[1][self._time_field])
