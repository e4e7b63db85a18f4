"""``kato retune`` on a SQLite file: after an upgrade changed an operator's version, it queues
one job per key tuned only at older versions, skips what it must, and a second run queues
nothing; the queued job, run by a replay worker, measures the key's old winner first."""

from __future__ import annotations

import json
import os

import pytest
from kato.db import queries
from kato.db.models import Job
from kato.db.session import init_db, session_factory
from kato.db.upgrade import DEFAULT_RETUNE_BUDGET
from kato.kernels import get_operator
from kato.service.cli import app
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.worker import Worker
from test_cli import _assert_clear_error
from typer.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDING = os.path.join(
    REPO, "tests", "data", "recorded", "softmax_H200_4096x4096_float16.json.gz"
)
#: The version of the operators' code before the "upgrade".
OLD = "0ld0ld0ld0ld"
#: A config in the recording, far from its fastest: the old winner the new job must try first.
OLD_WINNER = {"BLOCK_SIZE": 32, "VEC": 2, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 0, "LANES": 32}


def store_best(sessions, operator, shape, dtype, gpu, version, time_ms=0.025):
    with sessions() as s:
        queries.upsert_best_config(
            s,
            operator=operator,
            operator_version=version,
            shape=shape,
            dtype=dtype,
            gpu_model=gpu,
            compute_capability="9.0",
            cuda_version="13.0",
            config=OLD_WINNER,
            time_ms=time_ms,
            job_id=None,
        )


@pytest.fixture
def upgraded(tmp_path):
    """A database as an upgrade leaves it: softmax and layernorm keys tuned at an old version,
    one also at the current one, one with a job queued at the current version, one of an
    operator that no longer exists, one of a dtype softmax no longer takes."""
    url = f"sqlite:///{tmp_path}/kato.db"
    engine = init_db(url)
    sessions = session_factory(engine)
    softmax, layernorm = get_operator("softmax").version, get_operator("layernorm").version
    store_best(sessions, "softmax", [4096, 4096], "float16", "H200", OLD)
    store_best(sessions, "softmax", [2048, 4096], "float16", "H200", OLD)
    store_best(sessions, "softmax", [2048, 4096], "float16", "A100", OLD)
    store_best(sessions, "layernorm", [8192, 1024], "float32", "H200", OLD, time_ms=0.5)
    store_best(sessions, "layernorm", [4096, 1024], "float32", "H200", OLD)
    store_best(sessions, "layernorm", [4096, 1024], "float32", "H200", layernorm)  # up to date
    store_best(sessions, "softmax", [1024, 1024], "float32", "H200", OLD)
    store_best(sessions, "softmax", [1024, 1024], "int8", "H200", OLD)  # no longer valid
    store_best(sessions, "retired_op", [64, 64], "float32", "H200", "r371r3d")
    with sessions() as s:
        live = queries.create_job(
            s,
            operator="softmax",
            operator_version=softmax,
            shape=[1024, 1024],
            dtype="float32",
            gpu_model="H200",
            budget_configs=100,
        ).id
    yield url, sessions, live
    engine.dispose()


def retune(url, *args):
    # Wide enough for the table's rows on one line each.
    return CliRunner().invoke(app, ["retune", "--db", url, *args], env={"COLUMNS": "250"})


def jobs(sessions):
    with sessions() as s:
        return [
            (j.operator, j.shape, j.dtype, j.gpu_model, j.operator_version, j.budget_configs)
            for j in s.query(Job).order_by(Job.created_at)
            if j.status == "queued"
        ]


def test_dry_run_lists_what_would_be_queued_and_queues_nothing(upgraded):
    url, sessions, live = upgraded
    before = jobs(sessions)
    out = retune(url, "--dry-run")
    assert out.exit_code == 0, out.output
    assert jobs(sessions) == before
    rows = [line for line in out.stdout.splitlines() if "to queue" in line]
    assert len(rows) == 4, out.stdout
    assert any(
        all(p in r for p in ("layernorm", "8192x1024", "float32", "H200", OLD, "0.5000"))
        for r in rows
    )
    assert "skipped: operator no longer registered" in out.stdout
    assert f"skipped: a job is queued, or running at the current version: {live}" in out.stdout
    assert "skipped: no longer valid" in out.stdout
    assert "operator 'retired_op' is no longer registered" in out.output
    summary = "7 key(s) tuned only at other versions: would queue 4 job(s) of 50 configs"
    assert summary in out.output and "dry run: nothing queued" in out.output

    as_json = retune(url, "--dry-run", "--json")
    assert as_json.exit_code == 0, as_json.output
    listed = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(r["operator"], r["dtype"], r["gpu"], r["shape"]) for r in listed] == [
        ("layernorm", "float32", "H200", [8192, 1024]),
        ("retired_op", "float32", "H200", [64, 64]),
        ("softmax", "float16", "A100", [2048, 4096]),
        ("softmax", "float16", "H200", [2048, 4096]),
        ("softmax", "float16", "H200", [4096, 4096]),
        ("softmax", "float32", "H200", [1024, 1024]),
        ("softmax", "int8", "H200", [1024, 1024]),
    ]
    assert [r["old_versions"] for r in listed] == [[OLD], ["r371r3d"]] + [[OLD]] * 5
    assert all(r["job"] is None for r in listed)
    assert listed[1]["version"] is None and listed[1]["skip"] == "operator no longer registered"
    assert "int8" in listed[6]["skip"]
    assert jobs(sessions) == before


