"""The worker and job runner on the replay backend, against a real SQLite file: a job's whole
life, resume after an interruption without re-measuring, cancel, failures, version changes."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from kato.db import fleet, queries
from kato.db.ledger import RESERVED, JobLedger, Ledger, Seen
from kato.db.models import Job, utcnow
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service import lookup as service_lookup
from kato.tuner import worker as worker_module
from kato.tuner.backends.base import TrialResult, TrialStatus
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.job_runner import JobRunner, SharedResults
from kato.tuner.worker import Worker, stop_on_signals
from paths import RECORDED
from sqlalchemy import update as sa_update

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
SHAPE, DTYPE = [4096, 4096], "float16"


class CountingReplay(ReplayBackend):
    """Replay that counts evaluations and can interrupt the job after ``stop_after`` of them."""

    def __init__(self, stop_after: int | None = None, on_stop=None):
        super().__init__(RECORDING)
        self.measured: list[str] = []
        self.stop_after, self.on_stop = stop_after, on_stop

    def evaluate(self, config) -> TrialResult:
        self.measured.append(self.cache.key(config))
        if self.stop_after is not None and len(self.measured) == self.stop_after:
            self.on_stop()
        return super().evaluate(config)


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/kato.db"
    return url, session_factory(init_db(url))


def submit(sessions, budget=30, **kw):
    spec = get_operator("softmax")
    with sessions() as s:
        job = queries.create_job(
            s,
            operator="softmax",
            operator_version=spec.version,
            shape=SHAPE,
            dtype=DTYPE,
            gpu_model="H200",
            budget_configs=budget,
            **kw,
        )
        return job.id


def test_job_lifecycle_stores_trials_and_winner(db):
    url, sessions = db
    job_id = submit(sessions, budget=25)
    backend = CountingReplay()
    worker = Worker(sessions, url, ["H200"], lambda job: backend, poll_seconds=0.01)
    assert worker.run_once().status == "done"
    assert worker.run_once() is None  # nothing left
    with sessions() as s:
        job = queries.get_job(s, job_id)
        trials = queries.job_trials(s, job_id)
        assert job.status == "done" and job.trials_done == 25 and job.finished_at
        assert len(trials) == 25 and len({t.config_key for t in trials}) == 25
        best = min((t for t in trials if t.status == "ok"), key=lambda t: t.time_ms)
        assert job.best_time_ms == best.time_ms and job.best_config == best.config
        row, source = service_lookup.lookup_best_config(
            s,
            operator="softmax",
            operator_version=job.operator_version,
            shape=SHAPE,
            dtype=DTYPE,
            gpu_model="H200",
        )
        assert source == "exact" and row.config == best.config and row.time_ms == best.time_ms
        assert row.compute_capability == "9.0" and row.cuda_version == "13.0"


def test_job_stopped_half_way_resumes_without_remeasuring(db):
    url, sessions = db
    job_id = submit(sessions, budget=30)

    class Crash(Exception):
        pass

    def crash():
        raise Crash  # the worker process "dies" mid-measurement of trial 12

    first = CountingReplay(stop_after=12, on_stop=crash)
    runner = JobRunner(sessions, url, lambda job: first, worker_id="w1", lease_seconds=0.01)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="w1", lease_seconds=0.01)
    runner.run(job_id)  # the crash fails this attempt...
    with sessions() as s:
        recorded = {t.config_key for t in queries.job_trials(s, job_id)}
        assert len(recorded) == 11  # the 12th never got recorded
        # ...and a crashed worker leaves a running job behind: simulate that state.
        job = queries.get_job(s, job_id)
        job.status, job.error, job.finished_at = "running", None, None
        job.worker_id = "w1"
        job.lease_expires_at = datetime.now(UTC) - timedelta(seconds=1)
        s.commit()

    second = CountingReplay()
    worker = Worker(sessions, url, ["H200"], lambda job: second, worker_id="w2")
    outcome = worker.run_once()  # lease expired: w2 claims it
    assert outcome is not None and outcome.job_id == job_id and outcome.status == "done"
    assert not recorded & set(second.measured), "a recorded trial was measured again"
    assert len(second.measured) == 30 - 11
    with sessions() as s:
        trials = queries.job_trials(s, job_id)
        assert len(trials) == 30 and len({t.config_key for t in trials}) == 30


def test_cancel_stops_a_running_job(db):
    url, sessions = db
    job_id = submit(sessions, budget=50)

    def cancel():
        with sessions() as s:
            queries.request_cancel(s, job_id)

    backend = CountingReplay(stop_after=5, on_stop=cancel)
    worker = Worker(sessions, url, ["H200"], lambda job: backend)
    assert worker.run_once().status == "cancelled"
    assert len(backend.measured) <= 6
    with sessions() as s:
        assert queries.get_job(s, job_id).status == "cancelled"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
@pytest.mark.parametrize("jobs_at_once", [1, 2])
def test_an_interrupt_inside_a_job_stops_the_worker_and_gives_the_job_back(
    db, monkeypatch, jobs_at_once
):
    """A ``KeyboardInterrupt`` raised in a job's measurement (where a signal's lands when the
    worker runs one job, in its loop's thread) ends ``run_forever`` without raising, at once:
    the job is given back (lease ended, no reservation left, its trials kept), the worker's
    row says stopped, and another worker resumes the job from its trials."""
    # Only a worker that waits out its runners' grace (an idle runner's thread too) nears it.
    monkeypatch.setattr(worker_module, "STOP_GRACE_SECONDS", 60.0)
    url, sessions = db
    job_id = submit(sessions, budget=12)

    def interrupt():
        raise KeyboardInterrupt

    backend = CountingReplay(stop_after=5, on_stop=interrupt)
    worker = Worker(
        sessions, url, ["H200"], lambda job: backend, worker_id="w", poll_seconds=0.01,
        lease_seconds=120, jobs_at_once=jobs_at_once,
    )  # fmt: skip
    start = time.monotonic()
    assert worker.run_forever() == 0
    took = time.monotonic() - start
    with sessions() as s:
        job = queries.get_job(s, job_id)
        trials = queries.job_trials(s, job_id)
        (row,) = fleet.list_workers(s)
    assert job.status == "running" and job.lease_expires_at <= utcnow() + timedelta(seconds=1)
    assert job.trials_done == len(trials) <= 4
    assert not [t for t in trials if t.status == RESERVED]
    assert (row.id, row.status) == ("w", "stopped")
    assert took < 30, took
    second = CountingReplay()
    assert Worker(sessions, url, ["H200"], lambda job: second).run_once().status == "done"
    with sessions() as s:
        keys = [t.config_key for t in queries.job_trials(s, job_id)]
    assert len(keys) == len(set(keys)) == 12
    assert not {t.config_key for t in trials} & set(second.measured)  # kept, not measured again


def test_stop_on_signals_outside_the_main_thread_refuses_and_leaves_nothing_behind(db):
    """signal.signal's ValueError comes through, and the block's stopper thread and pipe end
    with it (a thread left blocked on the pipe for good, and two open files, before)."""
    url, sessions = db
    worker = Worker(sessions, url, ["H200"], lambda job: CountingReplay())
    handler_before = signal.getsignal(signal.SIGTERM)
    files_before = len(os.listdir("/proc/self/fd"))
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with stop_on_signals(worker):
                pass
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(30)
    assert [type(e) for e in errors] == [ValueError] and "main thread" in str(errors[0])
    assert [t.name for t in threading.enumerate() if t.name == "kato-stop-on-signal"] == []
    assert len(os.listdir("/proc/self/fd")) == files_before
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert not worker.stopping


def test_jobs_for_other_gpus_are_not_claimed(db):
    url, sessions = db
    spec = get_operator("softmax")
    with sessions() as s:
        queries.create_job(
            s,
            operator="softmax",
            operator_version=spec.version,
            shape=SHAPE,
            dtype=DTYPE,
            gpu_model="A100 80GB",
            budget_configs=5,
        )
    worker = Worker(sessions, url, ["H200"], lambda job: CountingReplay())
    assert worker.run_once() is None


def test_broken_backend_fails_the_job_not_the_worker(db):
    url, sessions = db
    job_id = submit(sessions)

    def broken(job):
        raise RuntimeError("no CUDA device")

    worker = Worker(sessions, url, ["H200"], broken)
    outcome = worker.run_once()
    assert outcome.status == "failed" and "no CUDA device" in outcome.error
    with sessions() as s:
        assert queries.get_job(s, job_id).status == "failed"


def test_all_configs_failing_is_a_failed_job(db):
    url, sessions = db
    job_id = submit(sessions, budget=5)

    class AllFail(CountingReplay):
        def evaluate(self, config):
            return TrialResult(config=config, status=TrialStatus.LAUNCH_ERROR, error="fault")

    assert Worker(sessions, url, ["H200"], lambda job: AllFail()).run_once().status == "failed"
    with sessions() as s:
        job = queries.get_job(s, job_id)
        assert job.status == "failed" and "no config ran correctly" in job.error
        assert job.trials_done == 5


def _old_version_job(sessions) -> str:
    with sessions() as s:
        return queries.create_job(
            s,
            operator="softmax",
            operator_version="0ld0ld0ld0ld",
            shape=SHAPE,
            dtype=DTYPE,
            gpu_model="H200",
            budget_configs=5,
        ).id


def test_a_job_queued_before_its_kernel_changed_is_tuned_at_the_current_version(db):
    """It has measured nothing: the worker moves it to the current version and tunes it, and its
    winner is stored (and served) under the current version."""
    url, sessions = db
    job_id = _old_version_job(sessions)
    version = get_operator("softmax").version
    outcome = Worker(sessions, url, ["H200"], lambda job: CountingReplay()).run_once()
    assert outcome.status == "done", outcome.error
    with sessions() as s:
        job = queries.get_job(s, job_id)
        assert (job.status, job.operator_version, job.trials_done) == ("done", version, 5)
        row, source = service_lookup.lookup_best_config(
            s, operator="softmax", operator_version=version, shape=SHAPE, dtype=DTYPE,
            gpu_model="H200",
        )  # fmt: skip
        assert source == "exact" and row.time_ms == job.best_time_ms


def test_a_job_with_trials_of_a_changed_kernel_fails_with_a_clear_error(db):
    """Its trials were measured on the old code: it is not moved, and fails saying what to do."""
    url, sessions = db
    job_id = _old_version_job(sessions)
    config = get_operator("softmax").default_config(SHAPE, DTYPE)
    with sessions() as s:
        queries.record_trial(
            s, job_id, number=0, config=config, config_key="old-trial",
            result={"status": "ok", "time_ms": 1.0, "config": config},
        )  # fmt: skip
        # Its worker died (the lease expired): the job is claimable, to be resumed.
        expired = datetime.now(UTC) - timedelta(minutes=5)
        s.execute(
            sa_update(Job)
            .where(Job.id == job_id)
            .values(status="running", worker_id="dead", lease_expires_at=expired)
        )
        s.commit()
    outcome = Worker(sessions, url, ["H200"], lambda job: CountingReplay()).run_once()
    assert outcome.status == "failed" and "submit the job again" in outcome.error
    assert "measured configs of the old version" in outcome.error
    with sessions() as s:
        job = queries.get_job(s, job_id)
        assert (job.status, job.operator_version) == ("failed", "0ld0ld0ld0ld")


def _claim(sessions, worker_id: str = "w1"):
    with sessions() as s:
        return queries.claim_next_job(s, gpu_models=["H200"], worker_id=worker_id, lease_seconds=60)


def test_adopting_a_version_needs_the_owner_and_a_job_without_trials(db):
    _url, sessions = db
    fresh = _old_version_job(sessions)
    assert _claim(sessions).id == fresh
    measured = _old_version_job(sessions)
    assert _claim(sessions).id == measured
    queued = _old_version_job(sessions)  # not claimed: nobody owns it
    with sessions() as s:
        queries.record_trial(
            s, measured, number=0, config={}, config_key="k",
            result={"status": "failed", "time_ms": None, "config": {}},
        )  # fmt: skip
        args = {"worker_id": "w1", "old_version": "0ld0ld0ld0ld", "new_version": "n3w"}
        assert queries.adopt_operator_version(s, fresh, **(args | {"worker_id": "w2"})) is False
        assert queries.adopt_operator_version(s, queued, **args) is False
        assert queries.adopt_operator_version(s, measured, **args) is False
        assert queries.adopt_operator_version(s, fresh, **args) is True
        assert queries.adopt_operator_version(s, fresh, **args) is False  # not at old any more
        versions = [queries.get_job(s, j).operator_version for j in (fresh, measured, queued)]
        assert versions == ["n3w", "0ld0ld0ld0ld", "0ld0ld0ld0ld"]


def test_a_worker_of_older_code_does_not_move_a_newer_job_back(db):
    """Half-way through an upgrade: the job was submitted at a version first seen after this
    worker's own (newer code submitted it). It fails saying to upgrade the worker, unmoved."""
    url, sessions = db
    submit(sessions)  # a job at this code's version, submitted first
    with sessions() as s:
        newer = queries.create_job(
            s, operator="softmax", operator_version="n3w3rc0d3", shape=SHAPE, dtype=DTYPE,
            gpu_model="H200", budget_configs=5,
        ).id  # fmt: skip
        for job in s.query(Job).filter(Job.id != newer):
            job.status = "done"
        s.commit()
    outcome = Worker(sessions, url, ["H200"], lambda job: CountingReplay()).run_once()
    assert outcome.job_id == newer and outcome.status == "failed"
    assert "newer version" in outcome.error and "upgrade this worker" in outcome.error
    with sessions() as s:
        assert queries.get_job(s, newer).operator_version == "n3w3rc0d3"


