"""The ``kato`` command line: serve the API, run workers, tune, look up, replay recorded spaces."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

app = typer.Typer(
    help="Kato: GPU kernel autotuning service.", no_args_is_help=True, add_completion=False
)
#: Messages on stderr, one line each (the terminal wraps them; a copied command stays whole).
console = Console(stderr=True, soft_wrap=True)

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="SQLAlchemy URL (default: KATO_DB_URL or a SQLite file under ~/.local/share/kato)",
    ),
]


def _fail(message: str, code: int = 1) -> NoReturn:
    """End the command on a user's mistake: ``message`` (what is wrong, what to fix) on stderr
    in red, on one line, and exit status ``code`` (1; 2 for a bad argument), no traceback."""
    console.print(f"[red]{escape(message)}[/red]", soft_wrap=True)
    raise typer.Exit(code)


def _reason(exc: BaseException) -> str:
    """``exc`` as one line: a database error as its driver's message, without SQLAlchemy's
    "Background on this error" link; a missing key named as such."""
    if isinstance(exc, KeyError):
        return f"missing {exc}"
    text = str(getattr(exc, "orig", None) or exc)
    lines = [line for line in text.splitlines() if not line.startswith("(Background on")]
    return " ".join(" ".join(lines).split()) or type(exc).__name__


def _shown_url(url: str) -> str:
    """A database URL fit to print (its password masked)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url


def _db_fail(url: str, reason: str) -> NoReturn:
    _fail(
        f"cannot open the database {_shown_url(url)}: {reason}; check --db or KATO_DB_URL "
        "(a file path, sqlite:///path/to/kato.db or postgresql+psycopg://user@host/dbname)"
    )


