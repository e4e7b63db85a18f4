"""Schema migrations: init_db creates the schema, is idempotent, and matches the models."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from kato.db.models import Base, BestConfig
from kato.db.session import (
    VERSION_TABLE,
    current_revision,
    default_db_url,
    head_revision,
    include_name,
    init_db,
    make_engine,
)
from sqlalchemy import Engine, inspect, select, text

OUR_TABLES = {
    "kato_jobs",
    "kato_trials",
    "kato_best_configs",
    "kato_workers",
    "kato_api_tokens",
    "kato_user_operators",
    VERSION_TABLE,
}


def test_init_db_creates_the_tables_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "kato.db"
    engine = init_db(f"sqlite:///{path}")
    assert path.exists()
    assert set(inspect(engine).get_table_names()) >= OUR_TABLES
    with engine.connect() as connection:
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert connection.execute(text("PRAGMA busy_timeout")).scalar() == 30_000
    assert current_revision(engine) == head_revision() == "0009"


def test_init_db_twice_is_a_no_op(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kato.db'}"
    first = init_db(url)
    with first.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO kato_jobs (id, operator, operator_version, shape, shape_key, dtype,"
                " gpu_model, budget_configs, strategy, seed, status, trials_done, created_at,"
                " cancel_requested) VALUES ('j1', 'softmax', 'v', '[1, 2]', '1x2', 'float32',"
                " 'H200', 10, 'tpe', 0, 'queued', 0, '2026-01-01 00:00:00.000000', 0)"
            )
        )
    second = init_db(url)
    assert current_revision(second) == head_revision()
    with second.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM kato_jobs")).scalar() == 1


def test_init_db_works_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    engine = init_db(f"sqlite:///{tmp_path / 'kato.db'}")
    assert current_revision(engine) == head_revision()


def test_concurrent_init_db_migrates_once(db_url: str) -> None:
    """A service and workers starting together on an empty database: one migrates, the others
    wait for it (advisory lock on PostgreSQL, file lock on SQLite), nobody fails."""
    errors: list[BaseException] = []
    engines: list[Engine] = []
    start = threading.Barrier(4)

    def start_process() -> None:
        try:
            start.wait()
            engines.append(init_db(db_url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start_process) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert [current_revision(e) for e in engines] == [head_revision()] * 4
    for engine in engines:
        engine.dispose()


def test_connections_opening_a_new_sqlite_file_at_once_all_succeed(tmp_path: Path) -> None:
    """The first connections to a new file race to switch it to WAL, and SQLite answers the
    losers "database is locked" at once, without the busy timeout: make_engine retries."""
    for attempt in range(60):  # the race is in the first milliseconds of a file: run it often
        url = f"sqlite:///{tmp_path / f'k{attempt}.db'}"
        engines = [make_engine(url) for _ in range(4)]
        barrier = threading.Barrier(len(engines))
        errors: list[BaseException] = []

        def write(
            engine: Engine, n: int, barrier: threading.Barrier, errors: list[BaseException]
        ) -> None:
            barrier.wait()
            try:
                with engine.begin() as connection:
                    connection.execute(text("CREATE TABLE IF NOT EXISTS t (n INTEGER)"))
                    connection.execute(text("INSERT INTO t VALUES (:n)"), {"n": n})
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=write, args=(e, n, barrier, errors))
            for n, e in enumerate(engines)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, f"attempt {attempt}: {errors}"
        with engines[0].connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM t")).scalar() == len(engines)
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        for engine in engines:
            engine.dispose()


def test_in_memory_database() -> None:
    engine = init_db("sqlite://")
    assert "kato_jobs" in inspect(engine).get_table_names()


def assert_models_match_head(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={
                "compare_type": True,
                "include_name": include_name,
                "version_table": VERSION_TABLE,
            },
        )
        assert compare_metadata(context, Base.metadata) == []


def test_head_matches_the_models(engine: Engine) -> None:
    """Autogenerate finds nothing to do: migrations and models agree (SQLite and PostgreSQL)."""
    assert_models_match_head(engine)


def test_coexists_with_optuna_tables(tmp_path: Path) -> None:
    """Optuna's RDB storage shares the database: its tables are ignored, nothing collides."""
    import optuna

    url = f"sqlite:///{tmp_path / 'kato.db'}"
    engine = init_db(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name="s")
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=2)
    init_db(url)  # still a no-op with Optuna's tables (and its alembic_version) present

    tables = set(inspect(engine).get_table_names())
    assert {"trials", "studies", "alembic_version"} <= tables
    assert tables >= OUR_TABLES
    assert_models_match_head(engine)


