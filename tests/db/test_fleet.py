"""The queue with real worker processes, on SQLite and PostgreSQL (see conftest.py): no double
claims, a worker killed with SIGKILL mid-job loses nothing and measures nothing twice, a cancel
stops a running job within seconds, idle workers share a large job through its Optuna study."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import Counter

import optuna
from fleet_helpers import claim_until_empty, job, sessions_for, start_worker, stop, submit, wait_for
from kato.db import fleet, queries
from kato.db.ledger import RESERVED, JobLedger, Ledger
from kato.db.models import Trial
from kato.db.retry import RetryPolicy

#: Ledgers of these tests never retry: a fault (a deadlock) must show, not be absorbed.
NO_RETRY = RetryPolicy(max_seconds=0)


def ledger(sessions, worker_id: str, job_id: str) -> JobLedger:
    """``worker_id``'s ledger of ``job_id`` (a lease of 60 s: a worker is dead after it)."""
    return Ledger(sessions, worker_id, lease_seconds=60, retry_policy=NO_RETRY).job(job_id)


def assert_complete(sessions, job_id: str) -> list[Trial]:
    """Done, every budget unit a distinct recorded trial, no reservation left behind."""
    with sessions() as s:
        found = queries.get_job(s, job_id)
        trials = queries.job_trials(s, job_id)
    keys = Counter(t.config_key for t in trials)
    assert found.status == "done", (found.status, found.error)
    assert max(keys.values()) == 1, "a config was recorded twice"
    assert all(t.status != RESERVED for t in trials), "a reservation was left behind"
    assert found.trials_done == len(trials) == found.budget_configs
    assert sorted(t.number for t in trials) == list(range(len(trials))), "numbers repeat or skip"
    ok = [t for t in trials if t.status == "ok"]
    assert found.best_time_ms == min(t.time_ms for t in ok)
    return trials


def test_processes_claiming_at_once_never_share_a_job(db_url):
    sessions = sessions_for(db_url)
    ids = {submit(sessions, 5) for _ in range(24)}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        claims = pool.starmap(claim_until_empty, [(db_url, f"w{i}") for i in range(3)])
    flat = [j for c in claims for j in c]
    assert sorted(flat) == sorted(ids), "a job was claimed twice or not at all"


def test_a_worker_killed_mid_job_loses_nothing_and_measures_nothing_twice(db_url, tmp_path):
    sessions = sessions_for(db_url)
    job_id = submit(sessions, 20)
    log = tmp_path / "workers.log"
    first = start_worker(db_url, log, delay=0.05, lease=2.0)
    try:
        wait_for(lambda: job(sessions, job_id).trials_done >= 6, 60, "progress", logs=[log])
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        with sessions() as s:
            before = {
                t.config_key: (t.id, t.status, t.time_ms)
                for t in queries.job_trials(s, job_id)
                if t.status != RESERVED
            }
        # trials_done also counts the trial being measured, and the replay backend measures
        # "out of process": the last result's row is written while the next config measures
        # (tuner/write_behind.py, at most one result behind), so a kill loses it too, and the
        # resume measures it again.
        assert 4 <= len(before) < 20
        assert job(sessions, job_id).status == "running"  # orphaned: the lease runs out

        second = start_worker(db_url, log, delay=0.01, lease=2.0)
        try:
            wait_for(lambda: job(sessions, job_id).status == "done", 60, "resume", logs=[log])
            assert second.poll() is None
        finally:
            stop([second])
    finally:
        stop([first])
    trials = assert_complete(sessions, job_id)
    after = {t.config_key: (t.id, t.status, t.time_ms) for t in trials}
    assert all(after[k] == v for k, v in before.items()), "a recorded trial was re-measured"


def test_cancel_stops_a_running_measurement_within_seconds(db_url, tmp_path):
    sessions = sessions_for(db_url)
    job_id = submit(sessions, 5)
    log = tmp_path / "worker.log"
    # Every trial takes 60 s, in an isolated child: only killing it stops the job quickly.
    worker = start_worker(
        db_url, log, delay=60, lease=3.0, extra=("--isolate", "--trial-timeout", "120")
    )
    try:

        def measuring() -> bool:
            return bool(ledger(sessions, "test", job_id).reservations())

        wait_for(measuring, 60, "the first measurement", logs=[log])
        start = time.monotonic()
        with sessions() as s:
            queries.request_cancel(s, job_id)
        wait_for(lambda: job(sessions, job_id).status == "cancelled", 20, "cancel", logs=[log])
        # Well under the 60 s trial; the margin is for a loaded machine (the worker's heartbeat
        # notices the cancel within a second on an idle one).
        assert time.monotonic() - start < 10
        assert not ledger(sessions, "test", job_id).reservations()
        with sessions() as s:
            assert not queries.job_trials(s, job_id)
        time.sleep(0.5)
        assert worker.poll() is None, "the worker exited"
        with sessions() as s:
            (row,) = fleet.list_workers(s)
            assert row.status == "idle" and row.current_job_id is None
    finally:
        stop([worker])
    with sessions() as s:
        assert fleet.list_workers(s)[0].status == "stopped"


