"""``kato operator add DIR`` / ``list`` and ``kato token create --operators``."""

from __future__ import annotations

import json
import shutil

from kato.db import tokens
from kato.db.session import init_db, session_factory
from kato.service import lookup as service_lookup
from kato.service.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def test_add_list_and_version(tmp_path, vector_add_dir):
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    folder = tmp_path / "op"
    shutil.copytree(vector_add_dir, folder)
    first = runner.invoke(app, ["operator", "add", str(folder), "--db", db, "--json"])
    assert first.exit_code == 0, first.output
    added = json.loads(first.stdout)
    assert added["name"] == "vector_add_test" and added["created"] is True
    again = runner.invoke(app, ["operator", "add", str(folder), "--db", db, "--json"])
    assert json.loads(again.stdout)["created"] is False
    (folder / "vector_add.cu").write_text((folder / "vector_add.cu").read_text() + "\n")
    changed = json.loads(
        runner.invoke(app, ["operator", "add", str(folder), "--db", db, "--json"]).stdout
    )
    assert changed["created"] is True and changed["versions"] == 2
    assert changed["version"] != added["version"]
    listed = runner.invoke(app, ["operator", "list", "--db", db, "--json"])
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["name"], r["version"], r["versions"]) for r in rows] == [
        ("vector_add_test", changed["version"], "2")
    ]


