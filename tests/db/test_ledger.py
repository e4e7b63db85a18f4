"""The job ledger's contracts (db/ledger.py), on SQLite and PostgreSQL: what the owner alone
may do, what a heartbeat answers, what a sync shows, how a job ends (also when an ending is
made again), and what a stopping worker gives back. The fleet tests (test_fleet.py) run the
same protocol with real worker processes."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from fleet_helpers import sessions_for, submit
from kato.db import fleet, queries
from kato.db import ledger as ledger_module
from kato.db.ledger import LEGACY_RESERVED_BY, JobLedger, Ledger
from kato.db.models import RESERVED, BestConfig, Job, Trial, Worker, utcnow
from kato.db.retry import RetryPolicy
from sqlalchemy import update
from sqlalchemy.exc import DisconnectionError

NO_RETRY = RetryPolicy(max_seconds=0)


def ok(config: dict, time_ms: float) -> dict:
    return {"config": config, "status": "ok", "times_ms": [time_ms], "time_ms": time_ms}


def _ledger(sessions, worker_id: str, job_id: str, *, helper: bool = False) -> JobLedger:
    ledger = Ledger(sessions, worker_id, lease_seconds=60, retry_policy=NO_RETRY)
    return ledger.job(job_id, helper=helper)


def _alive(sessions, *worker_ids: str) -> None:
    with sessions() as s:
        for worker_id in worker_ids:
            fleet.heartbeat_worker(
                s, worker_id=worker_id, hostname="h", pid=1, gpu_models=["H200"],
                backend="replay", status="busy", current_job_id=None,
            )  # fmt: skip


@pytest.fixture
def job(db_url):
    """A job of budget 4 claimed by worker "owner": (sessions, job id)."""
    sessions = sessions_for(db_url)
    job_id = submit(sessions, 4)
    claim = Ledger(sessions, "owner", lease_seconds=60).claim(["H200"])
    assert claim is not None and (claim.job_id, claim.helper) == (job_id, False)
    return sessions, job_id


def test_a_helper_may_not_end_the_job_nor_release_others_reservations(job):
    sessions, job_id = job
    helper = _ledger(sessions, "helper", job_id, helper=True)
    for call in (
        helper.release_stale,
        helper.settle,
        lambda: helper.fail("no"),
        helper.cancel,
        lambda: helper.adopt_version("a", "b"),
        lambda: helper.finish(gpu_model="H200", compute_capability="9.0", cuda_version="13.0"),
    ):
        with pytest.raises(PermissionError, match="only its owner"):
            call()
    assert helper.load().status == "running"


def test_a_second_worker_with_nothing_to_claim_is_offered_the_job_to_help(job):
    sessions, job_id = job
    _alive(sessions, "owner")
    other = Ledger(sessions, "other", lease_seconds=60)
    assert other.claim(["H200"]) is None  # one worker per job unless sharing is on
    claim = other.claim(["H200"], max_workers_per_job=2, min_configs_per_worker=1)
    assert (claim.job_id, claim.helper) == (job_id, True)


def test_the_heartbeat_says_when_to_stop(job):
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    helper = _ledger(sessions, "helper", job_id, helper=True)
    assert owner.renew() is None and helper.renew() is None
    with sessions() as s:  # the owner's lease ran out and another worker claimed the job
        s.execute(update(Job).where(Job.id == job_id).values(worker_id="thief"))
        s.commit()
    assert owner.renew() == "lost" and helper.renew() is None
    with sessions() as s:
        queries.request_cancel(s, job_id)
    assert owner.renew() == "cancelled" and helper.renew() == "cancelled"


def test_an_owner_whose_lease_went_elsewhere_fails_nothing(job):
    sessions, job_id = job
    with sessions() as s:
        s.execute(update(Job).where(Job.id == job_id).values(worker_id="thief"))
        s.commit()
    assert _ledger(sessions, "owner", job_id).fail("boom") is False
    found = _ledger(sessions, "thief", job_id).load()
    assert (found.status, found.error) == ("running", None)


def test_a_sync_shows_other_workers_results_and_reservations_not_its_own(job):
    sessions, job_id = job
    owner, helper = _ledger(sessions, "owner", job_id), _ledger(sessions, "helper", job_id)
    assert owner.reserve({"k": 1}, "k1") == "reserved"
    assert owner.record("k1", ok({"k": 1}, 2.0))
    assert owner.reserve({"k": 2}, "k2") == "reserved"  # being measured
    assert helper.reserve({"k": 3}, "k3") == "reserved"
    seen = helper.sync(known=())
    assert seen.pending == {"k2": {"k": 2}} and list(seen.results) == ["k1"]
    assert seen.results["k1"]["times_ms"] == [2.0] and seen.results["k1"]["status"] == "ok"
    assert helper.sync(known={"k1"}).results == {}
    assert (helper.holds("k3"), owner.holds("k3"), owner.held()) == (True, False, {"k2"})
    assert helper.reserve({"k": 2}, "k2") == "taken"
    assert helper.reserve({"k": 4}, "k4") == "reserved"
    assert helper.reserve({"k": 5}, "k5") == "budget"  # 4 of 4 reserved or recorded


def test_waiting_for_another_workers_result_ends_with_it_or_with_its_release(job):
    sessions, job_id = job
    _alive(sessions, "owner", "helper")
    owner, helper = _ledger(sessions, "owner", job_id), _ledger(sessions, "helper", job_id)
    assert helper.reserve({"k": 1}, "k1") == "reserved"
    threading.Timer(0.3, lambda: helper.record("k1", ok({"k": 1}, 1.5))).start()
    stop = threading.Event()
    assert owner.await_result("k1", stop, poll_seconds=0.05)["times_ms"] == [1.5]

    dead = _ledger(sessions, "dead", job_id)  # never beats: dead
    assert dead.reserve({"k": 2}, "k2") == "reserved"
    assert owner.await_result("k2", stop, poll_seconds=0.05) is None  # released: free again
    assert owner.reserve({"k": 2}, "k2") == "reserved"
    stop.set()
    assert helper.await_result("k2", stop) is None  # stopped before the owner's result


def test_finishing_stores_the_winner_and_answers_the_same_when_made_again(job):
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    for n, time_ms in enumerate([3.0, 1.0, 2.0]):
        assert owner.reserve({"k": n}, f"k{n}") == "reserved"
        assert owner.record(f"k{n}", ok({"k": n}, time_ms))
    device = {"gpu_model": "H200", "compute_capability": "9.0", "cuda_version": "13.0"}
    first = owner.finish(**device, default_key="k0", framework_ms=4.0, framework="torch x",
                         compiled_ms=2.5, compiled="torch.compile x")  # fmt: skip
    again = owner.finish(**device, default_key="k0")  # its answer was lost: made again
    assert first == again and (first.status, first.measured, first.best_time_ms) == ("done", 3, 1.0)
    with sessions() as s:
        (row,) = s.query(BestConfig).all()
    assert (row.config, row.time_ms, row.default_ms, row.framework_ms) == ({"k": 1}, 1.0, 3.0, 4.0)
    assert (row.compiled_ms, row.compiled) == (2.5, "torch.compile x")


def test_a_job_without_a_correct_config_fails_and_a_cancel_wins_over_finishing(job, db_url):
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    assert owner.reserve({"k": 0}, "k0") == "reserved"
    assert owner.record("k0", {"config": {"k": 0}, "status": "verify_error", "error": "x"})
    device = {"gpu_model": "H200", "compute_capability": "9.0", "cuda_version": "13.0"}
    ending = owner.finish(**device)
    assert (ending.status, ending.measured, ending.error) == (
        "failed", 1, "no config ran correctly (see the job's trials)",
    )  # fmt: skip

    other = submit(sessions, 4)
    assert Ledger(sessions, "owner2").claim(["H200"]).job_id == other
    with sessions() as s:
        queries.request_cancel(s, other)
    ending = _ledger(sessions, "owner2", other).finish(**device)
    assert ending.status == "cancelled" and _ledger(sessions, "x", other).load().status == (
        "cancelled"
    )


def test_a_stopping_worker_gives_back_its_reservations_and_its_lease(job):
    sessions, job_id = job
    owner, helper = (
        _ledger(sessions, "owner", job_id),
        _ledger(sessions, "helper", job_id, helper=True),
    )
    assert owner.reserve({"k": 1}, "k1") == "reserved"
    assert helper.reserve({"k": 2}, "k2") == "reserved"
    helper.give_back()
    assert [key for key, *_ in owner.reservations()] == ["k1"]
    assert owner.load().lease_expires_at > utcnow() + timedelta(seconds=30)  # a helper's stop
    owner.give_back()
    found = owner.load()
    assert owner.reservations() == [] and found.trials_done == 0
    assert found.status == "running" and found.lease_expires_at <= utcnow()  # claimable now
    assert Ledger(sessions, "next").claim(["H200"]).job_id == job_id


def test_a_job_given_back_stays_given_back_whatever_its_runner_does_next(job, monkeypatch):
    """A worker gives back the job of a runner that is still going (another thread, the same
    ledger): a reservation in flight lands first and is released with the rest, and after the
    give-back the runner reserves and renews nothing (the lease stays ended)."""
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    assert owner.reserve({"k": 1}, "k1") == "reserved"
    in_flight, go_on = threading.Event(), threading.Event()
    real = ledger_module._reserve

    def slow_reserve(*args, **kwargs):  # type: ignore[no-untyped-def]
        in_flight.set()
        assert go_on.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(ledger_module, "_reserve", slow_reserve)
    answers = []
    runner = threading.Thread(target=lambda: answers.append(owner.reserve({"k": 2}, "k2")))
    runner.start()
    assert in_flight.wait(30)
    giver = threading.Thread(target=owner.give_back)
    giver.start()
    giver.join(0.3)
    assert giver.is_alive(), "the give-back did not wait for the reservation in flight"
    go_on.set()
    runner.join(30)
    giver.join(30)
    assert answers == ["reserved"] and not giver.is_alive()
    assert owner.reservations() == []  # k1 and the one in flight, both released
    assert owner.reserve({"k": 3}, "k3") == "stopped" and owner.renew() == "stopped"
    found = owner.load()
    assert found.status == "running" and found.trials_done == 0
    assert found.lease_expires_at <= utcnow()  # not renewed: claimable now
    assert Ledger(sessions, "next").claim(["H200"]).job_id == job_id


def test_a_reservation_waiting_to_retry_blocks_neither_the_renewal_nor_a_give_back(
    job, monkeypatch
):
    """A reservation retrying a database fault holds the ledger's fence only during each try:
    while it waits to try again, the heartbeat renews the lease and another thread gives the
    job back; the try after the wait then answers ``stopped`` and reserves nothing."""
    sessions, job_id = job
    waiting, go_on = threading.Event(), threading.Event()

    class RetryWait(threading.Event):  # the retries' wait, held until the test goes on
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            assert go_on.wait(30)
            return self.is_set()

    ledger = Ledger(
        sessions, "owner", lease_seconds=60, retry_policy=RetryPolicy(), stop=RetryWait()
    )
    owner = ledger.job(job_id)
    real, tries = ledger_module._reserve, []

    def fails_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        tries.append(args[3])
        if len(tries) == 1:
            raise DisconnectionError("the connection was lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(ledger_module, "_reserve", fails_once)
    answers: list[str] = []
    runner = threading.Thread(target=lambda: answers.append(owner.reserve({"k": 1}, "k1")))
    runner.start()
    try:
        _renew_and_give_back_while_waiting(owner, waiting)
    finally:
        go_on.set()
        runner.join(30)
    assert answers == ["stopped"] and tries == ["k1"]  # the second try reserved nothing
    assert owner.reservations() == [] and owner.renew() == "stopped"
    assert Ledger(sessions, "next").claim(["H200"]).job_id == job_id


def _renew_and_give_back_while_waiting(owner: JobLedger, waiting: threading.Event) -> None:
    assert waiting.wait(30)
    renewals: list[str | None] = []
    beat = threading.Thread(target=lambda: renewals.append(owner.renew()))
    beat.start()
    beat.join(10)
    assert not beat.is_alive(), "the renewal waited out the reservation's retry wait"
    assert renewals == [None]  # the lease renewed: the job goes on
    giver = threading.Thread(target=owner.give_back)
    giver.start()
    giver.join(10)
    assert not giver.is_alive(), "the give-back waited out the reservation's retry wait"


def test_a_job_measured_nothing_moves_to_the_current_version_and_says_why_not_otherwise(db_url):
    sessions = sessions_for(db_url)

    def create(version: str) -> str:
        with sessions() as s:
            return queries.create_job(
                s, operator="softmax", operator_version=version, shape=[64, 64],
                dtype="float16", gpu_model="H200", budget_configs=4,
            ).id  # fmt: skip

    def claim(worker_id: str, job_id: str) -> JobLedger:
        only = queries.JobScope(job_ids=frozenset({job_id}))
        assert Ledger(sessions, worker_id).claim(["H200"], scope=only).job_id == job_id
        return _ledger(sessions, worker_id, job_id)

    old, newer = create("0ld"), create("n3w")  # "n3w" first submitted after "0ld"
    # A worker of older code (at "0ld", first seen earlier) never moves a newer job back.
    assert claim("old-code", newer).adopt_version("n3w", "0ld") == "newer"
    assert _ledger(sessions, "x", newer).load().operator_version == "n3w"
    owner = claim("owner", old)
    assert owner.adopt_version("0ld", "n3w") == "moved"
    assert owner.adopt_version("0ld", "n3w") == "moved"  # made again: already moved
    assert owner.load().operator_version == "n3w"
    assert owner.reserve({"k": 1}, "k1") == "reserved"
    assert owner.adopt_version("n3w", "n3w2") == "measured"
    assert _ledger(sessions, "stranger", old).adopt_version("n3w", "n3w2") == "lost"


DEVICE = {"gpu_model": "H200", "compute_capability": "9.0", "cuda_version": "13.0"}


def _legacy_placeholder(sessions, job_id: str, key: str, worker_id: str | None) -> None:
    """A placeholder as code older than migration 0007 writes it: its worker in the error
    text, no ``reserved_by``; one unit of the job's budget taken."""
    with sessions() as s:
        number = s.query(Trial).filter_by(job_id=job_id).count()
        error = LEGACY_RESERVED_BY + worker_id if worker_id is not None else None
        s.add(
            Trial(
                job_id=job_id, number=number, config={"k": key}, config_key=key,
                status=RESERVED, times_ms=[], error=error,
            )
        )  # fmt: skip
        s.execute(update(Job).where(Job.id == job_id).values(trials_done=Job.trials_done + 1))
        s.commit()


