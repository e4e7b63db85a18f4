"""The ``kato`` group itself: logging set up for every command, ``--version``."""

from __future__ import annotations

from typing import Annotated

import typer
from kato.service.cli.common import (
    app,
    fail,
)

from kato import env


def _version_lines(verbose: bool) -> list[str]:
    """``kato VERSION`` (the installed package's); with ``verbose`` also every registered
    operator's version, one ``NAME VERSION`` a line (what its stored results are keyed by)."""
    from kato.service import __version__

    lines = [f"kato {__version__}"]
    if verbose:
        from kato.kernels import list_operators

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

    from kato.service import logs

    try:
        level = logs.parse_level(env.get("KATO_LOG_LEVEL"))
    except ValueError as exc:
        fail(str(exc), 2)
    logs.configure(level, verbose=verbose)
    if version:
        typer.echo("\n".join(_version_lines(verbose)))
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()