def test_a_helper_never_moves_a_job(db):
    url, sessions = db
    job_id = _old_version_job(sessions)
    assert _claim(sessions, "owner").id == job_id
    runner = JobRunner(sessions, url, lambda job: CountingReplay(), worker_id="h", lease_seconds=60)
    outcome = runner.run(job_id, helper=True)
    assert outcome.status == "failed" and "left to its owner" in outcome.error
    with sessions() as s:
        job = queries.get_job(s, job_id)
        assert (job.operator_version, job.worker_id) == ("0ld0ld0ld0ld", "owner")


def test_shared_search_leaves_a_just_asked_trial_to_its_worker():
    """A RUNNING trial without a worker yet was just asked for by a live worker (the owner is
    written right after the ask): a worker joining the study must not fail it, unless it is
    older than the grace period (then its worker died between the two steps)."""
    import optuna
    from kato.tuner.job_runner import SharedSearch
    from kato.tuner.space import SearchSpace

    storage = optuna.storages.InMemoryStorage()
    space = SearchSpace({"A": (1, 2, 3), "B": (1, 2)}, lambda c: None)

    def join(grace: float) -> SharedSearch:
        return SharedSearch(
            space,
            lambda c: None,
            strategy="tpe",  # a strategy that asks Optuna: the forest keeps no study
            storage=storage,
            study_name="shared",
            worker_id="joining",
            is_live=lambda worker: False,
            orphan_grace_seconds=grace,
        )

    owner = join(60.0)
    trial = owner.study._study.ask()  # RUNNING, no kato_worker attribute yet
    join(60.0)
    state = owner.study._study.get_trials(deepcopy=False)[trial.number].state
    assert state == optuna.trial.TrialState.RUNNING
    join(0.0)
    state = owner.study._study.get_trials(deepcopy=False)[trial.number].state
    assert state == optuna.trial.TrialState.FAIL


