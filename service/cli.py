"""The ``kato`` command line: serve the API, run workers, tune, look up, replay recorded spaces."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(
    help="Kato: GPU kernel autotuning service.", no_args_is_help=True, add_completion=False
)
console = Console(stderr=True)

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="SQLAlchemy URL (default: KATO_DB_URL or a SQLite file under ~/.local/share/kato)",
    ),
]


def _parse_shape(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace("x", ",").replace("X", ",").split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter(f"shape must look like 4096x4096, got {text!r}") from None


def _settings(db: str | None):
    from service.settings import Settings

    return Settings(db_url=db) if db else Settings()


def _gpu_model(device: int) -> str:
    """The catalog name of CUDA device ``device``; exits with a clear message where none."""
    from tuner.backends.pycuda import describe_device

    try:
        return describe_device(device).model
    except Exception as exc:  # no PyCUDA, no driver, no such device
        console.print(f"[red]no usable CUDA device {device}: {exc}[/red]")
        raise typer.Exit(2) from None


def _sessions(db_url: str):
    from db.session import init_db, session_factory

    engine = init_db(db_url)
    return engine, session_factory(engine)


def _start_gpu_workers(db_url: str, sessions, lease_seconds: float) -> list[threading.Thread]:
    """One worker thread per visible CUDA device; none (with a note) on a machine without."""
    from tuner.backends.pycuda import describe_device, device_count
    from tuner.worker import Worker, pycuda_backend_factory

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
            sessions, db_url, [model], pycuda_backend_factory(index), lease_seconds=lease_seconds
        )
        t = threading.Thread(target=worker.run_forever, name=f"kato-worker-{index}", daemon=True)
        t.start()
        console.print(f"worker {worker.worker_id} on GPU {index} ({model})")
        threads.append(t)
    return threads


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address")] = None,
    port: Annotated[int | None, typer.Option(help="port")] = None,
    db: DbOption = None,
    workers: Annotated[bool, typer.Option(help="run a tuning worker per visible GPU")] = True,
) -> None:
    """Run the REST API (OpenAPI docs at /docs) and a worker for each visible GPU."""
    import uvicorn

    from service.app import create_app

    settings = _settings(db)
    api = create_app(settings)
    if workers:
        _start_gpu_workers(settings.db_url, api.state.session_factory, settings.lease_seconds)
    uvicorn.run(api, host=host or settings.host, port=port or settings.port)


@app.command()
def worker(
    db: DbOption = None,
    device: Annotated[int, typer.Option(help="CUDA device index")] = 0,
    max_jobs: Annotated[int | None, typer.Option(help="exit after this many jobs")] = None,
) -> None:
    """Claim and run queued tuning jobs for this machine's GPU model until interrupted."""
    from tuner.worker import Worker, pycuda_backend_factory

    settings = _settings(db)
    _, sessions = _sessions(settings.db_url)
    model = _gpu_model(device)
    w = Worker(
        sessions,
        settings.db_url,
        [model],
        pycuda_backend_factory(device),
        lease_seconds=settings.lease_seconds,
    )
    console.print(f"worker {w.worker_id}: GPU {device} ({model}), database {settings.db_url}")
    try:
        n = w.run_forever(max_jobs=max_jobs)
    except KeyboardInterrupt:
        n = 0
    console.print(f"ran {n} job(s)")


@app.command()
def tune(
    operator: Annotated[str, typer.Argument(help="operator name, e.g. softmax")],
    shape: Annotated[str, typer.Option(help="e.g. 4096x4096")],
    dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16")] = "float32",
    budget: Annotated[int, typer.Option(help="distinct configs to measure")] = 100,
    budget_seconds: Annotated[float | None, typer.Option(help="wall-clock limit")] = None,
    strategy: Annotated[str, typer.Option(help="tpe, random or grid")] = "tpe",
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[int, typer.Option(help="CUDA device index")] = 0,
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Tune one operator on this machine's GPU now (a job run in-process, stored in the DB)."""
    from db import queries
    from kernels import get_operator
    from kernels.spec import InvalidInput
    from tuner.worker import JobRunner, default_worker_id, pycuda_backend_factory

    settings = _settings(db)
    _, sessions = _sessions(settings.db_url)
    try:
        spec = get_operator(operator)
        dims = spec.validate(_parse_shape(shape), dtype)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None
    model = _gpu_model(device)
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
            session, gpu_models=[model], worker_id=worker_id, lease_seconds=settings.lease_seconds
        )
        job_id = job.id
    if claimed is None or claimed.id != job_id:
        console.print("[red]could not claim the job (another worker took it)[/red]")
        raise typer.Exit(1)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("best {task.fields[best]}"),
        TimeElapsedColumn(),
        console=console,
        disable=as_json,
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
            pycuda_backend_factory(device),
            worker_id=worker_id,
            lease_seconds=settings.lease_seconds,
            on_progress=on_progress,
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

        r = httpx.get(
            f"{url.rstrip('/')}/v1/configs/{operator}",
            params={"shape": shape, "dtype": dtype, "gpu": gpu},
            timeout=30,
        )
        if r.status_code != 200:
            console.print(f"[red]{r.status_code}: {r.json().get('detail', r.text)}[/red]")
            raise typer.Exit(1)
        _emit(r.json(), True)
        return
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(_settings(db))) as client:
        r = client.get(
            f"/v1/configs/{operator}", params={"shape": shape, "dtype": dtype, "gpu": gpu}
        )
    if r.status_code != 200:
        console.print(f"[red]{r.status_code}: {r.json().get('detail', r.text)}[/red]")
        raise typer.Exit(1)
    _emit(r.json(), True)


@app.command()
def replay(
    cachefile: Annotated[
        Path,
        typer.Argument(
            exists=True, dir_okay=False, help="Kernel Tuner cache file (.json or .json.gz)"
        ),
    ],
    budget: Annotated[int, typer.Option(min=1, help="distinct configs measured per search")] = 100,
    repeats: Annotated[int, typer.Option(min=1, help="searches, one seed each")] = 10,
    seed: Annotated[int, typer.Option(help="first seed")] = 0,
    strategy: Annotated[str, typer.Option(help="tpe, random or grid")] = "tpe",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Search a recorded space on the replay backend; report the mean fraction of optimum."""
    from tuner.replay_eval import replay_search
    from tuner.search import STRATEGIES

    if strategy not in STRATEGIES:
        raise typer.BadParameter(f"strategy must be one of {', '.join(STRATEGIES)}")
    try:
        report = replay_search(
            cachefile, budget=budget, repeats=repeats, seed=seed, strategy=strategy
        )
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    data = report.to_dict()
    data["file"] = str(cachefile)
    _emit(data, as_json)


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
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
