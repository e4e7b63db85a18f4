"""The CLI's GPU paths after the split (service/cli/, service/workers.py, service/validation.py):
``kato tune`` on this machine's device refuses a problem too large for its memory with the
API's message before queueing anything, tunes one that fits, and ``kato worker --max-jobs 1``
(built by service.workers.build_worker) runs a job queued through the shared validation; the
winner is then what service.lookup serves."""

from __future__ import annotations

import json

from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.cli import app
from kato.service.lookup import Lookups
from kato.service.settings import Settings
from kato.service.validation import JobRequest, job_fields
from typer.testing import CliRunner


def _sessions(db: str):
    engine = init_db(db)
    return engine, session_factory(engine)


def test_kato_tune_checks_memory_then_tunes_and_kato_worker_runs_a_queued_job(tmp_path):
    from kato.tuner.backends.pycuda import describe_device

    from kato.shared.gpus import find_gpu

    model = describe_device(0).model
    db = f"sqlite:///{tmp_path}/kato.db"
    runner = CliRunner()

    gpu = find_gpu(model)
    assert gpu is not None and gpu.memory_bytes, model
    rows = gpu.memory_bytes // (2 * 2 * 65536) + 1024  # float16 in + out: past the memory
    too_large = runner.invoke(
        app, ["tune", "softmax", "--shape", f"{rows}x65536", "--dtype", "float16", "--db", db]
    )
    assert too_large.exit_code == 2, too_large.output
    assert "of device memory;" in too_large.output and f"{model} has" in too_large.output

    tuned = runner.invoke(
        app,
        ["tune", "softmax", "--shape", "4096x4096", "--dtype", "float16", "--budget", "6",
         "--db", db, "--json"],
    )  # fmt: skip
    assert tuned.exit_code == 0, tuned.output
    result = json.loads(tuned.output)
    assert result["status"] == "done" and result["measured"] == 6, result

    settings = Settings(db_url=db)
    engine, sessions = _sessions(db)
    try:
        with sessions() as session:
            assert len(queries.list_jobs(session)) == 1  # the refused problem queued nothing
            request = JobRequest("layernorm", [8192, 1024], "float32", model, budget=6)
            fields = job_fields(request, settings)
            queued = queries.create_job(session, **fields).id
        worked = runner.invoke(app, ["worker", "--db", db, "--max-jobs", "1"])
        assert worked.exit_code == 0, worked.output
        assert "ran 1 job(s)" in worked.output
        with sessions() as session:
            job = queries.get_job(session, queued)
            assert job is not None and job.status == "done" and job.trials_done == 6
            lookups = Lookups(session, max_distance=settings.nearest_max_distance)
            answer = lookups.answer(get_operator("layernorm"), [8192, 1024], "float32", model)
            assert answer.source == "exact" and answer.row is not None
            assert answer.row.time_ms == job.best_time_ms
    finally:
        engine.dispose()
