"""``kato token``: create, revoke and list the API tokens of the write routes."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    console,
    fail,
    load_settings,
    open_sessions,
    print_records,
)

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
    from kato.db import tokens

    _, sessions = open_sessions(load_settings(db).db_url)
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
    from kato.db import tokens

    _, sessions = open_sessions(load_settings(db).db_url)
    with sessions() as session:
        try:
            token = tokens.revoke_token(session, tokens.find_by_id(session, token_id).id)
        except (tokens.UnknownTokenId, tokens.AmbiguousTokenId) as exc:
            fail(f"{exc}; `kato token list` shows the ids", 2)
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
    from kato.db import tokens

    _, sessions = open_sessions(load_settings(db).db_url)
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

    print_records([{headers.get(k, k): cell(v) for k, v in r.items()} for r in rows])
