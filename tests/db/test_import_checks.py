"""An import checks every record against the registered operator it names (its parameters and
their values, its constraints for the shape and dtype, its rank and dtypes) and against the
file's own measurements, and refuses what does not fit: nothing stored, CLI exit 2. No stored
value steers where ``kato export`` writes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kato.db import queries
from kato.db.export import collect, export
from kato.db.importer import InvalidImport, import_paths, read_file
from kato.db.models import BestConfig, Job, Trial
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service import lookup as service_lookup
from kato.service.cli import app as cli
from paths import RECORDED, SPACES
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

SPEC = get_operator("softmax")
SHAPE, DTYPE = [4096, 4096], "float16"
#: A point of softmax's space that its constraints reject for 4096x4096 float16.
REJECTED = {"BLOCK_SIZE": 32, "VEC": 1, "STRATEGY": 0, "CACHE": 2, "MIN_BLOCKS": 0, "LANES": 32}
#: A valid config that the exported job did not measure.
UNMEASURED = {"BLOCK_SIZE": 1024, "VEC": 4, "STRATEGY": 1, "CACHE": 1, "MIN_BLOCKS": 0, "LANES": 32}


def _db(path: Path) -> sessionmaker[Session]:
    return session_factory(init_db(f"sqlite:///{path}"))


def _key(config: dict) -> str:
    return ",".join(str(config[p]) for p in SPEC.params)


def _counts(factory: sessionmaker[Session]) -> tuple[int, int, int]:
    with factory() as session:
        return tuple(
            session.scalar(select(func.count()).select_from(m)) for m in (Job, Trial, BestConfig)
        )


def _lookup(factory: sessionmaker[Session]) -> tuple[str, dict | None, float | None]:
    with factory() as session:
        row, source = service_lookup.lookup_best_config(
            session, operator="softmax", operator_version=SPEC.version, shape=SHAPE,
            dtype=DTYPE, gpu_model="H200",
            accept=lambda c: SPEC.check(c, SHAPE, DTYPE) is None,
        )  # fmt: skip
        return source, row and dict(row.config), row and row.time_ms


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """One done softmax job (3 measured configs, the fastest 1.0 ms) and its best config,
    exported as T4 and as a Kernel Tuner cache."""
    tmp = tmp_path_factory.mktemp("exported")
    factory = _db(tmp / "source.db")
    configs = [dict(SPEC.default_config(SHAPE, DTYPE), BLOCK_SIZE=b) for b in (128, 256, 512)]
    assert all(SPEC.check(c, SHAPE, DTYPE) is None for c in configs)
    assert SPEC.check(UNMEASURED, SHAPE, DTYPE) is None and UNMEASURED not in configs
    with factory() as session:
        job = queries.create_job(session, operator="softmax", operator_version=SPEC.version,
                                 shape=SHAPE, dtype=DTYPE, gpu_model="H200",
                                 budget_configs=10)  # fmt: skip
        queries.claim_next_job(session, gpu_models=["H200"], worker_id="w", lease_seconds=60)
        for number, config in enumerate(configs):
            result = {"status": "ok", "time_ms": 1.0 + number, "times_ms": [1.0 + number]}
            queries.record_trial(session, job.id, number=number, config=config,
                                 config_key=_key(config), result=result)  # fmt: skip
        queries.finish_job(session, job.id, status="done")
        queries.upsert_best_config(session, operator="softmax", operator_version=SPEC.version,
                                   shape=SHAPE, dtype=DTYPE, gpu_model="H200",
                                   compute_capability="9.0", cuda_version="13.0",
                                   config=configs[0], time_ms=1.0, job_id=job.id)  # fmt: skip
        bundles = collect(session)
    return {fmt: export(bundles, tmp / f"good.{fmt}.json", fmt)[0] for fmt in ("t4", "kt")}


@pytest.fixture
def target(tmp_path, exported) -> sessionmaker[Session]:
    """A database that already serves the exported winner (1.0 ms, exact)."""
    factory = _db(tmp_path / "target.db")
    with factory() as session:
        import_paths(session, [exported["t4"]])
    assert _lookup(factory)[0] == "exact"
    return factory


def _kato(doc: dict) -> dict:
    return doc["metadata"]["kato"] if "metadata" in doc else doc["kato"]


def _first_trial(doc: dict) -> dict:
    if "results" in doc:
        return doc["results"][0]
    return next(e for e in doc["cache"].values() if "kato_job" in e)


def _set_config(record: dict, config: dict) -> None:
    """Give a T4 result, a Kernel Tuner entry or a best row ``config``."""
    if "configuration" in record:
        record["configuration"] = dict(config)
    elif "config" in record:
        record["config"] = dict(config)
    else:
        record.update(config)


def _best_config(config, time_ms=None):
    def mutate(doc):
        best = _kato(doc)["best"][0]
        best["config"] = dict(config)
        if time_ms is not None:
            best["time_ms"] = time_ms

    return mutate


def _best_field(name, value):
    return lambda doc: _kato(doc)["best"][0].__setitem__(name, value)


def _trial_config(config):
    def mutate(doc):
        trial = _first_trial(doc)
        _set_config(trial, config)
        if "cache" in doc:  # a Kernel Tuner entry is keyed by its config
            key = next(k for k, e in doc["cache"].items() if e is trial)
            doc["cache"][_key(trial)] = doc["cache"].pop(key)

    return mutate


def _top(name, value):
    return lambda doc: doc.__setitem__(name, value)


def _kato_field(name, value):
    return lambda doc: _kato(doc).__setitem__(name, value)


def _lone_surrogate(doc):
    trial = _first_trial(doc)
    (trial["kato"] if "results" in doc else trial)["error"] = "\ud800"


BAD = [  # (formats, mutation, message): each was stored with exit 0 before, or crashed
    ("both", _best_config({**UNMEASURED, "BLOCK_SIZE": 4096}, 0.5), r"BLOCK_SIZE=4096 is not one"),
    ("both", _best_config({**UNMEASURED, "EXTRA": 1}, 0.5), r"unknown parameter\(s\) EXTRA"),
    ("both", _best_config(REJECTED, 0.5), r"kato\.best\[0\].*not valid for softmax 4096x4096"),
    ("both", _best_config(UNMEASURED, 0.5), r"kato\.best\[0\].*not among the file's measured"),
    ("both", _best_field("time_ms", 1e-6), r"kato\.best\[0\].*not among the file's measured"),
    ("both", _best_field("compute_capability", "banana"), r"compute_capability.*banana"),
    ("both", _best_field("compute_capability", "8.0"), r"compute capability of the H200 is 9\.0"),
    ("both", _best_field("cuda_version", "13.0\u0000"), r"cuda_version"),
    ("both", _kato_field("shape", [4096]), r"takes a shape of rank 2"),
    ("both", _kato_field("shape", [4096, 4096, 2]), r"takes a shape of rank 2"),
    ("both", _kato_field("dtype", "int8"), r"does not support dtype 'int8'"),
    ("both", _kato_field("operator", "../../x/y"), r"unknown operator '\.\./\.\./x/y'"),
    ("both", _kato_field("operator", "/etc/passwd"), r"unknown operator '/etc/passwd'"),
    ("both", _kato_field("operator", "layernorm"), r"are not layernorm's"),
    ("both", _kato_field("operator_version", "../../v"), r"operator_version"),
    ("both", _kato_field("gpu_model", "H200\u0000"), r"gpu_model"),
    ("both", _trial_config({**UNMEASURED, "VEC": 3}), r"VEC=3 is not one of"),
    ("both", _trial_config(REJECTED), r"measured as ok.*not valid for softmax"),
    ("both", _lone_surrogate, r"lone surrogate"),
    ("kt", _top("dtype", "float32"), r"dtype 'float32' disagrees with kato\.dtype 'float16'"),
    ("kt", _top("kato_operator", "layernorm"), r"kato_operator 'layernorm' disagrees"),
    ("kt", _top("problem_size", [8, 8]), r"problem_size \[8, 8\] disagrees"),
    ("kt", _top("device_name", "NVIDIA A100"), r"device_name 'NVIDIA A100' disagrees"),
    ("kt", _top("compute_capability", "banana"), r"compute_capability"),
    # Values of the space's own types only (issue 28's review): 2.0 and True are not 2 and 1.
    ("both", _trial_config({**UNMEASURED, "VEC": 2.0}), r"VEC=2\.0 is a float, not a int"),
    ("both", _trial_config({**UNMEASURED, "STRATEGY": True}), r"STRATEGY: .*not bool, got True"),
    ("both", _best_config({**UNMEASURED, "VEC": 4.0}, 0.5), r"VEC=4\.0 is a float"),
    # GPU model names: the API's character rules, nothing path-like or reserved.
    ("both", _kato_field("gpu_model", "../../evil"), r"GPU model '\.\./\.\./evil' must not hold"),
    ("both", _kato_field("gpu_model", ".."), r"GPU model '\.\.' must not start or end"),
    ("both", _kato_field("gpu_model", "CON"), r"GPU model 'CON' is a name reserved"),
    ("both", _kato_field("gpu_model", "nul.txt"), r"GPU model 'nul\.txt' is a name reserved"),
    ("both", _kato_field("gpu_model", "a\\b"), r"must not hold \\"),
    ("both", _kato_field("gpu_model", "H" * 65), r"gpu_model: .*at most 64 characters"),
    ("both", _kato_field("gpu_model", "C:evil"), r"must not hold :"),
    # T4 schema majors other than 1.
    ("t4", _top("schema_version", "9.0.0"), r"schema_version '9\.0\.0' is not supported.*1\.x"),
    ("t4", _top("schema_version", "one"), r"schema_version 'one' is not a version"),
]


@pytest.mark.parametrize(
    "fmt, mutate, message",
    [
        pytest.param(fmt, mutate, message, id=f"{fmt}-{i}")
        for i, (formats, mutate, message) in enumerate(BAD)
        for fmt in (("t4", "kt") if formats == "both" else (formats,))
    ],
)
def test_a_record_that_does_not_fit_is_refused(exported, target, tmp_path, fmt, mutate, message):
    """A corrupt or foreign record in a Kato export is refused with a message naming the file
    and what is wrong; the winner already stored is still served as it was."""
    doc = json.loads(exported[fmt].read_text())
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    before = (_counts(target), _lookup(target))
    with target() as session, pytest.raises(InvalidImport, match=message) as raised:
        import_paths(session, [exported["kt" if fmt == "t4" else "t4"], bad])
    assert str(raised.value).startswith(f"{bad}: ")
    assert (
        (_counts(target), _lookup(target))
        == before
        == ((1, 3, 1), ("exact", _lookup(target)[1], 1.0))
    )


def test_the_cli_refuses_a_bad_file_with_exit_2_and_stores_nothing(exported, tmp_path):
    doc = json.loads(exported["t4"].read_text())
    _best_config(UNMEASURED, 0.001)(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = CliRunner().invoke(cli, ["import", str(exported["kt"]), str(bad), "--db", url])
    assert result.exit_code == 2, result.output
    assert "not among the file's measured trials" in result.output
    assert _counts(_db(tmp_path / "cli.db")) == (0, 0, 0)


def _foreign_cache(params: dict[str, list], entries: list[dict], **top) -> dict:
    keys = list(params)
    return {
        "device_name": "NVIDIA H200",
        "kernel_name": "some_kernel",
        "problem_size": [4096, 4096],
        "tune_params_keys": keys,
        "tune_params": params,
        "objective": "time",
        "cache": {",".join(str(e[k]) for k in keys): e for e in entries},
        **top,
    }


def _strip_kato(recorded: Path) -> dict:
    """A committed Kato recording as Kernel Tuner would have it: no Kato fields."""
    with gzip.open(recorded, "rt") as f:
        doc = json.load(f)
    for name in ("kato", "kato_operator", "kato_operator_version", "dtype"):
        doc.pop(name, None)
    for entry in doc["cache"].values():
        for name in [n for n in entry if n.startswith("kato_")]:
            del entry[name]
    return doc


FOREIGN = [  # (document, overrides, message)
    (  # a GEMM-like cache under matmul
        lambda: _foreign_cache(
            {"MWG": [16, 32], "NWG": [16, 32]},
            [{"MWG": m, "NWG": n, "time": 1.0 + m + n} for m in (16, 32) for n in (16, 32)],
        ),
        {"operator": "matmul", "shape": "4096x4096x4096", "dtype": "float32"},
        r"parameters \['MWG', 'NWG'\] are not matmul's",
    ),
    (  # a convolution-like cache under softmax
        lambda: _foreign_cache(
            {"block_size_x": [16, 32], "filter_width": [3]},
            [{"block_size_x": b, "filter_width": 3, "time": b / 10} for b in (16, 32)],
        ),
        {"operator": "softmax", "dtype": "float16"},
        r"parameters \['block_size_x', 'filter_width'\] are not softmax's",
    ),
    (  # a real layernorm space imported as softmax
        lambda: _strip_kato(next(SPACES.glob("h200/layernorm_H200_1048576x128_float32_*"))),
        {"operator": "softmax", "dtype": "float32"},
        r"are not softmax's",
    ),
    (  # a softmax recording of rank 2 given a rank-1 shape
        lambda: _strip_kato(RECORDED / "softmax_H200_4096x4096_float16.json.gz"),
        {"operator": "softmax", "dtype": "float16", "shape": "16777216"},
        r"takes a shape of rank 2",
    ),
    (  # an operator this installation does not have
        lambda: _strip_kato(RECORDED / "softmax_H200_4096x4096_float16.json.gz"),
        {"operator": "softmax_v2", "dtype": "float16"},
        r"unknown operator 'softmax_v2'",
    ),
    (  # a value outside the operator's space
        lambda: _foreign_cache(
            {**{k: list(v) for k, v in SPEC.params.items()}, "BLOCK_SIZE": [2048]},
            [{**UNMEASURED, "BLOCK_SIZE": 2048, "time": 0.5}],
        ),
        {"operator": "softmax", "dtype": "float16"},
        r"BLOCK_SIZE=2048 is not one of",
    ),
    (  # a compute capability that is not a version
        lambda: (
            _strip_kato(RECORDED / "softmax_H200_4096x4096_float16.json.gz")
            | {"compute_capability": "banana"}
        ),
        {"operator": "softmax", "dtype": "float16"},
        r"compute_capability.*banana",
    ),
]


@pytest.mark.parametrize("make, overrides, message", FOREIGN)
def test_a_foreign_cache_that_is_not_the_operators_space_is_refused(
    tmp_path, make, overrides, message
):
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(make()))
    url = f"sqlite:///{tmp_path / 'kato.db'}"
    argv = ["import", str(path), "--db", url]
    for name, value in overrides.items():
        argv += [f"--{name}", value]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    with pytest.raises(InvalidImport, match=message):
        read_file(path, overrides)
    assert _counts(_db(tmp_path / "kato.db")) == (0, 0, 0)


def test_a_kernel_tuner_cache_of_the_operator_still_imports(tmp_path):
    """The checks refuse only what does not fit: Kernel Tuner's own cache of a Kato operator
    (no Kato fields) imports with the flags naming what it lacks."""
    path = tmp_path / "kt.json"
    path.write_text(json.dumps(_strip_kato(RECORDED / "softmax_H200_4096x4096_float16.json.gz")))
    target = _db(tmp_path / "kato.db")
    with target() as session:
        report = import_paths(session, [path], {"operator": "softmax", "dtype": "float16"})
    assert (report.jobs_added, report.trials_added, report.best_added) == (1, 100, 1)


def test_every_committed_export_passes_the_checks():
    """The committed winners and recorded spaces (kato export files) are what a real export
    holds: every one of them reads under the checks."""
    files = sorted((SPACES.parent / "h200").glob("*.t4.json")) + sorted(SPACES.glob("*/*.gz"))
    assert len(files) > 60
    for path in files:
        bundle = read_file(path)
        assert bundle.best, path


def _stored_with_bad_names(factory: sessionmaker[Session]) -> None:
    """Rows as an older Kato stored them from a file it did not check."""
    with factory() as session:
        job = queries.create_job(session, operator="../../../escaped/op",
                                 operator_version="/tmp/v", shape=SHAPE, dtype="../d",
                                 gpu_model="../../g/h", budget_configs=1)  # fmt: skip
        queries.claim_next_job(session, gpu_models=["../../g/h"], worker_id="w", lease_seconds=60)
        config = dict(SPEC.default_config(SHAPE, DTYPE))
        result = {"status": "ok", "time_ms": 1.0, "times_ms": [1.0]}
        queries.record_trial(session, job.id, number=0, config=config, config_key=_key(config),
                             result=result)  # fmt: skip
        queries.finish_job(session, job.id, status="done")


@pytest.mark.parametrize("fmt", ["t4", "kt"])
def test_no_stored_value_steers_where_export_writes(tmp_path, fmt):
    factory = _db(tmp_path / "kato.db")
    _stored_with_bad_names(factory)
    out = tmp_path / "a" / "b" / "out"
    before = {p for p in tmp_path.rglob("*")}
    with factory() as session:
        paths = export(collect(session), out, fmt)
    (path,) = paths
    assert path.parent == out and path.exists()
    assert "/" not in path.name and not path.name.startswith(".")
    written = {p for p in tmp_path.rglob("*")} - before
    assert all(p == out or out in p.parents or p in out.parents for p in written), written


def test_an_unknown_but_well_formed_gpu_is_imported_with_a_warning(exported, tmp_path):
    doc = json.loads(exported["t4"].read_text())
    _kato(doc)["gpu_model"] = "Banana GPU"
    for best in _kato(doc)["best"]:
        best["compute_capability"] = "12.3"  # unchecked: the catalog does not know the GPU
    unknown = tmp_path / "banana.json"
    unknown.write_text(json.dumps(doc))
    factory = _db(tmp_path / "target.db")
    with factory() as session:
        report = import_paths(session, [unknown])
    assert [w for w in report.warnings if "GPU" in w] == [
        "GPU model 'Banana GPU' is not in Kato's catalog: its results are stored under that "
        "name, their compute capability and the GPU's limits unchecked; check the name "
        "(`GET /v1/gpus` lists the catalog)"
    ]
    with factory() as session:
        assert list(session.scalars(select(BestConfig.gpu_model))) == ["Banana GPU"]