@pytest.mark.parametrize("error", ["integrity", "duplicate_table"])
def test_optuna_storage_retries_when_another_worker_made_the_tables(monkeypatch, tmp_path, error):
    # Workers starting at once on a fresh database race to create Optuna's tables; the loser
    # sees the version row (IntegrityError) or, on PostgreSQL, a table (ProgrammingError:
    # DuplicateTable) created under it. It must try again, not die (a fleet test lost a worker).
    import optuna
    from kato.tuner.study import optuna_storage
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    real = optuna.storages.RDBStorage
    calls = []

    def racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            exc = IntegrityError if error == "integrity" else ProgrammingError
            raise exc("CREATE TABLE studies", {}, Exception('relation "studies" already exists'))
        return real(*args, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    storage = optuna_storage(f"sqlite:///{tmp_path}/jobs.db")
    assert len(calls) == 2 and storage.get_all_studies() == []


class CompilingReplay(CountingReplay):
    """Replay whose configs "compile" for a while: one is ready after ``delay`` readiness checks
    since it was first asked about (``is_compiled``, as the pycuda backends answer it)."""

    def __init__(self, delay: int):
        super().__init__()
        self.delay, self.checks = delay, 0
        self.first_check: dict[str, int] = {}
        self.most_in_flight = 0

    def is_compiled(self, config) -> bool:
        self.checks += 1
        key = self.cache.key(config)
        self.first_check.setdefault(key, self.checks)
        waiting = set(self.first_check) - set(self.measured)
        self.most_in_flight = max(self.most_in_flight, len(waiting))
        return self.checks - self.first_check[key] >= self.delay


@pytest.mark.parametrize("lookahead", [1, 4])
def test_a_job_asks_ahead_while_configs_compile_and_measures_its_budget_once_each(db, lookahead):
    url, sessions = db
    job_id = submit(sessions, budget=30)
    backend = CompilingReplay(delay=12)
    worker = Worker(
        sessions, url, ["H200"], lambda job: backend, poll_seconds=0.01, lookahead=lookahead
    )
    assert worker.run_once().status == "done"
    assert len(backend.measured) == 30 == len(set(backend.measured))
    # 1: the search asks, measures, asks (readiness is never asked); 4: up to 4 in flight.
    assert backend.most_in_flight == (0 if lookahead == 1 else 4)
    with sessions() as s:
        job = queries.get_job(s, job_id)
        trials = queries.job_trials(s, job_id)
        assert job.status == "done" and job.trials_done == 30
        assert len({t.config_key for t in trials}) == 30
        assert all(t.status != "reserved" for t in trials)


def test_a_helper_whose_write_fails_gives_back_its_reservations(db, monkeypatch):
    """A helper failing mid-job (here: a trial row write raises) must release the configs it
    reserved: it stays alive (its reservations never look stale), so the owner would wait its
    whole grace period for them and end the job short of its budget."""
    url, sessions = db
    job_id = submit(sessions, budget=40)
    with sessions() as s:
        claimed = queries.claim_next_job(s, gpu_models=["H200"], worker_id="A", lease_seconds=600)
        assert claimed.id == job_id
    owner = Worker(sessions, url, ["H200"], lambda j: ReplayBackend(RECORDING), worker_id="A")
    owner.heartbeat("busy", job_id)  # a live owner, so B may join its job
    record, calls = JobLedger.record, []

    def flaky(ledger, config_key, result):
        calls.append(config_key)
        if len(calls) == 3:
            raise RuntimeError("database hiccup")
        return record(ledger, config_key, result)

    monkeypatch.setattr(JobLedger, "record", flaky)
    helper = Worker(sessions, url, ["H200"], lambda j: ReplayBackend(RECORDING), worker_id="B",
                    max_workers_per_job=2, min_configs_per_worker=1,
                    lease_seconds=5)  # fmt: skip
    outcome = helper.run_once()
    assert (outcome.status, outcome.error) == ("failed", "RuntimeError: database hiccup")
    assert Ledger(sessions, "test").job(job_id).reservations() == []
    with sessions() as s:
        trials = queries.job_trials(s, job_id)  # the measured configs whose rows were stored
        assert len(trials) >= 2 and all(t.status != RESERVED for t in trials)
        assert queries.get_job(s, job_id).trials_done == len(trials)  # the budget given back


def test_sync_keeps_a_result_of_this_worker_whose_row_is_still_being_written():
    """Another worker reserved K, died and K was released; this worker then reserved and
    measured K, and its row waits on the write-behind. The next sync must not take K's result
    out of the search (it was 'released' from another worker's reservation): the budget
    would be undercounted and K proposed again. A released K this worker does not hold is
    measurable again."""
    results: dict[str, TrialResult] = {}
    shared = SharedResults()
    shared.apply(Seen(pending={"K": {"x": 1}}), results, held=())  # another worker measures K
    assert results["K"].status == TrialStatus.PENDING and shared.pending == {"K"}
    # Released, then reserved and measured here: the ledger's sync leaves out a key it holds.
    results["K"] = TrialResult(config={"x": 1}, status=TrialStatus.OK, times_ms=[1.0])
    shared.apply(Seen(), results, held={"K"})
    assert results["K"].status == TrialStatus.OK and shared.pending == set()

    shared.apply(Seen(pending={"J": {"x": 2}}), results, held=())
    shared.apply(Seen(), results, held=())  # J released by its dead worker, not taken here
    assert "J" not in results and "K" in results
    stored = {"config": {"x": 3}, "status": "ok", "times_ms": [2.0, 3.0, 4.0]}
    shared.apply(Seen(results={"L": stored}), results, held=())  # another worker's result
    assert results["L"].time_ms == 3.0 and "L" in shared.final


def test_an_owner_that_lost_its_lease_does_not_fail_the_new_owners_job(db):
    """A run that fails after its lease went to another worker leaves the job to that
    worker, instead of marking the other worker's running job failed."""
    url, sessions = db
    job_id = submit(sessions, budget=30)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="w1", lease_seconds=600)

    def taken_over():
        with sessions() as s:
            job = queries.get_job(s, job_id)
            job.worker_id = "w2"  # the lease expired and w2 claimed the job
            s.commit()
        raise RuntimeError("database hiccup")

    backend = CountingReplay(stop_after=5, on_stop=taken_over)
    runner = JobRunner(sessions, url, lambda job: backend, worker_id="w1", lease_seconds=600)
    assert runner.run(job_id).status == "lost"
    with sessions() as s:
        job = queries.get_job(s, job_id)
        assert (job.status, job.worker_id, job.error) == ("running", "w2", None)