def test_several_workers_run_the_queue_and_share_a_large_job(db_url, tmp_path):
    sessions = sessions_for(db_url)
    big = submit(sessions, 24, strategy="tpe", seed=1)
    small = [submit(sessions, 3, seed=i) for i in range(2)]
    log = tmp_path / "workers.log"
    procs = [
        start_worker(db_url, log, delay=0.03, extra=("--max-workers-per-job", "2"))
        for _ in range(2)
    ]
    try:

        def all_done() -> bool:
            return all(job(sessions, j).status == "done" for j in [big, *small])

        wait_for(all_done, 240, "every job done", logs=[log])
        assert all(p.poll() is None for p in procs)
        with sessions() as s:
            workers = fleet.list_workers(s)
        assert len(workers) == 2 and all(w.gpu_models == ["H200"] for w in workers)
    finally:
        stop(procs)
    for job_id in [big, *small]:
        assert_complete(sessions, job_id)
    study = optuna.load_study(study_name=f"kato-job-{big}", storage=db_url)
    measured_by = Counter(
        t.user_attrs.get("kato_worker")
        for t in study.get_trials(deepcopy=False)
        if t.state == optuna.trial.TrialState.COMPLETE
    )
    assert len(measured_by) >= 2, f"the large job was not shared: {measured_by}"


def test_a_job_for_a_gpu_no_live_worker_has_says_so(db_url):
    sessions = sessions_for(db_url)
    with sessions() as s:
        found = queries.get_job(s, submit(sessions, 5))
        note = fleet.waiting_note(s, found, stale_seconds=60)
        assert note and "no live worker advertises GPU model H200" in note
        fleet.heartbeat_worker(
            s,
            worker_id="w1",
            hostname="h",
            pid=1,
            gpu_models=["H200"],
            backend="replay",
            status="idle",
            current_job_id=None,
        )
        assert fleet.waiting_note(s, found, stale_seconds=60) is None


def test_completing_a_trial_while_another_worker_reserves_that_config_does_not_deadlock(db_url):
    """Reserving takes the job's row, then inserts the trial; completing used to update the
    trial, then the job's best. When another worker reserved the config being completed (its
    proposer had not seen the reservation yet), PostgreSQL found a deadlock and failed one of
    them: completing now takes the job's row first, as reserving does."""
    import threading

    from kato.db.models import Job
    from sqlalchemy import update
    from sqlalchemy.exc import IntegrityError

    sessions = sessions_for(db_url)
    job_id = submit(sessions, 10)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="a", lease_seconds=60)
    config = {"BLOCK_SIZE": 256}
    worker = ledger(sessions, "a", job_id)
    assert worker.reserve(config, "k") == "reserved"
    done: list[object] = []
    other = sessions()
    try:
        # Worker b's reservation, first half: the job's row, held.
        other.execute(update(Job).where(Job.id == job_id).values(trials_done=Job.trials_done + 1))

        def complete() -> None:
            result = {"status": "ok", "time_ms": 1.5, "times_ms": [1.5], "config": config}
            try:
                done.append(worker.record("k", result))
            except Exception as exc:  # a deadlock victim
                done.append(exc)

        worker_a = threading.Thread(target=complete)
        worker_a.start()
        time.sleep(0.5)  # worker a waits for the job's row (before the fix: holding the trial)
        # Second half: the same config. Before the fix it waited for worker a's trial update
        # while worker a waited for this row; now the row is a committed reservation: taken.
        other.add(Trial(job_id=job_id, number=1, config=config, config_key="k", status="ok"))
        try:
            other.flush()
            raise AssertionError("a second row for the same config was inserted")
        except IntegrityError:
            other.rollback()
    finally:
        other.close()
    worker_a.join(30)
    assert done == [True]
    with sessions() as s:
        assert queries.get_job(s, job_id).best_time_ms == 1.5


def _released_reservation(sessions, job_id: str) -> dict:
    """Worker a reserves a config, then is taken for dead (it has no heartbeat) and its
    reservation released, as a long measurement past the lease would have it."""
    config = {"BLOCK_SIZE": 256}
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="a", lease_seconds=60)
    assert ledger(sessions, "a", job_id).reserve(config, "k") == "reserved"
    assert ledger(sessions, "owner", job_id).release_stale() == 1
    with sessions() as s:
        assert queries.get_job(s, job_id).trials_done == 0
    return {"status": "ok", "time_ms": 2.5, "times_ms": [2.5], "config": config}


