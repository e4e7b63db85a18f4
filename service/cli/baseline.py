"""``kato baseline``: PyTorch's eager and compiled baselines for stored winners that lack them."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    check_operators,
    console,
    fail,
    gpu_model_of,
    gpu_option,
    load_settings,
    open_sessions,
    print_records,
    progress_bar,
    use_stored_operators,
)


@app.command(
    short_help="Time PyTorch's op (eager and compiled) for stored winners that lack it, on this "
    "host's GPU."
)
def baseline(
    db: DbOption = None,
    device: Annotated[int, typer.Option(min=0, help="CUDA device to measure on")] = 0,
    operator: Annotated[
        list[str] | None, typer.Option(help="only this operator (repeatable)")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            help="GPU model of the winners (default: the device's; must match it unless --dry-run)"
        ),  # fmt: skip
    ] = None,
    redo: Annotated[
        bool, typer.Option("--all", help="measure winners that have baselines too")
    ] = False,
    compiled: Annotated[
        bool,
        typer.Option(
            "--compiled/--no-compiled",
            help="also the op compiled by torch.compile (without it, a measured winner's stored "
            "compiled figure is cleared: the two figures are one measurement's)",
        ),
    ] = True,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="list the winners it would measure; no GPU needed")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="one JSON line per winner instead of the table")
    ] = False,
) -> None:
    """Time PyTorch's own op, eagerly and compiled by torch.compile, for every stored winner of
    this GPU model at its operator's current version that lacks those figures (imported, tuned
    with the baseline off, or stored before the compiled baseline), and store them beside it:
    kato_torch's policy compares winners with them. Each is measured in a child process of its
    own on the given device, as a worker measures them after a job; the configs and their
    times stay. Stop it with Ctrl-C: what was measured is kept. Exit status 0 when every
    winner's baselines were stored, 1 when one was not (the table says why), 130 when
    interrupted."""
    from kato.tuner import baselines

    settings = load_settings(db)
    _, sessions = open_sessions(settings.db_url)
    use_stored_operators(sessions)
    known = sorted(spec.name for spec in baselines.measurable())
    check_operators(operator, known, "an operator with a PyTorch op (a user operator has none)")
    model = gpu_option(gpu)
    if not dry_run:
        local = gpu_model_of(device)
        if model is not None and model != local:
            fail(f"--gpu {model}: device {device} is a {local}; a baseline is measured on the "
                 "GPU model its winner was tuned on", 2)  # fmt: skip
        model = local
    elif model is None:
        fail("--dry-run needs --gpu (the model whose winners to list)", 2)

    with sessions() as session:
        todo = baselines.winners(
            session, model, operators=operator, missing_only=not redo, compiled=compiled
        )
    if dry_run or not todo:
        listed = [baselines.Outcome(w, "to measure", framework_ms=w.framework_ms,
                                    compiled_ms=w.compiled_ms) for w in todo]  # fmt: skip
        _show(listed, as_json)
        console.print(f"{len(todo)} winner(s) of {model} to measure" + (
            " (dry run)" if dry_run else ""))  # fmt: skip
        return

    outcomes, interrupted = [], False
    with progress_bar(disable=as_json) as bar:
        task = bar.add_task("baselines", total=len(todo))
        try:
            baselines.fill(
                sessions, todo, model, device_index=device, compiled=compiled,
                on_outcome=lambda o: (outcomes.append(o), bar.advance(task)),
            )  # fmt: skip
        except KeyboardInterrupt:
            interrupted = True
            console.print("interrupted: the baselines measured so far are stored")
    _show(outcomes, as_json)
    stored = sum(o.status == "stored" for o in outcomes)
    console.print(f"{stored} of {len(todo)} winner(s) of {model}: baselines stored")
    if interrupted:  # a script must not take a partial run for a finished one
        raise typer.Exit(130)
    if stored < len(outcomes):
        raise typer.Exit(1)


def _show(outcomes, as_json: bool) -> None:
    """One JSON line per outcome, or a table (stdout)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    if as_json:
        for o in outcomes:
            w = o.winner
            typer.echo(json.dumps({
                "operator": w.operator, "shape": list(w.shape), "dtype": w.dtype,
                "time_ms": w.time_ms, "status": o.status, "framework_ms": o.framework_ms,
                "framework": o.framework, "speedup": o.speedup, "compiled_ms": o.compiled_ms,
                "compiled": o.compiled, "compiled_speedup": o.compiled_speedup,
                "detail": o.detail,
            }))  # fmt: skip
        return
    if not outcomes:
        return
    print_records([
        {"operator": o.winner.operator, "shape": "x".join(map(str, o.winner.shape)),
         "dtype": o.winner.dtype, "Kato ms": ms(o.winner.time_ms),
         "torch ms": ms(o.framework_ms), "speedup": times(o.speedup),
         "compiled ms": ms(o.compiled_ms), "vs compiled": times(o.compiled_speedup),
         "status": o.status if o.detail is None else f"{o.status}: {o.detail}"}
        for o in outcomes
    ])  # fmt: skip