def _age(sessions, job_id: str, seconds: float, *, workers: tuple[str, ...] = ()) -> None:
    """Move the job's placeholders (and the heartbeats of ``workers``) ``seconds`` back."""
    back = utcnow() - timedelta(seconds=seconds)
    with sessions() as s:
        s.execute(update(Trial).where(Trial.job_id == job_id).values(created_at=back))
        if workers:
            s.execute(update(Worker).where(Worker.id.in_(workers)).values(heartbeat_at=back))
        s.commit()


def test_a_placeholder_of_older_code_is_stale_only_once_its_worker_died_and_a_lease_passed(job):
    """A fleet mid-upgrade: an old-code worker measuring a config must keep it, or the
    config is measured twice; released, it gives its unit of budget back."""
    sessions, job_id = job
    _alive(sessions, "owner", "old-code")
    _legacy_placeholder(sessions, job_id, "measuring", "old-code")
    _legacy_placeholder(sessions, job_id, "unnamed", None)
    owner = _ledger(sessions, "owner", job_id)
    assert owner.release_stale() == 0  # both inserted just now
    assert not owner.settle()
    _age(sessions, job_id, 120)  # a long measurement: its worker still beats
    assert owner.release_stale() == 1  # only the one no worker names
    assert [key for key, *_ in owner.reservations()] == ["measuring"]
    _alive(sessions, "owner")
    _age(sessions, job_id, 120, workers=("old-code",))  # its worker died
    assert owner.release_stale() == 1
    assert owner.reservations() == [] and owner.load().trials_done == 0


