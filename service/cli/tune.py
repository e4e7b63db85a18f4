"""``kato tune`` (one job run in this process now) and ``kato replay`` (search a recorded
space)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    check_recording,
    console,
    emit,
    fail,
    gpu_model_of,
    load_settings,
    one_line,
    open_sessions,
    parse_shape,
    progress_bar,
    use_stored_operators,
)
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


def _tune_backends(
    kind: str,
    replay: Path | None,
    operator: str,
    shape: Sequence[int],
    dtype: str,
    device: int,
    *,
    isolate: bool,
    trial_timeout_s: float,
):
    """``(gpu_model, backend_factory)`` of ``kato tune``: every kind measured through
    :func:`tuner.backends.isolated.measuring_backend`, as a worker's; a bad choice ends the
    command with the reason (exit 2)."""
    from kato.kernels import get_operator
    from kato.kernels.spec import InvalidInput
    from kato.tuner.backends.isolated import BackendSpec, build_backend, measuring_backend
    from kato.tuner.factories import pycuda_backend_factory

    if kind == "pycuda":
        model = gpu_model_of(device)
        return model, pycuda_backend_factory(
            device, isolate=isolate, trial_timeout_s=trial_timeout_s
        )
    if kind != "replay" and ":" not in kind:
        raise typer.BadParameter(
            f"--backend must be pycuda, replay or MODULE:FUNCTION, not {kind!r}"
        )
    if kind == "replay" and replay is None:
        raise typer.BadParameter("--backend replay needs --replay FILE")
    spec = BackendSpec(
        kind=kind,
        operator=operator,
        shape=tuple(shape),
        dtype=dtype,
        device_index=device,
        replay_file=str(replay) if replay is not None else None,
    )
    if kind == "replay":
        from kato.tuner.backends.replay import recorded_problem

        try:
            problem = recorded_problem(check_recording(replay, "--replay"), replay)
        except (ValueError, InvalidInput) as exc:
            fail(f"--replay {one_line(exc)}", 2)
        wanted = (operator, tuple(shape), dtype)
        if (problem.operator, tuple(problem.shape), problem.dtype) != wanted:
            fail(f"--replay {replay} is a recording of {problem}, not of this problem", 2)
        version = get_operator(operator).version
        if problem.operator_version not in (None, version):
            fail(
                f"--replay {replay} is a recording of {problem}; {operator} is at version "
                f"{version} now, whose times it does not hold",
                2,
            )
        spec = BackendSpec(
            kind="replay", replay_file=str(replay), options=(("gpu_model", problem.gpu_model),)
        )
        model = problem.gpu_model
    else:
        try:  # the parent's cheap, GPU-free instance (the BackendSpec contract) names the GPU
            shadow = build_backend(spec)
        except Exception as exc:  # a plugin that cannot be imported or built
            fail(f"--backend {kind}: {type(exc).__name__}: {exc}", 2)
        try:
            model = shadow.device().model
        finally:
            shadow.close()

    def factory(job):
        return measuring_backend(spec, isolate=isolate, trial_timeout_s=trial_timeout_s)

    return model, factory


@app.command()
def tune(
    operator: Annotated[str, typer.Argument(help="operator name, e.g. softmax")],
    shape: Annotated[str, typer.Option(help="e.g. 4096x4096")],
    dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16")] = "float32",
    budget: Annotated[int, typer.Option(min=1, help="distinct configs to measure")] = 100,
    budget_seconds: Annotated[float | None, typer.Option(help="wall-clock limit")] = None,
    strategy: Annotated[
        str, typer.Option(help="forest (default), tpe, hybrid, random or grid")
    ] = "forest",
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[int, typer.Option(help="CUDA device index")] = 0,
    backend: Annotated[
        str,
        typer.Option(
            help="pycuda (this machine's GPU), replay (answers from --replay, a recording of "
            "this problem; no GPU) or MODULE:FUNCTION (a plugin building a tuner Backend from "
            "a kato.tuner.backends.isolated.BackendSpec, given --replay as its replay_file)"
        ),
    ] = "pycuda",
    replay: Annotated[
        Path | None,
        typer.Option(
            exists=True, dir_okay=False, help="the recording --backend replay answers from"
        ),
    ] = None,
    isolate: Annotated[
        bool | None,
        typer.Option(
            help="measure in a child process, as a worker does: a hung or faulting config is a "
            "failed trial and the search goes on (default: KATO_ISOLATE, on); --no-isolate "
            "measures in this process, for debugging"
        ),
    ] = None,
    trial_timeout: Annotated[
        float | None,
        typer.Option(
            help="per-trial limit in seconds, scaled up for a problem whose one launch is "
            "predicted to take long (KATO_TRIAL_TIMEOUT_SECONDS)"
        ),
    ] = None,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Tune one operator on this machine's GPU now (a job run in-process, stored in the DB).

    Measured as kato worker measures: in a child process under the per-trial limit, so a
    config that hangs or faults is a timeout or crashed trial and the job goes on.
    """
    from kato.db import queries
    from kato.kernels import get_operator
    from kato.kernels.spec import InvalidInput
    from kato.service.validation import JobRequest, check_budget, check_seed, job_fields
    from kato.service.workers import build_runner, measuring, queue_and_claim
    from kato.tuner.job_runner import default_worker_id
    from kato.tuner.search import STRATEGIES

    settings = load_settings(db)
    if trial_timeout is not None and not trial_timeout > 0:
        raise typer.BadParameter("--trial-timeout must be more than 0")
    isolated, timeout = measuring(settings, isolate, trial_timeout)
    _, sessions = open_sessions(settings.db_url)
    use_stored_operators(sessions)
    try:  # the shape first: the backends are built for it
        dims = get_operator(operator).validate(parse_shape(shape), dtype)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None
    if strategy not in STRATEGIES:
        raise typer.BadParameter(f"strategy must be one of {', '.join(STRATEGIES)}")
    try:  # before the backends are built (a GPU opened): job_fields checks them again
        check_budget(budget, budget_seconds, settings)
        check_seed(seed)
    except InvalidInput as exc:
        fail(str(exc), 2)
    model, factory = _tune_backends(
        backend, replay, operator, dims, dtype, device, isolate=isolated, trial_timeout_s=timeout
    )
    request = JobRequest(operator, dims, dtype, model, budget, budget_seconds, strategy, seed)
    try:  # what POST /v1/jobs checks, with its messages: the GPU's memory, the budgets
        fields = job_fields(request, settings, device_gpu=True)
    except InvalidInput as exc:
        fail(str(exc), 2)
    worker_id = default_worker_id()
    try:  # before the job is queued: a setting it cannot use ends the command first
        runner = build_runner(settings, sessions, factory, worker_id=worker_id)
    except ValueError as exc:
        fail(str(exc), 2)
    job_id = queue_and_claim(sessions, fields, worker_id, settings.lease_seconds)
    if job_id is None:
        fail("could not claim the job (another worker took it)")
    outcome = _run_with_progress(
        runner, job_id, f"{operator} {shape} {dtype}", budget, quiet=as_json
    )
    with sessions() as session:
        job = queries.get_job(session, job_id)
        out = {
            "job": job_id,
            "status": outcome.status,
            "measured": outcome.measured,
            "best_time_ms": outcome.best_time_ms,
            "best_config": job.best_config,
            "error": outcome.error,
        }
    emit(out, as_json)
    if outcome.status != "done":
        raise typer.Exit(1)


