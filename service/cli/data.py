"""``kato export`` and ``kato import``: results as T4 JSON or Kernel Tuner cache files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    console,
    emit,
    fail,
    load_settings,
    open_sessions,
    progress_bar,
    use_stored_operators,
)


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
    from kato.db.export import ExportError, collect, export, kernel_tuner_reads

    _, sessions = open_sessions(load_settings(db).db_url)
    use_stored_operators(sessions)
    try:
        with sessions() as session:
            bundles = collect(session, job_ids=job, operator=operator, gpu=gpu, dtype=dtype)
            paths = export(bundles, out, fmt)
    except ExportError as exc:
        fail(f"export: {exc}")
    except (FileExistsError, NotADirectoryError):  # a file where a folder must be
        blocker = next((p for p in (out, *out.parents) if p.exists()), out)
        fail(
            f"export: cannot write {out}: {blocker} is a file, not a directory; pass a "
            "directory, or a file name ending in .json for one problem"
        )
    except OSError as exc:  # permissions, a full disk
        fail(f"export: cannot write {exc.filename or out}: {exc.strerror or exc}")
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
    from kato.db.importer import InvalidImport, import_paths
    from kato.tuner.imported_studies import record_job_studies

    overrides = {"operator": operator, "shape": shape, "dtype": dtype, "gpu": gpu}
    _, sessions = open_sessions(load_settings(db).db_url)
    use_stored_operators(sessions)
    try:
        with sessions() as session, progress_bar(disable=as_json) as progress:
            task = progress.add_task("import", total=None)

            def advance(stage: str, done: int, total: int) -> None:
                what = "checking" if stage == "check" else "writing"
                progress.update(task, description=f"import: {what}", completed=done, total=total)

            report = import_paths(  # the imported jobs' Optuna studies, once committed
                session, paths, overrides, on_progress=advance, after_commit=record_job_studies
            )
    except InvalidImport as exc:
        fail(f"import: {exc}", 2)
    for warning in report.warnings:
        console.print(f"[yellow]{warning}[/yellow]", soft_wrap=True)
    emit(report.to_dict(), as_json)