def _parse_shape(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace("x", ",").replace("X", ",").split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter(f"shape must look like 4096x4096, got {text!r}") from None


def _settings(db: str | None):
    """The settings, from --db and ``KATO_*``; a value that cannot be used ends the command."""
    import os

    from pydantic import ValidationError
    from sqlalchemy.exc import SQLAlchemyError

    from service.settings import Settings

    url = db or os.environ.get("KATO_DB_URL", "")
    try:
        return Settings(db_url=db) if db else Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            if field == "db_url":
                _db_fail(url, message)
            problems.append(f"KATO_{field.upper()}: {message}" if field else message)
        _fail(f"invalid settings: {'; '.join(problems)}")
    except (OSError, SQLAlchemyError) as exc:  # an unparsable URL; a SQLite folder not made
        _db_fail(url, _reason(exc))


def _gpu_model(device: int) -> str:
    """The catalog name of CUDA device ``device``; exits with a clear message where none."""
    from tuner.backends.pycuda import describe_device

    try:
        return describe_device(device).model
    except Exception as exc:  # no PyCUDA, no driver, no such device
        _fail(f"no usable CUDA device {device}: {exc}", 2)


def _engine(db_url: str, connections: int | None = None):
    """Open and migrate the database, before a command does anything with it; a URL that
    cannot be opened (unknown kind, no driver, no such database, not a database file, server
    down) ends the command with what went wrong. ``connections``: the pool's size
    (``db.session.make_engine``; default: a small pool)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from db.session import init_db, make_engine

    try:
        engine = make_engine(db_url, connections=connections)
    except SQLAlchemyError as exc:  # NoSuchModuleError, ArgumentError: not a URL SQLAlchemy knows
        _db_fail(db_url, _reason(exc))
    except ImportError as exc:  # the dialect's driver is not installed
        _db_fail(db_url, f"its driver is not installed ({exc})")
    try:
        return init_db(engine)
    except (SQLAlchemyError, OSError, CommandError) as exc:
        _db_fail(db_url, _reason(exc))


def _sessions(db_url: str):
    from db.session import session_factory

    engine = _engine(db_url)
    return engine, session_factory(engine)


#: What reading a malformed recording raises (unreadable, not gzip, not JSON, wrong shape).
_BAD_RECORDING = (OSError, ValueError, TypeError, KeyError)


def _check_recording(path: Path, what: str, code: int = 2):
    """``path`` loaded as a Kernel Tuner cache (or T4 results) file, or the command ends
    saying it is not one."""
    from tuner.kt_cache import load_cache

    try:
        return load_cache(path)
    except _BAD_RECORDING as exc:
        reason = _reason(exc).removeprefix(f"{path}: ")
        if not reason.startswith("not a Kernel Tuner cache"):
            reason = f"not a Kernel Tuner cache file ({reason})"
        _fail(
            f"{what} {path}: {reason}; give a Kernel Tuner cache or T4 results file "
            "(.json or .json.gz), e.g. from `kato export --format kt`",
            code,
        )


def _replay_backends(path: Path, gpu: list[str] | None, **options):
    """The replay factory for the recordings at ``path`` (a file or a directory), each file
    checked, and the problem it is for read, before a worker starts on them; ``gpu``: keep only
    the recordings of these GPU models."""
    from kernels.spec import InvalidInput
    from tuner.backends.replay import recorded_problem
    from tuner.worker import Recording, ReplayBackends, recording_files

    files = recording_files(path)
    if not files:
        _fail(f"--replay {path}: no recordings (*.json, *.json.gz) in this directory", 2)
    recordings = []
    for file in files:
        cache = _check_recording(file, "--replay")
        try:
            recordings.append(Recording(file, recorded_problem(cache, file)))
        except (ValueError, InvalidInput) as exc:
            _fail(f"--replay {_reason(exc)}", 2)
    try:
        return ReplayBackends(recordings, gpu_models=gpu, **options)
    except (ValueError, InvalidInput) as exc:
        _fail(f"--replay {path}: {_reason(exc)}", 2)


def _measuring(settings, isolate: bool | None, trial_timeout: float | None) -> tuple[bool, float]:
    """Whether a command measures in a child process and its per-trial limit (the floor of the
    limit scaled to a task's cost, :mod:`tuner.trial_cost`): the options where given, else
    ``KATO_ISOLATE`` and ``KATO_TRIAL_TIMEOUT_SECONDS``."""
    isolated = settings.isolate if isolate is None else isolate
    return isolated, trial_timeout or settings.trial_timeout_seconds


def _use_stored_operators(sessions) -> None:
    """The user operators stored in the database join this process's registry."""
    from db.operators import use_database

    use_database(sessions)


def _start_gpu_workers(db_url: str, sessions, lease_seconds: float) -> list[threading.Thread]:
    """One worker thread per visible CUDA device; none (with a note) on a machine without.
    Each measures in a child process (settings: ``isolate``, ``trial_timeout_seconds``)."""
    from service.settings import Settings
    from tuner.backends.pycuda import describe_device, device_count
    from tuner.worker import Worker
    from tuner.worker import pycuda_backend_factory as _factory

    settings = Settings(db_url=db_url)

    def pycuda_backend_factory(index: int):
        return _factory(
            index, isolate=settings.isolate, trial_timeout_s=settings.trial_timeout_seconds
        )

    threads = []
    count = device_count()
    if count == 0:
        console.print(
            "[yellow]no CUDA device visible: serving lookups and queueing jobs for "
            "workers elsewhere[/yellow]"
        )
    for index in range(count):
        model = describe_device(index).model
        worker = Worker(
            sessions,
            db_url,
            [model],
            pycuda_backend_factory(index),
            lease_seconds=lease_seconds,
            devices=[{"index": index, "model": model}],
            max_workers_per_job=settings.max_workers_per_job,
            lookahead=settings.lookahead,
        )
        t = threading.Thread(target=worker.run_forever, name=f"kato-worker-{index}", daemon=True)
        t.start()
        console.print(f"worker {worker.worker_id} on GPU {index} ({model})")
        threads.append(t)
    return threads


def _token_hint(settings, sessions) -> None:
    """On start: say how writes are protected, and how to get a token where none exists."""
    from db import tokens

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


def _version_lines(verbose: bool) -> list[str]:
    """``kato VERSION`` (the installed package's); with ``verbose`` also every registered
    operator's version, one ``NAME VERSION`` a line (what its stored results are keyed by)."""
    from service import __version__

    lines = [f"kato {__version__}"]
    if verbose:
        from kernels import list_operators

        lines += [f"{spec.name} {spec.version}" for spec in list_operators()]
    return lines


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="also the libraries' log lines (database migrations, HTTP requests); with "
            "--version, the operators' versions",
        ),
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", help="print Kato's version and exit")
    ] = False,
) -> None:
    """Kato: GPU kernel autotuning service. Log lines go to stderr at KATO_LOG_LEVEL (INFO)."""
    import os

    from service import logs

    try:
        level = logs.parse_level(os.environ.get("KATO_LOG_LEVEL"))
    except ValueError as exc:
        _fail(str(exc), 2)
    logs.configure(level, verbose=verbose)
    if version:
        typer.echo("\n".join(_version_lines(verbose)))
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


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
    import os

    import uvicorn

    from service.app import create_app

    settings = _settings(db)
    # The API's pool: a connection per API thread plus headroom (service.deps).
    api = create_app(settings, engine=_engine(settings.db_url, settings.api_db_connections))
    _token_hint(settings, api.state.session_factory)
    if workers:
        _start_gpu_workers(settings.db_url, api.state.session_factory, settings.lease_seconds)
    host, port = host or settings.host, port or settings.port
    if api_workers == 1:
        uvicorn.run(api, host=host, port=port)
        return
    # Each uvicorn worker process builds its own app from the environment.
    os.environ["KATO_DB_URL"] = settings.db_url
    uvicorn.run(
        "service.app:create_app_from_env", factory=True, host=host, port=port, workers=api_workers
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
    worker_id: Annotated[str | None, typer.Option(help="default: host-pid-random")] = None,
) -> None:
    """Claim and run queued tuning jobs for this machine's GPU model until interrupted.

    Exits only when stopped (Ctrl-C, SIGTERM) or after --max-jobs: failing kernels, faulting
    measurements and database hiccups are recorded or retried, never fatal
    (KATO_DB_RETRY_SECONDS, 300: how long a running job retries a database fault).
    """
    from db.retry import RetryPolicy
    from tuner.worker import Worker, pycuda_backend_factory, stop_on_signals

    settings = _settings(db)
    isolated, timeout = _measuring(settings, isolate, trial_timeout)
    lease = lease_seconds or settings.lease_seconds
    _, sessions = _sessions(settings.db_url)
    _use_stored_operators(sessions)  # before the recordings are checked against the operators
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
        models = list(gpu or [_gpu_model(device)])
        factory = pycuda_backend_factory(device, isolate=isolated, trial_timeout_s=timeout)
        where = f"GPU {device}" + (" (isolated)" if isolated else "")
        devices = [{"index": device, "model": models[0]}]
    else:
        raise typer.BadParameter(f"--backend must be pycuda or replay, got {backend!r}")
    try:
        retry_policy = RetryPolicy.from_env()
    except ValueError as exc:
        _fail(str(exc), 2)
    w = Worker(
        sessions,
        settings.db_url,
        models,
        factory,
        worker_id=worker_id,
        retry_policy=retry_policy,
        lease_seconds=lease,
        poll_seconds=poll_seconds,
        backend_name=backend,
        devices=devices,
        max_workers_per_job=max_workers_per_job or settings.max_workers_per_job,
        lookahead=settings.lookahead,
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
    from kernels import get_operator
    from kernels.spec import InvalidInput
    from tuner.backends.isolated import BackendSpec, build_backend, measuring_backend
    from tuner.worker import pycuda_backend_factory

    if kind == "pycuda":
        model = _gpu_model(device)
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
        from tuner.backends.replay import recorded_problem

        try:
            problem = recorded_problem(_check_recording(replay, "--replay"), replay)
        except (ValueError, InvalidInput) as exc:
            _fail(f"--replay {_reason(exc)}", 2)
        wanted = (operator, tuple(shape), dtype)
        if (problem.operator, tuple(problem.shape), problem.dtype) != wanted:
            _fail(f"--replay {replay} is a recording of {problem}, not of this problem", 2)
        version = get_operator(operator).version
        if problem.operator_version not in (None, version):
            _fail(
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
            _fail(f"--backend {kind}: {type(exc).__name__}: {exc}", 2)
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
            "a tuner.backends.isolated.BackendSpec, given --replay as its replay_file)"
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
    from db import queries
    from kernels import get_operator
    from kernels.spec import InvalidInput
    from tuner.search import STRATEGIES
    from tuner.worker import JobRunner, default_worker_id

    settings = _settings(db)
    if trial_timeout is not None and not trial_timeout > 0:
        raise typer.BadParameter("--trial-timeout must be more than 0")
    isolated, timeout = _measuring(settings, isolate, trial_timeout)
    _, sessions = _sessions(settings.db_url)
    _use_stored_operators(sessions)
    try:
        spec = get_operator(operator)
        dims = spec.validate(_parse_shape(shape), dtype)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None
    if strategy not in STRATEGIES:
        raise typer.BadParameter(f"strategy must be one of {', '.join(STRATEGIES)}")
    if budget_seconds is not None and not budget_seconds > 0:
        raise typer.BadParameter("--budget-seconds must be more than 0")
    model, factory = _tune_backends(
        backend, replay, operator, dims, dtype, device, isolate=isolated, trial_timeout_s=timeout
    )
    worker_id = default_worker_id()
    with sessions() as session:
        job = queries.create_job(
            session,
            operator=operator,
            operator_version=spec.version,
            shape=list(dims),
            dtype=dtype,
            gpu_model=model,
            budget_configs=budget,
            budget_seconds=budget_seconds,
            strategy=strategy,
            seed=seed,
        )
        claimed = queries.claim_next_job(
            session,
            gpu_models=[model],
            worker_id=worker_id,
            lease_seconds=settings.lease_seconds,
            scope=queries.JobScope(job_ids=frozenset({job.id})),  # this job, not an older one
        )
        job_id = job.id
    if claimed is None or claimed.id != job_id:
        _fail("could not claim the job (another worker took it)")
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("best {task.fields[best]}"),
        TimeElapsedColumn(),
        console=console,
        disable=as_json or not console.is_terminal,
    ) as progress:
        task = progress.add_task(f"{operator} {shape} {dtype}", total=budget, best="-")
        best: list[float] = []

        def on_progress(result, measured, total):
            if result.time_ms is not None:
                best.append(result.time_ms)
            progress.update(task, completed=measured, best=f"{min(best):.4f} ms" if best else "-")

        runner = JobRunner(
            sessions,
            settings.db_url,
            factory,
            worker_id=worker_id,
            lease_seconds=settings.lease_seconds,
            on_progress=on_progress,
            lookahead=settings.lookahead,
        )
        outcome = runner.run(job_id)
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
    _emit(out, as_json)
    if outcome.status != "done":
        raise typer.Exit(1)


@app.command()
def lookup(
    operator: Annotated[str, typer.Argument()],
    shape: Annotated[str, typer.Option(help="e.g. 4096x4096")],
    dtype: Annotated[str, typer.Option()] = "float32",
    gpu: Annotated[str, typer.Option(help="GPU model, e.g. H200")] = "H200",
    url: Annotated[str | None, typer.Option(help="ask a running service instead of the DB")] = None,
    db: DbOption = None,
) -> None:
    """Print the tuned config for an operator, shape, dtype and GPU (exact, nearest or default)."""
    if url:
        import httpx

        try:
            r = httpx.get(
                f"{url.rstrip('/')}/v1/configs/{operator}",
                params={"shape": shape, "dtype": dtype, "gpu": gpu},
                timeout=30,
            )
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            _fail(f"--url {url}: not a service URL ({_reason(exc)}); e.g. http://127.0.0.1:8000")
        except httpx.HTTPError as exc:  # refused, unresolvable, timed out
            _fail(
                f"cannot reach the Kato service at {url}: {_reason(exc)}; is `kato serve` "
                "running there? Check --url (e.g. http://127.0.0.1:8000)"
            )
        _emit(_answer(r, url), True)
        return
    import asyncio

    import httpx

    from service.app import create_app

    settings = _settings(db)
    api = create_app(settings, engine=_engine(settings.db_url))

    async def ask() -> httpx.Response:
        # The app answers in this process, through its routes as a served request would be
        # (httpx's ASGI transport: no socket, and not Starlette's TestClient, a test tool).
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://kato") as client:
            return await client.get(
                f"/v1/configs/{operator}", params={"shape": shape, "dtype": dtype, "gpu": gpu}
            )

    r = asyncio.run(ask())
    api.state.engine.dispose()
    if r.status_code != 200:
        _fail(f"{r.status_code}: {r.json().get('detail', r.text)}")
    _emit(r.json(), True)


def _answer(r, url: str) -> dict[str, Any]:
    """The JSON object of the service at ``url``'s 200 answer; else the command ends with the
    service's detail, or (an answer that is not the service's JSON) a word on the URL."""
    try:
        data = r.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        _fail(
            f"{url} did not answer as a Kato service (HTTP {r.status_code}, "
            f"{r.headers.get('content-type', 'no content type')}): check --url"
        )
    if r.status_code != 200:
        _fail(f"{r.status_code}: {data.get('detail', r.text)}")
    return data


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
    from tuner.replay_eval import replay_search
    from tuner.search import DEFAULT_STRATEGY, STRATEGIES

    strategy = strategy or DEFAULT_STRATEGY
    if strategy not in STRATEGIES:
        raise typer.BadParameter(f"strategy must be one of {', '.join(STRATEGIES)}")
    _check_recording(cachefile, "cachefile")
    if warm_start is not None:
        _check_recording(warm_start, "--warm-start")
    try:
        with _progress(disable=as_json) as progress:
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
        _fail(str(exc), 2)
    data = report.to_dict()
    data["file"] = str(cachefile)
    if not as_json:
        data["seed_configs"] = len(report.seed_configs)
    _emit(data, as_json)


token_app = typer.Typer(
    help="API tokens for the write routes (submit, batch, cancel, import).", no_args_is_help=True
)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Argument(help="who or what the token is for, e.g. ci-fleet")],
    max_queued: Annotated[
        int | None,
        typer.Option(min=1, help="most queued + running jobs (default: KATO_MAX_QUEUED_JOBS)"),
    ] = None,
    admin: Annotated[
        bool,
        typer.Option(
            "--admin", help="may cancel any job (a revoked token's too), not only its own"
        ),
    ] = False,
    operators: Annotated[
        bool,
        typer.Option("--operators", help="may register user operators (POST /v1/operators)"),
    ] = False,
    db: DbOption = None,
) -> None:
    """Create a token; print its secret on stdout, once (only its SHA-256 is stored)."""
    from db import tokens

    _, sessions = _sessions(_settings(db).db_url)
    with sessions() as session:
        try:
            token, secret = tokens.create_token(
                session, name, max_queued_jobs=max_queued, admin=admin
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if operators:
            token.operators = True
            session.commit()
        console.print(
            f"{'admin ' if admin else ''}token {token.id} ({token.name!r}) created; its secret "
            "is printed once, below. Send it as 'Authorization: Bearer <secret>'.",
            soft_wrap=True,
        )
    typer.echo(secret)


@token_app.command("revoke", short_help="Revoke a token: 403 from now on; its jobs keep running.")
def token_revoke(
    token_id: Annotated[
        str, typer.Argument(help="the token's id, or a unique prefix of it (kato token list)")
    ],
    db: DbOption = None,
) -> None:
    """Revoke a token: its requests get 403 from now on; its jobs keep running (an admin token
    or `kato cancel` stops them)."""
    from db import tokens

    _, sessions = _sessions(_settings(db).db_url)
    with sessions() as session:
        try:
            token = tokens.revoke_token(session, tokens.find_by_id(session, token_id).id)
        except (tokens.UnknownTokenId, tokens.AmbiguousTokenId) as exc:
            _fail(f"{exc}; `kato token list` shows the ids", 2)
        assert token is not None  # found just now, and tokens are never deleted
        console.print(f"token {token.id} ({token.name!r}) revoked", soft_wrap=True)


@token_app.command(
    "list",
    short_help="Every token (never the secrets): id, name, admin, queue limit, use, revoked.",
)
def token_list(
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
) -> None:
    """Every token (never the secrets): id, name, admin, queue limit, live jobs, created, last
    used, revoked (times in UTC)."""
    from db import tokens

    _, sessions = _sessions(_settings(db).db_url)
    with sessions() as session:
        rows = [
            {
                "id": t.id,
                "name": t.name,
                "admin": t.admin,
                "max_queued_jobs": t.max_queued_jobs,
                "live_jobs": tokens.live_jobs(session, t.id),
                "created_at": t.created_at.isoformat(timespec="seconds"),
                "last_used_at": t.last_used_at.isoformat(timespec="seconds")
                if t.last_used_at
                else None,
                "revoked_at": t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else None,
            }
            for t in tokens.list_tokens(session)
        ]
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    if not rows:
        console.print("no tokens: create one with `kato token create NAME`")
        return
    headers = {
        "max_queued_jobs": "queue limit",
        "live_jobs": "live jobs",
        "created_at": "created",
        "last_used_at": "last used",
        "revoked_at": "revoked",
    }

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return str(value).replace("T", " ").removesuffix("+00:00")  # ISO times, in UTC

    _print_records([{headers.get(k, k): cell(v) for k, v in r.items()} for r in rows])


operator_app = typer.Typer(
    help="User operators: your own CUDA kernels, tuned like Kato's (docs/user_kernels.md).",
    no_args_is_help=True,
)
app.add_typer(operator_app, name="operator")


@operator_app.command(
    "add", short_help="Validate an operator folder and store it as its newest version."
)
def operator_add(
    folder: Annotated[
        Path, typer.Argument(help="a folder holding kato.toml, its template and reference")
    ],
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Validate an operator folder (nothing is compiled here) and store it as the newest version
    of its name; an unchanged folder is found, not stored twice. Workers and API processes of
    this database serve it within seconds."""
    from db import operators as stored
    from kernels.spec import InvalidInput
    from kernels.user import load_folder

    try:
        definition = load_folder(folder)
    except InvalidInput as exc:
        _fail(str(exc), 2)
    _, sessions = _sessions(_settings(db).db_url)
    _use_stored_operators(sessions)
    with sessions() as session:
        try:
            added = stored.add_operator(session, definition)
        except InvalidInput as exc:
            _fail(f"{folder}: {exc}", 2)
    if as_json:
        typer.echo(json.dumps(added.__dict__))
        return
    what = "stored as a new version" if added.created else "unchanged (already stored)"
    console.print(
        f"operator {added.name} version {added.version}: {what}; {added.versions} version(s)"
    )


@operator_app.command("list")
def operator_list(
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
) -> None:
    """Every stored user operator: name, current version, versions stored, tunables, added."""
    from db import operators as stored

    _, sessions = _sessions(_settings(db).db_url)
    rows = []
    with sessions() as session:
        for row in stored.newest(session):
            spec = row.definition.get("spec", {})
            rows.append(
                {
                    "name": row.name,
                    "version": row.version,
                    "versions": str(len(stored.versions(session, row.name))),
                    "shape": "x".join(spec.get("shape", [])),
                    "tunables": ", ".join(spec.get("tune_params", {})),
                    "added": f"{row.created_at:%Y-%m-%d %H:%M}",
                }
            )
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    if not rows:
        console.print("no user operators stored: add one with `kato operator add DIR`")
        return
    _print_records(rows)


def _print_records(rows: list[dict[str, str]]) -> None:
    """``rows`` on stdout, as a table where it fits the terminal at its natural width, else one
    block per row (its first field, then the others indented): never a cell cut short, so an id
    printed can be copied whole."""
    from rich.measure import Measurement

    out = Console()
    table = Table(*(escape(k) for k in rows[0]), box=box.SIMPLE_HEAD, pad_edge=False)
    for row in rows:
        table.add_row(*(escape(v) for v in row.values()))
    natural = Measurement.get(out, out.options.update_width(10_000), table).maximum
    if natural <= out.width:
        out.print(table)
        return
    for row in rows:
        first, *rest = row.items()
        typer.echo(first[1])
        for key, value in rest:
            typer.echo(f"  {key}: {value}")


@app.command(
    short_help="Cancel a job, whoever submitted it: a queued one at once, a running one after "
    "its current trial."
)
def cancel(
    job_id: Annotated[
        str, typer.Argument(help="the job's id (as POST /v1/jobs answered it), or a unique prefix")
    ],
    db: DbOption = None,
) -> None:
    """Cancel a job in the database, whoever submitted it (the operator's way to stop the jobs
    of a revoked token): a queued job at once, a running one after its current trial. A
    finished job is left as it is."""
    from db import ids, queries
    from db.models import Job

    _, sessions = _sessions(_settings(db).db_url)
    with sessions() as session:
        try:
            job = ids.find_by_id(session, Job, job_id, what="job")
        except (ids.UnknownId, ids.AmbiguousId) as exc:
            _fail(f"{exc}; GET /v1/jobs lists the ids", 2)
        if job.status not in ("queued", "running"):
            console.print(f"job {job.id} is already {job.status}: nothing to do", soft_wrap=True)
            return
        done = queries.request_cancel(session, job.id)
    if done is not None and done.status == "cancelled":
        console.print(f"job {job.id} cancelled", soft_wrap=True)
    elif done is not None and done.status == "running" and _lease_ran_out(done):
        console.print(
            f"job {job.id}: cancel requested; its worker {done.worker_id} has not renewed its "
            "lease (it may be gone): the job is marked cancelled when a worker next looks for "
            "work",
            soft_wrap=True,
        )
    elif done is not None and done.status == "running":
        console.print(
            f"job {job.id}: cancel requested; its worker {done.worker_id} stops it after the "
            "current trial (within about a second)",
            soft_wrap=True,
        )
    else:  # it finished between the two reads
        status = done.status if done is not None else "gone"
        console.print(f"job {job.id} is already {status}: nothing to do", soft_wrap=True)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@app.command(
    "jobs", short_help="List tuning jobs and their progress: configs done, best, time left."
)
def jobs(
    status: Annotated[
        str | None, typer.Option(help="only jobs with this status (queued, running, done, ...)")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="newest jobs shown")] = 20,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the jobs as JSON")] = False,
) -> None:
    """List the newest tuning jobs with their progress: configs measured of the budget, the
    best time so far, the time since each started and, for running ones, the estimated time
    left (as GET /v1/jobs reports them)."""
    from typing import get_args

    from db import queries
    from service.schemas import JobPublic, JobStatus

    if status is not None and status not in get_args(JobStatus):
        raise typer.BadParameter(f"status must be one of {', '.join(get_args(JobStatus))}")
    _, sessions = _sessions(_settings(db).db_url)
    with sessions() as session:
        found = [JobPublic.from_job(j) for j in queries.list_jobs(session, status, limit)]
    if as_json:
        typer.echo(json.dumps([j.model_dump(mode="json") for j in found]))
        return
    if not found:
        console.print("no jobs" + (f" with status {status}" if status else ""))
        return
    _print_records(
        [
            {
                "id": j.id,
                "operator": j.operator,
                "shape": "x".join(map(str, j.shape)),
                "dtype": j.dtype,
                "GPU": j.gpu,
                "status": j.status,
                "configs": f"{j.trials_done}/{j.budget}",
                "best (ms)": "-" if j.best_time_ms is None else f"{j.best_time_ms:.4f}",
                "elapsed": _duration(j.elapsed_s),
                "left": _duration(j.eta_s),
            }
            for j in found
        ]
    )


def _lease_ran_out(job) -> bool:
    from db.models import utcnow

    return job.lease_expires_at is not None and job.lease_expires_at < utcnow()


@app.command(
    "export",
    short_help="Export best configs and trials (T4 JSON or Kernel Tuner cache files) to import "
    "or replay elsewhere.",
)
def export_results(
    out: Annotated[
        Path, typer.Argument(help="a .json file (one problem) or a directory (one file each)")
    ],
    fmt: Annotated[
        str, typer.Option("--format", help="t4 (T4 JSON) or kt (Kernel Tuner cache)")
    ] = ("t4"),
    job: Annotated[list[str] | None, typer.Option(help="job id (repeatable)")] = None,
    operator: Annotated[str | None, typer.Option(help="only this operator")] = None,
    gpu: Annotated[str | None, typer.Option(help="only this GPU model")] = None,
    dtype: Annotated[str | None, typer.Option(help="only this dtype")] = None,
    db: DbOption = None,
) -> None:
    """Export best configs and trials (T4 JSON or Kernel Tuner cache files), to import
    elsewhere (kato import) or to replay in Kernel Tuner's simulation mode."""
    from db.export import ExportError, collect, export, kernel_tuner_reads

    _, sessions = _sessions(_settings(db).db_url)
    _use_stored_operators(sessions)
    try:
        with sessions() as session:
            bundles = collect(session, job_ids=job, operator=operator, gpu=gpu, dtype=dtype)
            paths = export(bundles, out, fmt)
    except ExportError as exc:
        _fail(f"export: {exc}")
    except (FileExistsError, NotADirectoryError):  # a file where a folder must be
        blocker = next((p for p in (out, *out.parents) if p.exists()), out)
        _fail(
            f"export: cannot write {out}: {blocker} is a file, not a directory; pass a "
            "directory, or a file name ending in .json for one problem"
        )
    except OSError as exc:  # permissions, a full disk
        _fail(f"export: cannot write {exc.filename or out}: {exc.strerror or exc}")
    for bundle, path in zip(bundles, paths, strict=True):
        console.print(
            f"{path}: {bundle.operator} {'x'.join(map(str, bundle.shape))} {bundle.dtype} "
            f"{bundle.gpu_model}: {len(bundle.jobs)} job(s), {len(bundle.trials)} trial(s), "
            f"{len(bundle.best)} best config(s)"
        )
    if fmt == "kt" and not all(kernel_tuner_reads(path, fmt) for path in paths):
        console.print(
            "[yellow]Kernel Tuner reads only plain .json cache files: name the file .json to "
            "replay it there (a .gz cache is for kato replay and kato import)[/yellow]",
            soft_wrap=True,
        )


@app.command(
    "import",
    short_help="Import exported results, idempotently; every file is checked before anything "
    "is written.",
)
def import_results(
    paths: Annotated[list[Path], typer.Argument(help="T4 or Kernel Tuner files, or directories")],
    operator: Annotated[str | None, typer.Option(help="for files without Kato metadata")] = None,
    shape: Annotated[str | None, typer.Option(help="for files without Kato metadata")] = None,
    dtype: Annotated[str | None, typer.Option(help="for files without Kato metadata")] = None,
    gpu: Annotated[str | None, typer.Option(help="for files without Kato metadata")] = None,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Import exported results (idempotent: importing twice adds nothing). Every file is checked
    before anything is written (types, the operator's space, rank and dtypes, the file's own
    measurements); an invalid file exits with status 2 and says what is wrong."""
    from db.importer import InvalidImport, import_paths

    overrides = {"operator": operator, "shape": shape, "dtype": dtype, "gpu": gpu}
    _, sessions = _sessions(_settings(db).db_url)
    _use_stored_operators(sessions)
    try:
        with sessions() as session, _progress(disable=as_json) as progress:
            task = progress.add_task("import", total=None)

            def advance(stage: str, done: int, total: int) -> None:
                what = "checking" if stage == "check" else "writing"
                progress.update(task, description=f"import: {what}", completed=done, total=total)

            report = import_paths(session, paths, overrides, on_progress=advance)
    except InvalidImport as exc:
        _fail(f"import: {exc}", 2)
    for warning in report.warnings:
        console.print(f"[yellow]{warning}[/yellow]", soft_wrap=True)
    _emit(report.to_dict(), as_json)


@app.command(
    short_help="After an upgrade: queue a job at the current version for every key whose best "
    "configs are all from older versions."
)
def retune(
    db: DbOption = None,
    budget: Annotated[
        int,
        typer.Option(
            min=1,
            help="distinct configs per job (default 50: half a cold job's, as each job first "
            "measures the key's old winner; see db/upgrade.py)",
        ),
    ] = 50,  # db.upgrade.DEFAULT_RETUNE_BUDGET (not imported here: the CLI starts fast)
    operator: Annotated[
        list[str] | None, typer.Option(help="only this operator (repeatable)")
    ] = None,
    gpu: Annotated[str | None, typer.Option(help="only this GPU model, e.g. H200")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="list what would be queued; queue nothing")
    ] = False,
    retry_failed: Annotated[
        bool,
        typer.Option(
            "--retry-failed", help="queue keys whose last job at the current version failed, too"
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON line per key instead of the table")
    ] = False,
) -> None:
    """After an upgrade: queue a tuning job at the current version for every result key whose
    best configs are all from other versions of its operator (until then it is served the
    default config).

    Keys of operators no longer registered, keys the operator can no longer tune, and keys
    with a queued job or one running at the current version are listed and skipped; running it
    again queues nothing new. Each job first measures the key's old winner (warm start).
    """
    from db.upgrade import SKIP_UNREGISTERED, StaleKey, find_stale_keys, queue_retune
    from kernels import InvalidInput, list_operators
    from tuner.gpus import normalize_gpu_name

    settings = _settings(db)
    if budget > settings.max_budget_configs:
        _fail(
            f"--budget {budget} is more than KATO_MAX_BUDGET_CONFIGS "
            f"({settings.max_budget_configs}); pass a smaller --budget",
            2,
        )
    specs = {spec.name: spec for spec in list_operators()}
    unknown = sorted(set(operator or ()) - specs.keys())
    if unknown:
        _fail(
            f"unknown operator(s) {', '.join(map(repr, unknown))}: --operator takes a registered "
            f"operator ({', '.join(specs)})",
            2,
        )
    model = None
    if gpu is not None:
        try:
            model = normalize_gpu_name(gpu)
        except InvalidInput as exc:
            _fail(f"--gpu: {exc}; e.g. --gpu H200", 2)

    def check(name: str, shape: Sequence[int], dtype: str) -> str | None:
        try:
            specs[name].validate(list(shape), dtype)
        except InvalidInput as exc:
            return str(exc)
        return None

    _, sessions = _sessions(settings.db_url)
    _use_stored_operators(sessions)
    with sessions() as session:
        keys = find_stale_keys(
            session,
            {name: spec.version for name, spec in specs.items()},
            operators=operator,
            gpu_model=model,
            check=check,
            retry_failed=retry_failed,
        )
        job_ids = [] if dry_run else queue_retune(session, keys, budget_configs=budget)
    todo = [k for k in keys if k.skip is None]
    queued = {} if dry_run else dict(zip(todo, job_ids, strict=True))

    def status(key: StaleKey) -> str:
        if key.skip is not None:
            return f"skipped: {key.skip}"
        return "to queue" if dry_run else f"queued {queued[key]}"

    if as_json:
        for key in keys:
            row = {
                "operator": key.operator,
                "shape": list(key.shape),
                "dtype": key.dtype,
                "gpu": key.gpu_model,
                "old_versions": list(key.old_versions),
                "old_best_time_ms": key.old_best_time_ms,
                "version": key.current_version,
                "job": queued.get(key),
                "skip": key.skip,
            }
            typer.echo(json.dumps(row))
    elif keys:
        table = Table("operator", "shape", "dtype", "GPU", "old version(s)", "old best (ms)", "")
        for key in keys:
            table.add_row(
                *(
                    escape(str(v))
                    for v in (
                        key.operator,
                        key.shape_key,
                        key.dtype,
                        key.gpu_model,
                        ", ".join(key.old_versions),
                        f"{key.old_best_time_ms:.4f}",
                        status(key),
                    )
                )
            )
        Console().print(table)
    for name in sorted({k.operator for k in keys if k.skip == SKIP_UNREGISTERED}):
        n = sum(k.operator == name for k in keys)
        console.print(
            f"[yellow]operator {escape(repr(name))} is no longer registered: its {n} key(s) "
            "stay stored, are not served, and cannot be tuned again[/yellow]",
            soft_wrap=True,
        )
    if not keys:
        console.print(
            "nothing to retune: every stored best config"
            + (" matching the filters" if operator or model else "")
            + " has one at its operator's current version"
        )
        return
    verb = "would queue" if dry_run else "queued"
    console.print(
        f"{len(keys)} key(s) tuned only at other versions: {verb} {len(todo)} job(s) of "
        f"{budget} configs at the current version, skipped {len(keys) - len(todo)}"
        + (" (dry run: nothing queued)" if dry_run else ""),
        soft_wrap=True,
    )


def _progress(*, disable: bool = False) -> Progress:
    """A progress bar on stderr (description, bar, done/total, elapsed, time left) where stderr
    is a terminal; nothing otherwise (a pipe, a log file) or with ``disable`` (``--json``)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=disable or not console.is_terminal,
    )


def _emit(data: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, default=str))
        return
    table = Table(show_header=False)
    for k, v in data.items():
        if k == "per_seed":
            v = ", ".join(f"{p['fraction_of_optimum']:.3f}" for p in v)
        table.add_row(k, json.dumps(v, default=str) if isinstance(v, dict | list) else str(v))
    Console().print(table)


def main() -> None:  # pragma: no cover
    app()  # logging is set up by the callback (service.logs), for every way of calling it


if __name__ == "__main__":  # pragma: no cover
    main()
