"""The framework baseline on the worker's path: a finished job stores PyTorch's time and the
default config's time beside its winner; a baseline that fails, disagrees or is turned off
leaves the job done without it. The timing itself needs a GPU (tests/gpu/test_framework_gpu.py);
here a test double factory answers for it, and the real child reports why it cannot measure."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import pytest
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service import lookup as service_lookup
from kato.tuner import framework
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.framework import FrameworkResult
from kato.tuner.worker import Worker
from paths import RECORDED

from kato.shared.kt_cache import config_key, load_cache

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
SHAPE, DTYPE = [4096, 4096], "float16"
SPEC = get_operator("softmax")


class BaselineFactory:
    """Replay backends for the job, and a framework timer answering ``result`` (or raising
    it), recording what it was asked."""

    def __init__(self, result: FrameworkResult | Exception):
        self.result = result
        self.calls: list[tuple[str, tuple[int, ...], str, str]] = []

    def __call__(self, job):
        return ReplayBackend(RECORDING)

    def measure_framework(self, job, device, stop):
        assert not stop.is_set()
        self.calls.append((job.operator, tuple(job.shape), job.dtype, device.model))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/kato.db"
    return url, session_factory(init_db(url))


def run_job(db, factory, budget: int = 12):
    url, sessions = db
    with sessions() as s:
        queries.create_job(
            s, operator="softmax", operator_version=SPEC.version, shape=SHAPE, dtype=DTYPE,
            gpu_model="H200", budget_configs=budget,
        )  # fmt: skip
    outcome = Worker(sessions, url, ["H200"], factory, poll_seconds=0.01).run_once()
    assert outcome is not None and outcome.status == "done", outcome
    with sessions() as s:
        row, source = service_lookup.lookup_best_config(
            s, operator="softmax", operator_version=SPEC.version, shape=SHAPE, dtype=DTYPE,
            gpu_model="H200",
        )  # fmt: skip
    assert source == "exact"
    return row


def recorded_default_ms() -> float:
    cache = load_cache(RECORDING)
    key = config_key(list(SPEC.params), SPEC.default_config(SHAPE, DTYPE))
    return float(cache.entries[key]["time"])


def test_a_finished_job_stores_the_framework_and_default_times_beside_its_winner(db):
    baseline = FrameworkResult("ok", "torch 2.13.0+cu130", "torch.softmax", (0.05, 0.04, 0.06))
    factory = BaselineFactory(baseline)
    row = run_job(db, factory)
    assert factory.calls == [("softmax", tuple(SHAPE), DTYPE, "H200")]
    assert row.framework_ms == 0.05 and row.framework == "torch 2.13.0+cu130"
    # Every job measures the default config first: its time is the recording's.
    assert row.default_ms == pytest.approx(recorded_default_ms())
    assert row.time_ms <= row.default_ms


@pytest.mark.parametrize(
    "result",
    [
        FrameworkResult("mismatch", "torch 2.13.0", "torch.softmax", detail="output 1: 3 of 9"),
        FrameworkResult("skipped", detail="torch sees no CUDA device 0"),
        FrameworkResult("failed", detail="no answer within 300 s"),
        RuntimeError("the timer broke"),
    ],
    ids=["untimed mismatch", "skipped", "failed", "raised"],
)
def test_a_baseline_that_is_not_timed_is_logged_not_stored_and_the_job_is_done(db, result, caplog):
    caplog.set_level(logging.WARNING, logger="kato.tuner.worker")
    row = run_job(db, BaselineFactory(result))
    assert (row.framework_ms, row.framework) == (None, None)
    assert row.default_ms == pytest.approx(recorded_default_ms())
    text = caplog.text
    expected = str(result) if isinstance(result, Exception) else result.detail
    assert "framework baseline" in text and expected in text


def test_a_timed_mismatch_is_stored_with_a_warning(db, caplog):
    """PyTorch's op out of Kato's tolerance is still what runs in Kato's place: its time is
    the policy's bar, stored beside the winner, and the disagreement is logged."""
    caplog.set_level(logging.WARNING, logger="kato.tuner.worker")
    result = FrameworkResult("mismatch", "torch 2.13.0", "op", (0.08, 0.07, 0.09), "output 6: 2%")
    row = run_job(db, BaselineFactory(result))
    assert (row.framework_ms, row.framework) == (0.08, "torch 2.13.0 (mismatch)")
    assert "outside Kato's tolerance" in caplog.text and "output 6: 2%" in caplog.text


