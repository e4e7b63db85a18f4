"""What every ``kato`` command shares: the Typer app, stderr console, the ``--db`` option,
one-line failures, settings and database opening, recordings' checks, output helpers."""

from __future__ import annotations

import json
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

from kato import env
from kato.shared.kt_cache import load_cache

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


def fail(message: str, code: int = 1) -> NoReturn:
    """End the command on a user's mistake: ``message`` (what is wrong, what to fix) on stderr
    in red, on one line, and exit status ``code`` (1; 2 for a bad argument), no traceback."""
    console.print(f"[red]{escape(message)}[/red]", soft_wrap=True)
    raise typer.Exit(code)


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: a database error as its driver's message, without SQLAlchemy's
    "Background on this error" link; a missing key named as such."""
    if isinstance(exc, KeyError):
        return f"missing {exc}"
    text = str(getattr(exc, "orig", None) or exc)
    lines = [line for line in text.splitlines() if not line.startswith("(Background on")]
    return " ".join(" ".join(lines).split()) or type(exc).__name__


def shown_url(url: str) -> str:
    """A database URL fit to print (its password masked)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url


def db_fail(url: str, reason: str) -> NoReturn:
    fail(
        f"cannot open the database {shown_url(url)}: {reason}; check --db or KATO_DB_URL "
        "(a file path, sqlite:///path/to/kato.db or postgresql+psycopg://user@host/dbname)"
    )


def parse_shape(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace("x", ",").replace("X", ",").split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter(f"shape must look like 4096x4096, got {text!r}") from None


def load_settings(db: str | None):
    """The settings, from --db and ``KATO_*``; a value that cannot be used ends the command."""

    from kato.service.settings import Settings
    from pydantic import ValidationError
    from sqlalchemy.exc import SQLAlchemyError

    url = db or env.get("KATO_DB_URL") or ""
    try:
        return Settings(db_url=db) if db else Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            if field == "db_url":
                db_fail(url, message)
            problems.append(f"KATO_{field.upper()}: {message}" if field else message)
        fail(f"invalid settings: {'; '.join(problems)}")
    except (OSError, SQLAlchemyError) as exc:  # an unparsable URL; a SQLite folder not made
        db_fail(url, one_line(exc))


def check_operators(given: list[str] | None, known: list[str], takes: str) -> None:
    """Exit 2 naming every ``--operator`` value not in ``known``; ``takes`` says what the
    option takes ("a registered operator")."""
    unknown = sorted(set(given or ()) - set(known))
    if unknown:
        fail(
            f"unknown operator(s) {', '.join(map(repr, unknown))}: --operator takes {takes} "
            f"({', '.join(known)})",
            2,
        )


def gpu_option(gpu: str | None) -> str | None:
    """``--gpu`` as the catalog names it (None stays None); exits 2 with the reason if it is
    no GPU model."""
    if gpu is None:
        return None
    from kato.kernels import InvalidInput

    from kato.shared.gpus import normalize_gpu_name

    try:
        return normalize_gpu_name(gpu)
    except InvalidInput as exc:
        fail(f"--gpu: {exc}; e.g. --gpu H200", 2)


def gpu_model_of(device: int) -> str:
    """The catalog name of CUDA device ``device``; exits with a clear message where none."""
    from kato.tuner.backends.pycuda import describe_device

    try:
        return describe_device(device).model
    except Exception as exc:  # no PyCUDA, no driver, no such device
        fail(f"no usable CUDA device {device}: {exc}", 2)


def open_engine(db_url: str, connections: int | None = None):
    """Open and migrate the database, before a command does anything with it; a URL that
    cannot be opened (unknown kind, no driver, no such database, not a database file, server
    down) ends the command with what went wrong. ``connections``: the pool's size
    (``db.session.make_engine``; default: a small pool)."""
    from alembic.util import CommandError
    from kato.db.session import init_db, make_engine
    from sqlalchemy.exc import SQLAlchemyError

    try:
        engine = make_engine(db_url, connections=connections)
    except SQLAlchemyError as exc:  # NoSuchModuleError, ArgumentError: not a URL SQLAlchemy knows
        db_fail(db_url, one_line(exc))
    except ImportError as exc:  # the dialect's driver is not installed
        db_fail(db_url, f"its driver is not installed ({exc})")
    try:
        return init_db(engine)
    except (SQLAlchemyError, OSError, CommandError) as exc:
        db_fail(db_url, one_line(exc))


def open_sessions(db_url: str):
    from kato.db.session import session_factory

    engine = open_engine(db_url)
    return engine, session_factory(engine)


#: What reading a malformed recording raises (unreadable, not gzip, not JSON, wrong shape).
BAD_RECORDING = (OSError, ValueError, TypeError, KeyError)


def check_recording(path: Path, what: str, code: int = 2):
    """``path`` loaded as a Kernel Tuner cache (or T4 results) file, or the command ends
    saying it is not one."""
    try:
        return load_cache(path)
    except BAD_RECORDING as exc:
        reason = one_line(exc).removeprefix(f"{path}: ")
        if not reason.startswith("not a Kernel Tuner cache"):
            reason = f"not a Kernel Tuner cache file ({reason})"
        fail(
            f"{what} {path}: {reason}; give a Kernel Tuner cache or T4 results file "
            "(.json or .json.gz), e.g. from `kato export --format kt`",
            code,
        )


def use_stored_operators(sessions) -> None:
    """The user operators stored in the database join this process's registry."""
    from kato.db.operators import use_database

    use_database(sessions)


def progress_bar(*, disable: bool = False) -> Progress:
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


def emit(data: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, default=str))
        return
    table = Table(show_header=False)
    for k, v in data.items():
        if k == "per_seed":
            v = ", ".join(f"{p['fraction_of_optimum']:.3f}" for p in v)
        table.add_row(k, json.dumps(v, default=str) if isinstance(v, dict | list) else str(v))
    Console().print(table)


def print_records(rows: list[dict[str, str]]) -> None:
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


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
