"""Every tuning path's per-trial limit and fault isolation (issue 31): the limit scales with a
task's predicted cost (floor and cap), the measuring code fits its timing repeats into it, and
``kato tune`` measures through the worker's isolated child, so a hung trial is a ``timeout``
trial and the job ends ``done`` with the rest."""

from __future__ import annotations

import json
import time

import pytest
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.cli import app
from kato.tuner.backends.base import TrialStatus
from kato.tuner.backends.isolated import BackendSpec, IsolatedBackend, measuring_backend
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.trial_cost import (
    CAP_FACTOR,
    MIN_LAUNCHES,
    SLACK,
    TrialDeadline,
    UnmeasurableTask,
    check_measurable,
    launch_lower_bound_s,
    peak_flops,
    trial_timeout_s,
)
from paths import RECORDED
from timed_backend import ENV
from typer.testing import CliRunner

from kato.shared.gpus import get_gpu

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
OTHER_RECORDING = RECORDED / "softmax_H200_4096x4096_float32.json.gz"
SHAPE, DTYPE = [4096, 4096], "float16"


@pytest.fixture(scope="module")
def replay() -> ReplayBackend:
    return ReplayBackend(RECORDING)


def timed_spec(**options) -> BackendSpec:
    return BackendSpec(
        kind="timed_backend:make", replay_file=str(RECORDING), options=tuple(options.items())
    )


def default_key() -> str:
    op = get_operator("softmax")
    return ",".join(str(v) for v in op.default_config(SHAPE, DTYPE).values())


# --- the prediction and the scaled limit ----------------------------------------------------


def test_launch_lower_bound_is_bytes_at_peak_bandwidth_for_a_reduction():
    h200 = get_gpu("H200")
    op = get_operator("reduce_sum")
    rows, cols = 8, 1 << 27  # a few very long rows: 4 GiB of float32
    bound = launch_lower_bound_s(op, (rows, cols), "float32", h200)
    assert bound == pytest.approx(rows * (cols * 4 + 4) / 4800e9)
    assert 8e-4 < bound < 1e-3
    assert launch_lower_bound_s(op, (rows, cols), "float32", None) == 0.0  # an unknown GPU


def test_launch_lower_bound_of_a_large_matmul_is_its_flops_at_the_peak_rate():
    h200 = get_gpu("H200")
    op = get_operator("matmul")
    shape = (16384, 16384, 16384)
    flops = op.flops(shape, "float16")
    assert flops == 2 * 16384**3
    rate = peak_flops(h200)
    assert rate == pytest.approx(132 * 1980e6 * 8192)  # an upper bound of any kernel's rate
    assert launch_lower_bound_s(op, shape, "float16", h200) == pytest.approx(flops / rate)
    assert launch_lower_bound_s(op, shape, "float16", h200) > op.bytes_moved(shape, "float16") / (
        4800e9
    )


def test_the_limit_scales_with_the_predicted_cost_between_its_floor_and_cap():
    assert trial_timeout_s(60.0, None) == 60.0  # not predicted: the configured limit
    assert trial_timeout_s(60.0, 0.0) == 60.0
    assert trial_timeout_s(60.0, 1e-4) == pytest.approx(60.0 + SLACK * MIN_LAUNCHES * 1e-4)
    assert trial_timeout_s(60.0, 2.0) == pytest.approx(60.0 + SLACK * MIN_LAUNCHES * 2.0)
    assert trial_timeout_s(60.0, 2.0) > 60.0 + MIN_LAUNCHES * 2.0  # room beyond the minimum
    assert trial_timeout_s(60.0, 1e3) == CAP_FACTOR * 60.0  # capped
    limits = [trial_timeout_s(60.0, s) for s in (0.01, 0.1, 1.0, 5.0, 20.0, 100.0)]
    assert limits == sorted(limits)


def test_a_deadline_allows_what_ends_before_it():
    assert TrialDeadline(None).allows(1e9) and TrialDeadline(None).left_s() == float("inf")
    deadline = TrialDeadline(1.0)
    assert deadline.allows(0.5) and not deadline.allows(0.95)
    assert 0.7 < deadline.left_s() <= 0.85


# --- the isolated child and the in-process path ---------------------------------------------


def test_the_isolated_limit_scales_so_a_costly_trial_is_measured_not_timed_out(replay):
    """Each trial takes 5 launches of 0.3 s (1.5 s) under a configured limit of 1 s: with the
    prediction (0.3 s a launch) the limit is 1 + 4 * 4 * 0.3 s and every repeat is timed."""
    config = replay.space().valid_configs()[0]
    backend = IsolatedBackend(
        timed_spec(launch_s=0.3, predicted_s=0.3, repeats=3), trial_timeout_s=1.0
    )
    try:
        assert backend.launch_lower_bound_s() == 0.3
        assert backend.trial_limit_s == pytest.approx(1.0 + SLACK * MIN_LAUNCHES * 0.3)
        result = backend.evaluate(config)
        assert result.status is TrialStatus.OK, result.error
        assert result.times_ms == [replay.evaluate(config).time_ms] * 3
        assert backend.restarts == 0
    finally:
        backend.close()


