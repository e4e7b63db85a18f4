"""Export -> import -> identical lookups, in T4 and Kernel Tuner formats; idempotent imports;
clear errors; Kernel Tuner's simulation mode replays an exported file and finds the same best."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kato.db import queries
from kato.db.export import bundle_to_t4, collect, export, job_to_cache
from kato.db.importer import InvalidImport, import_paths, read_file
from kato.db.ledger import Ledger
from kato.db.models import BestConfig, Job, Trial
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service import lookup as service_lookup
from kato.service.cli import app as cli
from paths import RECORDED
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from kato.shared.kt_cache import config_key, load_cache

SPEC = get_operator("softmax")
COMPILED = "torch.compile 2.14.1 inductor"
FAILURES = [  # configs recorded as failed in job A, on top of the recorded measurements
    (
        {"BLOCK_SIZE": 1024, "VEC": 8, "STRATEGY": 1, "CACHE": 1, "MIN_BLOCKS": 4, "LANES": 32},
        "compile_error",
    ),
    (
        {"BLOCK_SIZE": 32, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4, "LANES": 32},
        "verify_error",
    ),
    (
        {"BLOCK_SIZE": 64, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4, "LANES": 32},
        "invalid",
    ),
    (
        {"BLOCK_SIZE": 128, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4, "LANES": 32},
        "crashed",
    ),
    (
        {"BLOCK_SIZE": 256, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4, "LANES": 32},
        "launch_error",
    ),
    (
        {"BLOCK_SIZE": 512, "VEC": 1, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 4, "LANES": 32},
        "timeout",
    ),
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
    default = SPEC.default_config(shape, dtype)
    queries.upsert_best_config(session, operator="softmax", operator_version=SPEC.version,
                               shape=shape, dtype=dtype, gpu_model="H200",
                               compute_capability="9.0", cuda_version="13.0",
                               config=job.best_config, time_ms=job.best_time_ms,
                               job_id=job.id, default_ms=queries.trial_time(
                                   session, job.id, config_key(list(SPEC.params), default)),
                               framework_ms=2 * job.best_time_ms,
                               framework="torch 2.13.0+cu130",
                               compiled_ms=1.5 * job.best_time_ms,
                               compiled=COMPILED)  # fmt: skip
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
            # No nearest-shape guard: every stored row may answer (the guard's inputs, the
            # figures beside each winner, are compared by _figures).
            row, source = service_lookup.lookup_best_config(
                session, operator="softmax", operator_version=SPEC.version, shape=shape,
                dtype=dtype, gpu_model="H200",
                accept=lambda c, s=shape, d=dtype: SPEC.check(c, s, d) is None, min_gain=None,
            )  # fmt: skip
            out.append((source, row and (row.config, row.time_ms, row.shape, row.cuda_version)))
    return out


def _figures(factory: sessionmaker[Session]) -> list[tuple]:
    """The figures stored beside every winner, by key."""
    with factory() as session:
        rows = session.scalars(select(BestConfig).order_by(BestConfig.shape_key,
                               BestConfig.dtype, BestConfig.cuda_version))  # fmt: skip
        return [(r.shape_key, r.dtype, r.cuda_version, r.default_ms, r.framework_ms,
                 r.framework, r.compiled_ms, r.compiled) for r in rows]  # fmt: skip


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
    assert _figures(target) == _figures(source)
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


def _kernel_tuner_replay(path: Path, strategy: str = "brute_force") -> list[dict]:
    """Kernel Tuner's simulation mode on ``path`` as a Kernel Tuner user runs it: the file's
    own kernel name, problem size and parameters, and no restrictions."""
    kernel_tuner = pytest.importorskip(
        "kernel_tuner", reason="kernel-tuner (pip install kernel-tuner==1.5.0) replays the file"
    )
    cache = json.loads(path.read_text())
    results, _ = kernel_tuner.tune_kernel(
        cache["kernel_name"],
        "__global__ void k() {}",  # never compiled in simulation mode
        cache["problem_size"],
        [],
        cache["tune_params"],
        cache=str(path),
        simulation_mode=True,
        strategy=strategy,
        quiet=True,
    )
    return results


def test_kernel_tuner_simulation_replays_an_exported_job_as_it_is(source, tmp_path):
    """A job exported as a Kernel Tuner cache replays in Kernel Tuner's simulation mode without
    a restrictions function: every config of the space is in the file, the ones Kato did not
    measure marked as Kernel Tuner marks invalid configs, so it skips them."""
    with source() as session:
        job = session.scalars(select(Job).where(Job.shape_key == "4096x4096")).one()
        cache = job_to_cache(session, job.id)
        best_config, best_time = job.best_config, job.best_time_ms
    path = tmp_path / "softmax.json"
    path.write_text(json.dumps(cache.to_json()))
    assert len(cache.entries) == SPEC.space_size() == 3456
    results = _kernel_tuner_replay(path)
    ok = [r for r in results if "__error__" not in r]
    assert len(results) == 3456 and len(ok) == 100
    best = min(ok, key=lambda r: r["time"])
    assert {k: best[k] for k in cache.tune_params} == best_config
    assert best["time"] == best_time


@pytest.mark.parametrize(
    "space",
    ["transpose_H200_8192x8192_float32_*.json.gz", "layernorm_H200_1048576x128_float32_*.json.gz"],
)
def test_kernel_tuner_finds_the_exported_best_of_other_operators(tmp_path, space):
    """A recorded whole space, imported and exported again by the CLI into a directory: the
    file there has a name Kernel Tuner opens (.json) and its simulation mode, given nothing but
    the file, finds the exported best config at its time. Importing the export again adds
    nothing (the unmeasured configs are not trials)."""
    (recorded,) = (Path(__file__).resolve().parents[2] / "data" / "spaces").glob(f"*/{space}")
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    runner = CliRunner()
    assert runner.invoke(cli, ["import", str(recorded), "--db", db]).exit_code == 0
    done = runner.invoke(cli, ["export", str(tmp_path / "out"), "--format", "kt", "--db", db])
    assert done.exit_code == 0, done.output
    (path,) = (tmp_path / "out").iterdir()
    assert path.name.endswith(".kt.json")
    exported = json.loads(path.read_text())
    (best,) = exported["kato"]["best"]
    spec = get_operator(exported["kato"]["operator"])
    assert len(exported["cache"]) == spec.space_size()
    results = _kernel_tuner_replay(path)
    ok = [r for r in results if "__error__" not in r]
    assert len(ok) == len(load_cache(recorded).ok_entries())
    fastest = min(ok, key=lambda r: r["time"])
    assert ({k: fastest[k] for k in spec.params}, fastest["time"]) == (
        best["config"],
        best["time_ms"],
    )
    again = runner.invoke(cli, ["import", str(path), "--db", db, "--json"])
    report = json.loads(again.stdout.strip().splitlines()[-1])
    assert (report["trials_added"], report["best_added"], report["jobs_added"]) == (0, 0, 0)
    assert load_cache(path).entries.keys() == load_cache(recorded).entries.keys()


def test_a_recorded_kernel_tuner_cache_imports_without_kato_metadata(tmp_path):
    recorded = RECORDED / "softmax_H200_65536x1024_float16.json.gz"
    target = _db(tmp_path / "target.db")
    overrides = {"operator_version": SPEC.version}  # the recording may predate a kernel change
    with target() as session:
        first = import_paths(session, [recorded], overrides)
        second = import_paths(session, [recorded], overrides)
        row, source = service_lookup.lookup_best_config(
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
            r"results\[0\]\.times: Field required",
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
    assert "Kernel Tuner reads only plain .json" in done.output  # a gzipped cache is for Kato
    with gzip.open(out, "rt") as f:
        entries = json.load(f)["cache"].values()
    assert (len(entries), sum("kato_job" in e for e in entries)) == (3456, 106)

    first = runner.invoke(cli, ["import", str(out), "--db", dst_url, "--json"])
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert (report["jobs_added"], report["trials_added"], report["best_added"]) == (1, 106, 1)
    again = runner.invoke(cli, ["import", str(out), "--db", dst_url, "--json"])
    assert json.loads(again.stdout.strip().splitlines()[-1])["trials_added"] == 0

    bad = _write(tmp_path / "bad.json", {"results": 3, "schema_version": "1.0.0"})
    failed = runner.invoke(cli, ["import", str(out), str(bad), "--db", dst_url])
    assert failed.exit_code == 2 and "results: Input should be a valid list" in failed.output
    missing = runner.invoke(cli, ["import", str(tmp_path / "nope"), "--db", dst_url])
    assert missing.exit_code == 2 and "no such file" in missing.output
    empty = runner.invoke(cli, ["export", str(tmp_path / "x"), "--operator", "nope", "--db",
                                src_url])  # fmt: skip
    assert empty.exit_code == 1 and "nothing to export" in empty.output


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_a_config_being_measured_is_not_exported(tmp_path, fmt):
    """A running shared job's reservation rows (db.ledger) are not results: exporting that job
    writes its measured trials only, and the file imports."""
    factory = _db(tmp_path / "source.db")
    measured = {
        "BLOCK_SIZE": 128,
        "VEC": 1,
        "STRATEGY": 0,
        "CACHE": 0,
        "MIN_BLOCKS": 4,
        "LANES": 32,
    }
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
        assert (
            Ledger(factory, "w2").job(job.id, helper=True).reserve(reserved, key(reserved))
            == "reserved"
        )
        paths = export(collect(session), tmp_path / "out", fmt)
    target = _db(tmp_path / "target.db")
    with target() as session:
        report = import_paths(session, paths)
        assert report.trials_added == 1
        assert [t.config for t in session.scalars(select(Trial))] == [measured]


# --- corrupt fields of a real export, and the CLI's overrides ------------------------------------


@pytest.fixture(scope="module")
def small_export(tmp_path_factory) -> dict[str, Path]:
    """One done job (3 trials with registers) and its best config, exported as T4 and KT."""
    tmp = tmp_path_factory.mktemp("small")
    factory = _db(tmp / "source.db")
    configs = [dict(SPEC.default_config([4096, 4096], "float16"), BLOCK_SIZE=b)
               for b in (128, 256, 512)]  # fmt: skip
    with factory() as session:
        job = queries.create_job(session, operator="softmax", operator_version=SPEC.version,
                                 shape=[4096, 4096], dtype="float16", gpu_model="H200",
                                 budget_configs=10)  # fmt: skip
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
        for number, config in enumerate(configs):
            result = {"status": "ok", "time_ms": 1.0 + number, "times_ms": [1.0 + number],
                      "registers": 32}  # fmt: skip
            queries.record_trial(session, job.id, number=number, config=config,
                                 config_key=",".join(str(config[p]) for p in SPEC.params),
                                 result=result)  # fmt: skip
        queries.finish_job(session, job.id, status="done")
        queries.upsert_best_config(session, operator="softmax", operator_version=SPEC.version,
                                   shape=[4096, 4096], dtype="float16", gpu_model="H200",
                                   compute_capability="9.0", cuda_version="13.0",
                                   config=configs[0], time_ms=1.0, job_id=job.id)  # fmt: skip
        bundles = collect(session)
    return {fmt: export(bundles, tmp / f"good.{fmt}.json", fmt)[0] for fmt in ("t4", "kt")}


def _kato(doc: dict) -> dict:
    return doc["metadata"]["kato"] if "metadata" in doc else doc["kato"]


def _first_trial(doc: dict) -> dict:
    return doc["results"][0] if "results" in doc else next(iter(doc["cache"].values()))


def _set(*keys, value):
    """A mutation setting ``value`` at ``keys`` under the Kato block ("kato") or the first
    trial ("trial")."""

    def mutate(doc: dict) -> None:
        obj = _kato(doc) if keys[0] == "kato" else _first_trial(doc)
        for key in keys[1:-1]:
            obj = obj[key]
        obj[keys[-1]] = value

    return mutate


def _t4_measurement(name: str, value):
    return lambda doc: doc["results"][0]["measurements"].append({"name": name, "value": value})


def _rename_job(new_id: str):
    """A mutation giving the job ``new_id`` everywhere the file names it."""

    def mutate(doc: dict) -> None:
        old_id = _kato(doc)["jobs"][0]["id"]
        text = json.dumps(doc).replace(json.dumps(old_id), json.dumps(new_id))
        doc.update(json.loads(text))

    return mutate


_JOB = ("kato", "jobs", 0)
CORRUPT = [  # (formats, mutation, message): each was stored or crashed before
    (
        "t4",
        _set("trial", "invalidity", value=[]),
        r"invalidity: Input should be 'correct', 'compile'",
    ),
    (
        "t4",
        _set("trial", "kato", "number", value=True),
        r"kato\.number: Input should be a valid int",
    ),
    (
        "t4",
        _set("trial", "kato", "number", value="abc"),
        r"kato\.number: Input should be a valid int",
    ),
    (
        "t4",
        _set("trial", "kato", "number", value=10**20),
        r"kato\.number: .* less than or equal to 2147483647",
    ),
    (
        "t4",
        _set("trial", "kato", "error", value={"a": 1}),
        r"kato\.error: Input should be a valid string",
    ),
    ("t4", _set("trial", "kato", "job", value=5), r"kato\.job: must be a Kato job id"),
    (
        "t4",
        _set("trial", "measurements", 1, "value", value="many"),
        "registers: Input should be a valid int",
    ),
    (
        "t4",
        _set("trial", "measurements", 1, "value", value=1.5),
        "registers: Input should be a valid int",
    ),
    ("t4", _t4_measurement("occupancy", 2), r"occupancy: Input should be less than or equal to 1"),
    (
        "t4",
        _set("trial", "measurements", value={"a": 1}),
        r"measurements: Input should be a valid list",
    ),
    ("t4", _set("trial", "times", value=[1]), r"times: Input should be a valid dictionary"),
    (
        "t4",
        _set("trial", "times", "compilation_time", value="x"),
        "compilation_time: Input should be a valid number",
    ),
    ("t4", _set("trial", "timestamp", value="yesterday"), r"timestamp: must be an ISO 8601 date"),
    ("t4", _set("trial", "configuration", "VEC", value=float("nan")), "VEC: is nan, not a finite"),
    ("kt", _set("trial", "kato_number", value="abc"), r"kato_number: Input should be a valid int"),
    ("kt", _set("trial", "registers", value="many"), r"registers: Input should be a valid int"),
    ("kt", _set("trial", "error", value={"a": 1}), r"error: Input should be a valid string"),
    (
        "kt",
        _set("trial", "compile_time", value="slow"),
        r"compile_time: Input should be a valid number",
    ),
    ("kt", _set("trial", "timestamp", value="9999-12-31T23:59:59-05:00"), "must lie between"),
    (
        "both",
        _set(*_JOB, "best_config", value=[1, 2]),
        r"best_config: Input should be a valid dict",
    ),
    (
        "both",
        _set(*_JOB, "budget_configs", value="lots"),
        r"budget_configs: Input should be a valid int",
    ),
    (
        "both",
        _set(*_JOB, "budget_configs", value=-5),
        r"budget_configs: .* greater than or equal to 1",
    ),
    (
        "both",
        _set(*_JOB, "budget_seconds", value="x"),
        r"budget_seconds: Input should be a valid number",
    ),
    ("both", _set(*_JOB, "seed", value=[1]), r"jobs\[0\]\.seed: Input should be a valid int"),
    (
        "both",
        _set(*_JOB, "best_time_ms", value="fast"),
        r"best_time_ms: Input should be a valid number",
    ),
    ("both", _set(*_JOB, "error", value=5), r"jobs\[0\]\.error: Input should be a valid string"),
    ("both", _set(*_JOB, "status", value=["done"]), r"jobs\[0\]\.status: Input should be 'queued'"),
    (
        "both",
        _set(*_JOB, "strategy", value="z" * 100),
        r"strategy: String should have at most 16 characters",
    ),
    ("both", _rename_job("../../x"), r"jobs\[0\]\.id: must be a Kato job id \(32 lowercase hex"),
    ("both", _rename_job("A" * 32), r"jobs\[0\]\.id: must be a Kato job id \(32 lowercase hex"),
    ("both", _set(*_JOB, "created_at", value="9999-12-31T23:59:59-05:00"), "must lie between"),
    ("both", _set(*_JOB, "finished_at", value="1999-01-01T00:00:00"), "must lie between 2000"),
    ("both", lambda doc: _kato(doc)["jobs"].append(dict(_kato(doc)["jobs"][0])), "listed twice"),
    (
        "both",
        _set("kato", "shape", value=[2**40, 4096]),
        r"shape\[0\]: .* less than or equal to 2147483647",
    ),
    (
        "both",
        _set("kato", "gpu_model", value="G" * 500),
        r"gpu_model: String should have at most 64",
    ),
    ("both", _set("kato", "dtype", value="x" * 500), r"dtype: String should have at most 32"),
    (
        "both",
        _set("kato", "operator_version", value={"a": 1}),
        "operator_version: Input should be a valid string",
    ),
    (
        "both",
        _set("kato", "best", 0, "config", "VEC", value=float("inf")),
        "VEC: is inf, not a finite",
    ),
    (
        "both",
        _set("kato", "best", 0, "compute_capability", value="9" * 300),
        "compute_capability: String should have at most 16",
    ),
    ("both", _set("kato", "best", 0, "job_id", value="zz"), r"job_id: must be a Kato job id"),
    (
        "both",
        _set("kato", "best", 0, "updated_at", value=20240101),
        r"updated_at: must be an ISO 8601",
    ),
]


@pytest.mark.parametrize(
    "fmt, mutate, message",
    [
        pytest.param(fmt, mutate, message, id=f"{fmt}-{i}")
        for i, (formats, mutate, message) in enumerate(CORRUPT)
        for fmt in (("t4", "kt") if formats == "both" else (formats,))
    ],
)
def test_corrupt_fields_of_an_export_are_rejected(small_export, tmp_path, fmt, mutate, message):
    """A corrupt field of a Kato export is an InvalidImport naming the file and the field: it
    neither crashes the import nor is stored (where the API then failed with HTTP 500)."""
    doc = json.loads(small_export[fmt].read_text())
    read_file(_write(tmp_path / "good.json", doc))  # the export itself imports
    mutate(doc)
    path = _write(tmp_path / "bad.json", doc)
    target = _db(tmp_path / "target.db")
    with target() as session, pytest.raises(InvalidImport, match=message) as raised:
        import_paths(session, [path])
    assert str(raised.value).startswith(f"{path}: ")
    assert _counts(target) == (0, 0, 0)


def test_an_unforeseen_error_reading_a_file_is_an_invalid_import(tmp_path):
    """Any other exception while reading one file becomes an InvalidImport naming the file,
    the original chained (JSON nested too deep for the decoder raises RecursionError)."""
    path = _write(tmp_path / "deep.json", "[" * 100_000)
    with pytest.raises(InvalidImport, match="cannot import: RecursionError") as raised:
        read_file(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert isinstance(raised.value.__cause__, RecursionError)


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_overrides_do_not_replace_a_kato_exports_own_metadata(small_export, tmp_path, fmt):
    """--gpu/--shape/--dtype/--operator are for files without Kato metadata: on a Kato export
    one that disagrees is an error (it relabelled an H200 4096x4096 winner as A100 1x1), one
    that agrees or fills a missing field is used; a foreign file's fields are still replaced."""
    good = small_export[fmt]
    target = _db(tmp_path / "target.db")
    with target() as session:
        with pytest.raises(InvalidImport, match="--gpu 'A100' conflicts with the file's"):
            import_paths(session, [good], {"gpu": "A100", "shape": "1x1"})
        with pytest.raises(InvalidImport, match=r"--shape \[1, 1\] conflicts with the file's"):
            import_paths(session, [good], {"shape": "1x1"})
    assert _counts(target) == (0, 0, 0)

    runner = CliRunner()
    db_url = f"sqlite:///{tmp_path / 'target.db'}"
    failed = runner.invoke(cli, ["import", str(good), "--gpu", "A100", "--shape", "1x1", "--db",
                                 db_url])  # fmt: skip
    assert failed.exit_code == 2 and "conflicts with the file's" in failed.output
    assert _counts(target) == (0, 0, 0)
    agreeing = {"gpu": "NVIDIA H200", "shape": "4096x4096", "dtype": "float16"}
    done = runner.invoke(cli, ["import", str(good), "--gpu", "NVIDIA H200", "--shape",
                               "4096x4096", "--dtype", "float16", "--db", db_url])  # fmt: skip
    assert done.exit_code == 0, done.output
    with target() as session:
        assert import_paths(session, [good], agreeing).trials_present == 3
        row = session.scalars(select(BestConfig)).one()
        assert (row.gpu_model, row.shape, row.dtype) == ("H200", [4096, 4096], "float16")

    doc = json.loads(good.read_text())
    del _kato(doc)["dtype"]  # a field the Kato block lacks: the override fills it
    doc.pop("dtype", None)  # (a Kernel Tuner file's top-level copy of it too)
    lacking = _write(tmp_path / "lacking.json", doc)
    assert read_file(lacking, {"dtype": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(InvalidImport, match="VEC=8 of float32 is a 32-byte vector"):
        read_file(lacking, {"dtype": "float32"})  # the configs measured do not fit float32

    recorded = RECORDED / "softmax_H200_65536x1024_float16.json.gz"  # no Kato block
    foreign = read_file(recorded, {"operator_version": "other"})
    assert (foreign.operator_version, foreign.gpu_model) == ("other", "H200")


def test_a_job_id_stored_for_another_problem_is_rejected(small_export, tmp_path):
    """A file whose job id is already stored for another problem would add its trials to that
    job: the import stops there and writes nothing."""
    target = _db(tmp_path / "target.db")
    doc = json.loads(small_export["t4"].read_text())
    _kato(doc)["shape"] = [8192, 4096]
    other = _write(tmp_path / "other.json", doc)
    with target() as session:
        import_paths(session, [small_export["t4"]])
        before = _counts(target)
        with pytest.raises(InvalidImport, match="is stored for another problem"):
            import_paths(session, [other])
    assert _counts(target) == before == (1, 3, 1)


def test_figures_beside_a_winner_are_exported_and_read_back(source, tmp_path):
    """default_ms, framework_ms and framework (compiled_ms and compiled too) travel in the Kato
    block where measured; a best without them (no job: nothing measured beside it) has none in
    the file either."""
    with source() as session:
        (path,) = export(collect(session, operator="softmax", dtype="float16"), tmp_path, "t4")
        job = session.scalars(select(Job).where(Job.shape_key == "4096x4096")).one()
        default_ms = queries.trial_time(
            session, job.id, config_key(list(SPEC.params), SPEC.default_config([4096, 4096],
                                        "float16")))  # fmt: skip
    (best,) = json.loads(path.read_text())["metadata"]["kato"]["best"]
    assert default_ms is not None and best["default_ms"] == default_ms
    assert best["framework_ms"] == 2 * best["time_ms"]
    assert best["framework"] == "torch 2.13.0+cu130"
    assert (best["compiled_ms"], best["compiled"]) == (1.5 * best["time_ms"], COMPILED)
    figures = {(k, d, c): rest for k, d, c, *rest in _figures(source)}
    assert figures[("1024x1024", "float32", "13.0")] == [None] * 5


def test_an_older_file_imports_and_gets_its_default_time_from_its_trials(source, tmp_path):
    """A file written before the figures existed (no default_ms, framework_ms, framework,
    compiled_ms, compiled) is
    imported as before; its best's default time is read from the file's own trial of the
    operator's default config, so the lookup guard can serve it for other shapes."""
    with source() as session:
        (path,) = export(collect(session, operator="softmax", dtype="float16"), tmp_path, "t4")
    doc = json.loads(path.read_text())
    for best in doc["metadata"]["kato"]["best"]:
        for name in ("default_ms", "framework_ms", "framework", "compiled_ms", "compiled"):
            del best[name]
    path.write_text(json.dumps(doc))
    target = _db(tmp_path / "target.db")
    with target() as session:
        report = import_paths(session, [path])
    assert report.best_added == 1
    ((_, _, _, default_ms, *measured),) = _figures(target)
    expected = {(k, d): rest for k, d, _, *rest in _figures(source)}[("4096x4096", "float16")]
    assert default_ms == expected[0] and default_ms is not None
    assert measured == [None] * 4
