"""The fleet protocol: the one API through which a worker takes part in a tuning job.

A :class:`Ledger` belongs to one worker process (its ``worker_id``). It owns the worker's
database sessions and the retry policy for transient faults (:mod:`db.retry`): callers never
see a session, a row lock or a retry. It claims jobs, announces the worker's presence and opens
a :class:`JobLedger` per job the worker runs, as its *owner* (it claimed the job and holds the
lease) or as a *helper* (it joined a job another worker owns, :func:`db.fleet.join_running_job`).

A job's life on one worker, owner and helper alike (``[owner]``: the owner only)::

    ledger = Ledger(sessions, worker_id, lease_seconds=60)
    ledger.announce(...)                       # presence, on every idle poll and heartbeat
    claim = ledger.claim(gpu_models, scope)    # (job id, helper?) or None
    job = ledger.job(claim.job_id, helper=claim.helper)
    job.release_stale()                        # [owner] dead workers' reservations
    job.adopt_version(old, new)                # [owner] a job queued before its kernel changed
    known = job.stored_results()               # resume: what is recorded is never measured again
    while searching:
        job.renew()                            # heartbeat thread: None, or why to stop
        job.sync(known)                        # other workers' results and reservations
        job.reserve(config, key)               # before measuring: reserved|taken|budget|stopped
        job.await_result(key, stop)            # after "taken": the other worker's result
        job.record(key, result)  |  job.release(key)
    job.settle()                               # [owner] wait for the helpers' last results
    job.finish(...) | job.fail(error) | job.cancel()   # [owner] the job's end
    job.give_back()                            # on a stop: reservations (and lease) back

Contracts:

- **Atomic steps.** Every method is its own transaction(s), committed before it returns. A
  reservation takes one unit of the job's budget (``trials_done + 1`` under ``trials_done <
  budget_configs``) and inserts a placeholder row (status :data:`RESERVED`, ``reserved_by``,
  ``reserved_at``) in one transaction: the unique ``(job_id, config_key)`` constraint makes it
  exclusive (no config is measured twice across workers) and the condition keeps the budget
  exact, on SQLite and PostgreSQL alike. :meth:`JobLedger.record` fills the placeholder in (no
  second count) and keeps the job's best; :meth:`JobLedger.release` deletes it and gives the
  unit back.
- **Retries.** Methods that the search depends on are retried on a transient fault for up to
  the policy's ``max_seconds`` (not once ``stop`` is set), each safe to make again: a
  reservation this worker holds already answers ``reserved``, a result already stored answers
  ``True``, a claim retakes the job already running under the worker, the finish of a job this
  worker ended answers what it stored. :meth:`JobLedger.renew`, :meth:`Ledger.claim`,
  :meth:`Ledger.announce` and :meth:`JobLedger.give_back` make one try (their callers try again
  on their next beat or poll, or do not wait: a stopping worker).
- **Who may call what.** The owner alone ends the job (:meth:`JobLedger.finish`, ``fail``,
  ``cancel``), moves it to another operator version and releases other workers' stale
  reservations at its start; a helper's :class:`JobLedger` refuses those (``PermissionError``).
  Everything else either may call.
- **A lost lease.** :meth:`JobLedger.renew` answers ``"lost"`` once the job runs under another
  worker's lease (this one's expired and the job was claimed again) and ``"cancelled"`` once a
  cancel was requested; the caller stops before its next measurement. The ending steps end the
  job by a conditional update (``running`` under this worker's lease), so a claim or an end
  committed since they read it is never overwritten: an owner whose lease went elsewhere ends
  nothing, and a job ended stays as it ended (``fail`` and ``cancel`` answer ``False``,
  ``finish`` an ending ``lost``; the caller treats it as a lost lease). A worker taken for dead
  (its heartbeat older than a lease) may find its reservation released while it measured:
  :meth:`JobLedger.record` reserves the config again to store the result, unless another worker
  has taken it since, the budget is used up or the job stopped.
- **Threads.** A :class:`JobLedger` may be used from several threads at once (the search, its
  write-behind thread, the heartbeat, the worker's thread that gives a held job back): every
  step opens its own session.
- **Given back is final.** Once :meth:`JobLedger.give_back` has begun, that ledger takes
  nothing more: :meth:`JobLedger.reserve` answers ``stopped`` and :meth:`JobLedger.renew`
  ``"stopped"`` without a database call, and a reservation or renewal in flight in another
  thread commits before the give-back releases anything. So a worker may give back a job whose
  runner is still going (stuck in a measurement) at once, without waiting for it, and that
  runner cannot take the lease or a reservation again afterwards; a result it measured before
  is still stored (:meth:`JobLedger.record` leaves no reservation behind).
- **Upgrades.** Placeholders of workers older than migration 0007 (a fleet half-way through
  a rolling upgrade) have no ``reserved_by``; their ``error`` text names the worker. They are
  released only once that worker is not live and the placeholder is older than a lease, never
  at once while their worker measures (:func:`_release_stale`).

Trial numbers: a reservation takes the lowest number none of the job's rows holds, under the
job's row lock, so a released reservation's number goes to the next one: a job's numbers are
0, 1, 2, ... without gaps, and the unique ``(job_id, number)`` constraint refuses a repeat. A
number, once given, is never changed (it orders the trials, not the time they were measured).

Lock order: every transaction that writes both takes the job's row first, then trial rows. A
reservation must (its count decides whether it may insert); completing and releasing lock the
job row before touching their trial. In the other order PostgreSQL deadlocked: one worker
completing a trial waited for the job row that another held while inserting that same config,
which waited for the first worker's trial update.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from kato.db import fleet, queries, retry
from kato.db.models import RESERVED, Job, Trial, result_values, utcnow
from sqlalchemy import exists, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker

__all__ = [
    "RESERVED",
    "Adoption",
    "Claim",
    "Ending",
    "JobLedger",
    "Ledger",
    "Reservation",
    "Seen",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What :meth:`JobLedger.reserve` answers: ``reserved`` (measure it), ``taken`` (recorded
#: already, or another worker measures it), ``budget`` (every unit of the budget is reserved),
#: ``stopped`` (the job is no longer running, a cancel was requested, or this worker gave the
#: job back: :meth:`JobLedger.give_back`).
Reservation = Literal["reserved", "taken", "budget", "stopped"]

#: What :meth:`JobLedger.adopt_version` answers: ``moved`` (the job is at the new version now),
#: ``newer`` (the job's version is the newer one: this worker runs older code), ``measured``
#: (it holds trials of the old version), ``lost`` (it runs under another worker's lease) or
#: ``gone`` (deleted). Only ``moved`` wrote anything.
Adoption = Literal["moved", "newer", "measured", "lost", "gone"]

#: A stored result: :meth:`tuner.backends.base.TrialResult.to_dict`'s shape (config included).
Result = dict[str, Any]

#: How code older than migration 0007 named a placeholder's worker: in its ``error`` text. Such
#: workers still run in a fleet half-way through an upgrade (see :func:`_release_stale`).
LEGACY_RESERVED_BY = "being measured by worker "

#: Tries to end a job that changed between its read and its conditional update (SQLite).
_END_ATTEMPTS = 3

#: Tries to give a reservation a number that a writer outside the job's lock did not take.
_NUMBER_ATTEMPTS = 5


@dataclass(frozen=True)
class Claim:
    """A job for this worker: one it claimed (its owner, the lease is its) or, with
    ``helper``, a running job of another owner it may help with."""

    job_id: str
    helper: bool = False


@dataclass(frozen=True)
class Seen:
    """What :meth:`JobLedger.sync` read: ``results`` (config key -> stored result) of rows the
    caller did not know, and ``pending`` (config key -> config) of the configs other workers
    have reserved now (this worker's own reservations are never in it)."""

    results: dict[str, Result] = field(default_factory=dict)
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Ending:
    """How a job ended for the worker that tried to end it: ``status`` is ``done``,
    ``failed``, ``cancelled``, ``lost`` (it runs under another worker's lease now) or
    ``missing`` (deleted); ``measured`` the job's count of budget used."""

    status: str
    measured: int
    best_time_ms: float | None = None
    error: str | None = None


class Ledger:
    """One worker's access to the job database (see the module docstring).

    Args:
        sessions: the session factory of the job database (:func:`db.session.session_factory`).
        worker_id: this worker's id, the name on its leases, reservations and presence row.
        lease_seconds: a claim's lease, and how long a worker's heartbeat may be silent before
            it counts as dead (its reservations are then released).
        retry_policy: how transient database faults are retried (default
            :meth:`db.retry.RetryPolicy.from_env`).
        stop: once set, no step is tried again (a worker shutting down does not wait out a
            database restart).
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        worker_id: str,
        *,
        lease_seconds: float = 60.0,
        retry_policy: retry.RetryPolicy | None = None,
        stop: threading.Event | None = None,
    ):
        self.sessions = sessions
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.retry_policy = retry_policy or retry.RetryPolicy.from_env()
        self.stop = stop or threading.Event()

    def step(self, what: str, work: Callable[[Session], T], *, retried: bool = True) -> T:
        """``work(session)`` in a fresh session, tried again on a transient fault (``retried``;
        a fresh session per try). ``work`` must be safe to run again: a try whose commit landed
        may have lost its answer."""

        def once() -> T:
            with self.sessions() as session:
                return work(session)

        if not retried:
            return once()
        return retry.call(once, what=what, logger=log, policy=self.retry_policy, stop=self.stop)

    # --- presence and claims ------------------------------------------------------------

    def announce(
        self,
        *,
        status: str,
        job_id: str | None,
        hostname: str,
        pid: int,
        gpu_models: Sequence[str],
        devices: Sequence[Mapping[str, Any]] = (),
        backend: str,
    ) -> None:
        """Upsert this worker's presence row (:func:`db.fleet.heartbeat_worker`); one try."""
        self.step(
            "announce",
            lambda s: fleet.heartbeat_worker(
                s, worker_id=self.worker_id, hostname=hostname, pid=pid,
                gpu_models=gpu_models, devices=devices, backend=backend, status=status,
                current_job_id=job_id,
            ),
            retried=False,
        )  # fmt: skip

    def claim(
        self,
        gpu_models: Sequence[str],
        *,
        scope: queries.JobScope | None = None,
        max_workers_per_job: int = 1,
        min_configs_per_worker: int = 8,
    ) -> Claim | None:
        """The next job for this worker, or ``None``; one try (the idle loop polls again).

        First a claim (:func:`db.queries.claim_next_job`, this worker's own running job first:
        one whose claim landed with its answer lost), the lease its; else, with
        ``max_workers_per_job`` > 1, a running job it may help with
        (:func:`db.fleet.join_running_job`: at least ``min_configs_per_worker`` configs of
        budget left per worker)."""

        def claim(session: Session) -> Claim | None:
            job = queries.claim_next_job(
                session, gpu_models=gpu_models, worker_id=self.worker_id,
                lease_seconds=self.lease_seconds, scope=scope, resume_own=True,
            )  # fmt: skip
            if job is not None:
                return Claim(job.id)
            joined = fleet.join_running_job(
                session, gpu_models=gpu_models, worker_id=self.worker_id,
                max_workers_per_job=max_workers_per_job,
                min_configs_per_worker=min_configs_per_worker,
                stale_seconds=self.lease_seconds, scope=scope,
            )  # fmt: skip
            return Claim(joined, helper=True) if joined is not None else None

        return self.step("claim", claim, retried=False)

    def next_job(
        self, gpu_models: Sequence[str], *, scope: queries.JobScope | None = None
    ) -> Job | None:
        """The job :meth:`claim` would take now, not claimed (a detached copy), or ``None``
        (:func:`db.queries.next_claimable_job`); one try."""

        return self.step(
            "look at the next job",
            lambda s: queries.next_claimable_job(s, gpu_models=gpu_models, scope=scope),
            retried=False,
        )

    def live_workers(self) -> set[str]:
        """The ids of the live workers (heartbeat younger than a lease, not stopped), this one
        included."""
        live = self.step(
            "list live workers", lambda s: fleet.live_worker_ids(s, self.lease_seconds)
        )
        return live | {self.worker_id}

    def job(self, job_id: str, *, helper: bool = False) -> JobLedger:
        """This worker's ledger of ``job_id``: as its owner (it claimed the job) or as a
        ``helper``."""
        return JobLedger(self, job_id, helper=helper)


class JobLedger:
    """One worker's part in one job: its reservations, results and (owner) the job's end.
    Made by :meth:`Ledger.job`; the contracts are the module docstring's.

    It keeps the config keys this worker has reserved and not yet recorded or released
    (:meth:`holds`), so that a failed or stopped run gives them back (:meth:`release_mine`)."""

    def __init__(self, ledger: Ledger, job_id: str, *, helper: bool = False):
        self.ledger, self.job_id, self.helper = ledger, job_id, helper
        self.worker_id = ledger.worker_id
        self._held: set[str] = set()
        self._lock = threading.Lock()
        #: Held across each reservation's try and each renewal, and while :meth:`give_back`
        #: marks the job given back: those in flight commit first, none starts after.
        self._fence = threading.Lock()
        self._given_back = False

    def _step(self, what: str, work: Callable[[Session], T], *, retried: bool = True) -> T:
        return self.ledger.step(f"job {self.job_id}: {what}", work, retried=retried)

    def _owner_only(self, what: str) -> None:
        if self.helper:
            raise PermissionError(f"job {self.job_id}: only its owner may {what}")

    # --- the job ------------------------------------------------------------------------

    def load(self) -> Job | None:
        """The job's row as it is now (a detached copy), or ``None`` if it was deleted."""
        return self._step("load", lambda s: queries.get_job(s, self.job_id))

    def renew(self) -> str | None:
        """One heartbeat's check; one try (a fault is raised: the caller tries on its next
        beat). ``None`` while the job goes on (the owner's lease renewed for a lease), else why
        this worker must stop: ``"cancelled"`` (a cancel was requested, or the job was
        cancelled), ``"lost"`` (the job runs under another worker's lease, ended, or is gone;
        a helper's is the owner's to hold, so only the job's end stops a helper) or
        ``"stopped"`` (this ledger gave the job back: nothing is renewed)."""

        def beat(session: Session) -> str | None:
            if not self.helper and queries.renew_lease(
                session, self.job_id, self.worker_id, self.ledger.lease_seconds
            ):
                return None
            job = queries.get_job(session, self.job_id)
            if job is not None and job.status == "running" and not job.cancel_requested:
                return None if self.helper else "lost"  # running under another worker's lease
            if job is not None and (job.cancel_requested or job.status == "cancelled"):
                return "cancelled"
            return "lost"

        with self._fence:
            if self._given_back:
                return "stopped"
            return self._step("heartbeat", beat, retried=False)

    def adopt_version(self, old_version: str, new_version: str) -> Adoption:
        """Owner: move the job from ``old_version`` of its operator to ``new_version`` if it
        has measured nothing (:func:`db.queries.adopt_operator_version`); see :data:`Adoption`
        for the answers. ``moved`` also when an earlier try's move landed. Older means first
        submitted earlier (:func:`db.queries.first_seen`): a worker of older code than the
        job's (a fleet half-way through an upgrade) never moves a newer job back."""
        self._owner_only("move it to another operator version")

        def adopt(session: Session) -> Adoption:
            job = queries.get_job(session, self.job_id)
            if job is None:
                return "gone"
            seen_old = queries.first_seen(session, job.operator, old_version)
            seen_new = queries.first_seen(session, job.operator, new_version)
            if seen_new is not None and seen_old is not None and seen_new <= seen_old:
                return "newer"
            moved = queries.adopt_operator_version(
                session, self.job_id, worker_id=self.worker_id, old_version=old_version,
                new_version=new_version,
            )  # fmt: skip
            current = queries.get_job(session, self.job_id)
            if current is None:
                return "gone"
            if current.worker_id != self.worker_id:
                return "lost"
            return "moved" if moved or current.operator_version == new_version else "measured"

        return self._step("moving to the current operator version", adopt)

    # --- trials -------------------------------------------------------------------------

    def stored_results(self) -> dict[str, Result]:
        """The job's recorded results (config key -> result), reservations left out: what a
        resumed search knows and never measures again."""
        rows = self._step("load trials", lambda s: queries.job_trials(s, self.job_id))
        return {t.config_key: t.result() for t in rows if not t.reserved}

    def measured_trials(self) -> list[Trial]:
        """The job's recorded trial rows (reservations left out), detached, in the order they
        were measured: what the job's Optuna study view is written from."""
        rows = self._step("load trials", lambda s: queries.job_trials(s, self.job_id))
        return [t for t in rows if not t.reserved]

    def sync(self, known: Collection[str]) -> Seen:
        """The job's rows whose config key is neither in ``known`` nor held by this worker: the
        results other workers stored, and the configs they are measuring now."""
        skip = set(known) | self.held()

        def read(session: Session) -> Seen:
            seen = Seen()
            rows = session.scalars(
                select(Trial)
                .where(Trial.job_id == self.job_id)
                .execution_options(populate_existing=True)
            )
            for row in rows:
                if row.config_key in skip:
                    continue
                if not row.reserved:
                    seen.results[row.config_key] = row.result()
                elif row.reserved_by != self.worker_id:
                    seen.pending[row.config_key] = dict(row.config)
            return seen

        return self._step("sync", read)

    def reserve(self, config: Mapping[str, Any], config_key: str) -> Reservation:
        """Reserve ``config`` for this worker to measure (see :data:`Reservation`); then
        :meth:`record` its result or :meth:`release` it. ``reserved`` also when this worker
        holds the reservation already (a try whose commit landed made again). The placeholder
        takes the job's lowest free trial number. ``stopped`` at once after :meth:`give_back`.
        """

        # Fenced per try, not across the retries' waits: a renewal (the heartbeat) or a
        # give-back never waits out a reservation's backoff during a database outage.
        def fenced(session: Session) -> Reservation:
            with self._fence:
                if self._given_back:
                    return "stopped"
                answer = _reserve(session, self.job_id, config, config_key, self.worker_id)
                if answer == "reserved":
                    with self._lock:
                        self._held.add(config_key)
                return answer

        if self._given_back:  # no session opened; fenced() decides a race
            return "stopped"
        return self._step("reserve a trial", fenced)

    def await_result(
        self, config_key: str, stop: threading.Event, *, poll_seconds: float = 0.1
    ) -> Result | None:
        """Wait for another worker's measurement of ``config_key`` (after :meth:`reserve`
        answered ``taken``), releasing the reservations of dead workers as it polls: the stored
        result, or ``None`` if the config is free again (its worker died: reserve it) or
        ``stop`` was set (the caller checks which)."""

        def look(session: Session) -> Trial | None:
            row = _find(session, self.job_id, config_key)
            if row is not None and row.reserved:
                _release_stale(session, self.job_id, self.ledger.lease_seconds, keep=self.worker_id)
            return row

        while not stop.is_set():
            row = self._step("wait for a measurement", look)
            if row is None:
                return None
            if not row.reserved:
                return row.result()
            stop.wait(poll_seconds)
        return None

    def record(self, config_key: str, result: Mapping[str, Any]) -> bool:
        """Store this worker's measured ``result`` (:meth:`TrialResult.to_dict`) in its
        reservation and keep the job's best. A reservation released meanwhile (this worker
        looked dead, its heartbeat late during a long measurement) is taken again first, so
        that the measurement is stored rather than made twice: ``False`` only if that fails too
        (another worker has reserved or recorded the config since, the budget is used up or the
        job stopped), and nothing is stored then. Safe to make again: a result whose commit
        landed is found stored and answers ``True``."""
        stored = self._step(
            "store a trial",
            lambda s: _complete(s, self.job_id, config_key, self.worker_id, result),
        )
        with self._lock:
            self._held.discard(config_key)
        return stored

    def add_gpu_busy(self, seconds: float) -> None:
        """Add the seconds this worker held the GPU for the job (:mod:`tuner.gpu_gate`) to its
        record (:func:`db.queries.add_gpu_busy`). One try: made again after a commit that
        landed it would count them twice."""
        self._step(
            "store its GPU busy time",
            lambda s: queries.add_gpu_busy(s, self.job_id, seconds),
            retried=False,
        )

    def release(self, config_key: str) -> bool:
        """Give back this worker's reservation of ``config_key`` (its measurement was
        interrupted) and its unit of budget. ``False`` if there was none."""
        released = self._step(
            "release a reservation",
            lambda s: _release(s, self.job_id, [(config_key, self.worker_id)]) == 1,
        )
        with self._lock:
            self._held.discard(config_key)
        return released

    def holds(self, config_key: str) -> bool:
        """Whether this worker reserved ``config_key`` and has not recorded or released it."""
        with self._lock:
            return config_key in self._held

    def held(self) -> set[str]:
        """The config keys :meth:`holds` is true of."""
        with self._lock:
            return set(self._held)

    def release_mine(self) -> None:
        """Best effort, on a failed or stopped run: give back every config this worker holds.
        Left reserved, they would hold the owner's end of the job (it waits for them) while this
        worker, alive, keeps them from looking stale. A failure is logged."""
        for key in sorted(self.held()):
            try:
                self.release(key)
            except Exception as exc:
                log.warning(
                    "job %s: releasing the reservation of %s failed: %s",
                    self.job_id, key, retry.describe(exc),
                )  # fmt: skip

    def release_stale(self) -> int:
        """Owner: release the reservations of workers that are not live (killed mid-trial);
        how many were released."""
        self._owner_only("release other workers' reservations")
        return self._step(
            "release dead workers' reservations",
            lambda s: _release_stale(
                s, self.job_id, self.ledger.lease_seconds, keep=self.worker_id
            ),
        )

    def settle(self) -> bool:
        """Owner, its search stopped: release the reservations of dead workers; whether none
        is left (every other worker's measurement is in). The caller polls it."""
        self._owner_only("settle its reservations")

        def settle(session: Session) -> bool:
            _release_stale(session, self.job_id, self.ledger.lease_seconds, keep=self.worker_id)
            return not _reservations(session, self.job_id)

        return self._step("settle reservations", settle)

    def reservations(self) -> list[tuple[str, str | None, datetime | None]]:
        """The job's reservations now, every worker's: (config key, reserved by, reserved
        at); one try. For diagnosis and tests."""

        def read(session: Session) -> list[tuple[str, str | None, datetime | None]]:
            rows = _reservations(session, self.job_id)
            return [(t.config_key, t.reserved_by, t.reserved_at) for t in rows]

        return self._step("list reservations", read, retried=False)

    def trial_number(self, config_key: str) -> tuple[int | None, float | None]:
        """The trial number of ``config_key``'s row and the job's best time so far (for a log
        line; one try, ``(None, None)`` when the row is gone)."""

        def read(session: Session) -> tuple[int | None, float | None]:
            row = session.execute(
                select(Trial.number, Job.best_time_ms)
                .join(Job, Job.id == Trial.job_id)
                .where(Trial.job_id == self.job_id, Trial.config_key == config_key)
            ).first()
            return (row.number, row.best_time_ms) if row is not None else (None, None)

        return self._step("read a trial", read, retried=False)

    def warm_start_sources(self, *, per_source: int) -> list[queries.MeasuredSource]:
        """What other jobs and stored winners measured for this job's operator and dtype
        (:func:`db.queries.warm_start_sources`; this job's own trials left out); one try."""

        def read(session: Session) -> list[queries.MeasuredSource]:
            job = queries.get_job(session, self.job_id)
            if job is None:
                return []
            return queries.warm_start_sources(
                session, operator=job.operator, operator_version=job.operator_version,
                dtype=job.dtype, shape=list(job.shape), gpu_model=job.gpu_model,
                exclude_job_id=job.id, per_source=per_source,
            )  # fmt: skip

        return self._step("read the warm start", read, retried=False)

    # --- the job's end (owner) ----------------------------------------------------------

    def _ended_by_me(self, job: Job) -> bool:
        return job.status in ("done", "failed") and job.worker_id == self.worker_id

    def _not_mine_to_end(self, job: Job | None) -> Ending | None:
        """How ``job`` ended for this worker when it no longer runs under this worker's lease
        (``None``: it does, this worker may end it). What this worker ended already (a try
        whose commit landed, made again) answers what it stored; a job ended or claimed by
        another worker answers ``lost`` (``cancelled`` if it was cancelled)."""
        if job is None:
            return Ending("missing", 0, None, "job deleted")
        if self._ended_by_me(job):
            return Ending(job.status, job.trials_done, job.best_time_ms, job.error)
        if job.status == "cancelled" and job.worker_id == self.worker_id:
            return Ending("cancelled", job.trials_done)
        if job.status != "running" or job.worker_id != self.worker_id:
            return Ending("lost", job.trials_done)
        return None

    def finish(
        self,
        *,
        gpu_model: str,
        compute_capability: str,
        cuda_version: str,
        default_key: str | None = None,
        framework_ms: float | None = None,
        framework: str | None = None,
        compiled_ms: float | None = None,
        compiled: str | None = None,
    ) -> Ending:
        """Owner, every reservation settled: store the job's best over every worker's trials
        as the winner of its result key (with the default config's time, the trial of
        ``default_key``, and the framework's, eager and compiled) and mark the job ``done``
        (``failed`` when no config ran correctly), in one transaction. A cancel requested
        meanwhile ends it ``cancelled``. The job is ended only while it runs under this
        worker's lease (a conditional update): one claimed by another worker, or ended by one,
        is left alone (``lost``; ``cancelled`` for a cancelled one), so a done job stays done.
        A try made again after its commit landed answers what it stored."""
        self._owner_only("finish it")

        def finish(session: Session) -> Ending:
            for _ in range(_END_ATTEMPTS):
                _lock_job(session, self.job_id)  # PostgreSQL: no claim lands before the end
                current = queries.get_job(session, self.job_id)
                if (ending := self._not_mine_to_end(current)) is not None:
                    session.rollback()
                    return ending
                assert current is not None
                measured, best_time = current.trials_done, current.best_time_ms
                best_config, error = current.best_config, None
                if current.cancel_requested:
                    status = "cancelled"
                elif best_time is None or best_config is None:
                    status, error = "failed", "no config ran correctly (see the job's trials)"
                else:
                    status = "done"
                if not _end_job(
                    session, self.job_id, self.worker_id, status, error,
                    unless_cancelled=status != "cancelled",
                ):  # fmt: skip
                    session.rollback()  # changed since it was read (SQLite): read it again
                    continue
                if status != "done":
                    session.commit()
                    return Ending(status, measured, None, error)
                assert best_time is not None and best_config is not None
                default_ms = None
                if default_key is not None:
                    default_ms = queries.trial_time(session, self.job_id, default_key)
                # Commits the job's end with the winner. A writer inserting the same result
                # key first makes it roll back and try again: the end is then made again.
                queries.upsert_best_config(
                    session, operator=current.operator,
                    operator_version=current.operator_version, shape=list(current.shape),
                    dtype=current.dtype, gpu_model=gpu_model,
                    compute_capability=compute_capability, cuda_version=cuda_version,
                    config=best_config, time_ms=best_time, job_id=self.job_id,
                    default_ms=default_ms, framework_ms=framework_ms, framework=framework,
                    compiled_ms=compiled_ms, compiled=compiled,
                )  # fmt: skip
                ended = queries.get_job(session, self.job_id)
                if ended is not None and self._ended_by_me(ended):
                    return Ending("done", measured, best_time, None)
                session.rollback()
            raise RuntimeError(f"job {self.job_id}: it kept changing while it was being ended")

        return self._step("finish", finish)

    def fail(self, error: str) -> bool:
        """Owner: mark the job ``failed`` with ``error`` (its own work failed: a backend, a
        kernel, the search), only while it runs under this worker's lease. ``False``, with
        nothing written, when it does not: another worker claimed it (this one lost its
        lease), it was ended already (a done job stays done) or deleted. ``True`` too for a
        try made again after its commit landed."""
        self._owner_only("fail it")
        return self._end("failed", error)

    def cancel(self) -> bool:
        """Owner: mark the job ``cancelled`` (a cancel was requested and its search stopped),
        only while it runs under this worker's lease. ``False``, with nothing written, when it
        does not (another worker's lease, ended already, deleted): the caller lost the job.
        ``True`` too for a try made again after its commit landed."""
        self._owner_only("cancel it")
        return self._end("cancelled")

    def _end(self, status: str, error: str | None = None) -> bool:
        """End the job as ``status`` while it runs under this worker (see :meth:`fail`)."""

        def end(session: Session) -> bool:
            if _end_job(session, self.job_id, self.worker_id, status, error):
                session.commit()
                return True
            session.rollback()
            current = queries.get_job(session, self.job_id)
            return (
                current is not None
                and current.status == status
                and current.worker_id == self.worker_id
            )

        return self._step(f"mark {status}", end)

    def give_back(self, *, every_reservation: bool = False) -> None:
        """The worker stops mid-job: its reservations are released and (owner) its lease
        ended, so that the next claim resumes the job at once. One try each (a stopping worker
        does not wait on the database); a failure is logged, and the lease then runs out by
        itself.

        ``every_reservation``: release every reservation the job's rows hold in this worker's
        name, also those this ledger did not make (one whose answer a fault lost).

        Safe to call from any thread, more than once, while another thread still uses this
        ledger: from its start nothing more is reserved or renewed through it (the module
        docstring, "Given back is final"), so a worker gives back a job whose runner has not
        stopped (:class:`tuner.worker.Worker`) at once and for good."""
        with self._fence:  # a reservation or renewal in flight lands first, none after
            self._given_back = True
        self.release_mine()
        if every_reservation:
            try:
                self._step(
                    "release this worker's reservations",
                    lambda s: _release_all_of(s, self.job_id, self.worker_id),
                    retried=False,
                )
            except Exception as exc:
                log.warning(
                    "job %s: releasing this worker's reservations failed: %s",
                    self.job_id, retry.describe(exc),
                )  # fmt: skip
        if self.helper:
            return
        try:
            self._step(
                "give back the lease",
                lambda s: queries.release_lease(s, self.job_id, self.worker_id),
                retried=False,
            )
        except Exception as exc:
            log.warning(
                "job %s: could not give back its lease: %s", self.job_id, retry.describe(exc)
            )


# --- the SQL of reservations ------------------------------------------------------------------


def _reserve(
    session: Session,
    job_id: str,
    config: Mapping[str, Any],
    config_key: str,
    worker_id: str,
) -> Reservation:
    """:meth:`JobLedger.reserve` in ``session``; commits."""
    for _ in range(_NUMBER_ATTEMPTS):
        counted = session.execute(
            update(Job)
            .where(
                Job.id == job_id,
                Job.status == "running",
                Job.cancel_requested.is_(False),
                Job.trials_done < Job.budget_configs,
            )
            .values(trials_done=Job.trials_done + 1)
            .execution_options(synchronize_session=False)
        )
        if counted.rowcount == 0:
            session.rollback()
            if (row := _find(session, job_id, config_key)) is not None:
                return "reserved" if _held_by(row, worker_id) else "taken"
            job = session.get(Job, job_id, populate_existing=True)
            session.rollback()
            if job is None or job.status != "running" or job.cancel_requested:
                return "stopped"
            return "budget"
        session.add(
            Trial(
                job_id=job_id,
                number=_lowest_free_number(session, job_id),
                config=dict(config),
                config_key=config_key,
                status=RESERVED,
                times_ms=[],
                reserved_by=worker_id,
                reserved_at=utcnow(),
            )
        )
        try:
            session.commit()
        except IntegrityError:  # the count is rolled back with the row
            session.rollback()
            if (row := _find(session, job_id, config_key)) is not None:
                # Ours already: a retry of a reservation whose commit landed but whose answer
                # was lost (the connection dropped). Else recorded or reserved by another worker.
                return "reserved" if _held_by(row, worker_id) else "taken"
            # Not the config but its number: a writer outside the job's row lock
            # (queries.record_trial) stored that number meanwhile. Take the next free one.
            continue
        return "reserved"
    raise RuntimeError(f"job {job_id}: no free trial number after {_NUMBER_ATTEMPTS} attempts")


def _held_by(row: Trial, worker_id: str) -> bool:
    return row.reserved and row.reserved_by == worker_id


def _lowest_free_number(session: Session, job_id: str) -> int:
    """The lowest trial number that none of the job's rows (recorded or reserved) holds: one
    past the highest while the numbers are dense, else the first gap a released reservation
    left. Call it under the job's row lock, so that two writers never pick the same number."""
    count, highest = session.execute(
        select(func.count(Trial.number), func.coalesce(func.max(Trial.number), -1)).where(
            Trial.job_id == job_id
        )
    ).one()
    if count == highest + 1:
        return int(count)  # dense: the common case, answered from the (job_id, number) index
    taken = aliased(Trial)
    held = select(Trial.number).where(Trial.job_id == job_id)
    if session.scalar(held.where(Trial.number == 0)) is None:
        return 0
    return int(
        session.scalar(
            select(func.min(Trial.number + 1)).where(
                Trial.job_id == job_id,
                ~exists().where(taken.job_id == job_id, taken.number == Trial.number + 1),
            )
        )
    )


def _complete(
    session: Session, job_id: str, config_key: str, worker_id: str, result: Mapping[str, Any]
) -> bool:
    """:meth:`JobLedger.record` in ``session``; commits."""
    if _fill(session, job_id, config_key, worker_id, result):
        return True
    if _holds_result(_find(session, job_id, config_key), result):
        session.rollback()
        return True
    again = _reserve(session, job_id, result["config"], config_key, worker_id)
    return again == "reserved" and _fill(session, job_id, config_key, worker_id, result)


def _holds_result(row: Trial | None, result: Mapping[str, Any]) -> bool:
    """Whether a recorded (not reserved) ``row`` holds ``result``: same status, times, error."""
    if row is None or row.reserved:
        return False
    wanted = result_values(result)
    return (
        row.status == wanted["status"]
        and list(row.times_ms or []) == wanted["times_ms"]
        and row.time_ms == wanted["time_ms"]
        and (row.error or None) == (wanted["error"] or None)
    )


def _fill(
    session: Session, job_id: str, config_key: str, worker_id: str, result: Mapping[str, Any]
) -> bool:
    """Fill in this worker's reservation of ``config_key`` (``False``: there is none); commit.
    ``reserved_by`` / ``reserved_at`` stay: who measured the config, and when it started."""
    values = result_values(result)
    _lock_job(session, job_id)
    filled = session.execute(
        update(Trial)
        .where(
            Trial.job_id == job_id,
            Trial.config_key == config_key,
            Trial.status == RESERVED,
            Trial.reserved_by == worker_id,
        )
        .values(**values, created_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    time_ms = values["time_ms"]
    if filled.rowcount == 1 and values["status"] == "ok" and time_ms is not None:
        session.execute(
            update(Job)
            .where(Job.id == job_id, or_(Job.best_time_ms.is_(None), Job.best_time_ms > time_ms))
            .values(best_time_ms=time_ms, best_config=dict(result["config"]))
            .execution_options(synchronize_session=False)
        )
    session.commit()
    return filled.rowcount == 1


def _release_all_of(session: Session, job_id: str, worker_id: str) -> int:
    """:func:`_release` of every reservation of ``job_id`` held by ``worker_id``."""
    keys = session.scalars(
        select(Trial.config_key).where(
            Trial.job_id == job_id, Trial.status == RESERVED, Trial.reserved_by == worker_id
        )
    ).all()
    return _release(session, job_id, [(key, worker_id) for key in keys])


def _lock_job(session: Session, job_id: str) -> None:
    """Take the job's row lock (PostgreSQL; SQLite's one writer needs none) before a trial's:
    the lock order of the module docstring."""
    session.execute(select(Job.id).where(Job.id == job_id).with_for_update())


def _release(session: Session, job_id: str, keys: Sequence[tuple[str, str | None]]) -> int:
    """Delete the reservations ``(config key, reserved_by)`` and give their budget back;
    commits. How many there were."""
    _lock_job(session, job_id)
    released = 0
    for config_key, worker_id in keys:
        by = Trial.reserved_by.is_(None) if worker_id is None else Trial.reserved_by == worker_id
        released += queries.delete_reservations(session, job_id, Trial.config_key == config_key, by)
    session.commit()
    return released


def _end_job(
    session: Session,
    job_id: str,
    worker_id: str,
    status: str,
    error: str | None = None,
    *,
    unless_cancelled: bool = False,
) -> bool:
    """End the job (``status``, ``error``, ``finished_at``; the lease released) if it runs
    under ``worker_id``'s lease (and, ``unless_cancelled``, no cancel was requested); whether
    it did. Not committed: the caller commits it with what goes with it. The condition is in
    the update, so a claim or an end that another worker committed since the caller read the
    job is never overwritten."""
    conditions = [Job.id == job_id, Job.status == "running", Job.worker_id == worker_id]
    if unless_cancelled:
        conditions.append(Job.cancel_requested.is_(False))
    ended = session.execute(
        update(Job)
        .where(*conditions)
        .values(status=status, error=error, finished_at=utcnow(), lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    return ended.rowcount == 1


def _release_stale(session: Session, job_id: str, stale_seconds: float, *, keep: str) -> int:
    """Release the reservations of workers that are not live (and not ``keep``); commits.

    A placeholder without ``reserved_by`` was written by code older than migration 0007 (a
    fleet half-way through an upgrade): it names its worker in its ``error`` text, and it is
    stale only once that worker is not live *and* the placeholder is older than
    ``stale_seconds``. Without the age its worker, alive but unnamed here, would lose it at
    once and the config would be measured twice."""
    live = fleet.live_worker_ids(session, stale_seconds) | {keep}
    older_than = utcnow() - timedelta(seconds=stale_seconds)
    stale = [
        (t.config_key, t.reserved_by)
        for t in _reservations(session, job_id)
        if (
            t.reserved_by not in live
            if t.reserved_by is not None
            else _legacy_stale(t, live, older_than)
        )
    ]
    return _release(session, job_id, stale) if stale else 0


def _legacy_stale(row: Trial, live: Collection[str], older_than: datetime) -> bool:
    """Whether a placeholder of pre-0007 code (``reserved_by`` NULL) is stale: inserted before
    ``older_than`` and not named (in its ``error`` text) by a worker in ``live``."""
    inserted = row.reserved_at or row.created_at
    if inserted is not None and inserted > older_than:
        return False
    text = row.error or ""
    return not (text.startswith(LEGACY_RESERVED_BY) and text[len(LEGACY_RESERVED_BY) :] in live)


def _reservations(session: Session, job_id: str) -> list[Trial]:
    return list(
        session.scalars(select(Trial).where(Trial.job_id == job_id, Trial.status == RESERVED))
    )


def _find(session: Session, job_id: str, config_key: str) -> Trial | None:
    return session.scalars(
        select(Trial)
        .where(Trial.job_id == job_id, Trial.config_key == config_key)
        .execution_options(populate_existing=True)
    ).first()