def test_a_dead_workers_fresh_legacy_placeholder_waits_for_a_lease(job):
    sessions, job_id = job
    _alive(sessions, "owner", "old-code")
    _age(sessions, job_id, 120, workers=("old-code",))  # dead before its placeholder was read
    _legacy_placeholder(sessions, job_id, "k", "old-code")
    owner = _ledger(sessions, "owner", job_id)
    assert owner.release_stale() == 0
    _age(sessions, job_id, 120)
    assert owner.release_stale() == 1


def _expire(sessions, job_id: str) -> None:
    """The owner's lease runs out (its heartbeats were lost, say, in a network partition)."""
    with sessions() as s:
        past = utcnow() - timedelta(seconds=1)
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=past))
        s.commit()


def _claim(sessions, job_id: str, worker_id: str = "thief") -> bool:
    """Whether ``worker_id``'s claim takes the job."""
    claim = Ledger(sessions, worker_id, lease_seconds=60).claim(["H200"])
    return claim is not None and claim.job_id == job_id


def _steal(sessions, job_id: str) -> bool:
    _expire(sessions, job_id)
    return _claim(sessions, job_id)


def test_an_owner_whose_job_was_claimed_again_finishes_fails_and_cancels_nothing(job):
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    assert owner.reserve({"k": 1}, "k1") == "reserved" and owner.record("k1", ok({"k": 1}, 1.0))
    assert _steal(sessions, job_id)
    assert owner.cancel() is False
    assert owner.fail("boom") is False
    assert owner.finish(**DEVICE).status == "lost"
    found = owner.load()
    assert (found.status, found.worker_id, found.error) == ("running", "thief", None)
    assert found.lease_expires_at > utcnow()
    with sessions() as s:
        assert s.query(BestConfig).count() == 0