def test_default_db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KATO_DB_URL", raising=False)
    assert default_db_url() == f"sqlite:///{tmp_path}/.local/share/kato/kato.db"
    assert (tmp_path / ".local" / "share" / "kato").is_dir()

    monkeypatch.setenv("KATO_DB_URL", str(tmp_path / "other" / "x.db"))
    assert default_db_url() == f"sqlite:///{tmp_path}/other/x.db"
    assert (tmp_path / "other").is_dir()

    monkeypatch.setenv("KATO_DB_URL", "postgresql+psycopg://u@host/db")
    assert default_db_url() == "postgresql+psycopg://u@host/db"


def _upgrade(engine: Engine, revision: str) -> None:
    from alembic import command
    from kato.db.session import alembic_config

    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def test_0003_renumbers_repeated_trial_numbers_then_refuses_them(db_url: str) -> None:
    """A database written before 0003 holds jobs whose trial numbers repeat (a worker died in a
    shared job): the migration renumbers each such job densely in (number, id) order, leaves
    the other jobs alone, and from then on the database refuses a repeated number."""
    from sqlalchemy.exc import IntegrityError

    engine = make_engine(db_url)
    _upgrade(engine, "0002")
    job = (
        "INSERT INTO kato_jobs (id, operator, operator_version, shape, shape_key, dtype,"
        " gpu_model, budget_configs, strategy, seed, status, trials_done, created_at,"
        " cancel_requested) VALUES (:id, 'softmax', 'v', '[1, 2]', '1x2', 'float32', 'H200',"
        " 10, 'tpe', 0, 'done', 6, '2026-01-01 00:00:00+00:00', false)"
    )
    trial = (
        "INSERT INTO kato_trials (id, job_id, number, config, config_key, status, times_ms,"
        " created_at) VALUES (:id, :job, :number, '{}', :key, 'ok', '[]',"
        " '2026-01-01 00:00:00+00:00')"
    )
    # (row id, job, number): "dup" holds 3 and 4 twice, 2 and 5 missing; "gap" has no repeat.
    rows = [(1, "dup", 0), (2, "dup", 1), (3, "dup", 3), (4, "dup", 4), (5, "dup", 3),
            (6, "dup", 4), (7, "gap", 0), (8, "gap", 2)]  # fmt: skip
    with engine.begin() as connection:
        for job_id in ("dup", "gap"):
            connection.execute(text(job), {"id": job_id})
        for row_id, job_id, number in rows:
            connection.execute(
                text(trial), {"id": row_id, "job": job_id, "number": number, "key": f"k{row_id}"}
            )
    init_db(engine)
    assert current_revision(engine) == head_revision()
    with engine.connect() as connection:
        numbers = dict(connection.execute(text("SELECT id, number FROM kato_trials")).all())
    assert numbers == {1: 0, 2: 1, 3: 2, 5: 3, 4: 4, 6: 5, 7: 0, 8: 2}
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(text(trial), {"id": 9, "job": "gap", "number": 2, "key": "k9"})
    engine.dispose()


