"""``kato.tune_kernel`` and ``kato.lookup``: Kernel Tuner's front door onto Kato's search,
database and service.

Locally (no ``service``) the operator is registered in this process, a job is queued in Kato's
database (``db``: default the ``KATO_DB_URL`` / SQLite default) and run at once by a
:class:`tuner.job_runner.JobRunner` on this machine's GPU (the PyCUDA backend, measured as a
worker measures, :func:`tuner.backends.isolated.measuring_backend`: in a child process under
the per-trial limit, so a config that hangs or faults is a ``timeout`` or ``crashed`` result
and the search goes on), or on the replay backend with ``simulation_mode`` (the ``cache``
file's recorded times, as Kernel Tuner's simulation mode replays its cache). Every trial is
stored, the winner becomes a lookup, and the job is warm-started from the operator's other
shapes and GPUs as any job is.
With ``service="http://kato:8000"`` the operator is registered through ``POST /v1/operators``
and a job submitted to the service's workers; the arrays never leave this process, so the
service's workers fill the inputs at random and the ``answer`` is not checked there.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kato.kernel_tuner import operator_from_arguments, operator_name, problem_dims, problem_shape
from kato.kernels.spec import InvalidInput
from kato.shared.gpus import normalize_gpu_name
from kato.shared.kt_cache import KernelTunerCache, config_key, save_cache
from kato.tuner.space import ENUMERATE_MAX, SearchSpace

#: Kernel Tuner's markers for a config that did not give a time.
_MARKERS = {
    "compile_error": "CompilationFailedConfig",
    "invalid": "InvalidConfig",
}
#: The operator :func:`tune_kernel` last tuned locally under each name in this process:
#: :func:`lookup` checks a winner of another size against it before serving it.
_TUNED: dict[str, Any] = {}
#: A code generator still running after this many seconds prints how far it is, and again
#: each as many seconds (unless ``quiet``): up to 10,000 calls may take minutes.
PROGRESS_EVERY_S = 5.0
#: Strategies of Kernel Tuner that are an exhaustive search; any other name runs Kato's
#: default search at the budget ``strategy_options["max_fevals"]`` (default 100).
_EXHAUSTIVE = (None, "brute_force")
KATO_STRATEGIES = ("forest", "tpe", "hybrid", "random", "grid")
DEFAULT_BUDGET = 100


def _strategy(
    strategy: str | None, options: Mapping[str, Any] | None, space: int
) -> tuple[str, int, float | None]:
    options = dict(options or {})
    seconds = options.get("time_limit")
    if strategy in _EXHAUSTIVE:
        return "grid", int(options.get("max_fevals", space)), seconds
    budget = int(options.get("max_fevals", DEFAULT_BUDGET))
    return (strategy if strategy in KATO_STRATEGIES else "forest"), budget, seconds


def _marker(name: str) -> Any:
    """Kernel Tuner's failure marker: its own ``ErrorConfig`` object where Kernel Tuner is
    installed (its helpers, ``util.get_best_config``, skip those), else the marker's name
    (what ``str`` of the object is, and what its cache files hold)."""
    try:
        from kernel_tuner import util
    except ImportError:
        return name
    return getattr(util, name)()


def result_row(trial: Any, params: Sequence[str], iterations: int) -> dict[str, Any]:
    """One trial as Kernel Tuner reports it: the tunables, ``time`` (ms; a marker string for a
    failure), ``times``, ``compile_time`` (ms) and Kato's resource figures."""
    row = {name: trial.config[name] for name in params}
    if trial.status == "ok":
        row["time"] = trial.time_ms
        row["times"] = list(trial.times_ms)
    else:
        row["time"] = _marker(_MARKERS.get(trial.status, "RuntimeFailedConfig"))
        row["error"] = trial.error
    row["status"] = trial.status
    # Kernel Tuner's per-config timings (its file_utils read them): what Kato does not time
    # apart (the framework, the strategy, the on-device verification) is None, not a guess.
    row["compile_time"] = trial.compile_time_s * 1e3 if trial.compile_time_s is not None else None
    row["benchmark_time"] = sum(trial.times_ms) if trial.status == "ok" else None
    row["verification_time"] = None
    row["framework_time"] = None
    row["strategy_time"] = None
    created = getattr(trial, "created_at", None)
    row["timestamp"] = created.isoformat() if hasattr(created, "isoformat") else created
    for name in ("registers", "shared_static_bytes", "local_bytes", "occupancy"):
        value = getattr(trial, name)
        if value is not None:
            row[name] = value
    row["iterations"] = iterations
    return row


