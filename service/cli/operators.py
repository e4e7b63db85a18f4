"""``kato operator``: store and list user operators (docs/user_kernels.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    console,
    fail,
    load_settings,
    open_sessions,
    print_records,
    use_stored_operators,
)

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
    of its name; an unchanged folder is found, not stored twice, and one changed only in its
    description or [backward] section (which the version leaves out) replaces them in the
    stored version. Workers and API processes of this database serve it within seconds."""
    from kato.db import operators as stored
    from kato.kernels.spec import InvalidInput
    from kato.kernels.user import load_folder

    try:
        definition = load_folder(folder)
    except InvalidInput as exc:
        fail(str(exc), 2)
    _, sessions = open_sessions(load_settings(db).db_url)
    use_stored_operators(sessions)
    with sessions() as session:
        try:
            added = stored.add_operator(session, definition)
        except InvalidInput as exc:
            fail(f"{folder}: {exc}", 2)
    if as_json:
        typer.echo(json.dumps(added.__dict__))
        return
    if added.created:
        what = "stored as a new version"
    elif added.updated:
        what = f"already stored; its {' and '.join(added.updated)} updated"
    else:
        what = "unchanged (already stored)"
    console.print(
        f"operator {added.name} version {added.version}: {what}; {added.versions} version(s)"
    )


@operator_app.command("list")
def operator_list(
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON lines")] = False,
) -> None:
    """Every stored user operator: name, version, versions stored, tunables, backward, added.

    ``backward``: the operator computing its gradients (its spec's ``[backward]`` section)."""
    from kato.db import operators as stored

    _, sessions = open_sessions(load_settings(db).db_url)
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
                    "backward": (spec.get("backward") or {}).get("operator", ""),
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
    print_records(rows)