def _run_with_progress(runner, job_id: str, label: str, budget: int, *, quiet: bool):
    """``runner.run(job_id)`` under a progress bar on stderr (configs measured, the best time
    so far) where stderr is a terminal and not ``quiet``."""
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("best {task.fields[best]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
    ) as progress:
        task = progress.add_task(label, total=budget, best="-")
        best: list[float] = []

        def on_progress(result, measured, total):
            if result.time_ms is not None:
                best.append(result.time_ms)
            progress.update(task, completed=measured, best=f"{min(best):.4f} ms" if best else "-")

        runner.on_progress = on_progress
        return runner.run(job_id)


@app.command()
def replay(
    cachefile: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="Kernel Tuner cache or T4 results file (.json or .json.gz)",
        ),
    ],
    budget: Annotated[int, typer.Option(min=1, help="distinct configs measured per search")] = 100,
    repeats: Annotated[int, typer.Option(min=1, help="searches, one seed each")] = 10,
    seed: Annotated[int, typer.Option(help="first seed")] = 0,
    strategy: Annotated[
        str | None, typer.Option(help="forest (default), tpe, hybrid, random or grid")
    ] = None,
    warm_start: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="another recorded space of the same kernel (e.g. another GPU): its fastest "
            "config is measured first, as a job's warm start from the database",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Search a recorded space on the replay backend; report the mean fraction of optimum."""
    from kato.tuner.replay_eval import replay_search
    from kato.tuner.search import DEFAULT_STRATEGY, STRATEGIES

    strategy = strategy or DEFAULT_STRATEGY
    if strategy not in STRATEGIES:
        raise typer.BadParameter(f"strategy must be one of {', '.join(STRATEGIES)}")
    check_recording(cachefile, "cachefile")
    if warm_start is not None:
        check_recording(warm_start, "--warm-start")
    try:
        with progress_bar(disable=as_json) as progress:
            task = progress.add_task(f"replay {cachefile.name}", total=repeats * budget)
            report = replay_search(
                cachefile,
                budget=budget,
                repeats=repeats,
                seed=seed,
                strategy=strategy,
                warm_start=warm_start,
                on_progress=lambda done, total: progress.update(task, completed=done),
            )
    except ValueError as exc:
        fail(str(exc), 2)
    data = report.to_dict()
    data["file"] = str(cachefile)
    if not as_json:
        data["seed_configs"] = len(report.seed_configs)
    emit(data, as_json)
