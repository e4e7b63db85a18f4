"""``kato baseline`` and :mod:`tuner.baselines`: PyTorch's eager and compiled baselines measured
for stored winners that lack them and stored beside them, the configs and times untouched; which
winners it takes (current versions, one GPU model, missing figures); what a baseline that was
not timed leaves; the command's dry run and its refusals on a host without a GPU."""

from __future__ import annotations

import json
import threading

import pytest
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.cli import app
from kato.tuner import baselines, framework
from test_cli import _assert_clear_error
from typer.testing import CliRunner

CONFIG = {"BLOCK_SIZE": 128}


def store(sessions, operator, shape, dtype="float16", gpu="H200", version=None, **figures):
    with sessions() as s:
        return queries.upsert_best_config(
            s, operator=operator, operator_version=version or get_operator(operator).version,
            shape=shape, dtype=dtype, gpu_model=gpu, compute_capability="9.0",
            cuda_version="13.0", config=CONFIG, time_ms=0.05, job_id=None, **figures,
        ).id  # fmt: skip


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/kato.db"
    engine = init_db(url)
    sessions = session_factory(engine)
    rows = {
        "bare": store(sessions, "softmax", [4096, 1024]),
        "eager only": store(
            sessions, "layernorm", [8192, 768], framework_ms=0.1, framework="torch 2.13.0"
        ),  # fmt: skip
        "both": store(
            sessions,
            "softmax",
            [2048, 1024],
            framework_ms=0.1,
            framework="torch 2.13.0",
            compiled_ms=0.08,
            compiled="torch.compile 2.13.0 inductor",
        ),  # fmt: skip
        "other gpu": store(sessions, "softmax", [4096, 1024], gpu="A100"),
        "old version": store(sessions, "relu", [1 << 20], version="0ld0ld0ld0ld"),
    }
    yield url, sessions, rows
    engine.dispose()


def test_winners_are_the_gpus_current_ones_that_lack_a_figure(db):
    _, sessions, rows = db
    with sessions() as s:
        want = baselines.winners(s, "H200")
        every = baselines.winners(s, "H200", missing_only=False)
        eager = baselines.winners(s, "H200", compiled=False)
        softmax = baselines.winners(s, "H200", operators=["softmax", "unknown"])
    assert {w.row_id for w in want} == {rows["bare"], rows["eager only"]}
    assert {w.row_id for w in every} == {rows["bare"], rows["eager only"], rows["both"]}
    assert {w.row_id for w in eager} == {rows["bare"]}
    assert [w.row_id for w in softmax] == [rows["bare"]]


def timed(ms, compiled_ms=None, status=framework.OK):
    compiled = None
    if compiled_ms is not None:
        compiled = framework.FrameworkResult(framework.OK, "torch.compile 2.13.0 inductor",
                                             "softmax", (compiled_ms,) * 3)  # fmt: skip
    return framework.FrameworkResult(status, "torch 2.13.0", "op", (ms,) * 3, compiled=compiled)


def test_fill_stores_what_was_timed_and_leaves_the_rest(db):
    """A timed pair is stored (config and time unchanged, updated_at moved); a compiled
    baseline that was not timed clears the compiled figure and says why; an eager one not
    timed stores nothing; a mismatch is stored marked."""
    _, sessions, rows = db
    with sessions() as s:
        todo = baselines.winners(s, "H200", missing_only=False)
        before = {r: queries.best_config_row(s, r).updated_at for r in rows.values()}
    answers = {
        rows["bare"]: timed(0.2, 0.1),
        rows["both"]: framework.FrameworkResult(framework.SKIPPED, detail="no CUDA device"),
    }
    answers[rows["eager only"]] = framework.FrameworkResult(
        framework.MISMATCH, "torch 2.13.0", "op", (0.3,) * 3,
        compiled=framework.FrameworkResult(framework.FAILED, detail="inductor raised"),
    )  # fmt: skip
    by_key = {(w.operator, w.shape): w.row_id for w in todo}
    calls = []

    def measure(operator, shape, dtype, **kw):
        calls.append((operator, shape, dtype, kw["gpu_model"], kw["compiled"]))
        return answers[by_key[(operator, shape)]]

    seen = []
    out = baselines.fill(sessions, todo, "H200", measure=measure, on_outcome=seen.append)
    assert seen == out and len(out) == 3
    assert {c[3] for c in calls} == {"H200"} and all(c[4] for c in calls)
    status = {o.winner.row_id: o for o in out}
    assert status[rows["bare"]].status == "stored"
    assert status[rows["bare"]].speedup == pytest.approx(0.2 / 0.05)
    assert status[rows["bare"]].compiled_speedup == pytest.approx(0.1 / 0.05)
    assert status[rows["eager only"]].status == "stored"
    assert "failed" in status[rows["eager only"]].detail
    assert status[rows["both"]].status == framework.SKIPPED
    with sessions() as s:
        bare = queries.best_config_row(s, rows["bare"])
        mism = queries.best_config_row(s, rows["eager only"])
        both = queries.best_config_row(s, rows["both"])
        assert (bare.framework_ms, bare.compiled_ms) == (pytest.approx(0.2), pytest.approx(0.1))
        assert bare.config == CONFIG and bare.time_ms == 0.05
        assert bare.updated_at > before[rows["bare"]]
        assert mism.framework_ms == pytest.approx(0.3) and mism.framework.endswith("(mismatch)")
        assert mism.compiled_ms is None and mism.compiled is None
        assert (both.framework_ms, both.compiled_ms) == (0.1, 0.08)  # untouched
        assert both.updated_at == before[rows["both"]]