def test_0006_adds_the_figures_beside_each_winner_to_an_existing_database(db_url: str) -> None:
    """A database at 0005 with a stored winner: after the upgrade the row is kept, its figures
    are unknown (NULL), and a new winner stores them; the downgrade drops the columns again."""
    from kato.db import queries
    from kato.db.session import session_factory

    engine = make_engine(db_url)
    _upgrade(engine, "0005")
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO kato_best_configs (id, operator, operator_version, shape, shape_key,"
                " dtype, gpu_model, compute_capability, cuda_version, config, time_ms,"
                " updated_at) VALUES (1, 'softmax', 'v', '[64, 64]', '64x64', 'float16', 'H200',"
                " '9.0', '13.0', '{\"BLOCK_SIZE\": 128}', 0.5, '2026-01-01 00:00:00+00:00')"
            )
        )
    init_db(engine)
    assert current_revision(engine) == head_revision()
    assert_models_match_head(engine)
    with session_factory(engine)() as session:
        (row,) = session.scalars(select(BestConfig)).all()
        assert (row.time_ms, row.default_ms, row.framework_ms, row.framework) == (
            0.5, None, None, None,
        )  # fmt: skip
        kept = queries.upsert_best_config(
            session, operator="softmax", operator_version="v", shape=[64, 64], dtype="float16",
            gpu_model="H200", compute_capability="9.0", cuda_version="13.0",
            config={"BLOCK_SIZE": 256}, time_ms=0.6, job_id=None, default_ms=0.7,
            framework_ms=0.65, framework="torch 2.13.0",
        )  # fmt: skip
        assert kept.id == 1 and kept.config == {"BLOCK_SIZE": 128}
        assert (kept.default_ms, kept.framework_ms, kept.framework) == (0.7, 0.65, "torch 2.13.0")
    from alembic import command
    from kato.db.session import alembic_config

    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, "0005")
    columns = {c["name"] for c in inspect(engine).get_columns("kato_best_configs")}
    assert not columns & {"default_ms", "framework_ms", "framework"} and "time_ms" in columns
    engine.dispose()