def test_budget_seconds_count_from_the_jobs_first_start(db):
    """A job's time budget is one clock for every run on it: a resumed job (or a helper that
    joins late) gets what is left of it, not a fresh budget of its own."""
    url, sessions = db
    job_id = submit(sessions, budget=30, budget_seconds=60)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="w1", lease_seconds=600)
        job = queries.get_job(s, job_id)
        job.started_at = datetime.now(UTC) - timedelta(seconds=57)  # 3 s left
        s.commit()

    class SlowReplay(CountingReplay):
        def evaluate(self, config) -> TrialResult:
            time.sleep(1.0)  # 30 configs would take 30 s, the job's whole clock 87 s
            return super().evaluate(config)

    backend = SlowReplay()
    runner = JobRunner(sessions, url, lambda job: backend, worker_id="w1", lease_seconds=600)
    outcome = runner.run(job_id)
    assert outcome.status == "done" and 0 < len(backend.measured) < 30
    with sessions() as s:
        job = queries.get_job(s, job_id)
        finished = (job.finished_at - job.started_at).total_seconds()
        # 3 s left, then one config in flight, and set-up time on a loaded host: well
        # under the 87 s a fresh budget would have allowed.
        assert job.status == "done" and finished < 72


# --- a replay worker answers only the problems of its recordings ----------------------------


