"""Export -> import -> identical lookups, in T4 and Kernel Tuner formats; idempotent imports;
clear errors; Kernel Tuner's simulation mode replays an exported file and finds the same best."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from paths import RECORDED
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from db import fleet, queries
from db.export import bundle_to_t4, collect, export, job_to_cache
from db.importer import InvalidImport, import_paths, read_file
from db.models import BestConfig, Job, Trial
from db.session import init_db, session_factory
from kernels import get_operator
from service.cli import app as cli
from tuner.kt_cache import load_cache

SPEC = get_operator("softmax")
FAILURES = [  # configs recorded as failed in job A, on top of the recorded measurements
    ({"BLOCK_SIZE": 1024, "VEC": 8, "STRATEGY": 1, "CACHE": 1, "MIN_BLOCKS": 4}, "compile_error"),
    ({"BLOCK_SIZE": 32, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4}, "verify_error"),
    ({"BLOCK_SIZE": 64, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4}, "invalid"),
    ({"BLOCK_SIZE": 128, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4}, "crashed"),
    ({"BLOCK_SIZE": 256, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4}, "launch_error"),
    ({"BLOCK_SIZE": 512, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4}, "timeout"),
]
KEYS = [
    (shape, dtype)
    for shape in ([4096, 4096], [8192, 4096], [65536, 1024], [1024, 1024], [100, 100], [7, 4001])
    for dtype in ("float16", "float32")
]


def _db(path: Path) -> sessionmaker[Session]:
    return session_factory(init_db(f"sqlite:///{path}"))


def _record_job(session: Session, recorded: str, failures=()) -> Job:
    cache = load_cache(RECORDED / recorded)
    shape, dtype = list(cache.problem_size), cache.extra["dtype"]
    job = queries.create_job(session, operator="softmax", operator_version=SPEC.version,
                             shape=shape, dtype=dtype, gpu_model="H200", budget_configs=120,
                             strategy="tpe", seed=7)  # fmt: skip
    claimed = queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
    assert claimed is not None and claimed.id == job.id
    entries = [(e, "ok") for e in cache.entries.values()] + list(failures)
    for number, (entry, status) in enumerate(entries):
        config = {p: entry[p] for p in SPEC.params}
        result = {"status": status, "error": None if status == "ok" else f"{status} text"}
        if status == "ok":
            result |= {
                "time_ms": entry["time"],
                "times_ms": entry["times"],
                "compile_time_s": entry["compile_time"] / 1000,
                "registers": entry["registers"],
                "occupancy": entry["occupancy"],
            }
        queries.record_trial(session, job.id, number=number, config=config,
                             config_key=",".join(str(config[p]) for p in SPEC.params),
                             result=result)  # fmt: skip
    queries.finish_job(session, job.id, status="done")
    job = queries.get_job(session, job.id)
    queries.upsert_best_config(session, operator="softmax", operator_version=SPEC.version,
                               shape=shape, dtype=dtype, gpu_model="H200",
                               compute_capability="9.0", cuda_version="13.0",
                               config=job.best_config, time_ms=job.best_time_ms,
                               job_id=job.id)  # fmt: skip
    return job


@pytest.fixture
def source(tmp_path: Path) -> sessionmaker[Session]:
    """A database as a site that tuned has it: two jobs with trials, best configs (one without
    a job, one key with two CUDA versions)."""
    factory = _db(tmp_path / "source.db")
    with factory() as session:
        _record_job(session, "softmax_H200_4096x4096_float16.json.gz", FAILURES)
        _record_job(session, "softmax_H200_65536x1024_float32.json.gz")
        for cuda, time_ms in (("12.4", 0.5), ("13.0", 0.011)):
            queries.upsert_best_config(session, operator="softmax", operator_version=SPEC.version,
                                       shape=[1024, 1024], dtype="float32", gpu_model="H200",
                                       compute_capability="9.0", cuda_version=cuda,
                                       config=SPEC.default_config([1024, 1024], "float32"),
                                       time_ms=time_ms, job_id=None)  # fmt: skip
    return factory


def _lookups(factory: sessionmaker[Session]) -> list[tuple]:
    out = []
    with factory() as session:
        for shape, dtype in KEYS:
            row, source = queries.lookup_best_config(
                session, operator="softmax", operator_version=SPEC.version, shape=shape,
                dtype=dtype, gpu_model="H200",
                accept=lambda c, s=shape, d=dtype: SPEC.check(c, s, d) is None,
            )  # fmt: skip
            out.append((source, row and (row.config, row.time_ms, row.shape, row.cuda_version)))
    return out


def _counts(factory: sessionmaker[Session]) -> tuple[int, int, int]:
    with factory() as session:
        return tuple(
            session.scalar(select(func.count()).select_from(m)) for m in (Job, Trial, BestConfig)
        )


def _trials(factory: sessionmaker[Session]) -> set[tuple]:
    with factory() as session:
        return {
            (t.job_id, t.config_key, t.status, t.time_ms, tuple(t.times_ms), t.registers, t.error)
            for t in session.scalars(select(Trial))
        }


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_export_import_gives_identical_lookups_and_is_idempotent(source, tmp_path, fmt):
    with source() as session:
        paths = export(collect(session), tmp_path / "out", fmt)
    assert len(paths) == 3  # one file per problem
    target = _db(tmp_path / "target.db")
    with target() as session:
        report = import_paths(session, [tmp_path / "out"])
    assert (report.jobs_added, report.best_added, report.warnings) == (2, 4, [])
    assert _counts(target) == _counts(source) == (2, 206, 4)
    assert _lookups(target) == _lookups(source)
    assert _trials(target) == _trials(source)
    assert {s for s, _ in _lookups(target)} == {"exact", "nearest", "default"}
    with target() as session:
        again = import_paths(session, [tmp_path / "out"])
        job = session.scalars(select(Job).where(Job.shape_key == "4096x4096")).one()
        assert (job.status, job.trials_done, job.seed, job.budget_configs) == ("done", 105, 7, 120)
    assert (again.jobs_added, again.trials_added, again.best_added) == (0, 0, 0)
    assert (again.trials_present, again.best_kept) == (206, 4)
    assert _counts(target) == (2, 206, 4)


def test_t4_export_follows_the_t4_schema(source):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the T4 schema")
    file_utils = pytest.importorskip(
        "kernel_tuner.file_utils", reason="kernel-tuner ships the T4 schema (pip install it)"
    )
    version, schema = file_utils.output_file_schema("results")
    with source() as session:
        bundles = collect(session, operator="softmax", gpu="NVIDIA H200", dtype="float16")
    (doc,) = [bundle_to_t4(b) for b in bundles]
    jsonschema.validate(doc, schema)
    assert doc["schema_version"] == version
    ok = [r for r in doc["results"] if r["invalidity"] == "correct"]
    failed = {r["invalidity"] for r in doc["results"]} - {"correct"}
    assert len(ok) == 100 and failed == {
        "compile",
        "correctness",
        "constraints",
        "runtime",
        "timeout",
    }
    assert {"name": "time", "value": ok[0]["measurements"][0]["value"], "unit": "ms"} in ok[0][
        "measurements"
    ]
    assert doc["metadata"]["kato"]["gpu_model"] == "H200"


def test_kernel_tuner_simulation_replays_an_exported_cache(source, tmp_path):
    kernel_tuner = pytest.importorskip(
        "kernel_tuner", reason="kernel-tuner (pip install kernel-tuner==1.5.0) replays the file"
    )
    with source() as session:
        job = session.scalars(select(Job).where(Job.shape_key == "4096x4096")).one()
        cache = job_to_cache(session, job.id)
        best_config, best_time = job.best_config, job.best_time_ms
    path = tmp_path / "softmax.json"
    path.write_text(json.dumps(cache.to_json()))
    measured = set(cache.entries)
    names = list(cache.tune_params)

    def was_measured(params: dict) -> bool:  # the configs Kato's search measured
        return ",".join(str(params[k]) for k in names) in measured

    results, _ = kernel_tuner.tune_kernel(
        cache.kernel_name,
        "__global__ void softmax_kernel() {}",  # never compiled in simulation mode
        cache.problem_size,
        [],
        cache.tune_params,
        restrictions=was_measured,
        cache=str(path),
        simulation_mode=True,
        strategy="brute_force",
        quiet=True,
    )
    ok = [r for r in results if "__error__" not in r]
    assert len(results) == 106 and len(ok) == 100
    best = min(ok, key=lambda r: r["time"])
    assert {k: best[k] for k in cache.tune_params} == best_config
    assert best["time"] == best_time


def test_a_recorded_kernel_tuner_cache_imports_without_kato_metadata(tmp_path):
    recorded = RECORDED / "softmax_H200_65536x1024_float16.json.gz"
    target = _db(tmp_path / "target.db")
    overrides = {"operator_version": SPEC.version}  # the recording may predate a kernel change
    with target() as session:
        first = import_paths(session, [recorded], overrides)
        second = import_paths(session, [recorded], overrides)
        row, source = queries.lookup_best_config(
            session, operator="softmax", operator_version=SPEC.version, shape=[65536, 1024],
            dtype="float16", gpu_model="H200",
        )  # fmt: skip
    assert (first.jobs_added, first.trials_added, first.best_added) == (1, 100, 1)
    assert (second.jobs_added, second.trials_added, second.jobs_present) == (0, 0, 1)
    best_key, best_entry = load_cache(recorded).best()
    assert source == "exact" and row.time_ms == best_entry["time"]
    assert ",".join(str(row.config[p]) for p in SPEC.params) == best_key


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not JSON"),
        ([1, 2], "expected a JSON object"),
        ({"foo": 1}, "neither T4"),
        ({"schema_version": "1.0.0", "results": [{"configuration": {"A": 1}}]}, "--operator"),
        (
            {
                "schema_version": "1.0.0",
                "metadata": {
                    "kato": {
                        "operator": "softmax",
                        "shape": [8, 8],
                        "dtype": "float16",
                        "gpu_model": "H200",
                        "params": ["A"],
                        "jobs": [],
                    }
                },
                "results": [{"configuration": {"A": 1}}],
            },
            "missing 'times'",
        ),  # fmt: skip
        (
            {
                "tune_params_keys": ["A"],
                "tune_params": {"A": [1]},
                "problem_size": [8, 8],
                "device_name": "NVIDIA H200",
                "cache": {"1": {"A": 1, "time": -3}},
            },
            "time must be a positive number",
        ),  # fmt: skip
    ],
)
def test_invalid_files_are_rejected_with_a_clear_message(tmp_path, content, message):
    path = _write(tmp_path / "bad.json", content)
    overrides = {"dtype": "float16", "operator": "softmax"} if "device_name" in str(content) else {}
    with pytest.raises(InvalidImport, match=message):
        read_file(path, overrides)


def test_cli_export_and_import(source, tmp_path):
    src_url = str(source.kw["bind"].url)
    dst_url = f"sqlite:///{tmp_path / 'dst.db'}"
    runner = CliRunner()
    with source() as session:
        job_id = session.scalars(select(Job.id).where(Job.shape_key == "4096x4096")).one()

    one = runner.invoke(cli, ["export", str(tmp_path / "all.json"), "--db", src_url])
    assert one.exit_code == 1 and "3 problems match" in one.output

    out = tmp_path / "job.kt.json.gz"
    done = runner.invoke(cli, ["export", str(out), "--format", "kt", "--job", job_id, "--db",
                               src_url])  # fmt: skip
    assert done.exit_code == 0, done.output
    with gzip.open(out, "rt") as f:
        assert len(json.load(f)["cache"]) == 106

    first = runner.invoke(cli, ["import", str(out), "--db", dst_url, "--json"])
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert (report["jobs_added"], report["trials_added"], report["best_added"]) == (1, 106, 1)
    again = runner.invoke(cli, ["import", str(out), "--db", dst_url, "--json"])
    assert json.loads(again.stdout.strip().splitlines()[-1])["trials_added"] == 0

    bad = _write(tmp_path / "bad.json", {"results": 3, "schema_version": "1.0.0"})
    failed = runner.invoke(cli, ["import", str(out), str(bad), "--db", dst_url])
    assert failed.exit_code == 1 and "'results' must be a list" in failed.output
    missing = runner.invoke(cli, ["import", str(tmp_path / "nope"), "--db", dst_url])
    assert missing.exit_code == 1 and "no such file" in missing.output
    empty = runner.invoke(cli, ["export", str(tmp_path / "x"), "--operator", "nope", "--db",
                                src_url])  # fmt: skip
    assert empty.exit_code == 1 and "nothing to export" in empty.output


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_a_config_being_measured_is_not_exported(tmp_path, fmt):
    """A running shared job's reservation rows (db.fleet) are not results: exporting that job
    writes its measured trials only, and the file imports."""
    factory = _db(tmp_path / "source.db")
    measured = {"BLOCK_SIZE": 128, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4}
    reserved = {**measured, "BLOCK_SIZE": 256}
    key = lambda c: ",".join(str(c[p]) for p in SPEC.params)  # noqa: E731
    with factory() as session:
        job = queries.create_job(session, operator="softmax", operator_version=SPEC.version,
                                 shape=[4096, 4096], dtype="float16", gpu_model="H200",
                                 budget_configs=10)  # fmt: skip
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1", lease_seconds=60)
        result = {"status": "ok", "time_ms": 1.0, "times_ms": [1.0]}
        queries.record_trial(session, job.id, number=0, config=measured,
                             config_key=key(measured), result=result)  # fmt: skip
        assert fleet.reserve_trial(session, job.id, config=reserved, config_key=key(reserved),
                                   worker_id="w2") == "reserved"  # fmt: skip
        paths = export(collect(session), tmp_path / "out", fmt)
    target = _db(tmp_path / "target.db")
    with target() as session:
        report = import_paths(session, paths)
        assert report.trials_added == 1
        assert [t.config for t in session.scalars(select(Trial))] == [measured]