def test_a_trial_past_the_scaled_limit_still_times_out_saying_why(replay):
    config = replay.space().valid_configs()[0]
    backend = IsolatedBackend(
        timed_spec(launch_s=30.0, predicted_s=0.1, repeats=1), trial_timeout_s=0.5
    )
    try:
        start = time.monotonic()
        result = backend.evaluate(config)
        assert result.status is TrialStatus.TIMEOUT
        assert time.monotonic() - start < backend.trial_limit_s + 5
        assert f"no result within {backend.trial_limit_s:g} s" in result.error
        assert "predicted minimum of 0.1 s" in result.error
    finally:
        backend.close()


def test_the_child_fits_its_repeats_into_the_limit(replay):
    """No prediction: the limit stays 2 s, and a backend timing 20 repeats of 0.25 s (5.5 s
    with verification) stops where the next would pass the deadline: fewer repeats, not a
    timeout."""
    config = replay.space().valid_configs()[1]
    backend = IsolatedBackend(timed_spec(launch_s=0.25, repeats=20), trial_timeout_s=2.0)
    try:
        assert backend.trial_limit_s == 2.0
        start = time.monotonic()
        result = backend.evaluate(config)
        elapsed = time.monotonic() - start
        assert result.status is TrialStatus.OK, result.error
        assert 1 <= len(result.times_ms) <= 5  # 0.85 * 2 s - 0.5 s of verification
        assert elapsed < 2.0
    finally:
        backend.close()


def test_in_process_measuring_fits_the_same_scaled_limit(replay):
    spec = timed_spec(launch_s=0.2, predicted_s=0.05, repeats=50)
    backend = measuring_backend(spec, isolate=False, trial_timeout_s=1.0)
    try:
        assert not isinstance(backend, IsolatedBackend)
        assert backend.trial_limit_s == pytest.approx(1.0 + SLACK * MIN_LAUNCHES * 0.05)
        result = backend.evaluate(replay.space().valid_configs()[2])
        assert result.ok and 1 <= len(result.times_ms) < 50
    finally:
        backend.close()
    isolated = measuring_backend(spec, isolate=True, trial_timeout_s=1.0)
    try:
        assert isinstance(isolated, IsolatedBackend)
        assert isolated.trial_limit_s == backend.trial_limit_s  # one rule, both paths
    finally:
        isolated.close()


# --- kato tune ------------------------------------------------------------------------------


def _tune(tmp_path, *extra: str):
    db = f"sqlite:///{tmp_path}/kato.db"
    args = ["tune", "softmax", "--shape", "4096x4096", "--dtype", DTYPE, "--db", db, "--json"]
    out = CliRunner().invoke(app, [*args, *extra])
    return out, db


def _trials(db: str, job_id: str):
    engine = init_db(db)
    try:
        with session_factory(engine)() as session:
            return queries.job_trials(session, job_id)
    finally:
        engine.dispose()