def test_a_claim_landing_while_the_owner_ends_the_job_is_never_overwritten(job, monkeypatch):
    """The owner reads the job (still its own), then another worker's claim commits before
    the owner writes: the job ends under exactly one of them."""
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    assert owner.reserve({"k": 1}, "k1") == "reserved" and owner.record("k1", ok({"k": 1}, 1.0))
    _expire(sessions, job_id)
    real, stolen = queries.get_job, {}

    def get_job_then_claim(session, wanted):
        found = real(session, wanted)
        if not stolen:
            stolen["thief"] = None  # the claim reads the job too
            stolen["thief"] = _claim(sessions, job_id)  # PostgreSQL skips the locked row
        return found

    monkeypatch.setattr(queries, "get_job", get_job_then_claim)
    ending = owner.finish(**DEVICE)
    monkeypatch.setattr(queries, "get_job", real)
    found = owner.load()
    if stolen["thief"]:
        assert ending.status == "lost" and (found.status, found.worker_id) == ("running", "thief")
    else:
        assert ending.status == "done" and (found.status, found.worker_id) == ("done", "owner")
        assert not _claim(sessions, job_id)


def test_a_done_job_stays_done(job):
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    assert owner.reserve({"k": 1}, "k1") == "reserved" and owner.record("k1", ok({"k": 1}, 1.0))
    assert owner.finish(**DEVICE).status == "done"
    with sessions() as s:  # a cancel requested too late: set while the end was committing
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
        s.commit()
    assert owner.fail("late") is False and owner.cancel() is False
    assert owner.finish(**DEVICE).status == "done"
    found = owner.load()
    assert (found.status, found.error, found.best_time_ms) == ("done", None, 1.0)


def test_ending_the_job_made_again_after_its_commit_landed_answers_the_same(job, db_url):
    sessions, job_id = job
    owner = _ledger(sessions, "owner", job_id)
    assert owner.fail("boom") is True and owner.fail("boom") is True
    assert owner.load().status == "failed"
    other = submit(sessions, 4)
    assert Ledger(sessions, "owner2").claim(["H200"]).job_id == other
    second = _ledger(sessions, "owner2", other)
    assert second.cancel() is True and second.cancel() is True
    assert second.fail("x") is False and second.load().status == "cancelled"