def test_fill_stops_before_the_next_winner_once_told(db):
    _, sessions, _ = db
    with sessions() as s:
        todo = baselines.winners(s, "H200", missing_only=False)
    stop = threading.Event()

    def measure(*args, **kw):
        stop.set()
        return timed(0.2)

    assert len(baselines.fill(sessions, todo, "H200", measure=measure, stop=stop)) == 1


def test_the_command_lists_in_a_dry_run_and_refuses_what_it_cannot_do(db):
    url, _, rows = db
    runner = CliRunner()
    result = runner.invoke(app, ["baseline", "--db", url, "--dry-run", "--gpu", "H200", "--json"])
    assert result.exit_code == 0, result.output
    listed = [json.loads(line) for line in result.stdout.splitlines()]
    assert {(r["operator"], tuple(r["shape"])) for r in listed} == {
        ("softmax", (4096, 1024)),
        ("layernorm", (8192, 768)),
    }
    assert all(r["status"] == "to measure" for r in listed)
    assert next(r for r in listed if r["operator"] == "layernorm")["framework_ms"] == 0.1
    for argv, phrases in (
        (["--dry-run"], ["--dry-run needs --gpu"]),
        (["--operator", "nope", "--dry-run"], ["unknown operator", "'nope'"]),
        # Measuring needs the device: on a host without one, a clear error.
        ([], ["no usable CUDA device 0"]),
    ):
        _assert_clear_error(runner.invoke(app, ["baseline", "--db", url, *argv]), 2, phrases)


def test_a_user_operators_winners_are_not_measured(db):
    """A user operator has no PyTorch op (its baseline would be ``skipped`` on every run, and
    the run counted as failed): ``kato baseline`` leaves its winners out and refuses it by
    name."""
    from kato.db.operators import use_database
    from kato.kernels import registry
    from paths import REPO

    url, sessions, _ = db
    runner = CliRunner()
    added = runner.invoke(app, ["operator", "add", str(REPO / "tests/user_ops/data/vector_add"),
                                "--db", url])  # fmt: skip
    assert added.exit_code == 0, added.output
    source = use_database(sessions)
    try:
        store(sessions, "vector_add_test", [4096], dtype="float32")
        with sessions() as s:
            assert "vector_add_test" not in {w.operator for w in baselines.winners(s, "H200")}
        result = runner.invoke(app, ["baseline", "--db", url, "--dry-run", "--gpu", "H200",
                                     "--json"])  # fmt: skip
        assert result.exit_code == 0, result.output
        listed = {json.loads(line)["operator"] for line in result.stdout.splitlines()}
        assert listed == {"softmax", "layernorm"}
        argv = ["baseline", "--db", url, "--operator", "vector_add_test", "--dry-run"]
        _assert_clear_error(runner.invoke(app, argv), 2, ["'vector_add_test'", "user operator"])
    finally:
        registry.remove_source(source)


def test_an_interrupted_run_keeps_what_it_stored_and_exits_130(db, monkeypatch):
    """Ctrl-C during the second winner's measurement: the first's figures stay stored, and the
    exit status says the run did not finish (a script must not export a partial run as done).
    The measuring child, which needs a GPU, is replaced by one that answers, then is
    interrupted."""
    from kato.service.cli import baseline as command

    url, sessions, rows = db
    monkeypatch.setattr(command, "gpu_model_of", lambda device: "H200")
    answers = iter([timed(0.2, 0.1)])

    def measure(*args, **kw):
        for answer in answers:
            return answer
        raise KeyboardInterrupt

    monkeypatch.setattr(framework, "measure_in_child", measure)
    result = CliRunner().invoke(app, ["baseline", "--db", url, "--json"])
    assert result.exit_code == 130, result.output
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["status"] == "stored"
    with sessions() as s:
        stored = [r for r in rows.values() if queries.best_config_row(s, r).framework_ms == 0.2]
    assert len(stored) == 1
