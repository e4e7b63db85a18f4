"""The file formats' models (:mod:`db.formats`) check what a file says about itself, with
messages naming the field; what ``kato export`` writes is what they read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kato.db import queries
from kato.db.export import collect, export
from kato.db.formats import (
    OTHER_TRIALS,
    RESOURCES,
    UNMEASURED,
    BestRecord,
    FormatError,
    JobRecord,
    KatoBlock,
    KTDocument,
    KTEntry,
    T4Document,
    T4Kato,
    T4Measurement,
    T4Metadata,
    T4Result,
    T4Times,
    parse,
)
from kato.db.models import Trial
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from sqlalchemy.orm import Session, sessionmaker

JOB = "0123456789abcdef0123456789abcdef"


def _kt(cache: dict, **top) -> dict:
    return {"tune_params_keys": ["A", "B"], "tune_params": {"A": [1, 2], "B": [8]},
            "cache": cache, **top}  # fmt: skip


def _t4(results: list, **metadata) -> dict:
    return {"schema_version": "1.0.0", "results": results, "metadata": metadata}


def _result(**fields) -> dict:
    base = {"configuration": {"A": 1}, "times": {"runtimes": [2.0]}, "invalidity": "correct",
            "correctness": 1, "measurements": [{"name": "time", "value": 2.0}]}  # fmt: skip
    return base | fields


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"time": "InvalidConfig", "kato_status": "ok"}, "kato_status 'ok' but time is 'Inv"),
        ({"time": 1.5, "kato_status": "compile_error"}, "kato_status 'compile_error' but time is"),
        ({"time": "Banana"}, "time: is neither a time nor one of Kernel Tuner's markers"),
        ({"time": 0}, "time: time must be a positive number, got 0"),
    ],
)
def test_an_entry_whose_time_and_status_disagree_is_refused(raw, message):
    with pytest.raises(FormatError, match=f"^cache\\['1,8'\\][.:] ?{message}"):
        parse(KTEntry, raw, "cache['1,8']")


def test_an_entry_names_its_status_by_its_marker_unless_it_says():
    assert parse(KTEntry, {"time": "CompilationFailedConfig"}).status == "compile_error"
    assert parse(KTEntry, {"time": "RuntimeFailedConfig", "kato_status": "crashed"}).status == (
        "crashed"
    )
    assert parse(KTEntry, {"time": 0.5}).status == "ok"


@pytest.mark.parametrize(
    "result, message",
    [
        (
            _result(invalidity="compile", kato={"status": "ok"}),
            r"^results\[0\]: kato\.status 'ok' is not the T4 invalidity 'compile'$",
        ),
        (
            _result(measurements=[]),
            r"^results\[0\]\.measurements\.time: Input should be a valid number, got None$",
        ),
        (
            _result(measurements=[{"name": "time", "value": -1.0}]),
            r"^results\[0\]\.measurements\.time: Input should be greater than 0, got -1\.0$",
        ),
        (
            _result(
                measurements=[
                    {"name": "time", "value": 1.0},
                    {"name": "blocks_per_sm", "value": -2},
                ]
            ),  # fmt: skip
            r"^results\[0\]\.measurements\.blocks_per_sm: Input should be greater than or equal",
        ),
    ],
)
def test_a_t4_result_is_checked_as_its_status_says(result, message):
    with pytest.raises(FormatError, match=message):
        parse(T4Result, result, "results[0]")


def test_a_failed_t4_result_needs_no_time():
    result = parse(T4Result, _result(invalidity="compile", measurements=[]))
    assert result.status == "compile_error"
    assert result.trial(0, 1.0, "results[0]").time_ms is None


def test_t4_times_are_converted_to_milliseconds():
    result = _result(times={"runtimes": [0.002, 0.003], "compilation_time": 1.5},
                     measurements=[{"name": "time", "value": 0.002},
                                   {"name": "registers", "value": 40}])  # fmt: skip
    (trial,) = parse(T4Document, _t4([result], timeunit="Seconds")).trials()
    assert (trial.time_ms, trial.times_ms, trial.compile_time_s) == (2.0, [2.0, 3.0], 1.5)
    assert trial.resources["registers"] == 40 and trial.resources["occupancy"] is None
    assert (trial.number, trial.status, trial.job_id, trial.where) == (0, "ok", "", "results[0]")


def test_a_t4_time_beyond_the_range_of_milliseconds_is_refused():
    result = _result(measurements=[{"name": "time", "value": 1e306}])
    with pytest.raises(FormatError, match=r"^results\[0\]\.measurements\.time: 1e\+306 is out"):
        parse(T4Document, _t4([result], timeunit="s")).trials()


@pytest.mark.parametrize(
    "version, message",
    [
        ("2.0.0", r"^schema_version '2\.0\.0' is not supported: Kato reads T4 schema 1\.x"),
        ("1", r"^schema_version '1' is not a version like 1\.0\.0; Kato reads T4 schema 1\.x$"),
        (1.0, r"^schema_version: Input should be a valid string, got 1\.0$"),
    ],
)
def test_a_t4_schema_this_code_does_not_read_is_refused(version, message):
    with pytest.raises(FormatError, match=message):
        parse(T4Document, {"schema_version": version, "results": []})


def test_t4_parameters_are_the_blocks_else_the_first_configurations():
    assert parse(T4Document, _t4([_result()])).params() == ["A"]
    named = _t4([_result()], kato={"params": ["B", "A"]})
    assert parse(T4Document, named).params() == ["B", "A"]
    with pytest.raises(FormatError, match=r"^metadata\.kato\.params: no parameter names"):
        parse(T4Document, _t4([])).params()


@pytest.mark.parametrize(
    "doc, message",
    [
        (
            _kt({}) | {"tune_params_keys": ["A", "A"]},
            r"^tune_params_keys must be distinct parameter names, got \['A', 'A'\]$",
        ),
        (_kt({}) | {"tune_params_keys": []}, r"^tune_params_keys: List should have at least 1"),
        (
            _t4([], kato={"params": ["A", "B", "A"]}),
            r"^metadata\.kato\.params must be distinct parameter names",
        ),
    ],
)
def test_parameter_names_are_distinct(doc, message):
    with pytest.raises(FormatError, match=message):
        parse(T4Document if "results" in doc else KTDocument, doc)


def test_a_job_listed_twice_is_refused_at_its_place():
    jobs = [{"id": JOB}, {"id": "f" * 32}, {"id": JOB}]
    with pytest.raises(FormatError, match=rf"^metadata\.kato\.jobs\[2\]: job {JOB} is listed tw"):
        parse(KatoBlock, {"jobs": jobs}, "metadata.kato")


def test_a_kernel_tuner_cache_gives_its_measured_entries_and_their_other_trials():
    other = {"time": 3.0, "kato_job": "f" * 32, "kato_number": 7}
    cache = {
        "1,8": {
            "A": 1,
            "B": 8,
            "time": 2.0,
            "times": [2.0],
            "registers": 30,
            "kato_other_trials": [other],
        },  # fmt: skip
        "2,8": {"A": 2, "B": 8, "time": "InvalidConfig", "kato_unmeasured": "invalid"},
    }
    trials = parse(KTDocument, _kt(cache)).trials()
    assert [(t.where, t.number, t.job_id, t.time_ms) for t in trials] == [
        ("cache['1,8']", 0, "", 2.0),
        ("cache['1,8'].kato_other_trials[0]", 7, "f" * 32, 3.0),
    ]
    assert trials[0].config == trials[1].config == {"A": 1, "B": 8}
    assert trials[0].resources["registers"] == 30


@pytest.mark.parametrize(
    "cache, message",
    [
        ({"1,8": {"A": 1, "time": 1.0}}, r"^cache\['1,8'\]: missing parameter\(s\) B$"),
        ({"2,8": {"A": 1, "B": 8, "time": 1.0}}, r"^cache\['2,8'\]: the key is not the entry's"),
        ({"1,8": {"A": 1.5, "B": 8, "time": 1.0}}, r"^cache\['1,8'\]: the key is not"),
        ({"1,8": {"A": True, "B": 8, "time": 1.0}}, r"^cache\['1,8'\]\.A: a parameter value is"),
        (
            {"1,8": {"A": 1, "B": 8, "time": 1.0, "kato_other_trials": [{"time": -1}]}},
            r"^cache\['1,8'\]\.kato_other_trials\[0\]\.time: time must be a positive number",
        ),
    ],
)
def test_a_kernel_tuner_entry_that_is_not_its_key_is_refused(cache, message):
    with pytest.raises(FormatError, match=message):
        parse(KTDocument, _kt(cache)).trials()


def test_a_type_written_in_the_call_is_checked_as_itself():
    """Types are cached by value, not by the id of an object a call may free and reuse."""
    for _ in range(3):
        assert parse(list[int], [1]) == [1]
        with pytest.raises(FormatError, match=r"^x\[0\]: Input should be a valid string, got 1$"):
            parse(list[str], [1], "x")


def test_several_problems_are_named_up_to_three():
    with pytest.raises(FormatError) as raised:
        parse(KatoBlock, {"operator": 1, "dtype": 2, "gpu_model": 3, "shape": [0]}, "kato")
    parts = str(raised.value).split("; ")
    assert parts[0] == "kato.operator: Input should be a valid string, got 1"
    assert len(parts) == 4 and parts[-1] == "and 1 more"


# --- what kato export writes ------------------------------------------------------------------

SPEC = get_operator("softmax")
SHAPE, DTYPE = [4096, 4096], "float16"


def _key(config: dict) -> str:
    return ",".join(str(config[p]) for p in SPEC.params)


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[sessionmaker[Session], Path]:
    """A job of four trials (two measured, a compile error, a crash) and its winner."""
    tmp = tmp_path_factory.mktemp("formats")
    factory = session_factory(init_db(f"sqlite:///{tmp / 'kato.db'}"))
    configs = [dict(SPEC.default_config(SHAPE, DTYPE), BLOCK_SIZE=b) for b in (128, 256, 512, 1024)]
    results = [
        {
            "status": "ok",
            "time_ms": 1.5,
            "times_ms": [1.5, 1.6],
            "registers": 32,
            "occupancy": 0.5,
            "compile_time_s": 0.25,
        },  # fmt: skip
        {"status": "ok", "time_ms": 2.5, "times_ms": [2.5]},
        {"status": "compile_error", "error": "ptxas: too many registers"},
        {"status": "crashed", "error": "killed"},
    ]
    with factory() as session:
        job = queries.create_job(session, operator="softmax", operator_version=SPEC.version,
                                 shape=SHAPE, dtype=DTYPE, gpu_model="H200",
                                 budget_configs=10)  # fmt: skip
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
        for number, (config, result) in enumerate(zip(configs, results, strict=True)):
            queries.record_trial(session, job.id, number=number, config=config,
                                 config_key=_key(config), result=result)  # fmt: skip
        queries.finish_job(session, job.id, status="done")
        queries.upsert_best_config(session, operator="softmax", operator_version=SPEC.version,
                                   shape=SHAPE, dtype=DTYPE, gpu_model="H200",
                                   compute_capability="9.0", cuda_version="13.0",
                                   config=configs[0], time_ms=1.5, job_id=job.id)  # fmt: skip
    return factory, tmp


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_an_export_is_read_by_the_models_as_stored(stored, fmt):
    factory, tmp = stored
    with factory() as session:
        (path,) = export(collect(session), tmp / f"out.{fmt}.json", fmt)
        rows = sorted(session.query(Trial).all(), key=lambda t: t.number)
        wanted = [(t.number, t.config, t.status, t.time_ms, t.times_ms or [], t.compile_time_s,
                   t.registers, t.occupancy, t.error, t.job_id) for t in rows]  # fmt: skip
    doc = parse(T4Document if fmt == "t4" else KTDocument, json.loads(path.read_text()))
    assert doc.kato_export and doc.block is not None and doc.block.lists_jobs
    read = sorted(
        (t.number, t.config, t.status, t.time_ms, t.times_ms, t.compile_time_s,
         t.resources["registers"], t.resources["occupancy"], t.error, t.job_id)
        for t in doc.trials()
    )  # fmt: skip
    assert read == wanted
    (best,) = doc.block.best
    assert (best.config, best.time_ms, best.compute_capability) == (rows[0].config, 1.5, "9.0")
    assert [job.id for job in doc.block.jobs or []] == [rows[0].job_id]


def _unnamed(record: dict, model: type) -> set[str]:
    return set(record) - set(model.model_fields)


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_every_field_an_export_writes_is_one_the_models_read(stored, fmt):
    """The models ignore fields they do not name (a later Kato's): so nothing export writes
    may be outside them, or it would be dropped on the way back unnoticed."""
    factory, tmp = stored
    with factory() as session:
        (path,) = export(collect(session), tmp / f"fields.{fmt}.json", fmt)
    doc = json.loads(path.read_text())
    if fmt == "t4":
        assert _unnamed(doc, T4Document) == set()
        assert _unnamed(doc["metadata"], T4Metadata) == set()
        block = doc["metadata"]["kato"]
        for result in doc["results"]:
            assert _unnamed(result, T4Result) == set()
            assert _unnamed(result["times"], T4Times) == set()
            assert _unnamed(result["kato"], T4Kato) == set()
            for measurement in result["measurements"]:
                assert _unnamed(measurement, T4Measurement) == set()
                assert measurement["name"] in {"time", *RESOURCES}
    else:
        assert _unnamed(doc, KTDocument) == set()
        block = doc["kato"]
        params = set(doc["tune_params_keys"])
        for entry in doc["cache"].values():
            assert _unnamed(entry, KTEntry) - params <= {OTHER_TRIALS, UNMEASURED}
    assert _unnamed(block, KatoBlock) == set()
    assert all(_unnamed(job, JobRecord) == set() for job in block["jobs"])
    assert all(_unnamed(best, BestRecord) == set() for best in block["best"])