def _job_for(sessions, shape, dtype, *, version=None, budget=5, operator="softmax"):
    with sessions() as s:
        return queries.create_job(
            s, operator=operator, operator_version=version or get_operator(operator).version,
            shape=shape, dtype=dtype, gpu_model="H200", budget_configs=budget, strategy="grid",
        ).id  # fmt: skip


def _status(sessions, job_id):
    with sessions() as s:
        job = queries.get_job(s, job_id)
        return job.status, job.operator_version, job.trials_done


def _replay_worker(url, sessions, path, **kw):
    from kato.tuner.factories import replay_backend_factory

    factory = replay_backend_factory(path)
    return Worker(sessions, url, factory.gpu_models, factory, poll_seconds=0.01, **kw)


def test_a_replay_worker_leaves_jobs_of_other_problems_queued_and_answers_its_own(db):
    """Its recording is softmax 4096x4096 float16: a job for another shape, another dtype or
    another operator is left queued (before, the worker answered the oldest one from its
    file and stored those times as that job's tuned result)."""
    url, sessions = db
    other_shape = _job_for(sessions, [2048, 2048], "float32")
    other_dtype = _job_for(sessions, SHAPE, "float32")
    other_operator = _job_for(sessions, SHAPE, DTYPE, operator="layernorm")
    own = _job_for(sessions, SHAPE, DTYPE)
    worker = _replay_worker(url, sessions, RECORDING)
    outcome = worker.run_once()
    assert (outcome.job_id, outcome.status) == (own, "done")
    assert worker.run_once() is None
    version = get_operator("softmax").version
    assert _status(sessions, own) == ("done", version, 5)
    for job_id in (other_shape, other_dtype):
        assert _status(sessions, job_id) == ("queued", version, 0)
    assert _status(sessions, other_operator)[0] == "queued"
    with sessions() as s:
        found = service_lookup.lookup_best_config(
            s, operator="softmax", operator_version=version, shape=[2048, 2048],
            dtype="float32", gpu_model="H200",
        )  # fmt: skip
    assert found[1] != "exact"