def test_a_backward_operator_is_added_first_and_listed(
    tmp_path, scaled_mul_dir, scaled_mul_backward_dir
):
    """A folder whose [backward] names an operator not stored yet is refused with the reason;
    stored after it, it is listed with it (copies renamed: the names of the folders may be
    registered in this process by other tests)."""
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    forward, backward = tmp_path / "fwd", tmp_path / "bwd"
    shutil.copytree(scaled_mul_dir, forward)
    shutil.copytree(scaled_mul_backward_dir, backward)
    for folder in (forward, backward):
        spec = folder / "kato.toml"
        text = spec.read_text().replace('"scaled_mul_backward_test"', '"cli_scaled_mul_backward"')
        spec.write_text(text.replace('"scaled_mul_test"', '"cli_scaled_mul"'))
    refused = runner.invoke(app, ["operator", "add", str(forward), "--db", db])
    assert refused.exit_code == 2
    assert "'cli_scaled_mul_backward' is not registered; register the backward" in (
        " ".join(refused.output.split())
    )
    for folder in (backward, forward):
        added = runner.invoke(app, ["operator", "add", str(folder), "--db", db, "--json"])
        assert added.exit_code == 0, added.output
    listed = runner.invoke(app, ["operator", "list", "--db", db, "--json"])
    rows = {r["name"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert rows["cli_scaled_mul"]["backward"] == "cli_scaled_mul_backward"
    assert rows["cli_scaled_mul_backward"]["backward"] == ""
    # The version leaves the section and the description out: the stored version takes them.
    spec = forward / "kato.toml"
    text = spec.read_text()
    spec.write_text(text.replace('gradients = { grad_a = "a", grad_b = "b" }',
                                 'gradients = { grad_a = "b", grad_b = "a" }'))  # fmt: skip
    swapped = runner.invoke(app, ["operator", "add", str(forward), "--db", db])
    version = rows["cli_scaled_mul"]["version"]
    assert f"operator cli_scaled_mul version {version}: already stored; its backward updated; " \
           "1 version(s)" in " ".join(swapped.output.split())  # fmt: skip
    spec.write_text(text[: text.index("[backward]")].replace("y = alpha", "y equals alpha"))
    removed = runner.invoke(app, ["operator", "add", str(forward), "--db", db, "--json"])
    assert json.loads(removed.stdout) == {"name": "cli_scaled_mul", "version": version,
        "created": False, "versions": 1, "updated": ["description", "backward"]}  # fmt: skip
    listed = runner.invoke(app, ["operator", "list", "--db", db, "--json"])
    rows = {r["name"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert (rows["cli_scaled_mul"]["version"], rows["cli_scaled_mul"]["backward"]) == (version, "")


def test_bad_folder_is_reported_not_stored(tmp_path, vector_add_dir):
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    folder = tmp_path / "op"
    shutil.copytree(vector_add_dir, folder)
    spec = (folder / "kato.toml").read_text()
    (folder / "kato.toml").write_text(spec.replace("tile_size_x <= 4096", "unroll <= 4096"))
    result = runner.invoke(app, ["operator", "add", str(folder), "--db", db])
    assert result.exit_code == 2
    assert "unknown name 'unroll'" in result.output
    assert "restriction 1" in result.output
    empty = runner.invoke(app, ["operator", "list", "--db", db])
    assert "no user operators stored" in empty.output
    missing = runner.invoke(app, ["operator", "add", str(tmp_path / "nope"), "--db", db])
    assert missing.exit_code == 2 and "not a directory" in missing.output


def test_token_with_the_operators_scope(tmp_path):
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    result = runner.invoke(app, ["token", "create", "ops", "--operators", "--db", db])
    assert result.exit_code == 0, result.output
    plain = runner.invoke(app, ["token", "create", "plain", "--db", db])
    engine = init_db(db)
    with session_factory(engine)() as session:
        assert tokens.find_token(session, result.stdout.strip()).operators is True
        assert tokens.find_token(session, plain.stdout.strip()).operators is False
    engine.dispose()


def test_folder_operator_tuned_on_replay_exported_and_imported(tmp_path, vector_add_dir):
    """kato operator add, a replay worker tunes it, kato export --format kt writes its space,
    and kato import loads that into a second database holding the same operator."""
    import threading

    from kato.db.operators import use_database
    from kato.kernels import get_operator, registry
    from kato.tuner.factories import replay_backend_factory
    from kato.tuner.worker import Worker

    from user_ops.recording import record

    db = f"sqlite:///{tmp_path / 'kato.db'}"
    other = f"sqlite:///{tmp_path / 'other.db'}"
    for url in (db, other):
        result = runner.invoke(app, ["operator", "add", str(vector_add_dir), "--db", url])
        assert result.exit_code == 0, result.output
    engine = init_db(db)
    sessions = session_factory(engine)
    source = use_database(sessions)
    try:
        op = get_operator("vector_add_test")
        path, best = record(op, (4096,), tmp_path / "rec" / "vector_add_test.json")
        from kato.db import queries

        with sessions() as session:
            queries.create_job(
                session, operator=op.name, operator_version=op.version, shape=[4096],
                dtype="float32", gpu_model="H200", budget_configs=23, strategy="grid",
            )  # fmt: skip
        worker = Worker(sessions, db, ["H200"], replay_backend_factory(path.parent),
                        worker_id="w-cli", poll_seconds=0.01)  # fmt: skip
        thread = threading.Thread(target=worker.run_forever, kwargs={"max_jobs": 1})
        thread.start()
        thread.join(120)
        with sessions() as session:
            (row,) = queries.list_jobs(session)
            assert row.status == "done" and row.best_config == best
        out = tmp_path / "export"
        exported = runner.invoke(
            app, ["export", str(out), "--format", "kt", "--operator", op.name, "--db", db]
        )
        assert exported.exit_code == 0, exported.output
        files = list(out.glob("*.json*"))
        assert len(files) == 1
        imported = runner.invoke(app, ["import", str(files[0]), "--db", other])
        assert imported.exit_code == 0, imported.output
    finally:
        registry.remove_source(source)
        engine.dispose()
    engine = init_db(other)
    with session_factory(engine)() as session:
        from kato.db import queries

        found, how = service_lookup.lookup_best_config(
            session, operator=op.name, operator_version=op.version, shape=[4096],
            dtype="float32", gpu_model="H200",
        )  # fmt: skip
        assert how == "exact" and found.config == best
    engine.dispose()


def test_replay_worker_command_answers_a_stored_operator(tmp_path, vector_add_dir):
    """`kato worker --backend replay` reads the stored operators before checking its
    recordings against them, then tunes the stored operator's job."""
    from kato.db import queries
    from kato.kernels import registry
    from kato.kernels.user import spec_from_folder

    from user_ops.recording import record

    db = f"sqlite:///{tmp_path / 'kato.db'}"
    assert runner.invoke(app, ["operator", "add", str(vector_add_dir), "--db", db]).exit_code == 0
    registry._OPERATORS.pop("vector_add_test", None)  # known from the database only
    op = spec_from_folder(vector_add_dir)
    _, best = record(op, (8192,), tmp_path / "rec" / "vector_add_test.json")
    engine = init_db(db)
    with session_factory(engine)() as session:
        job = queries.create_job(
            session, operator=op.name, operator_version=op.version, shape=[8192],
            dtype="float32", gpu_model="H200", budget_configs=23, strategy="grid",
        )  # fmt: skip
        job_id = job.id
    result = runner.invoke(
        app,
        ["worker", "--backend", "replay", "--replay", str(tmp_path / "rec"), "--max-jobs", "1",
         "--db", db, "--poll-seconds", "0.01"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    with session_factory(engine)() as session:
        job = queries.get_job(session, job_id)
        assert job.status == "done" and job.best_config == best
    engine.dispose()
