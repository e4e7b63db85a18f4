"""Trial numbers are unique per job (0, 1, 2, ...) also for trials that come from a file: an
export written before numbers were unique carries repeats, and importing it stores each trial
under a number of its own instead of failing on the database's unique (job_id, number)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kato.db import queries
from kato.db.export import collect, export
from kato.db.importer import import_paths
from kato.db.models import Trial
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from sqlalchemy import select

SPEC = get_operator("softmax")
SHAPE, DTYPE = [4096, 4096], "float16"


def _exported_job(tmp_path: Path, fmt: str, blocks=(32, 64, 128, 256, 512)) -> Path:
    factory = session_factory(init_db(f"sqlite:///{tmp_path / 'source.db'}"))
    with factory() as session:
        job = queries.create_job(session, operator="softmax", operator_version=SPEC.version,
                                 shape=SHAPE, dtype=DTYPE, gpu_model="H200",
                                 budget_configs=10)  # fmt: skip
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
        for number, block in enumerate(blocks):
            config = dict(SPEC.default_config(SHAPE, DTYPE), BLOCK_SIZE=block)
            result = {"status": "ok", "time_ms": 1.0 + number, "times_ms": [1.0 + number]}
            queries.record_trial(session, job.id, number=number, config=config,
                                 config_key=",".join(str(config[p]) for p in SPEC.params),
                                 result=result)  # fmt: skip
        queries.finish_job(session, job.id, status="done")
        return export(collect(session), tmp_path / f"job.{fmt}.json", fmt)[0]


def _set_numbers(path: Path, numbers: list[int]) -> None:
    """Give the file's trials ``numbers``, in the file's order (as an old export had them)."""
    doc = json.loads(path.read_text())
    if "results" in doc:
        for result, number in zip(doc["results"], numbers, strict=True):
            result["kato"]["number"] = number
    else:
        measured = [e for e in doc["cache"].values() if "kato_job" in e]  # not the stand-ins
        for entry, number in zip(measured, numbers, strict=True):
            entry["kato_number"] = number
    path.write_text(json.dumps(doc))


def _numbers_by_time(factory) -> list[tuple[float, int]]:
    with factory() as session:
        return sorted((t.time_ms, t.number) for t in session.scalars(select(Trial)))


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_an_export_with_repeated_numbers_imports_with_numbers_of_their_own(tmp_path, fmt):
    """Numbers 0, 1, 3, 3, 1 (2 and 4 missing): the first of each number keeps it, a repeat
    takes the lowest number no trial of the job holds."""
    path = _exported_job(tmp_path, fmt)
    _set_numbers(path, [0, 1, 3, 3, 1])
    target = session_factory(init_db(f"sqlite:///{tmp_path / 'target.db'}"))
    with target() as session:
        report = import_paths(session, [path])
    assert report.trials_added == 5
    # time_ms 1..5 in file order: the second 3 takes 2, the second 1 takes 4.
    assert _numbers_by_time(target) == [(1.0, 0), (2.0, 1), (3.0, 3), (4.0, 2), (5.0, 4)]


def test_importing_more_trials_of_a_stored_job_never_repeats_a_stored_number(tmp_path):
    """The job is stored with three trials (numbers 0-2); a later export holds two more, one of
    them numbered as a stored one: it takes the lowest free number."""
    first = _exported_job(tmp_path / "a", "t4", blocks=(32, 64, 128))
    later = _exported_job(tmp_path / "b", "t4", blocks=(32, 64, 128, 256, 512))
    doc = json.loads(later.read_text())
    doc["metadata"]["kato"]["jobs"][0]["id"] = json.loads(first.read_text())["metadata"]["kato"][
        "jobs"
    ][0]["id"]
    job_id = doc["metadata"]["kato"]["jobs"][0]["id"]
    for result in doc["results"]:
        result["kato"]["job"] = job_id
    later.write_text(json.dumps(doc))
    _set_numbers(later, [0, 1, 2, 1, 4])
    target = session_factory(init_db(f"sqlite:///{tmp_path / 'target.db'}"))
    with target() as session:
        import_paths(session, [first])
        report = import_paths(session, [later])
    assert (report.trials_present, report.trials_added) == (3, 2)
    assert _numbers_by_time(target) == [(1.0, 0), (2.0, 1), (3.0, 2), (4.0, 3), (5.0, 4)]
