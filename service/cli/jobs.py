"""``kato jobs``, ``kato cancel`` and ``kato retune``: the job queue from the command line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    check_operators,
    console,
    duration,
    fail,
    gpu_option,
    load_settings,
    open_sessions,
    print_records,
    use_stored_operators,
)
from rich.console import Console
from rich.markup import escape
from rich.table import Table


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
    from kato.db import ids, queries
    from kato.db.models import Job

    _, sessions = open_sessions(load_settings(db).db_url)
    with sessions() as session:
        try:
            job = ids.find_by_id(session, Job, job_id, what="job")
        except (ids.UnknownId, ids.AmbiguousId) as exc:
            fail(f"{exc}; GET /v1/jobs lists the ids", 2)
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
    batch: Annotated[
        str | None,
        typer.Option(help="show one batch's progress (its id: a job's batch_id) instead"),
    ] = None,
) -> None:
    """List the newest tuning jobs with their progress: configs measured of the budget, the
    best time so far, the time since each started and, for running ones, the estimated time
    left, and the GPU's busy fraction of an ended job (as GET /v1/jobs reports them). With
    --batch, one batch as GET /v1/jobs/batch/{id} reports it."""
    from typing import get_args

    from kato.db import queries
    from kato.service.schemas import JobPublic, JobStatus

    if batch is not None:
        _show_batch(batch, db, as_json)
        return
    if status is not None and status not in get_args(JobStatus):
        raise typer.BadParameter(f"status must be one of {', '.join(get_args(JobStatus))}")
    _, sessions = open_sessions(load_settings(db).db_url)
    with sessions() as session:
        found = [JobPublic.from_job(j) for j in queries.list_jobs(session, status, limit)]
    if as_json:
        typer.echo(json.dumps([j.model_dump(mode="json") for j in found]))
        return
    if not found:
        console.print("no jobs" + (f" with status {status}" if status else ""))
        return
    print_records(
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
                "elapsed": duration(j.elapsed_s),
                "left": duration(j.eta_s),
                "GPU busy": _percent(j.gpu_busy_fraction),
            }
            for j in found
        ]
    )


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _show_batch(batch_id: str, db: str | None, as_json: bool) -> None:
    """``kato jobs --batch ID``: the batch's progress, a summary line and a row per key."""
    from kato.db import queries
    from kato.service.schemas import BatchProgress

    _, sessions = open_sessions(load_settings(db).db_url)
    with sessions() as session:
        found = queries.batch_jobs(session, batch_id)
        if not found:
            fail(f"no batch {batch_id!r} (a batch's id is its jobs' batch_id)")
        progress = BatchProgress.from_jobs(batch_id, found)
    if as_json:
        typer.echo(json.dumps(progress.model_dump(mode="json")))
        return
    counts = ", ".join(f"{n} {status}" for status, n in sorted(progress.status_counts.items()))
    Console().print(
        f"batch {progress.batch_id}: {progress.trials_done}/{progress.budget} configs, "
        f"{progress.jobs} job(s) ({counts}); elapsed {duration(progress.elapsed_s)}, "
        f"left {duration(progress.eta_s)}, GPU busy {_percent(progress.gpu_busy_fraction)}",
        highlight=False,
        soft_wrap=True,
    )
    print_records(
        [
            {
                "id": key.job_id,
                "operator": key.operator,
                "shape": "x".join(map(str, key.shape)),
                "dtype": key.dtype,
                "status": key.status,
                "configs": f"{key.trials_done}/{key.budget}",
                "best (ms)": "-" if key.best_time_ms is None else f"{key.best_time_ms:.4f}",
                "GPU busy": _percent(key.gpu_busy_fraction),
            }
            for key in progress.keys
        ]
    )


def _lease_ran_out(job) -> bool:
    from kato.db.models import utcnow

    return job.lease_expires_at is not None and job.lease_expires_at < utcnow()


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
    from kato.db.upgrade import find_stale_keys, queue_retune
    from kato.kernels import InvalidInput, list_operators
    from kato.service.validation import check_budget

    settings = load_settings(db)
    try:  # the budget check of every new job (service.validation), with its message
        check_budget(budget, None, settings)
    except InvalidInput as exc:
        fail(f"--budget: {exc}", 2)
    specs = {spec.name: spec for spec in list_operators()}
    check_operators(operator, list(specs), "a registered operator")
    model = gpu_option(gpu)

    _, sessions = open_sessions(settings.db_url)
    use_stored_operators(sessions)
    with sessions() as session:
        keys = find_stale_keys(
            session,
            {name: spec.version for name, spec in specs.items()},
            operators=operator,
            gpu_model=model,
            check=_key_check(specs),
            retry_failed=retry_failed,
        )
        job_ids = [] if dry_run else queue_retune(session, keys, budget_configs=budget)
    todo = [k for k in keys if k.skip is None]
    queued = {} if dry_run else dict(zip(todo, job_ids, strict=True))

    _show_retune(keys, queued, dry_run=dry_run, as_json=as_json)
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


def _key_check(specs):
    """``find_stale_keys``' check: why a key cannot be queued, by the checks of a new job
    (shape, dtype, memory; the GPU model is the one its results were measured on, listed in
    the catalog or not)."""
    from kato.kernels import InvalidInput
    from kato.service.validation import resolve_problem

    def check(name: str, shape: Sequence[int], dtype: str, gpu_model: str) -> str | None:
        try:
            resolve_problem(specs[name], shape, dtype, gpu_model, device_gpu=True)
        except InvalidInput as exc:
            return str(exc)
        return None

    return check


def _show_retune(keys, queued: dict, *, dry_run: bool, as_json: bool) -> None:
    """What ``kato retune`` found: one JSON line per key, or a table (stdout), then a warning
    per operator no longer registered (stderr)."""
    from kato.db.upgrade import SKIP_UNREGISTERED

    def status(key) -> str:
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
            cells = (
                key.operator,
                key.shape_key,
                key.dtype,
                key.gpu_model,
                ", ".join(key.old_versions),
                f"{key.old_best_time_ms:.4f}",
                status(key),
            )
            table.add_row(*(escape(str(v)) for v in cells))
        Console().print(table)
    for name in sorted({k.operator for k in keys if k.skip == SKIP_UNREGISTERED}):
        n = sum(k.operator == name for k in keys)
        console.print(
            f"[yellow]operator {escape(repr(name))} is no longer registered: its {n} key(s) "
            "stay stored, are not served, and cannot be tuned again[/yellow]",
            soft_wrap=True,
        )