def test_the_baseline_can_be_turned_off(db, monkeypatch):
    monkeypatch.setenv("KATO_FRAMEWORK_BASELINE", "false")
    factory = BaselineFactory(FrameworkResult("ok", "torch", "op", (0.05,)))
    row = run_job(db, factory)
    assert factory.calls == [] and row.framework_ms is None


def test_a_bad_setting_is_logged_and_the_job_is_done(db, monkeypatch, caplog):
    monkeypatch.setenv("KATO_FRAMEWORK_BASELINE", "sometimes")
    factory = BaselineFactory(FrameworkResult("ok", "torch", "op", (0.05,)))
    row = run_job(db, factory)
    assert factory.calls == [] and row.framework_ms is None
    assert "KATO_FRAMEWORK_BASELINE='sometimes'" in caplog.text


def test_a_replay_worker_takes_no_baseline_but_stores_the_default_time(db):
    row = run_job(db, lambda job: ReplayBackend(RECORDING))
    assert row.framework_ms is None
    assert row.default_ms == pytest.approx(recorded_default_ms())


def test_a_later_job_updates_the_figures_of_a_faster_winner_it_keeps(db):
    """The figures describe the key: a second job's framework time replaces the first's even
    where the first job's winner stays."""
    run_job(db, BaselineFactory(FrameworkResult("ok", "torch 2.12.0", "op", (0.05,))))
    row = run_job(db, BaselineFactory(FrameworkResult("ok", "torch 2.13.0", "op", (0.07,))), 3)
    assert (row.framework_ms, row.framework) == (0.07, "torch 2.13.0")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), ("true", True), ("1", True), ("on", True), ("false", False),
     ("0", False), ("no", False), (" off ", False)],
)  # fmt: skip
def test_enabled_reads_the_setting_as_the_service_reads_a_boolean(value, expected):
    environ = {} if value is None else {"KATO_FRAMEWORK_BASELINE": value}
    assert framework.enabled(environ) is expected


def test_enabled_refuses_what_is_not_a_boolean():
    with pytest.raises(ValueError, match="expected true or false"):
        framework.enabled({"KATO_FRAMEWORK_BASELINE": "maybe"})


def test_without_a_cuda_device_the_child_says_why_it_skipped():
    """The real measuring child, on this machine: torch imports (a CPU build) and sees no
    CUDA device, so nothing is timed and the reason is reported."""
    result = framework.measure_in_child(
        "softmax", (64, 100), "float32", device_index=0, gpu_model="H200", timeout_s=120
    )
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: tests/gpu/test_framework_gpu.py measures it")
    assert result.status == "skipped" and not result.ok and result.time_ms is None
    assert result.detail == "torch sees no CUDA device 0"
    assert result.framework == f"torch {torch.__version__}"


def _recorded_turn(events: list[str]):
    """A GPU turn (as tuner.gpu_gate gives one) that records when it is entered and left."""

    @contextlib.contextmanager
    def turn():
        events.append("enter")
        yield
        events.append("exit")

    return turn


def test_the_child_imports_torch_before_its_gpu_turn_and_answers_inside_it():
    """A worker sharing its GPU among jobs holds the GPU's turn only for the baseline's GPU
    work: the child imports torch first, then the turn is entered, then the child answers."""
    pytest.importorskip("torch")
    events: list[str] = []
    turn = _recorded_turn(events)

    result = framework.measure_in_child(
        "softmax", (64, 100), "float32", device_index=0, gpu_model="H200", timeout_s=120,
        turn=turn,
    )  # fmt: skip
    assert events == ["enter", "exit"]
    assert result.framework is not None and result.framework.startswith("torch ")


def test_a_stop_ends_the_child_at_once():
    stop = threading.Event()
    stop.set()
    result = framework.measure_in_child("softmax", (64, 100), "float32", stop=stop)
    assert result.status == "failed" and "stopped" in (result.detail or "")


