"""What a person at the terminal meets: only what a command is for on its streams (no library
log lines, no deprecation warnings), progress for long work, token ids that can be copied
from the list into revoke, ``kato cancel`` and ``kato --version``."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kato.db import queries, tokens
from kato.db.models import ApiToken
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator, list_operators
from kato.service.cli import app
from sqlalchemy import update
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
RECORDING = REPO / "tests" / "data" / "recorded" / "softmax_H200_4096x4096_float16.json.gz"
TOKEN_ID = re.compile(r"\b[0-9a-f]{32}\b")


def _kato(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """``kato ARGS`` as a user runs it: its own process, its own logging set-up."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KATO_", "PYTHONWARN"))}
    return subprocess.run(
        [sys.executable, "-m", "kato.service.cli", *args],
        env={**clean, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        **kw,
    )


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'kato.db'}"


@pytest.fixture
def sessions(db: str):
    engine = init_db(db)
    yield session_factory(engine)
    engine.dispose()


# --- logging: one set-up in the CLI, the libraries quiet unless asked ------------------------


def test_lookup_on_a_fresh_database_prints_only_its_answer(tmp_path: Path, db: str) -> None:
    """A fresh SQLite file is migrated (alembic), answered in process (the app): neither the
    migration's INFO lines, an httpx request line nor a deprecation warning reach the user."""
    proc = _kato("lookup", "softmax", "--shape", "64x64", "--db", db, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["source"] == "default"


def test_verbose_shows_the_libraries_lines(tmp_path: Path, db: str) -> None:
    proc = _kato("-v", "lookup", "softmax", "--shape", "64x64", "--db", db, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "alembic.runtime.migration" in proc.stderr and "Running upgrade" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["source"] == "default"


def test_a_bad_log_level_is_a_clear_error(monkeypatch, db: str) -> None:
    monkeypatch.setenv("KATO_LOG_LEVEL", "loud")
    result = CliRunner().invoke(app, ["token", "list", "--db", db])
    assert result.exit_code == 2, result.output
    assert "KATO_LOG_LEVEL" in result.output and "WARNING" in result.output


# --- kato --version ----------------------------------------------------------------------------


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"kato {importlib.metadata.version('kato')}"


def test_version_verbose_lists_the_operator_versions() -> None:
    result = CliRunner().invoke(app, ["--verbose", "--version"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"kato {importlib.metadata.version('kato')}"
    for spec in list_operators():
        assert f"{spec.name} {spec.version}" in lines


# --- tokens: the ids listed are the ids revoke takes ------------------------------------------


@pytest.mark.parametrize("columns", ["200", "80", "50"])
def test_token_list_shows_whole_ids_that_revoke_accepts(monkeypatch, db: str, columns) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    runner = CliRunner()
    for name in ("ci-fleet-with-a-rather-long-name", "ops"):
        assert runner.invoke(app, ["token", "create", name, "--db", db]).exit_code == 0
    listed = runner.invoke(app, ["token", "list", "--db", db])
    assert listed.exit_code == 0, listed.output
    ids = TOKEN_ID.findall(listed.stdout)
    assert len(ids) == 2, listed.stdout
    revoked = runner.invoke(app, ["token", "revoke", ids[0], "--db", db])
    assert revoked.exit_code == 0, revoked.output
    assert f"token {ids[0]}" in revoked.output and "revoked" in revoked.output
    rows = _listed(db)
    assert {r["id"]: r["revoked_at"] is not None for r in rows} == {ids[0]: True, ids[1]: False}


def _listed(db: str) -> list[dict]:
    """``kato token list --json``'s rows."""
    result = CliRunner().invoke(app, ["token", "list", "--json", "--db", db])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def _set_id(sessions, name: str, token_id: str) -> None:
    with sessions() as session:
        token, _ = tokens.create_token(session, name)
        session.execute(update(ApiToken).where(ApiToken.id == token.id).values(id=token_id))
        session.commit()


def test_revoke_takes_a_unique_prefix(sessions, db: str) -> None:
    _set_id(sessions, "a", "abcd1111" + "0" * 24)
    _set_id(sessions, "b", "abcd2222" + "0" * 24)
    runner = CliRunner()
    ambiguous = runner.invoke(app, ["token", "revoke", "abcd", "--db", db])
    assert ambiguous.exit_code == 2, ambiguous.output
    assert "ambiguous" in ambiguous.output
    assert "abcd1111" + "0" * 24 in ambiguous.output and "abcd2222" + "0" * 24 in ambiguous.output
    one = runner.invoke(app, ["token", "revoke", "ABCD2", "--db", db])
    assert one.exit_code == 0, one.output
    assert f"token abcd2222{'0' * 24} ('b') revoked" in one.output
    # What the old table showed (cut with an ellipsis) is a prefix too.
    cut = runner.invoke(app, ["token", "revoke", "abcd1111…", "--db", db])
    assert cut.exit_code == 0, cut.output
    with sessions() as session:
        assert all(t.revoked_at is not None for t in tokens.list_tokens(session))


@pytest.mark.parametrize(
    "given, phrase",
    [
        ("ffff0000", "no token with id 'ffff0000'"),
        ("abc", "at least 4"),
        ("not-hex!", "no token with id 'not-hex!'"),
        ("", "no token with id ''"),
    ],
)
def test_revoke_an_unknown_id_says_so(sessions, db: str, given: str, phrase: str) -> None:
    _set_id(sessions, "a", "abcd1111" + "0" * 24)
    result = CliRunner().invoke(app, ["token", "revoke", given, "--db", db])
    assert result.exit_code == 2, result.output
    assert phrase in result.output and "kato token list" in result.output
    with sessions() as session:
        assert tokens.list_tokens(session)[0].revoked_at is None


def test_token_create_admin(db: str) -> None:
    runner = CliRunner()
    created = runner.invoke(app, ["token", "create", "ops", "--admin", "--db", db])
    assert created.exit_code == 0, created.output
    assert "admin" in created.output
    assert runner.invoke(app, ["token", "create", "ci", "--db", db]).exit_code == 0
    rows = _listed(db)
    assert {r["name"]: r["admin"] for r in rows} == {"ops": True, "ci": False}
    table = runner.invoke(app, ["token", "list", "--db", db]).stdout
    assert "admin" in table


# --- kato cancel -------------------------------------------------------------------------------


def _job(sessions, token_id: str | None = None):
    spec = get_operator("softmax")
    with sessions() as session:
        return queries.create_job(
            session,
            operator="softmax",
            operator_version=spec.version,
            shape=[4096, 4096],
            dtype="float16",
            gpu_model="H200",
            budget_configs=5,
            token_id=token_id,
        )


def test_cancel_a_queued_job_of_a_revoked_token(sessions, db: str) -> None:
    with sessions() as session:
        token, _ = tokens.create_token(session, "gone")
    job = _job(sessions, token.id)
    with sessions() as session:
        tokens.revoke_token(session, token.id)
    result = CliRunner().invoke(app, ["cancel", job.id, "--db", db])
    assert result.exit_code == 0, result.output
    assert f"job {job.id} cancelled" in result.output
    with sessions() as session:
        assert queries.get_job(session, job.id).status == "cancelled"


def test_cancel_a_running_job_asks_its_worker_to_stop(sessions, db: str) -> None:
    job = _job(sessions)
    with sessions() as session:
        claimed = queries.claim_next_job(
            session, gpu_models=["H200"], worker_id="w1", lease_seconds=60
        )
        assert claimed.id == job.id
    result = CliRunner().invoke(app, ["cancel", job.id, "--db", db])
    assert result.exit_code == 0, result.output
    assert "cancel requested" in result.output and "w1" in result.output
    with sessions() as session:
        stored = queries.get_job(session, job.id)
        assert stored.status == "running" and stored.cancel_requested


def test_cancel_a_job_whose_worker_died_says_so(sessions, db: str) -> None:
    job = _job(sessions)
    with sessions() as session:
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1", lease_seconds=0.01)
    time.sleep(0.05)
    result = CliRunner().invoke(app, ["cancel", job.id, "--db", db])
    assert result.exit_code == 0, result.output
    assert "has not renewed its lease" in result.output
    with sessions() as session:  # the next worker looking for work marks it cancelled
        assert (
            queries.claim_next_job(session, gpu_models=["A100"], worker_id="w2", lease_seconds=60)
            is None
        )
        assert queries.get_job(session, job.id).status == "cancelled"


def test_cancel_a_finished_job_is_a_no_op(sessions, db: str) -> None:
    job = _job(sessions)
    runner = CliRunner()
    assert runner.invoke(app, ["cancel", job.id, "--db", db]).exit_code == 0
    again = runner.invoke(app, ["cancel", job.id, "--db", db])
    assert again.exit_code == 0, again.output
    assert "already cancelled" in again.output and "nothing to do" in again.output


def test_cancel_takes_a_unique_prefix_of_the_id_as_a_listing_shows_it(sessions, db: str):
    first, second = _job(sessions), _job(sessions)
    shared = 0
    while first.id[shared] == second.id[shared]:
        shared += 1
    result = CliRunner().invoke(app, ["cancel", first.id[: max(shared + 1, 8)] + "…", "--db", db])
    assert result.exit_code == 0, result.output
    assert f"job {first.id} cancelled" in result.output
    with sessions() as session:
        assert queries.get_job(session, first.id).status == "cancelled"
        assert queries.get_job(session, second.id).status == "queued"
    short = CliRunner().invoke(app, ["cancel", first.id[:3], "--db", db])
    assert short.exit_code == 2 and "at least 4 characters" in short.output


def test_cancel_with_an_ambiguous_prefix_names_the_jobs(sessions, db: str):
    from kato.db.models import Job
    from sqlalchemy import update

    ids = ["abcd1111" + "0" * 24, "abcd2222" + "0" * 24]
    for new_id in ids:
        made = _job(sessions)
        with sessions() as session:  # ids that share a prefix, as uuid4s rarely do
            session.execute(update(Job).where(Job.id == made.id).values(id=new_id))
            session.commit()
    result = CliRunner().invoke(app, ["cancel", "ABCD", "--db", db])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "is ambiguous" in text and all(i in text for i in ids)
    with sessions() as session:
        assert all(queries.get_job(session, i).status == "queued" for i in ids)
    assert CliRunner().invoke(app, ["cancel", "abcd2", "--db", db]).exit_code == 0


@pytest.mark.parametrize("job_id", ["0" * 32, "nope", "x" * 200])
def test_cancel_an_unknown_job_exits_2(sessions, db: str, job_id: str) -> None:
    result = CliRunner().invoke(app, ["cancel", job_id, "--db", db])
    assert result.exit_code == 2, result.output
    assert "no job with id" in result.output and "Traceback" not in result.output


# --- progress ----------------------------------------------------------------------------------


def test_replay_search_reports_progress() -> None:
    from kato.tuner.replay_eval import replay_search

    seen: list[tuple[int, int]] = []
    report = replay_search(
        RECORDING, budget=4, repeats=2, seed=0, on_progress=lambda d, t: seen.append((d, t))
    )
    assert report.repeats == 2
    assert all(total == 8 for _, total in seen)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == 8 and len(done) >= 8


def test_replay_json_output_stays_clean() -> None:
    result = CliRunner().invoke(
        app, ["replay", str(RECORDING), "--budget", "3", "--repeats", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert json.loads(result.stdout)["repeats"] == 2


def _on_a_terminal(*args: str, tmp_path: Path) -> str:
    """What ``kato ARGS`` writes to stderr when stderr is a terminal (a pseudo-terminal)."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kato.service.cli", *args],
            env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "COLUMNS": "120"},
            stdout=subprocess.DEVNULL,
            stderr=slave,
            cwd=tmp_path,
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=180) == 0
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_replay_shows_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    shown = _on_a_terminal(
        "replay", str(RECORDING), "--budget", "3", "--repeats", "2", tmp_path=tmp_path
    )
    assert "replay" in shown and "6/6" in shown, shown


RECORDINGS = [RECORDING, RECORDING.with_name("softmax_H200_4096x4096_float32.json.gz")]


def test_import_reports_progress(sessions) -> None:
    from kato.db.importer import import_paths

    seen: list[tuple[str, int, int]] = []
    with sessions() as session:
        report = import_paths(session, RECORDINGS, on_progress=lambda *a: seen.append(a))
    assert report.files == 2
    assert seen == [("check", 1, 2), ("check", 2, 2), ("write", 1, 2), ("write", 2, 2)]


def test_import_shows_a_progress_bar_on_a_terminal(tmp_path: Path, db: str) -> None:
    shown = _on_a_terminal("import", *map(str, RECORDINGS), "--db", db, tmp_path=tmp_path)
    assert "import: writing" in shown and "2/2" in shown, shown


def test_import_json_output_stays_clean(db: str) -> None:
    result = CliRunner().invoke(app, ["import", *map(str, RECORDINGS), "--json", "--db", db])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert json.loads(result.stdout)["files"] == 2


def test_worker_logs_one_line_per_trial(sessions, db: str, caplog) -> None:
    job = _job(sessions)
    caplog.set_level(logging.INFO, logger="kato.tuner.worker")
    result = CliRunner().invoke(
        app,
        ["worker", "--backend", "replay", "--replay", str(RECORDING), "--max-jobs", "1"]
        + ["--db", db],
    )
    assert result.exit_code == 0, result.output
    lines = [r.getMessage() for r in caplog.records if r.name == "kato.tuner.worker"]
    trials = [line for line in lines if " trial " in line]
    assert len(trials) == 5, lines
    assert lines[-1].startswith(f"job {job.id} done: 5 config(s) measured, best ")
    with sessions() as session:
        stored = queries.job_trials(session, job.id)
    for line, trial in zip(trials, stored, strict=True):
        assert line.startswith(f"job {job.id} trial {trial.number} (")
        assert f"/5): {trial.status} " in line
        if trial.time_ms is not None:
            assert f"{trial.time_ms:.4f} ms, best " in line
        assert json.dumps(trial.config, sort_keys=True) in line


def test_every_command_has_a_one_line_summary_in_the_command_list():
    """`kato --help` lists each command with its help's first paragraph, keeping its line
    breaks: a paragraph over several source lines broke mid-sentence there. A command whose
    first paragraph spans lines sets a one-line short_help."""
    import typer.main
    from kato.service.cli import app as cli_app

    def walk(group, prefix=""):
        for name, command in group.commands.items():
            yield f"{prefix}{name}", command
            if hasattr(command, "commands"):
                yield from walk(command, f"{prefix}{name} ")

    for name, command in walk(typer.main.get_command(cli_app)):
        summary = command.short_help or (command.help or "").strip().split("\n\n")[0]
        assert "\n" not in summary, f"kato {name}: {summary!r}"


def test_jobs_lists_progress_and_the_time_left_of_running_jobs(sessions, db: str) -> None:
    from datetime import timedelta

    from kato.db.models import Job, utcnow

    version = get_operator("softmax").version
    with sessions() as session:
        running, queued = queries.create_jobs(
            session,
            [
                dict(operator="softmax", operator_version=version, shape=[64, 1024],
                     dtype="float16", gpu_model="H200", budget_configs=40),
                dict(operator="softmax", operator_version=version, shape=[8, 8],
                     dtype="float32", gpu_model="H200", budget_configs=10),
            ],
        )  # fmt: skip
        started = utcnow() - timedelta(seconds=20)
        session.execute(
            update(Job)
            .where(Job.id == running.id)
            .values(status="running", trials_done=10, best_time_ms=0.25, started_at=started)
        )
        session.commit()
        running_id, queued_id = running.id, queued.id
    result = CliRunner().invoke(app, ["jobs", "--json", "--db", db])
    assert result.exit_code == 0, result.output
    listed = {j["id"]: j for j in json.loads(result.stdout)}
    assert listed.keys() == {running_id, queued_id}
    run = listed[running_id]
    assert run["trials_done"] == 10 and run["budget"] == 40
    # 10 configs in ~20 s: 30 configs left take ~60 s.
    assert 19 < run["elapsed_s"] < 40 and 55 < run["eta_s"] < 120
    assert listed[queued_id]["elapsed_s"] is None and listed[queued_id]["eta_s"] is None
    table = CliRunner().invoke(app, ["jobs", "--status", "running", "--db", db])
    assert table.exit_code == 0, table.output
    assert running_id in table.stdout and queued_id not in table.stdout
    assert "10/40" in table.stdout and "0.2500" in table.stdout
    bad = CliRunner().invoke(app, ["jobs", "--status", "sleeping", "--db", db])
    assert bad.exit_code == 2 and "status must be one of" in bad.output
