"""One validation of a new job, whichever front it comes through: ``POST /v1/jobs``,
``POST /v1/jobs/batch``, ``kato tune`` and ``kato retune`` refuse the same jobs with the same
message (the API as a 422, the CLI as a one-line error with exit status 2), and queue nothing.

``kato tune`` used to skip the memory-fit and budget checks, and took a time budget under a
second and a negative seed: it queued and ran a job that ``POST /v1/jobs`` refuses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.service.app import create_app
from kato.service.cli import app as cli
from kato.service.settings import Settings
from paths import RECORDED
from typer.testing import CliRunner

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"  # an H200's recording
#: softmax float16 whose input and output take 275 GB: more than an H200's 141 GB.
TOO_LARGE = [1 << 20, 1 << 16]
MAX_BUDGET = 50

#: (what is wrong, the job's fields beyond operator/dtype/gpu, the message every front gives).
BAD = [
    (
        "too-large-for-the-gpu",
        {"shape": TOO_LARGE, "budget": 4},
        "shape 1048576x65536 in float16 needs 274.9 GB of device memory; H200 has 141.0 GB",
    ),
    (
        "budget-over-the-maximum",
        {"shape": [4096, 4096], "budget": MAX_BUDGET + 1},
        f"budget must be at most {MAX_BUDGET} configs, got {MAX_BUDGET + 1}",
    ),
    (
        "time-budget-over-the-maximum",
        {"shape": [4096, 4096], "budget": 4, "budget_seconds": 1e9},
        "budget_seconds must be at most 86400, got 1e+09",
    ),
    (
        "time-budget-under-a-second",
        {"shape": [4096, 4096], "budget": 4, "budget_seconds": 0.5},
        "budget_seconds must be at least 1, got 0.5",
    ),
    (
        "negative-seed",
        {"shape": [4096, 4096], "budget": 4, "seed": -1},
        "seed must be from 0 to 2147483647, got -1",
    ),
    (
        "seed-over-int32",
        {"shape": [4096, 4096], "budget": 4, "seed": 2**31},
        "seed must be from 0 to 2147483647, got 2147483648",
    ),
]


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KATO_MAX_BUDGET_CONFIGS", str(MAX_BUDGET))
    monkeypatch.setenv("KATO_DEFAULT_BUDGET_CONFIGS", "10")
    monkeypatch.setenv("KATO_AUTH_REQUIRED", "false")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return f"sqlite:///{tmp_path / 'kato.db'}"


def _jobs(db: str) -> int:
    engine = init_db(db)
    try:
        with session_factory(engine)() as session:
            return len(queries.list_jobs(session))
    finally:
        engine.dispose()


def _one_line(output: str, message: str) -> bool:
    return any(message in line for line in output.splitlines())


@pytest.mark.parametrize(("fields", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_the_api_refuses_the_job_with_the_message(db: str, fields: dict, message: str) -> None:
    job = {"operator": "softmax", "dtype": "float16", "gpu": "H200", **fields}
    app = create_app(Settings(db_url=db))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            one = client.post("/v1/jobs", json=job)
            assert one.status_code == 422, one.text
            assert one.json()["detail"] == message
            valid = {**job, "shape": [4096, 4096], "budget": 4, "budget_seconds": 60, "seed": 0}
            batch = client.post("/v1/jobs/batch", json={"jobs": [valid, job]})
            assert batch.status_code == 422, batch.text
            assert batch.json()["detail"] == f"jobs[1]: {message}"
    finally:
        app.state.engine.dispose()
    assert _jobs(db) == 0


@pytest.mark.parametrize(("fields", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_kato_tune_refuses_the_job_with_the_message(db: str, fields: dict, message: str) -> None:
    """The GPU model is the backend's (the recording's H200, through a plugin that measures
    nothing here): the job is refused before anything is queued or measured."""
    shape = "x".join(map(str, fields["shape"]))
    args = ["tune", "softmax", "--shape", shape, "--dtype", "float16", "--db", db]
    args += ["--budget", str(fields["budget"]), "--backend", "timed_backend:make"]
    if "budget_seconds" in fields:
        args += ["--budget-seconds", str(fields["budget_seconds"])]
    if "seed" in fields:
        args += ["--seed", str(fields["seed"])]
    out = CliRunner().invoke(cli, [*args, "--replay", str(RECORDING), "--no-isolate"])
    assert out.exit_code == 2, out.output
    assert _one_line(out.output, message), out.output
    assert "Traceback" not in out.output
    assert _jobs(db) == 0


def test_kato_retune_checks_its_budget_as_the_api_does(db: str) -> None:
    out = CliRunner().invoke(cli, ["retune", "--db", db, "--budget", str(MAX_BUDGET + 1)])
    assert out.exit_code == 2, out.output
    assert _one_line(out.output, f"--budget: {BAD[1][2]}"), out.output


def test_a_device_of_a_gpu_the_catalog_does_not_list_may_still_tune() -> None:
    """A request must name a catalog GPU; a measuring device (``kato tune``, a stored result
    that ``kato retune`` queues again) is what it is: taken by its name, memory unchecked."""
    from kato.kernels import InvalidInput, get_operator
    from kato.service.validation import JobRequest, job_fields

    settings = Settings(db_url="sqlite://")
    request = JobRequest("softmax", TOO_LARGE, "float16", "RTX 3080", budget=4)
    with pytest.raises(InvalidInput, match="unknown GPU model 'RTX 3080'"):
        job_fields(request, settings)
    fields = job_fields(request, settings, device_gpu=True)
    assert fields["gpu_model"] == "RTX 3080" and fields["shape"] == TOO_LARGE
    assert fields["operator_version"] == get_operator("softmax").version
    with pytest.raises(InvalidInput, match="274.9 GB of device memory; H200 has"):
        job_fields(JobRequest("softmax", TOO_LARGE, "float16", "H200"), settings, device_gpu=True)


@pytest.mark.parametrize("seconds", [float("nan"), float("-inf"), 0.0])
def test_a_time_budget_that_is_no_number_of_seconds_is_refused(seconds: float) -> None:
    """``kato tune --budget-seconds nan`` parses; no comparison holds for NaN, so the check
    must be written as 'at least', not 'not less than'."""
    from kato.kernels import InvalidInput
    from kato.service.validation import JobRequest, job_fields

    request = JobRequest("softmax", [4096, 4096], "float16", "H200", 4, budget_seconds=seconds)
    with pytest.raises(InvalidInput, match="budget_seconds must be at least 1, got"):
        job_fields(request, Settings(db_url="sqlite://"))