def test_an_operator_without_an_equivalent_is_skipped(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    other = framework.measure_here("softmax", (64, 100), "float32", gpu_model="H200")
    assert other.status == "skipped" and "is a H100 SXM" in (other.detail or "")
    from kato.tuner import torch_ops

    monkeypatch.delitem(torch_ops.EQUIVALENTS, "softmax")
    missing = framework.measure_here("softmax", (64, 100), "float32", gpu_model="H100 SXM")
    assert (missing.status, missing.detail) == ("skipped", "no torch equivalent of softmax")


def test_a_gpu_workers_factory_times_in_a_child_on_its_own_device():
    """PyCudaBackends.measure_framework is the worker's default timer: the job's problem on the
    factory's device index, checked against the job's GPU model (here: no CUDA device)."""
    from types import SimpleNamespace

    from kato.tuner.backends.base import DeviceInfo
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.job_runner import JobRunner

    factory = pycuda_backend_factory(99)
    job = SimpleNamespace(operator="softmax", shape=[64, 100], dtype="float32")
    device = DeviceInfo("NVIDIA H200", "H200", (9, 0), "13.0")
    result = factory.measure_framework(job, device, threading.Event())
    assert result.status == "skipped" and result.detail == "torch sees no CUDA device 99"
    runner = JobRunner(None, "sqlite://", factory, worker_id="w")  # type: ignore[arg-type]
    assert runner.framework_timer == factory.measure_framework


# --- the compiled baseline (torch.compile of the same op, stored beside the eager one) --------

EAGER = FrameworkResult("ok", "torch 2.14.1", "torch.softmax", (0.05, 0.04, 0.06))
COMPILED_LABEL = "torch.compile 2.14.1 inductor"


def with_compiled(compiled: FrameworkResult | None) -> FrameworkResult:
    return dataclasses.replace(EAGER, compiled=compiled)


def test_a_finished_job_stores_the_compiled_baseline_beside_the_eager_one(db):
    compiled = FrameworkResult("ok", COMPILED_LABEL, "torch.compile(...)", (0.03, 0.02, 0.04))
    row = run_job(db, BaselineFactory(with_compiled(compiled)))
    assert (row.framework_ms, row.framework) == (0.05, "torch 2.14.1")
    assert (row.compiled_ms, row.compiled) == (0.03, COMPILED_LABEL)


@pytest.mark.parametrize(
    "compiled",
    [
        FrameworkResult("skipped", COMPILED_LABEL, detail="torch.compile raised BackendError: x"),
        FrameworkResult("failed", detail="the measuring process died (exit code 3)"),
        FrameworkResult("mismatch", COMPILED_LABEL, "op", detail="untimed: output 1: 3 of 9"),
    ],
    ids=["skipped", "failed", "untimed mismatch"],
)
def test_a_compiled_baseline_not_timed_is_logged_and_the_eager_one_stored(db, compiled, caplog):
    caplog.set_level(logging.WARNING, logger="kato.tuner.worker")
    row = run_job(db, BaselineFactory(with_compiled(compiled)))
    assert (row.framework_ms, row.compiled_ms, row.compiled) == (0.05, None, None)
    assert "no compiled framework baseline stored" in caplog.text
    assert compiled.detail in caplog.text


def test_a_timed_compiled_mismatch_is_stored_marked_with_a_warning(db, caplog):
    caplog.set_level(logging.WARNING, logger="kato.tuner.worker")
    compiled = FrameworkResult("mismatch", COMPILED_LABEL, "op", (0.03,), "output 2: 1%")
    row = run_job(db, BaselineFactory(with_compiled(compiled)))
    assert (row.compiled_ms, row.compiled) == (0.03, f"{COMPILED_LABEL} (mismatch)")
    assert "compiled framework baseline stored, but" in caplog.text
    assert "output 2: 1%" in caplog.text


def test_without_a_compiled_result_only_the_eager_baseline_is_stored(db):
    row = run_job(db, BaselineFactory(with_compiled(None)))
    assert (row.framework_ms, row.compiled_ms, row.compiled) == (0.05, None, None)


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("yes", True), ("off", False), ("0", False)]
)
def test_compiled_enabled_reads_its_own_setting(value, expected):
    environ = {"KATO_FRAMEWORK_BASELINE": "true"}
    if value is not None:
        environ["KATO_FRAMEWORK_COMPILED"] = value
    assert framework.compiled_enabled(environ) is expected