def test_a_measurement_whose_reservation_was_released_is_stored_when_the_config_is_free(db_url):
    """Before, a completion stored nothing once the reservation was gone, though the search
    had counted the result: the config was measured again by another worker."""
    sessions = sessions_for(db_url)
    job_id = submit(sessions, 10)
    result = _released_reservation(sessions, job_id)
    assert ledger(sessions, "a", job_id).record("k", result)
    with sessions() as s:
        (trial,) = queries.job_trials(s, job_id)
        found = queries.get_job(s, job_id)
    assert (trial.config_key, trial.status, trial.time_ms) == ("k", "ok", 2.5)
    assert not trial.reserved and trial.reserved_by == "a"  # a result, measured by a
    assert (found.trials_done, found.best_time_ms) == (1, 2.5)


def test_a_released_measurement_is_not_stored_over_another_workers_reservation(db_url):
    sessions = sessions_for(db_url)
    job_id = submit(sessions, 10)
    result = _released_reservation(sessions, job_id)
    assert ledger(sessions, "b", job_id).reserve(result["config"], "k") == "reserved"
    assert not ledger(sessions, "a", job_id).record("k", result)
    with sessions() as s:
        (trial,) = queries.job_trials(s, job_id)
        found = queries.get_job(s, job_id)
    assert trial.reserved and trial.reserved_by == "b"  # b's measurement is the one to store
    assert (found.trials_done, found.best_time_ms) == (1, None)


def _numbers(sessions, job_id: str) -> list[int]:
    with sessions() as s:
        return sorted(t.number for t in queries.job_trials(s, job_id))


def _alive(session, worker_id: str) -> None:
    fleet.heartbeat_worker(
        session, worker_id=worker_id, hostname="h", pid=1, gpu_models=["H200"],
        backend="replay", status="busy", current_job_id=None,
    )  # fmt: skip


def test_trial_numbers_stay_unique_after_a_worker_dies_holding_reservations(db_url):
    """Worker b dies holding two reservations in the middle of the job's numbers; their release
    gave their numbers back while numbers were counted from trials_done: the next reservations
    took numbers already held (two numbers twice, two missing). Numbers are 0..n-1, each once."""
    sessions = sessions_for(db_url)
    job_id = submit(sessions, 10)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="a", lease_seconds=60)
        _alive(s, "a")  # b never beats: it counts as dead
    a, b = ledger(sessions, "a", job_id), ledger(sessions, "b", job_id)
    for key, by in [("c0", a), ("c1", a), ("c2", b), ("c3", b), ("c4", a)]:
        assert by.reserve({"k": key}, key) == "reserved"
    assert a.release_stale() == 2
    for key in ["c5", "c6", "c7"]:
        assert a.reserve({"k": key}, key) == "reserved", key
    for key in ["c0", "c1", "c4", "c5", "c6", "c7"]:
        result = {"status": "ok", "time_ms": 1.0, "times_ms": [1.0], "config": {"k": key}}
        assert a.record(key, result)
    with sessions() as s:
        assert queries.get_job(s, job_id).trials_done == 6
    assert _numbers(sessions, job_id) == list(range(6))


def test_concurrent_reservations_number_trials_once_each(db_url):
    """Threads reserving configs of one job at once, while a dead worker's reservations are
    released between them: every reservation gets its own number, and the numbers have no
    gaps (on PostgreSQL the job's row lock orders them; the database refuses a repeat)."""
    import threading

    sessions = sessions_for(db_url)
    job_id = submit(sessions, 200)
    with sessions() as s:
        queries.claim_next_job(s, gpu_models=["H200"], worker_id="w0", lease_seconds=60)
        for i in range(4):
            _alive(s, f"w{i}")
    dead = ledger(sessions, "dead", job_id)
    for i in range(6):  # a dead worker's reservations, numbers 0..5
        assert dead.reserve({}, f"dead{i}") == "reserved"
    start = threading.Barrier(5)
    outcomes: list[object] = []

    def reserve(worker: str) -> None:
        mine = ledger(sessions, worker, job_id)
        start.wait()
        try:
            for n in range(15):
                outcomes.append(mine.reserve({}, f"{worker}-{n}"))
        except Exception as exc:
            outcomes.append(exc)

    def release() -> None:
        owner = ledger(sessions, "w0", job_id)
        start.wait()
        outcomes.append(owner.release_stale())

    threads = [threading.Thread(target=reserve, args=(f"w{i}",)) for i in range(4)]
    threads.append(threading.Thread(target=release))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes.count("reserved") == 60 and 6 in outcomes, outcomes
    assert _numbers(sessions, job_id) == list(range(60))
    with sessions() as s:
        assert queries.get_job(s, job_id).trials_done == 60