def test_kato_tune_records_a_hung_trial_as_a_timeout_and_finishes(tmp_path, monkeypatch, replay):
    monkeypatch.setenv(ENV, json.dumps({"hang": [default_key()], "launch_s": 0.01}))
    start = time.monotonic()
    out, db = _tune(
        tmp_path, "--backend", "timed_backend:make", "--replay", str(RECORDING),
        "--budget", "4", "--trial-timeout", "1.5", "--strategy", "random",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["status"] == "done" and result["measured"] == 4
    trials = {t.config_key: t for t in _trials(db, result["job"])}
    assert len(trials) == 4
    hung = trials[default_key()]  # a job measures the operator's default config first
    assert hung.status == "timeout" and "no result within 1.5 s" in hung.error
    ok = [t for t in trials.values() if t.status == "ok"]
    assert len(ok) == 3
    best = min(ok, key=lambda t: t.time_ms)
    assert result["best_time_ms"] == pytest.approx(best.time_ms)
    assert result["best_config"] == best.config
    assert best.time_ms == pytest.approx(replay.evaluate(best.config).time_ms)
    assert time.monotonic() - start < 60


def test_kato_tune_scales_the_limit_to_the_predicted_cost(tmp_path, monkeypatch):
    """Trials of 5 launches of 0.35 s under --trial-timeout 1: each is measured, since one
    launch is predicted to take at least 0.35 s."""
    monkeypatch.setenv(ENV, json.dumps({"launch_s": 0.35, "predicted_s": 0.35, "repeats": 3}))
    out, db = _tune(
        tmp_path, "--backend", "timed_backend:make", "--replay", str(RECORDING),
        "--budget", "2", "--trial-timeout", "1", "--strategy", "random",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    trials = _trials(db, result["job"])
    assert [t.status for t in trials] == ["ok", "ok"]
    assert all(len(t.times_ms) == 3 for t in trials)


def test_kato_tune_without_isolation_has_no_timeout_but_fits_its_repeats(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, json.dumps({"launch_s": 0.2, "repeats": 40}))
    out, db = _tune(
        tmp_path, "--backend", "timed_backend:make", "--replay", str(RECORDING),
        "--budget", "2", "--trial-timeout", "1.5", "--no-isolate", "--strategy", "random",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    trials = _trials(db, json.loads(out.output)["job"])
    assert [t.status for t in trials] == ["ok", "ok"]
    assert all(1 <= len(t.times_ms) <= 4 for t in trials)  # 0.85 * 1.5 s - 0.4 s


def test_kato_tune_replays_a_recording_of_its_problem(tmp_path, replay):
    out, _ = _tune(tmp_path, "--backend", "replay", "--replay", str(RECORDING), "--budget", "5")
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["status"] == "done" and result["measured"] == 5
    assert result["best_time_ms"] >= replay.best_time_ms()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--backend", "replay"], "--backend replay needs --replay FILE"),
        (["--backend", "replay", "--replay", str(OTHER_RECORDING)], "is a recording of softmax"),
        (["--backend", "nope"], "--backend must be pycuda, replay or MODULE:FUNCTION"),
        (["--backend", "no_such_module:make"], "--backend no_such_module:make: ModuleNotFound"),
        (["--trial-timeout", "0"], "--trial-timeout must be more than 0"),
    ],
)  # fmt: skip
def test_kato_tune_refuses_a_backend_it_cannot_use(tmp_path, extra, says):
    out, _ = _tune(tmp_path, *extra)
    assert out.exit_code == 2
    assert says in " ".join(out.output.split()), out.output


# --- kato.tune_kernel -----------------------------------------------------------------------

VADD = """
__global__ void vadd(float *c, const float *a, const float *b, int n) {
    int i = blockIdx.x * block_size_x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
"""


def _vadd(tmp_path, **options):
    import numpy as np

    import kato

    n = 1000
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    return kato.tune_kernel(
        "vadd", VADD, n, [np.zeros_like(a), a, b, np.int32(n)], {"block_size_x": [32, 64]},
        answer=[a + b, None, None, None], db=f"sqlite:///{tmp_path}/kato.db",
        name="trial_limits_vadd", **options,
    )  # fmt: skip


def test_tune_kernel_measures_in_the_isolated_child_by_default(tmp_path, monkeypatch):
    """No GPU for the child (CUDA_VISIBLE_DEVICES empty, inherited): the error is the measuring
    process's, as a worker's is, not this process's."""
    from kato.tuner.backends.isolated import ChildStartError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ChildStartError, match="the measuring process could not start"):
        _vadd(tmp_path)
    import importlib.util

    if importlib.util.find_spec("pycuda") is None:  # in process, the error is deterministic
        monkeypatch.setenv("KATO_ISOLATE", "false")  # the workers' setting, read here too
        with pytest.raises(RuntimeError, match="needs PyCUDA") as info:
            _vadd(tmp_path)
        assert not isinstance(info.value, ChildStartError)


def test_tune_kernel_refuses_a_limit_that_is_not_positive(tmp_path):
    from kato.kernels.spec import InvalidInput

    with pytest.raises(InvalidInput, match="trial_timeout_s must be more than 0"):
        _vadd(tmp_path, trial_timeout_s=0)


# --- a task no trial could measure ----------------------------------------------------------


def test_a_task_whose_launches_alone_exceed_the_capped_limit_is_refused_before_it_runs():
    with pytest.raises(UnmeasurableTask, match=r"takes at least 200 s .* cap of 600 s"):
        check_measurable(60.0, 200.0, "reduce_sum 8x99 float32 on H200")
    check_measurable(60.0, 100.0)  # 400 s of launches fit the 600 s cap
    check_measurable(60.0, None)
    with pytest.raises(UnmeasurableTask, match="cap of 3 s"):
        IsolatedBackend(timed_spec(predicted_s=1.0), trial_timeout_s=0.3)
    with pytest.raises(UnmeasurableTask):
        measuring_backend(timed_spec(predicted_s=1.0), isolate=False, trial_timeout_s=0.3)


def test_kato_tune_fails_a_task_no_trial_could_measure_saying_why(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, json.dumps({"predicted_s": 1.0}))
    out, db = _tune(
        tmp_path, "--backend", "timed_backend:make", "--replay", str(RECORDING),
        "--budget", "3", "--trial-timeout", "0.3",
    )  # fmt: skip
    assert out.exit_code == 1, out.output
    result = json.loads(out.output)
    assert result["status"] == "failed" and result["measured"] == 0
    assert "takes at least 1 s" in result["error"] and "tune a smaller shape" in result["error"]
    assert _trials(db, result["job"]) == []