def test_a_replay_worker_does_not_help_with_a_running_job_of_another_problem(db):
    url, sessions = db
    job_id = _job_for(sessions, [2048, 2048], "float32", budget=100)
    with sessions() as s:
        owner = queries.claim_next_job(
            s, gpu_models=["H200"], worker_id="gpu-owner", lease_seconds=600
        )
        assert owner.id == job_id
    Worker(sessions, url, ["H200"], lambda job: None, worker_id="gpu-owner").heartbeat("busy")
    helper = _replay_worker(
        url, sessions, RECORDING, max_workers_per_job=4, min_configs_per_worker=1
    )
    assert helper.run_once() is None
    assert Ledger(sessions, "test").job(job_id).reservations() == []
    with sessions() as s:
        assert queries.job_trials(s, job_id) == []


def _relabelled(tmp_path, version):
    """The recording as a file of another operator version (as an older Kato wrote it)."""
    from kato.shared.kt_cache import load_cache, save_cache

    cache = load_cache(RECORDING)
    cache.extra["kato_operator_version"] = version
    path = tmp_path / f"softmax_H200_4096x4096_float16_{version}.json.gz"
    save_cache(cache, path)
    return path


def test_a_recording_of_an_older_version_answers_only_jobs_of_that_version(db, tmp_path):
    """Its times are of the old kernel: it answers a job still at that version, which keeps its
    version (a GPU worker would move it to the current one; its result is stored, and never
    served, under the old version), and leaves a job at the current version queued."""
    url, sessions = db
    old = "0ld0ld0ld0ld"
    current_job = _job_for(sessions, SHAPE, DTYPE)
    old_job = _job_for(sessions, SHAPE, DTYPE, version=old)
    worker = _replay_worker(url, sessions, _relabelled(tmp_path, old))
    outcome = worker.run_once()
    assert (outcome.job_id, outcome.status) == (old_job, "done")
    assert worker.run_once() is None
    assert _status(sessions, old_job) == ("done", old, 5)
    assert _status(sessions, current_job)[0] == "queued"
    with sessions() as s:
        current = get_operator("softmax").version
        for version, source in ((old, "exact"), (current, "default")):
            _row, found = service_lookup.lookup_best_config(
                s, operator="softmax", operator_version=version, shape=SHAPE, dtype=DTYPE,
                gpu_model="H200",
            )  # fmt: skip
            assert found == source, version


