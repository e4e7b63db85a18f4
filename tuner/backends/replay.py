"""The replay backend: answers evaluations from a recorded Kernel Tuner cache file.

It makes the whole tuning path run without a GPU (CI, search-quality benchmarks): the search
space is the file's ``tune_params``; a combination absent from the file violated the kernel's
restrictions and is invalid; an entry whose time is a failure marker is a failed trial.
:func:`recorded_problem` says which problem a recording was measured for: the only jobs it may
answer (``tuner.factories.ReplayBackends``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kato.tuner.backends.base import Backend, DeviceInfo, TrialResult, TrialStatus
from kato.tuner.space import SearchSpace

from kato.shared.gpus import find_gpu, normalize_gpu_name
from kato.shared.kt_cache import KernelTunerCache, load_cache

#: ``<operator>_<gpu>_<shape>_<dtype>[_<version>].json[.gz]`` (``tests/data/recorded``, and
#: ``kato export``'s names with a ``.t4``/``.kt`` tag): what a file without Kato's metadata is for.
_RECORDING_NAME = re.compile(
    r"^(?P<operator>[a-z0-9_]+?)_(?P<gpu>[^_]+)_(?P<shape>[0-9]+(?:x[0-9]+)*)_(?P<dtype>[a-z0-9]+)"
    r"(?:_(?P<version>[0-9a-f]{12}))?(?:\.(?:t4|kt))?\.json(?:\.gz)?$"
)


@dataclass(frozen=True)
class RecordedProblem:
    """The tuning problem a recording was measured for: it answers a job of this operator,
    shape, dtype and GPU model only, and of this operator version where it names one
    (``None``: a file that does not say)."""

    operator: str
    shape: tuple[int, ...]
    dtype: str
    gpu_model: str
    operator_version: str | None = None

    @property
    def shape_key(self) -> str:
        return "x".join(str(d) for d in self.shape)

    def __str__(self) -> str:
        version = f" version {self.operator_version}" if self.operator_version else ""
        return f"{self.operator}{version} {self.shape_key} {self.dtype} on {self.gpu_model}"


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _dims(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value):
        return None
    return tuple(value)


def recorded_problem(cache: KernelTunerCache, path: str | Path | None = None) -> RecordedProblem:
    """What ``cache`` (read from ``path``) was measured for.

    From Kato's metadata where the file carries it (the ``kato`` object of an export, else the
    top-level ``kato_operator``, ``kato_operator_version``, ``dtype``, ``problem_size``; the GPU
    from ``kato.gpu_model`` or ``device_name``); a file without Kato's metadata (a Kernel Tuner
    cache) is for what its name says, ``<operator>_<gpu>_<shape>_<dtype>[_<version>].json[.gz]``.

    The recording is checked against the operator it names (:func:`check_recording`).

    Raises:
        ValueError: the file says neither, naming what is missing; or it is not a recording of
            a registered operator's space.
    """
    extra = cache.extra
    kato = extra.get("kato") if isinstance(extra.get("kato"), dict) else {}
    operator = _text(kato.get("operator")) or _text(extra.get("kato_operator"))
    version = _text(kato.get("operator_version")) or _text(extra.get("kato_operator_version"))
    dtype = _text(kato.get("dtype")) or _text(extra.get("dtype"))
    shape = _dims(kato.get("shape"))
    if shape is None and operator is not None:  # Kato writes problem_size as the shape
        shape = _dims(cache.problem_size)
    gpu = _text(kato.get("gpu_model"))
    if gpu is None and _text(cache.device_name) not in (None, "unknown"):
        gpu = normalize_gpu_name(cache.device_name)
    named = _RECORDING_NAME.match(Path(path).name) if path is not None else None
    if operator is None and named is not None:  # a file without Kato's metadata: its name
        operator, version = named["operator"], named["version"]
        shape = shape or tuple(int(d) for d in named["shape"].split("x"))
        dtype = dtype or named["dtype"]
        gpu = gpu or normalize_gpu_name(named["gpu"].replace("-", " "))  # as export names it
    found = {"operator": operator, "shape": shape, "dtype": dtype, "GPU": gpu}
    missing = [name for name, value in found.items() if value is None]
    if missing:
        raise ValueError(
            f"{path or cache.kernel_name}: the recording does not say which problem it is for "
            f"(no {', '.join(missing)} in its metadata, and its name is not "
            "<operator>_<gpu>_<shape>_<dtype>[_<version>].json[.gz]); give a file written by "
            "`kato export`, or name it so"
        )
    problem = RecordedProblem(operator, shape, dtype, gpu, version)  # type: ignore[arg-type]
    check_recording(cache, problem, path)
    return problem


def check_recording(
    cache: KernelTunerCache, problem: RecordedProblem, path: str | Path | None = None
) -> None:
    """Whether ``cache`` can answer jobs of ``problem``: the operator is registered here, the
    shape and dtype are its (``spec.validate``), and the recording's parameters are the
    operator's, each value one of its values with its type (a recording of the current
    version, or of no stated one; another version is checked for the names only), by the
    importer's rules (:func:`db.importer.space_outside`). A Kernel Tuner cache renamed to
    another operator's name is refused here.

    Raises:
        ValueError: it cannot, saying why.
    """
    from kato.db.importer import space_outside
    from kato.kernels import get_operator
    from kato.kernels.spec import InvalidInput

    where = path or cache.kernel_name
    try:
        spec = get_operator(problem.operator)
        spec.validate(list(problem.shape), problem.dtype)
    except InvalidInput as exc:
        raise ValueError(f"{where}: a recording for {problem}: {exc}") from None
    current = problem.operator_version in (None, spec.version)
    why = space_outside(spec, cache.tune_params, values=current)
    if why is not None:
        raise ValueError(f"{where}: a recording for {problem}, but {why}")


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
        compute_capability: tuple[int, int] | None = None,
        delay_s: float = 0.0,
        gpu_model: str | None = None,
    ):
        """``delay_s``: seconds each evaluation sleeps, to stand in for a real measurement's
        duration (crash, cancel and load tests need jobs that take a while). ``gpu_model``: the
        model :meth:`device` reports (default: the file's device name, normalised).
        ``compute_capability``: reported when the file names none (default: the catalog's for
        the model, else ``(0, 0)``): results are stored under it, and an import checks it
        against the catalog."""
        self.delay_s = delay_s
        self._gpu_model = gpu_model
        self.cache = cache if isinstance(cache, KernelTunerCache) else load_cache(cache)
        self._space = SearchSpace(
            params={k: tuple(v) for k, v in self.cache.tune_params.items()},
            check=self._check,
            enumerate_valid=self._recorded_configs,
        )
        self._time_field = self.cache.time_field  # raises early for a file it cannot replay
        self._compute_capability = compute_capability
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
        model = self._gpu_model or normalize_gpu_name(self.cache.device_name)
        cc = self.cache.extra.get("compute_capability")
        if cc:
            cc_tuple = tuple(int(x) for x in str(cc).split("."))
        elif self._compute_capability is not None:
            cc_tuple = tuple(self._compute_capability)
        else:
            listed = find_gpu(model)
            cc_tuple = tuple(listed.compute_capability) if listed is not None else (0, 0)
        return DeviceInfo(
            name=self.cache.device_name,
            model=model,
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