def test_retune_queues_one_job_per_stale_key_and_a_second_run_nothing(upgraded):
    url, sessions, _ = upgraded
    before = jobs(sessions)
    softmax, layernorm = get_operator("softmax").version, get_operator("layernorm").version
    out = retune(url, "--budget", "30", "--json")
    assert out.exit_code == 0, out.output
    assert jobs(sessions)[len(before) :] == [
        ("layernorm", [8192, 1024], "float32", "H200", layernorm, 30),
        ("softmax", [2048, 4096], "float16", "A100", softmax, 30),
        ("softmax", [2048, 4096], "float16", "H200", softmax, 30),
        ("softmax", [4096, 4096], "float16", "H200", softmax, 30),
    ]
    queued = [json.loads(line)["job"] for line in out.stdout.splitlines()]
    assert sum(j is not None for j in queued) == 4
    assert "queued 4 job(s) of 30 configs" in out.output

    again = retune(url)
    assert again.exit_code == 0, again.output
    assert "queued 0 job(s)" in again.output and "skipped 7" in again.output
    assert len(jobs(sessions)) == len(before) + 4


def test_filters_and_the_default_budget(upgraded):
    url, sessions, _ = upgraded
    before = jobs(sessions)
    out = retune(url, "--operator", "softmax", "--gpu", "NVIDIA H200")
    assert out.exit_code == 0, out.output
    assert [j[:4] + j[5:] for j in jobs(sessions)[len(before) :]] == [
        ("softmax", [2048, 4096], "float16", "H200", DEFAULT_RETUNE_BUDGET),
        ("softmax", [4096, 4096], "float16", "H200", DEFAULT_RETUNE_BUDGET),
    ]
    assert "retired_op" not in out.output
    out = retune(url, "--operator", "softmax", "--operator", "layernorm", "--gpu", "A100")
    assert out.exit_code == 0 and "queued 1 job(s)" in out.output
    out = retune(url, "--gpu", "V100")
    assert out.exit_code == 0 and "nothing to retune" in out.output


def test_the_queued_job_measures_the_old_winner_first_then_the_key_is_current(upgraded):
    """End to end: retune, a replay worker runs the job (warm start from the key's old
    winner), the key now has a current-version winner, and retune leaves it alone."""
    url, sessions, _ = upgraded
    out = retune(url, "--operator", "softmax", "--gpu", "H200", "--budget", "10", "--json")
    assert out.exit_code == 0, out.output
    job_id = next(
        r["job"]
        for r in map(json.loads, out.stdout.splitlines())
        if r["shape"] == [4096, 4096] and r["dtype"] == "float16"
    )
    with sessions() as s:  # only that job: the others are out of the worker's way
        for other in s.query(Job).filter(Job.id != job_id, Job.status == "queued"):
            queries.request_cancel(s, other.id)
    worker = Worker(sessions, url, ["H200"], lambda job: ReplayBackend(RECORDING))
    outcome = worker.run_once()
    assert outcome.job_id == job_id and outcome.status == "done", outcome
    with sessions() as s:  # after the default config every job times first
        configs = [t.config for t in queries.job_trials(s, job_id)]
        default = get_operator("softmax").default_config([4096, 4096], "float16")
        assert default != OLD_WINNER  # else they are one seed
        assert configs[:2] == [default, OLD_WINNER]
    listed = retune(url, "--dry-run", "--json", "--operator", "softmax", "--gpu", "H200")
    shapes = [(r["shape"], r["dtype"]) for r in map(json.loads, listed.stdout.splitlines())]
    assert ([4096, 4096], "float16") not in shapes and ([2048, 4096], "float16") in shapes
    looked_up = CliRunner().invoke(
        app,
        ["lookup", "softmax", "--shape", "4096x4096", "--dtype", "float16", "--db", url],
    )
    assert looked_up.exit_code == 0, looked_up.output
    assert json.loads(looked_up.stdout)["source"] == "exact"


@pytest.mark.parametrize(
    "args, code, phrases",
    [
        (["--db", "bogus://x"], 1, ["cannot open the database bogus://x", "check --db"]),
        (["--operator", "softmax", "--operator", "nope"], 2,
         ["unknown operator(s) 'nope'", "--operator takes a registered operator", "softmax"]),
        (["--budget", "0"], 2, ["--budget"]),
        (["--budget", "5001"], 2, ["--budget: budget must be at most 5000 configs, got 5001"]),
        (["--gpu", "NVIDIA"], 2, ["--gpu: not a GPU model name"]),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_errors(tmp_path, args, code, phrases):
    argv = ["retune", "--db", f"sqlite:///{tmp_path}/kato.db", *args]
    _assert_clear_error(CliRunner().invoke(app, argv), code, phrases)


def rows_by_key(text: str) -> dict[tuple, dict]:
    """``--json`` output (one object per line) by (first dimension, GPU, dtype)."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return {(r["shape"][0], r["gpu"], r["dtype"]): r for r in rows}


def test_a_key_whose_job_failed_waits_for_retry_failed(upgraded):
    url, sessions, _live = upgraded
    version = get_operator("softmax").version
    with sessions() as s:
        failed = queries.create_job(
            s, operator="softmax", operator_version=version, shape=[4096, 4096],
            dtype="float16", gpu_model="H200", budget_configs=50,
        ).id  # fmt: skip
        queries.finish_job(s, failed, status="failed", error="CUDA out of memory")
    out = retune(url, "--dry-run", "--json")
    assert out.exit_code == 0, out.output
    rows = rows_by_key(out.stdout)
    assert rows[(4096, "H200", "float16")]["skip"].endswith(f"--retry-failed): {failed}")
    out = retune(url, "--dry-run", "--json", "--retry-failed")
    rows = rows_by_key(out.stdout)
    assert rows[(4096, "H200", "float16")]["skip"] is None