def tune_kernel(
    kernel_name: str,
    kernel_source: Any,
    problem_size: Any,
    arguments: Sequence[Any],
    tune_params: Mapping[str, Sequence[Any]],
    grid_div_x: Any = None,
    grid_div_y: Any = None,
    grid_div_z: Any = None,
    restrictions: Any = None,
    answer: Sequence[Any] | None = None,
    atol: float = 1e-6,
    verify: Any = None,
    verbose: bool = False,
    lang: str | None = None,
    device: int = 0,
    platform: int = 0,
    smem_args: Mapping[str, Any] | None = None,
    cmem_args: Any = None,
    texmem_args: Any = None,
    compiler: Any = None,
    compiler_options: Any = None,
    defines: Mapping[str, Any] | None = None,
    log: Any = None,
    iterations: int = 7,
    block_size_names: Sequence[str] | None = None,
    quiet: bool = False,
    strategy: str | None = None,
    strategy_options: Mapping[str, Any] | None = None,
    cache: str | Path | None = None,
    metrics: Any = None,
    simulation_mode: bool | None = None,
    observers: Any = None,
    objective: str | None = None,
    objective_higher_is_better: bool | None = None,
    *,
    service: str | None = None,
    token: str | None = None,
    db: str | None = None,
    gpu: str | None = None,
    seed: int = 0,
    name: str | None = None,
    timeout_s: float = 3600.0,
    isolate: bool | None = None,
    trial_timeout_s: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Tune a kernel with Kernel Tuner's arguments; return ``(results, env)`` in its shape.

    Kernel Tuner's arguments mean what they mean there; those Kato cannot honour are refused
    with the reason rather than ignored: other languages than CUDA, ``texmem_args``,
    ``observers``, an objective other than time. ``cmem_args`` (``__constant__`` name ->
    array) are uploaded into every variant's module. ``verify`` (Kernel Tuner's
    ``verify(answer, result_host, atol=None)``) replaces the comparison with the answer in a
    local run (in the measuring child where the function pickles, else in this process);
    through a service it is refused.
    ``kernel_source``: CUDA code, a file name, or (locally only) a code generator, a callable
    of a config's tunables returning its source, such as a Jinja2 template's ``render``: it is
    called here, in this process, once per config that passes the restrictions and limits
    holding at every problem size, so its operator is one version at every size (at most
    :data:`~kernels.user.generated.MAX_GENERATED_CONFIGS`, else ``InvalidInput`` before any
    call), and the operator keeps the sources (:mod:`kato.kernel_tuner`); a call that raises
    or returns no string is an ``InvalidInput`` naming the config. Through a service it is
    refused. ``restrictions``: expression strings, and locally also Kernel Tuner's restriction
    functions (:func:`kato.kernel_tuner.split_restrictions`), called here with the generator
    (a string source is then a generator of itself); the operator they shape serves exact
    sizes only (:func:`lookup`).
    ``strategy``: None or ``brute_force`` measures every valid config (Kato's ``grid``);
    Kato's own names (``forest``, ``tpe``, ...) select that search; any other Kernel Tuner
    name runs Kato's default search; ``strategy_options["max_fevals"]`` is the budget and
    ``["time_limit"]`` the seconds. ``cache``: with ``simulation_mode``, the Kernel Tuner cache
    file replayed; else where the results are written, in Kernel Tuner's cache format.

    Kato's own arguments: ``service`` (a Kato URL: register and submit there, ``token`` its API
    token), ``db`` (the database of a local run), ``gpu`` (the GPU model of a service job;
    locally the device's), ``seed``, ``name`` (the operator's name, default from
    ``kernel_name``), ``timeout_s`` (how long to wait for a service job); locally,
    ``isolate`` (measure in a child process, as ``kato worker`` does; False measures in this
    process, for debugging) and ``trial_timeout_s`` (the per-trial limit, scaled up for a
    problem whose one launch is predicted to take long: :mod:`tuner.trial_cost`), by default
    ``KATO_ISOLATE`` (on) and ``KATO_TRIAL_TIMEOUT_SECONDS`` (60).

    Returns:
        ``results``: one dict per measured config in measuring order (the tunables, ``time``
        in ms or Kernel Tuner's failure marker, ``times``, ``compile_time``, ...); ``env``: the
        device, the problem, the strategy, the budget, the operator and version, the job id,
        the best config and time, and configs measured per minute.
    """
    refused = {"texmem_args": texmem_args, "observers": observers, "compiler": compiler}
    for key, value in refused.items():
        if value is not None:
            raise InvalidInput(f"kato.tune_kernel does not support {key} (yet)")
    if lang not in (None, "CUDA", "cuda", "PYCUDA", "pycuda", "cupy", "CuPy", "nvcuda"):
        raise InvalidInput(f"kato.tune_kernel tunes CUDA kernels; lang={lang!r} is not one")
    if objective not in (None, "time") or objective_higher_is_better:
        raise InvalidInput("kato.tune_kernel minimises time; other objectives are not supported")
    if compiler_options:
        raise InvalidInput("compiler_options are not supported: Kato compiles with nvcc -O3")
    if iterations < 1:
        raise InvalidInput("iterations must be at least 1")
    if trial_timeout_s is not None and not trial_timeout_s > 0:
        raise InvalidInput("trial_timeout_s must be more than 0")
    _check_metrics(metrics)
    op, spec_dict = operator_from_arguments(
        kernel_name, kernel_source, problem_size, arguments, tune_params,
        restrictions=restrictions, answer=answer, atol=atol, grid_div_x=grid_div_x,
        grid_div_y=grid_div_y, grid_div_z=grid_div_z, block_size_names=block_size_names,
        smem_args=smem_args, cmem_args=cmem_args, defines=defines, name=name,
        fixed=service is None, verify=_local_verify(verify, service),
        progress=None if quiet else _GeneratorProgress(kernel_name),
    )  # fmt: skip
    shape, _ = problem_shape(problem_size, arguments)
    dtype = op.dtypes[0]
    kt_strategy, budget, seconds = _strategy(strategy, strategy_options, op.space_size())

    def instead_of_walking() -> tuple[str, int]:
        """Kernel Tuner would measure every one of millions of configs (days on a GPU); Kato
        searches them at a budget instead, and says so."""
        budget = int(dict(strategy_options or {}).get("max_fevals", DEFAULT_BUDGET))
        warnings.warn(
            f"{kernel_name}: the space has over {ENUMERATE_MAX} valid configs, too many to "
            f"measure every one (brute_force): Kato's default search ('forest') measures "
            f"{budget} of them (strategy_options={{'max_fevals': N}} sets how many)",
            stacklevel=4 if service is None else 3,  # the caller of tune_kernel
        )
        return "forest", budget

    if service is not None:
        from kato.remote import tune_on_service

        # Filtered here (seconds for millions of combinations) to choose the strategy before
        # the job is submitted; the service's worker filters again, under its GPU's limits,
        # in its own process: nothing here could be handed to it.
        if kt_strategy == "grid" and _too_large_to_walk(op, shape, dtype):
            kt_strategy, budget = instead_of_walking()
        results, env = tune_on_service(
            service, token, op, spec_dict, shape, dtype, gpu or "H200", kt_strategy, budget,
            seconds, seed, timeout_s,
        )  # fmt: skip
    else:
        results, env = _tune_locally(
            op, shape, dtype, kt_strategy, budget, seconds, seed, iterations, device, db,
            cache, bool(simulation_mode), quiet,
            _measuring(_isolate_with(op, isolate, quiet), trial_timeout_s), instead_of_walking,
        )  # fmt: skip
    _add_metrics(results, metrics)
    return results, env


class _GeneratorProgress:
    """Prints how far a slow code generator is, as tune_kernel prints its other news (``kato:``
    lines, none when ``quiet``): every :data:`PROGRESS_EVERY_S` seconds, and once when done
    where it took that long, so a fast generator prints nothing."""

    def __init__(self, kernel_name: str):
        self.kernel_name = kernel_name
        self.start = self.last = time.monotonic()
        self.printed = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total:
            if self.printed or now - self.start >= PROGRESS_EVERY_S:
                print(f"kato: {self.kernel_name}: generated {total} sources in "
                      f"{now - self.start:.0f} s", flush=True)  # fmt: skip
        elif now - self.last >= PROGRESS_EVERY_S:
            self.last, self.printed = now, True
            print(f"kato: {self.kernel_name}: generated {done} of {total} sources "
                  f"({now - self.start:.0f} s)", flush=True)  # fmt: skip


def _too_large_to_walk(op: Any, shape: Sequence[int], dtype: str) -> bool:
    """Whether the operator's valid configs are too many to enumerate (a sampled space,
    :mod:`tuner.space`): filtered here, in seconds, to decide."""
    if op.space_size() <= ENUMERATE_MAX:
        return False
    screen = op.screen(shape, dtype)
    if screen is None:
        return False
    check = lambda config: op.check(config, shape, dtype)  # noqa: E731
    return SearchSpace(op.params, check=check, screen=screen).sampled


def _local_verify(verify: Any, service: str | None) -> Any:
    """Kernel Tuner's ``verify`` function, for a local run only: a service's workers run no
    Python of their callers (they check outputs against the answer's references or the
    operator's own reference)."""
    if verify is None:
        return None
    if service is not None:
        raise InvalidInput(
            "verify functions run only in a local kato.tune_kernel (they are Python of this "
            "process); through a service, drop verify= (the service's workers verify the "
            "outputs against the answer where there is one) or tune locally"
        )
    if not callable(verify):
        raise InvalidInput("verify must be a function verify(answer, result_host, atol=None)")
    return verify


def _isolate_with(op: Any, isolate: bool | None, quiet: bool) -> bool | None:
    """Whether to measure in a child process: the caller's choice; unset, in process where
    the operator's verify function cannot be sent to a child (a lambda or a closure does not
    pickle), else the default."""
    if op.verify_function is None:
        return isolate
    import pickle

    try:
        pickle.dumps(op.verify_function)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        if isolate:
            raise InvalidInput(
                f"the verify function cannot be sent to the measuring process ({exc}); define "
                "it at a module's top level, or pass isolate=False"
            ) from None
        if isolate is None and not quiet:
            print("kato: the verify function does not pickle; measuring in this process")
        return False
    return isolate


def _check_metrics(metrics: Any) -> None:
    if metrics is None:
        return
    if not isinstance(metrics, Mapping) or not all(callable(f) for f in metrics.values()):
        raise InvalidInput(
            "metrics must map names to functions of a result (p['time'] in ms, the tunables), "
            "as Kernel Tuner's; they run here, after tuning"
        )


def _add_metrics(results: list[dict[str, Any]], metrics: Mapping[str, Any] | None) -> None:
    """Kernel Tuner's user metrics, in order, on every result with a time (a metric may read
    the ones before it). They are this caller's own functions, run in this process only."""
    if not metrics:
        return
    for row in results:
        if isinstance(row.get("time"), float):
            for name, fn in metrics.items():
                row[name] = fn(row)


def _measuring(isolate: bool | None, trial_timeout_s: float | None) -> tuple[bool, float]:
    """Whether a local run measures in a child process, and its per-trial limit: the
    arguments where given, else the workers' settings (``KATO_ISOLATE``,
    ``KATO_TRIAL_TIMEOUT_SECONDS``; :func:`service.workers.measuring`)."""
    if isolate is not None and trial_timeout_s is not None:
        return isolate, trial_timeout_s
    from kato.service.settings import Settings
    from kato.service.workers import measuring

    return measuring(Settings(), isolate, trial_timeout_s)


def _tune_locally(
    op, shape, dtype, strategy, budget, seconds, seed, iterations, device, db, cache,
    simulation, quiet, measuring, instead_of_walking,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    from kato.db import queries
    from kato.db.session import default_db_url, init_db, session_factory
    from kato.kernels.registry import register
    from kato.service.settings import Settings
    from kato.service.workers import build_runner, queue_and_claim
    from kato.tuner.job_runner import default_worker_id

    register(op)  # before a measuring child starts: it is sent this process's operator
    _TUNED[op.name] = op
    if simulation:
        if cache is None or not Path(cache).is_file():
            raise InvalidInput("simulation_mode replays a cache file: give cache=PATH of one")
        from kato.tuner.backends.replay import ReplayBackend

        backend = ReplayBackend(cache)
        recorded = set(backend.cache.tune_params)
        if recorded != set(op.params):
            raise InvalidInput(
                f"the cache file's tune_params {sorted(recorded)} are not these {sorted(op.params)}"
            )
    else:
        from kato.tuner.backends.isolated import BackendSpec, measuring_backend

        isolate, trial_timeout_s = measuring
        spec = BackendSpec(
            kind="pycuda", operator=op.name, shape=tuple(shape), dtype=dtype,
            device_index=device, options=(("repeats", iterations), ("seed", seed)),
        )  # fmt: skip
        backend = measuring_backend(spec, isolate=isolate, trial_timeout_s=trial_timeout_s)
    db_url = db or default_db_url()
    engine = init_db(db_url)
    sessions = session_factory(engine)
    info = backend.device()
    worker_id = default_worker_id()
    if strategy == "grid":
        # The backend's space is the job's (the runner searches this object): filtered once,
        # here, under the device's limits, and not again by the job.
        walked = backend.space()
        if walked.sampled:
            strategy, budget = instead_of_walking()
        else:
            budget = min(budget, len(walked.valid_configs()) or budget)
    settings = Settings(db_url=db_url)
    fields = dict(
        operator=op.name, operator_version=op.version, shape=list(shape), dtype=dtype,
        gpu_model=info.model, budget_configs=max(1, budget), budget_seconds=seconds,
        strategy=strategy, seed=seed,
    )  # fmt: skip
    job_id = queue_and_claim(sessions, fields, worker_id, settings.lease_seconds)
    if job_id is None:
        raise RuntimeError("could not claim the tuning job (another worker took it)")
    t0 = time.perf_counter()
    runner = build_runner(settings, sessions, lambda _job: backend, worker_id=worker_id)
    outcome = runner.run(job_id)
    elapsed = time.perf_counter() - t0
    with sessions() as session:
        trials = queries.job_trials(session, job_id)
        results = [result_row(t, list(op.params), iterations) for t in trials]
        job = queries.get_job(session, job_id)
        best_config = job.best_config
    engine.dispose()
    env = tuning_env(op, shape, dtype, info, strategy, budget, seconds, job_id, outcome.status,
               best_config, results, elapsed, iterations)  # fmt: skip
    env["error"] = outcome.error
    if outcome.status != "done" and not quiet:
        print(f"kato: job {job_id} ended {outcome.status}: {outcome.error}")
    if cache is not None and not simulation:
        _write_cache(cache, op, shape, dtype, info, results)
    return results, env


def tuning_env(op, shape, dtype, info, strategy, budget, seconds, job_id, status, best_config,
         results, elapsed, iterations) -> dict[str, Any]:  # fmt: skip
    ok = [r for r in results if isinstance(r["time"], float)]
    best = min(ok, key=lambda r: r["time"]) if ok else None
    return {
        "device_name": info.name,
        "gpu_model": info.model,
        "compute_capability": ".".join(map(str, info.compute_capability)),
        "cuda_version": info.cuda_version,
        "kernel_name": op.kernel_name,
        "problem_size": list(shape),
        "dtype": dtype,
        "iterations": iterations,
        "tune_params": {k: list(v) for k, v in op.params.items()},
        "strategy": strategy,
        "budget": budget,
        "budget_seconds": seconds,
        "kato_operator": op.name,
        "kato_operator_version": op.version,
        "job_id": job_id,
        "status": status,
        "best_config": best_config,
        "best_time": best["time"] if best else None,
        "configs_measured": len(results),
        "elapsed_s": elapsed,
        "configs_per_minute": 60.0 * len(results) / elapsed if elapsed > 0 else None,
    }


def _write_cache(path, op, shape, dtype, info, results) -> None:
    entries = {}
    for row in results:
        key = config_key(list(op.params), row)
        entries[key] = {
            k: v if k != "time" or isinstance(v, float) else str(v)
            for k, v in row.items()
            if k not in ("status", "iterations")
        }
    cache = KernelTunerCache(
        device_name=info.name,
        kernel_name=op.kernel_name,
        problem_size=list(shape),
        tune_params={k: list(v) for k, v in op.params.items()},
        entries=entries,
        extra={
            "kato": {
                "operator": op.name,
                "operator_version": op.version,
                "shape": list(shape),
                "dtype": dtype,
                "gpu_model": info.model,
            }
        },
    )
    save_cache(cache, path)


def lookup(
    kernel_name: str,
    problem_size: Any,
    gpu: str,
    *,
    dtype: str = "float32",
    service: str | None = None,
    db: str | None = None,
    name: str | None = None,
) -> dict[str, Any] | None:
    """The tuned config of a kernel tuned through :func:`tune_kernel` for this problem size and
    GPU model: ``{"config", "time_ms", "source", "version"}``, or None where nothing is served.

    ``source`` ``exact``: the winner tuned at this size; ``nearest``: the winner of the
    nearest tuned size of the same version that is valid at this size (checked against the
    operator: a restriction naming ``x`` or a grid limit may refuse it here) and beat the
    default config on its own size. From the service's ``GET /v1/configs`` with ``service``
    (its registered operator checks), else from the local database, newest tuned version
    first: there only the operator :func:`tune_kernel` tuned in this process can check a
    nearest size's winner, so another process is served exact sizes only, and so is an
    operator shaped by restriction functions (called at its tuned sizes only)."""
    op_name = name or operator_name(kernel_name)
    shape = problem_dims(problem_size)
    if service is not None:
        import httpx

        r = httpx.get(
            f"{service.rstrip('/')}/v1/configs/{op_name}",
            params={"shape": "x".join(map(str, shape)), "dtype": dtype, "gpu": gpu},
            timeout=30,
        )
        if r.status_code == 404:
            return None
        r.raise_for_status()
        data = r.json()
        if data.get("source") == "default":
            return None
        return {"config": data["config"], "time_ms": data.get("time_ms"),
                "source": data["source"], "version": data.get("operator_version")}  # fmt: skip
    from kato.db import queries
    from kato.db.session import default_db_url, init_db, session_factory
    from kato.service.lookup import applies, lookup_best_config

    engine = init_db(db or default_db_url())
    try:
        with session_factory(engine)() as session:
            model = normalize_gpu_name(gpu)
            # The newest version tuned for this GPU: tune_kernel's operator lives in no
            # registry of this process, so its version is the one the database holds.
            version = queries.newest_tuned_version(
                session, operator=op_name, dtype=dtype, gpu_model=model
            )
            if version is None:
                return None
            op = _TUNED.get(op_name)
            if op is None or op.version != version or not op.checks_every_size:
                # Nothing here knows which configs are valid at this size: exact sizes only.
                accept, max_distance = None, 0.0
            else:
                accept, max_distance = (lambda c: applies(op, c, shape, dtype)), None
            found, source = lookup_best_config(
                session, operator=op_name, operator_version=version, shape=shape,
                dtype=dtype, gpu_model=model, accept=accept, max_distance=max_distance,
            )  # fmt: skip
            if found is None:
                return None
            return {"config": dict(found.config), "time_ms": found.time_ms, "source": source,
                    "version": found.operator_version}  # fmt: skip
    finally:
        engine.dispose()