def test_a_recording_without_kato_metadata_is_for_what_its_name_says(db, tmp_path):
    """A Kernel Tuner cache of its own (no kato_* fields): the name says its problem."""
    from kato.shared.kt_cache import load_cache, save_cache

    cache = load_cache(RECORDING)
    for name in ("kato_operator", "kato_operator_version", "dtype"):
        cache.extra.pop(name)
    save_cache(cache, tmp_path / "softmax_H200_4096x4096_float16.json")
    url, sessions = db
    other = _job_for(sessions, SHAPE, "float32")
    own = _job_for(sessions, SHAPE, DTYPE)
    worker = _replay_worker(url, sessions, tmp_path / "softmax_H200_4096x4096_float16.json")
    assert worker.run_once().job_id == own and worker.run_once() is None
    assert _status(sessions, other)[0] == "queued"


def test_a_gpu_worker_claims_only_registered_operators(db):
    """A job of an operator this code does not have (submitted by newer code, or one removed)
    stays queued for a worker that has it, instead of failing here."""
    from kato.tuner.factories import pycuda_backend_factory

    _url, sessions = db
    unknown = _job_for(sessions, SHAPE, DTYPE, operator="no_such_operator", version="v")
    known = _job_for(sessions, SHAPE, DTYPE)
    scope = pycuda_backend_factory(0).scope
    claims = []
    with sessions() as s:
        for _ in range(2):
            job = queries.claim_next_job(
                s, gpu_models=["H200"], worker_id="w", lease_seconds=60, scope=scope
            )
            claims.append(job and job.id)
    assert claims == [known, None]
    assert _status(sessions, unknown)[0] == "queued"