def _downgrade(engine: Engine, revision: str) -> None:
    from alembic import command
    from kato.db.session import alembic_config

    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def test_0007_moves_who_reserved_a_trial_out_of_its_error_text(db_url: str) -> None:
    """A database at 0006 with a shared job in flight: two reservations named their workers in
    the error text (one id with the ``_`` and ``%`` a LIKE pattern would misread), next to a
    recorded trial whose error is a real one. After the upgrade the reservations name their
    workers in ``reserved_by`` (``reserved_at``: when they were inserted) with no error text,
    the recorded trial is unchanged, and the ledger goes on from there: the live worker's
    reservation is its own, the dead one's is released and its result stored by the live one.
    The downgrade writes the text back."""
    from kato.db.ledger import Ledger
    from kato.db.models import Trial
    from kato.db.retry import RetryPolicy
    from kato.db.session import session_factory

    engine = make_engine(db_url)
    _upgrade(engine, "0006")
    live, dead = "host_1-42-a%b", "gone-7-c0ffee"
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO kato_jobs (id, operator, operator_version, shape, shape_key, dtype,"
                " gpu_model, budget_configs, strategy, seed, status, trials_done, created_at,"
                " cancel_requested, worker_id, lease_expires_at) VALUES ('j1', 'softmax', 'v',"
                " '[1, 2]', '1x2', 'float32', 'H200', 10, 'tpe', 0, 'running', 3,"
                " '2026-01-01 00:00:00+00:00', false, :live, '2099-01-01 00:00:00+00:00')"
            ),
            {"live": live},
        )
        trial = (
            "INSERT INTO kato_trials (id, job_id, number, config, config_key, status, times_ms,"
            " error, created_at) VALUES (:id, 'j1', :number, :config, :key, :status, '[]',"
            " :error, :at)"
        )
        # (id and number, status, error, minute inserted): k0 a result whose error only
        # looks like a reservation's (its status says it is not), k1 and k2 reservations.
        rows = [
            (0, "compile_error", "ptxas: being measured by worker x", 1),
            (1, "running", f"being measured by worker {live}", 2),
            (2, "running", f"being measured by worker {dead}", 3),
        ]
        for n, status, error, minute in rows:
            connection.execute(
                text(trial),
                {"id": n + 1, "number": n, "config": f'{{"k": "k{n}"}}', "key": f"k{n}",
                 "status": status, "error": error, "at": f"2026-01-01 00:0{minute}:00+00:00"},
            )  # fmt: skip
    init_db(engine)
    assert current_revision(engine) == head_revision() == "0009"
    assert_models_match_head(engine)
    sessions = session_factory(engine)
    with sessions() as session:
        got = {
            t.config_key: (t.status, t.error, t.reserved_by, t.reserved_at and t.reserved_at.minute)
            for t in session.scalars(select(Trial))
        }
    assert got == {
        "k0": ("compile_error", "ptxas: being measured by worker x", None, None),
        "k1": ("running", None, live, 2),
        "k2": ("running", None, dead, 3),
    }
    no_retry = RetryPolicy(max_seconds=0)
    owner = Ledger(sessions, live, lease_seconds=60, retry_policy=no_retry).job("j1")
    assert owner.reserve({"k": "k1"}, "k1") == "reserved"  # its own, from before the upgrade
    assert owner.release_stale() == 1  # the dead worker's (it never beat)
    assert owner.reserve({"k": "k2"}, "k2") == "reserved"
    result = {"config": {"k": "k2"}, "status": "ok", "times_ms": [1.0], "time_ms": 1.0}
    assert owner.record("k2", result)
    with sessions() as session:
        by_key = {t.config_key: t for t in session.scalars(select(Trial))}
        assert (by_key["k2"].status, by_key["k2"].reserved_by) == ("ok", live)
        assert session.scalar(text("SELECT trials_done FROM kato_jobs")) == 3

    _downgrade(engine, "0006")
    columns = {c["name"] for c in inspect(engine).get_columns("kato_trials")}
    assert not columns & {"reserved_by", "reserved_at"}
    with engine.connect() as connection:
        errors = dict(connection.execute(text("SELECT config_key, error FROM kato_trials")).all())
    assert errors == {
        "k0": "ptxas: being measured by worker x",
        "k1": f"being measured by worker {live}",
        "k2": None,
    }
    engine.dispose()


def test_0008_adds_a_jobs_batch_and_gpu_busy_time_to_an_existing_database(db_url: str) -> None:
    """A database at 0007 with a finished job: after the upgrade the job is kept with no batch
    and no busy figures (NULL); a batch then shares one id and a job's busy time gives its
    fraction over its wall time; the downgrade drops the columns again."""
    from kato.db import queries
    from kato.db.session import session_factory

    engine = make_engine(db_url)
    _upgrade(engine, "0007")
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO kato_jobs (id, operator, operator_version, shape, shape_key, dtype,"
                " gpu_model, budget_configs, strategy, seed, status, trials_done, created_at,"
                " started_at, finished_at, cancel_requested) VALUES ('j1', 'softmax', 'v',"
                " '[1, 2]', '1x2', 'float32', 'H200', 10, 'forest', 0, 'done', 10,"
                " '2026-01-01 00:00:00+00:00', '2026-01-01 00:00:00+00:00',"
                " '2026-01-01 00:00:08+00:00', false)"
            )
        )
        connection.execute(
            text(
                "INSERT INTO kato_trials (id, job_id, number, config, config_key, status,"
                " times_ms, created_at) VALUES (1, 'j1', 0, '{}', 'k0', 'ok', '[]',"
                " '2026-01-01 00:00:01+00:00')"
            )
        )
    init_db(engine)
    assert current_revision(engine) == head_revision() == "0009"
    assert_models_match_head(engine)
    with session_factory(engine)() as session:
        old = queries.get_job(session, "j1")
        assert old is not None
        assert (old.batch_id, old.gpu_busy_s, old.gpu_busy_fraction) == (None, None, None)
        queries.add_gpu_busy(session, "j1", 2.0)
        queries.add_gpu_busy(session, "j1", 4.0)
        old = queries.get_job(session, "j1")
        assert old is not None and old.gpu_busy_s == 6.0 and old.gpu_busy_fraction == 0.75
        fields = dict(
            operator="softmax", operator_version="v", shape=[4, 8], dtype="float16",
            gpu_model="H200", budget_configs=5,
        )  # fmt: skip
        jobs = queries.create_jobs(session, [fields, {**fields, "shape": [8, 8]}])
        (batch_id,) = {j.batch_id for j in jobs}
        assert batch_id is not None
        assert [j.id for j in queries.batch_jobs(session, batch_id)] == [j.id for j in jobs]
        assert queries.create_job(session, **fields).batch_id is None
    _downgrade(engine, "0007")
    columns = {c["name"] for c in inspect(engine).get_columns("kato_jobs")}
    assert not columns & {"batch_id", "gpu_busy_s", "gpu_busy_fraction"} and "token_id" in columns
    with engine.connect() as connection:  # no job's trials lost on the way up or down
        assert connection.execute(text("SELECT job_id FROM kato_trials")).scalars().all() == ["j1"]
    engine.dispose()


