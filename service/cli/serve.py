"""``kato serve`` (the API and a worker per GPU) and ``kato worker`` (claim and run jobs)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    check_recording,
    console,
    fail,
    gpu_model_of,
    load_settings,
    one_line,
    open_engine,
    open_sessions,
    use_stored_operators,
)

from kato import env


def _replay_backends(path: Path, gpu: list[str] | None, **options):
    """The replay factory for the recordings at ``path`` (a file or a directory), each file
    checked, and the problem it is for read, before a worker starts on them; ``gpu``: keep only
    the recordings of these GPU models."""
    from kato.kernels.spec import InvalidInput
    from kato.tuner.backends.replay import recorded_problem
    from kato.tuner.factories import Recording, ReplayBackends, recording_files

    files = recording_files(path)
    if not files:
        fail(f"--replay {path}: no recordings (*.json, *.json.gz) in this directory", 2)
    recordings = []
    for file in files:
        cache = check_recording(file, "--replay")
        try:
            recordings.append(Recording(file, recorded_problem(cache, file)))
        except (ValueError, InvalidInput) as exc:
            fail(f"--replay {one_line(exc)}", 2)
    try:
        return ReplayBackends(recordings, gpu_models=gpu, **options)
    except (ValueError, InvalidInput) as exc:
        fail(f"--replay {path}: {one_line(exc)}", 2)


def _start_gpu_workers(settings, sessions) -> list[threading.Thread]:
    """One worker thread per visible CUDA device (:func:`service.workers.build_worker`); none
    (with a note) on a machine without."""
    from kato.service.workers import build_worker, gpu_backends
    from kato.tuner.backends.pycuda import describe_device, device_count

    threads = []
    count = device_count()
    if count == 0:
        console.print(
            "[yellow]no CUDA device visible: serving lookups and queueing jobs for "
            "workers elsewhere[/yellow]"
        )
    for index in range(count):
        model = describe_device(index).model
        worker = _built(
            build_worker,
            settings,
            sessions,
            [model],
            gpu_backends(settings, index),
            devices=[{"index": index, "model": model}],
        )
        t = threading.Thread(target=worker.run_forever, name=f"kato-worker-{index}", daemon=True)
        t.start()
        console.print(f"worker {worker.worker_id} on GPU {index} ({model})")
        threads.append(t)
    return threads


def _built(build, *args, **kwargs):
    """``build(*args, **kwargs)``; a setting it cannot use (``KATO_DB_RETRY_SECONDS``) ends
    the command with exit status 2."""
    try:
        return build(*args, **kwargs)
    except ValueError as exc:
        fail(str(exc), 2)


def _token_hint(settings, sessions) -> None:
    """On start: say how writes are protected, and how to get a token where none exists."""
    from kato.db import tokens

    if not settings.auth_required:
        console.print(
            "[yellow]KATO_AUTH_REQUIRED=false: anyone who reaches this port may submit and "
            "cancel jobs[/yellow]"
        )
        return
    with sessions() as session:
        if tokens.count_tokens(session) == 0:
            console.print(
                "writes (POST /v1/jobs, DELETE /v1/jobs/{id}) need an API token and none exists:"
                " create one with `kato token create NAME`"
                + (f" --db {settings.db_url}" if settings.db_url else "")
            )


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="port")] = None,
    db: DbOption = None,
    workers: Annotated[bool, typer.Option(help="run a tuning worker per visible GPU")] = True,
    api_workers: Annotated[
        int, typer.Option(min=1, help="API processes (uvicorn workers) sharing the port")
    ] = 1,
) -> None:
    """Run the REST API (OpenAPI docs at /docs) and a worker for each visible GPU."""

    import uvicorn
    from kato.service.app import create_app

    settings = load_settings(db)
    # The API's pool: a connection per API thread plus headroom (service.deps).
    api = create_app(settings, engine=open_engine(settings.db_url, settings.api_db_connections))
    _token_hint(settings, api.state.session_factory)
    if workers:
        _start_gpu_workers(settings, api.state.session_factory)
    host, port = host or settings.host, port or settings.port
    if api_workers == 1:
        uvicorn.run(api, host=host, port=port)
        return
    # Each uvicorn worker process builds its own app from the environment.
    env.set_for_children("KATO_DB_URL", settings.db_url)
    uvicorn.run(
        "kato.service.app:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=api_workers,
    )


@app.command()
def worker(
    db: DbOption = None,
    device: Annotated[int, typer.Option(help="CUDA device index")] = 0,
    max_jobs: Annotated[int | None, typer.Option(help="exit after this many jobs")] = None,
    backend: Annotated[
        str, typer.Option(help="pycuda (a GPU), or replay (answers from --replay; no GPU)")
    ] = "pycuda",
    replay: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            help="replay backend: a Kernel Tuner cache or T4 file, or a directory of them; "
            "each answers only jobs of the problem it was recorded for (its Kato metadata, "
            "else its name <operator>_<gpu>_<shape>_<dtype>[_<version>].json[.gz])",
        ),
    ] = None,
    gpu: Annotated[
        list[str] | None,
        typer.Option(
            help="GPU model(s) to claim jobs for (replay: default the recordings' models)"
        ),
    ] = None,
    isolate: Annotated[
        bool | None,
        typer.Option(
            help="measure in a child process (default: KATO_ISOLATE for pycuda, off for replay)"
        ),
    ] = None,
    trial_timeout: Annotated[
        float | None, typer.Option(help="per-trial limit in seconds (KATO_TRIAL_TIMEOUT_SECONDS)")
    ] = None,
    lease_seconds: Annotated[
        float | None, typer.Option(help="job lease (KATO_LEASE_SECONDS)")
    ] = None,
    poll_seconds: Annotated[float, typer.Option(help="idle poll interval")] = 1.0,
    replay_delay: Annotated[
        float, typer.Option(help="replay: seconds each trial takes (stands in for measuring)")
    ] = 0.0,
    max_workers_per_job: Annotated[
        int | None, typer.Option(help="most workers sharing a job (KATO_MAX_WORKERS_PER_JOB)")
    ] = None,
    jobs_at_once: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="jobs held at once on the GPU, taking turns measuring "
            "(KATO_JOBS_PER_WORKER; 1: one at a time)",
        ),
    ] = None,
    worker_id: Annotated[str | None, typer.Option(help="default: host-pid-random")] = None,
) -> None:
    """Claim and run queued tuning jobs for this machine's GPU model until interrupted.

    Exits only when stopped (Ctrl-C, SIGTERM) or after --max-jobs: failing kernels, faulting
    measurements and database hiccups are recorded or retried, never fatal
    (KATO_DB_RETRY_SECONDS, 300: how long a running job retries a database fault).
    """
    from kato.service.workers import build_worker, gpu_backends, measuring
    from kato.tuner.worker import stop_on_signals

    settings = load_settings(db)
    isolated, timeout = measuring(settings, isolate, trial_timeout)
    _, sessions = open_sessions(settings.db_url)
    use_stored_operators(sessions)  # before the recordings are checked against the operators
    if backend == "replay":
        if replay is None:
            raise typer.BadParameter("--backend replay needs --replay FILE_OR_DIR")
        factory = _replay_backends(
            replay, gpu, isolate=bool(isolate), trial_timeout_s=timeout, delay_s=replay_delay
        )
        models = factory.gpu_models
        where = f"replay {replay} ({len(factory.recordings)} recorded problem(s))"
        devices = [{"replay": str(replay)}]
    elif backend == "pycuda":
        models = list(gpu or [gpu_model_of(device)])
        factory = gpu_backends(
            settings, device, isolate=isolate, trial_timeout=trial_timeout,
            jobs_at_once=jobs_at_once,
        )  # fmt: skip
        where = f"GPU {device}" + (" (isolated)" if isolated else "")
        devices = [{"index": device, "model": models[0]}]
    else:
        raise typer.BadParameter(f"--backend must be pycuda or replay, got {backend!r}")
    w = _built(
        build_worker,
        settings,
        sessions,
        models,
        factory,
        devices=devices,
        backend_name=backend,
        worker_id=worker_id,
        lease_seconds=lease_seconds,
        poll_seconds=poll_seconds,
        max_workers_per_job=max_workers_per_job,
        jobs_at_once=jobs_at_once,
    )

    console.print(
        f"worker {w.worker_id}: {where}, GPU model(s) {', '.join(models)}, "
        f"database {settings.db_url}"
    )
    try:
        with stop_on_signals(w):  # SIGTERM (docker stop), Ctrl-C: give the job back, exit
            n = w.run_forever(max_jobs=max_jobs)
    except KeyboardInterrupt:  # a signal during the worker's last clean-up
        n = 0
    console.print(f"ran {n} job(s)")