def test_replay_backends_refuse_a_recording_of_an_operator_not_registered_here(tmp_path):
    from kato.tuner.backends.replay import RecordedProblem
    from kato.tuner.factories import Recording, ReplayBackends

    made_by_hand = Recording(
        RECORDED / "softmax_H200_4096x4096_float16.json.gz",
        RecordedProblem("banana", (4096, 4096), "float16", "H200"),
    )
    with pytest.raises(ValueError, match="unknown operator 'banana'"):
        ReplayBackends([made_by_hand])


def test_recordings_are_found_below_a_directory_and_checked_against_their_operator(tmp_path):
    import shutil

    from kato.tuner.factories import find_recordings

    from kato.shared.kt_cache import load_cache, save_cache

    source = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
    (tmp_path / "a" / "b").mkdir(parents=True)
    shutil.copy(source, tmp_path / "a" / "b" / source.name)
    found = find_recordings(tmp_path)
    assert [(r.path, r.problem.operator, r.problem.shape) for r in found] == [
        (tmp_path / "a" / "b" / source.name, "softmax", (4096, 4096))
    ]
    cache = load_cache(source)
    cache.tune_params["BLOCK_SIZE"] = [float(v) for v in cache.tune_params["BLOCK_SIZE"]]
    save_cache(cache, tmp_path / "a" / "floats.json")  # softmax by its metadata, float values
    with pytest.raises(ValueError, match=r"BLOCK_SIZE values \[32.0, .*not among softmax's"):
        find_recordings(tmp_path)