def test_compiled_enabled_refuses_what_is_not_a_boolean():
    with pytest.raises(ValueError, match="KATO_FRAMEWORK_COMPILED='later': expected true or"):
        framework.compiled_enabled({"KATO_FRAMEWORK_COMPILED": "later"})


STAND_IN = ["framework_child_stand_in"]  # tests/framework_child_stand_in.py: a fake CUDA torch


def test_the_child_sends_the_compiled_baseline_after_the_eager_one_on_the_same_problem():
    """With a stand-in for torch on a GPU, the real child and parent: the eager result carries
    the compiled one, both measured on one problem (one seed, drawn by the child), Inductor
    compiling in the child's own process; the GPU's turn is held for the eager op, given back
    while the child compiles and held again for the compiled op's timing."""
    events: list[str] = []
    turn = _recorded_turn(events)

    result = framework.measure_in_child(
        "softmax", (64, 100), "float32", gpu_model="H200", imports=STAND_IN, timeout_s=60,
        turn=turn, compiled=True,
    )  # fmt: skip
    assert (result.status, result.framework, result.time_ms) == ("ok", "torch 9.9.9+stand-in", 0.2)
    compiled = result.compiled
    assert compiled is not None and compiled.ok and compiled.time_ms == 0.05
    assert compiled.framework == "torch.compile 9.9.9+stand-in inductor"
    assert compiled.op == result.op and result.op != "seed None"
    # One problem object, made for the eager baseline and handed to the compiled one.
    assert result.detail == "problems 1"
    assert compiled.detail == "compile_threads 1; problems 1"
    assert events == ["enter", "exit", "enter", "exit"]


def test_a_child_dying_while_compiling_keeps_the_eager_baseline(monkeypatch):
    monkeypatch.setenv("KATO_TEST_COMPILED_STAND_IN", "exit")
    result = framework.measure_in_child(
        "softmax", (64, 100), "float32", gpu_model="H200", imports=STAND_IN, timeout_s=60,
        seed=7,
    )  # fmt: skip
    assert (result.status, result.op, result.time_ms) == ("ok", "seed 7", 0.2)
    assert result.compiled is not None and result.compiled.status == "failed"
    assert "the measuring process died" in (result.compiled.detail or "")


def test_a_misset_compiled_baseline_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setenv("KATO_FRAMEWORK_COMPILED", "perhaps")
    result = framework.measure_in_child(
        "softmax", (64, 100), "float32", gpu_model="H200", imports=STAND_IN, timeout_s=60,
        seed=7,
    )  # fmt: skip
    assert result.ok and result.compiled is not None
    assert (result.compiled.status, result.compiled.time_ms) == ("skipped", None)
    assert "KATO_FRAMEWORK_COMPILED='perhaps'" in (result.compiled.detail or "")


def test_a_long_version_is_cut_to_the_column_keeping_the_mismatch_mark():
    """A local build's version string can push a label past the 64 characters its column
    holds: the name is cut, the mismatch mark kept, so the job's row is still stored."""
    name = "torch.compile 2.8.0a0+5228986c39.nv25.05.build.local.custom inductor"
    label = framework.stored_label(FrameworkResult(framework.MISMATCH, name, times_ms=(0.1,)))
    assert len(label) == framework.LABEL_CHARS and label.endswith(" (mismatch)")
    assert label.startswith("torch.compile 2.8.0a0+5228986c39")
    ok = framework.stored_label(FrameworkResult(framework.OK, name, times_ms=(0.1,)))
    assert ok == name[: framework.LABEL_CHARS]
    short = FrameworkResult(framework.OK, "torch 2.13.0", times_ms=(0.1,))
    assert framework.stored_label(short) == "torch 2.13.0"