def test_0009_adds_the_compiled_baseline_beside_each_winner_to_an_existing_database(
    db_url: str,
) -> None:
    """A database at 0008 with a stored winner and its eager baseline: after the upgrade the
    row keeps its figures and has no compiled baseline (NULL); a new job's stores one beside
    the kept winner; the downgrade drops the two columns and keeps the rest."""
    from kato.db import queries
    from kato.db.session import session_factory

    engine = make_engine(db_url)
    _upgrade(engine, "0008")
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO kato_best_configs (id, operator, operator_version, shape, shape_key,"
                " dtype, gpu_model, compute_capability, cuda_version, config, time_ms,"
                " updated_at, default_ms, framework_ms, framework) VALUES (1, 'softmax', 'v',"
                " '[64, 64]', '64x64', 'float16', 'H200', '9.0', '13.0',"
                " '{\"BLOCK_SIZE\": 128}', 0.5, '2026-01-01 00:00:00+00:00', 0.7, 0.65,"
                " 'torch 2.13.0')"
            )
        )
    init_db(engine)
    assert current_revision(engine) == head_revision() == "0009"
    assert_models_match_head(engine)
    with session_factory(engine)() as session:
        (row,) = session.scalars(select(BestConfig)).all()
        assert (row.framework_ms, row.compiled_ms, row.compiled) == (0.65, None, None)
        kept = queries.upsert_best_config(
            session, operator="softmax", operator_version="v", shape=[64, 64], dtype="float16",
            gpu_model="H200", compute_capability="9.0", cuda_version="13.0",
            config={"BLOCK_SIZE": 256}, time_ms=0.6, job_id=None, compiled_ms=0.45,
            compiled="torch.compile 2.14.1 inductor",
        )  # fmt: skip
        assert kept.id == 1 and kept.config == {"BLOCK_SIZE": 128}
        assert (kept.framework_ms, kept.compiled_ms, kept.compiled) == (
            0.65, 0.45, "torch.compile 2.14.1 inductor",
        )  # fmt: skip
    _downgrade(engine, "0008")
    columns = {c["name"] for c in inspect(engine).get_columns("kato_best_configs")}
    assert not columns & {"compiled_ms", "compiled"} and "framework_ms" in columns
    with engine.connect() as connection:
        stored = connection.execute(text("SELECT time_ms, framework_ms FROM kato_best_configs"))
        assert stored.all() == [(0.5, 0.65)]
    engine.dispose()
