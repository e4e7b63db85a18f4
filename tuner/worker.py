"""The worker: claims queued tuning jobs for the GPU model it owns and runs them.

It claims only jobs its backends can answer (the factory's ``scope``, :class:`db.queries.JobScope`:
a GPU worker's every registered operator, a replay worker's the problems of its recordings);
the others stay queued for workers that can. Each claimed job is run by a
:class:`tuner.job_runner.JobRunner` (the job's life, heartbeats, reservations, resumption); a
worker holding several jobs at once hands them to runner threads and gives every held job back
when it is interrupted. Claims, presence rows and give-backs go through the ledger
(:mod:`db.ledger`); backends come from a factory (:mod:`tuner.factories`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kato.db import queries, retry
from kato.db.ledger import Claim, JobLedger
from kato.db.models import Job
from kato.kernels import get_operator
from kato.tuner.admission import MemoryAdmission
from kato.tuner.factories import BackendFactory
from kato.tuner.gpu_gate import GpuGate
from kato.tuner.job_runner import (
    DEFAULT_LOOKAHEAD,
    JobOutcome,
    JobRunner,
    default_worker_id,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

#: Longest wait between two polls of an idle worker whose database keeps failing (the waits
#: double from ``poll_seconds`` up to this).
IDLE_BACKOFF_MAX_SECONDS = 15.0


@dataclass(frozen=True)
class _HeldJob:
    """A job a worker holds: its group (see :meth:`Worker._claim_held`), its part in it, and
    the ledger of its claim (its runner's, and the one it is given back through)."""

    operator: str
    dtype: str
    gpu_model: str
    ledger: JobLedger = field(compare=False)
    helper: bool = False


@dataclass(frozen=True)
class _RunEnded:
    """What a runner reports when the job it was handed ends (:meth:`Worker._run_ended`): the
    runner's slot, and the outcome, or the interrupt the run raised (``KeyboardInterrupt``, a
    library's error wrapping one, or a ``BaseException`` of the backend's), or neither (the
    run raised an error: a bug, logged)."""

    slot: int
    outcome: JobOutcome | None = None
    interrupt: BaseException | None = None


def _log_outcome(job_id: str, outcome: JobOutcome) -> None:
    """The log line of a job's end, whichever runner ran it."""
    best = f"{outcome.best_time_ms:.4f} ms" if outcome.best_time_ms is not None else "-"
    log.info(
        "job %s %s: %d config(s) measured, best %s%s",
        job_id, outcome.status, outcome.measured, best,
        f" ({outcome.error})" if outcome.error else "",
    )  # fmt: skip


class Worker:
    """Claims jobs for ``gpu_models`` and runs up to ``jobs_at_once`` of them at a time (by
    default one) until stopped.

    It claims (and helps with) only jobs in ``scope`` (:class:`db.queries.JobScope`; default:
    the backend factory's, :class:`tuner.backends.abilities.Scoped`, read at every claim, else
    every job of ``gpu_models``): the others stay queued for workers that can answer them.

    Its ``kato_workers`` row is refreshed on every idle poll and every heartbeat of a running
    job, and marked ``stopped`` when :meth:`run_forever` returns (nothing of this worker writes
    it after that). With nothing to claim and ``max_workers_per_job`` > 1 it helps with a
    running job of its GPU model that has at least ``min_configs_per_worker`` configs of budget
    left per worker.

    Database faults never stop it: a running job retries them (:class:`JobRunner`), the idle
    loop logs a fault once (and its recovery) and polls less often while it lasts (waits
    doubling from ``poll_seconds`` up to :data:`IDLE_BACKOFF_MAX_SECONDS`). A job claimed is
    given back at once when its load then fails (in the poll, or at its run's start), so the
    next claim, this worker's or another's, takes it without waiting out its lease. :meth:`stop`
    (:func:`stop_on_signals`: SIGTERM, SIGINT) is honoured by every loop.

    One loop (the thread of :meth:`run_forever`) polls, claims and hands each job to a free
    runner (:class:`JobRunner`), whatever ``jobs_at_once``: one presence row refreshed per
    poll, one log line per poll fault, one backoff. With 1 (:meth:`run_once` is one of its
    polls) the job runs in the loop's thread; with more, each runner has a thread of its own
    that only runs the jobs it is handed, and a runner whose job ends wakes the loop at once
    to claim the next.

    ``jobs_at_once`` > 1: it holds up to that many jobs at once on its one GPU, their GPU work
    taking turns at one :class:`tuner.gpu_gate.GpuGate` (one measurement at a time; a
    config's compile awaited before its turn): while one job waits on nvcc or on its search,
    another measures. Each job's trials, budget and winner are those it would have run alone:
    its proposer, seed and budget are its own, nothing of another job enters its search, and
    the worker never holds two jobs of one (operator, dtype), whatever their GPU models
    (:class:`db.queries.JobScope`'s exclusions; a warm start reads every model's results), so
    a group's jobs run one after the other in queue order and each warm start reads what it
    would in a serial run. Only the order of GPU work changes. It takes another job only if
    the jobs fit the GPU's memory together (:mod:`tuner.admission`); one that does not is left
    queued, and nothing else is taken, until enough of the held jobs have ended.

    Stopping while holding several: :meth:`stop` (a first signal) interrupts every runner at
    once (:meth:`JobRunner.interrupt`: its search stops before its next measurement, an
    interruptible measurement ends, and the runner gives its job back), and :meth:`run_forever`
    returns once each has. Interrupted (a second signal, the first's grace over:
    :func:`stop_on_signals`), or a runner's run raising an interrupt of its own, it gives back
    every job it holds at once from the loop's thread (:meth:`_give_back_held`): each job's
    reservations released and its lease ended through the ledger of its claim, which then
    reserves and renews nothing more (:meth:`db.ledger.JobLedger.give_back`), so that another
    worker resumes it from its stored trials now, also when its runner is stuck in a
    measurement or a compile wait nothing can stop. Running one job in the loop's thread, a
    stop reaches it through the runner's ``shutdown`` event (the same: its search stops before
    its next measurement, an isolated measurement is interrupted by its heartbeat), and an
    interrupt lands in its run, which gives the job back before the loop returns.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        db_url: str,
        gpu_models: list[str],
        backend_factory: BackendFactory,
        *,
        worker_id: str | None = None,
        lease_seconds: float = 60.0,
        poll_seconds: float = 1.0,
        backend_name: str = "pycuda",
        devices: Sequence[dict[str, Any]] = (),
        max_workers_per_job: int = 1,
        min_configs_per_worker: int = 8,
        lookahead: int = DEFAULT_LOOKAHEAD,
        scope: queries.JobScope | None = None,
        retry_policy: retry.RetryPolicy | None = None,
        jobs_at_once: int = 1,
    ):
        if jobs_at_once < 1:
            raise ValueError("jobs_at_once must be at least 1")
        self.jobs_at_once = jobs_at_once
        self.gpu_models = gpu_models
        self.backend_factory = backend_factory
        self._scope = scope
        self.worker_id = worker_id or default_worker_id()
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.backend_name = backend_name
        self.devices = list(devices)
        self.max_workers_per_job = max_workers_per_job
        self.min_configs_per_worker = min_configs_per_worker
        self._stop = threading.Event()
        #: Set by :meth:`stop` and by a runner whose job ended: the claiming loop looks again.
        self._wake = threading.Event()
        #: Held while a running job's heartbeat refreshes the presence row, and while the row
        #: is marked stopped: no heartbeat in flight lands after that mark.
        self._presence = threading.Lock()
        gate = GpuGate() if jobs_at_once > 1 else None
        #: The memory ledger of the jobs held at once (:mod:`tuner.admission`).
        self.admission = MemoryAdmission() if jobs_at_once > 1 else None
        #: The job a claim left queued for want of memory (logged once per job).
        self._waiting: str | None = None

        def runner() -> JobRunner:
            return JobRunner(
                sessions,
                db_url,
                backend_factory,
                worker_id=self.worker_id,
                lease_seconds=lease_seconds,
                on_heartbeat=self._job_heartbeat,
                lookahead=lookahead,
                retry_policy=retry_policy,
                shutdown=self._stop,
                gpu_gate=gate,
                admission=self.admission,
            )

        self.runner = runner()
        #: One runner per job held at once (the first is :attr:`runner`).
        self.runners = [self.runner] + [runner() for _ in range(jobs_at_once - 1)]
        self.ledger = self.runner.ledger
        #: The jobs held now: id -> what the worker knows of it, under ``_held_lock``.
        self._held: dict[str, _HeldJob] = {}
        self._held_lock = threading.Lock()

    def stop(self) -> None:
        """Stop: the idle loop exits, a running job stops before its next measurement (an
        isolated one is interrupted) and gives its reservations and lease back. Safe to call
        from another thread (:func:`stop_on_signals` calls it from one of its own: it takes
        locks, which a signal handler must not)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def scope(self) -> queries.JobScope | None:
        """The jobs this worker claims (see the class docstring)."""
        if self._scope is not None:
            return self._scope
        return self.runner.factory_abilities.scope()

    def _job_heartbeat(self, status: str, job_id: str | None) -> None:
        """A running job's heartbeat: its row says busy with that job (never once the worker
        stops: the row then says stopped)."""
        with self._presence:
            if not self._stop.is_set():
                self.heartbeat(status, job_id)

    def _mark_stopped(self) -> None:
        """The presence row's last word, after every heartbeat in flight (one try: a stopping
        worker does not wait)."""
        with self._presence:
            try:
                self.heartbeat("stopped")
            except Exception as exc:
                log.warning(
                    "worker %s: could not mark itself stopped: %s",
                    self.worker_id, retry.describe(exc),
                )  # fmt: skip

    def held_jobs(self) -> list[str]:
        """The jobs this worker runs now (several with ``jobs_at_once`` > 1)."""
        with self._held_lock:
            return list(self._held)

    def heartbeat(self, status: str = "idle", job_id: str | None = None) -> None:
        """Upsert this worker's row: GPU models, devices, status, current job, now."""
        self.ledger.announce(
            status=status,
            job_id=job_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_models=self.gpu_models,
            devices=self.devices,
            backend=self.backend_name,
        )

    def run_once(self) -> JobOutcome | None:
        """One poll of :meth:`run_forever`'s loop, its job run in this thread: announce,
        claim a job (or help with one, :meth:`_claim_held`) and run it to its end; None when
        there is nothing to do. A fault of the poll is raised (a job it had claimed already
        given back)."""
        self._announce_held()
        claim = self._claim_held()
        if claim is None:
            return None
        return self._run_claimed(self.runner, claim)

    def run_forever(self, *, max_jobs: int | None = None) -> int:
        """Run jobs until :meth:`stop`, an interrupt (``KeyboardInterrupt``, also one a
        library wrapped in its own error) or ``max_jobs`` ended; returns the number ended.

        One loop, this thread's, polls, claims and hands each job to a free runner, whatever
        ``jobs_at_once``: with 1 the job runs in this thread (where a signal's
        ``KeyboardInterrupt`` lands, in the job's measurement if need be), with more each runner
        has a thread of its own and a runner whose job ends wakes the loop at once.

        Errors of a poll (a database fault, or a bug) never end it: the first is logged (a
        transient database fault in one line, anything else with its traceback), again only
        when it changes, a ``recovered`` line when polls succeed again, and the polls back off
        meanwhile (see the class docstring), as they do after a job's run that ends
        ``interrupted`` (its database failed for too long) or raised (a bug, logged with the
        job). A stop with jobs running interrupts their runners and waits for each to give its
        job back; an interrupt gives back every held job at once (:meth:`_give_back_held`).
        A ``BaseException`` a job raised that is not an interrupt is raised here once every
        held job is given back.

        While it runs, a backend factory that keeps spare measuring children
        (:class:`tuner.backends.abilities.KeepsSpares`) has one warm for the next job; they
        are killed when it returns (a job's own child is its backend's to close)."""
        inline = self.jobs_at_once == 1
        spares = self.runner.factory_abilities.spares
        if spares is not None:  # the next job's measuring child, warm (KeepsSpares)
            spares.start_spares()
        inboxes: list[queue.SimpleQueue[Claim | None]] = [
            queue.SimpleQueue() for _ in (() if inline else self.runners)
        ]
        ended: queue.SimpleQueue[_RunEnded] = queue.SimpleQueue()
        threads = [
            threading.Thread(
                target=self._run_slot,
                args=(i, self.runners[i], inbox, ended),
                name=f"kato-job-{i}",
                daemon=True,
            )  # fmt: skip
            for i, inbox in enumerate(inboxes)
        ]
        for thread in threads:
            thread.start()
        free = list(range(len(self.runners)))
        running = done = 0
        fatal: BaseException | None = None
        interrupted = False
        faults = retry.FaultLog(log, f"worker {self.worker_id}: poll")
        first = self.poll_seconds if self.poll_seconds > 0 else 0.05
        backoff = retry.Backoff(first, max(first, IDLE_BACKOFF_MAX_SECONDS))
        try:
            while True:
                self._wake.clear()  # before looking: a wake-up from now on is not lost
                pause = False
                while not ended.empty():
                    report = ended.get()
                    free.append(report.slot)
                    running -= 1
                    if report.interrupt is not None:
                        if isinstance(report.interrupt, Exception | KeyboardInterrupt):
                            interrupted = True  # a KeyboardInterrupt, or one a library wrapped
                        else:
                            fatal = fatal or report.interrupt
                    elif report.outcome is None or report.outcome.status == "interrupted":
                        pause = True  # a run that raised, or whose database failed too long
                    elif report.outcome.status not in ("helped", "stopped"):
                        done += 1
                if fatal is not None or interrupted or self._stop.is_set():
                    break
                if max_jobs is not None and done >= max_jobs:
                    break
                if not free or (max_jobs is not None and done + running >= max_jobs):
                    self._wake.wait()  # a runner's end (or a stop) sets it
                    continue
                if pause:
                    self._stop.wait(backoff.next())
                    continue
                try:
                    self._announce_held()
                    claim = self._claim_held()
                except Exception as exc:
                    if retry.is_interrupt(exc) or self._stop.is_set():
                        interrupted = retry.is_interrupt(exc)
                        break  # a signal that landed inside a database call
                    wait = backoff.next()
                    faults.failed(exc, retry_in=wait)
                    self._stop.wait(wait)
                    continue
                faults.ok()
                backoff.reset()
                if claim is None:
                    self._wake.wait(self.poll_seconds)
                    continue
                running += 1
                slot = free.pop()
                if inline:
                    ended.put(self._run_ended(slot, self.runners[slot], claim))
                else:
                    inboxes[slot].put(claim)
        except KeyboardInterrupt:
            interrupted = True
        try:
            for inbox in inboxes:
                inbox.put(None)  # a runner that is free (or frees up) ends: none is waited for
            if fatal is not None or interrupted:
                self._give_back_held(threads)
            elif running:
                self._stop_runners(threads)
        except KeyboardInterrupt:  # the grace of stop_on_signals is over
            self._give_back_held(threads)
        finally:
            if spares is not None:  # no spare outlives the loop
                spares.close_spares()
            self._mark_stopped()
        if fatal is not None:
            raise fatal
        return done

    def _stop_runners(self, threads: Sequence[threading.Thread]) -> None:
        """A stop with jobs running: interrupt every runner now (:meth:`JobRunner.interrupt`),
        each giving its job back, and return once every runner thread has ended its run.
        A ``KeyboardInterrupt`` (the grace of :func:`stop_on_signals`) ends the wait."""
        self._stop.set()
        for runner in self.runners:
            runner.interrupt()
        while self.held_jobs():
            # Timed: a KeyboardInterrupt from _thread.interrupt_main is raised only once this
            # thread runs Python code again; a runner's end wakes it at once.
            self._wake.wait(0.1)
            self._wake.clear()

    def _give_back_held(self, threads: Sequence[threading.Thread]) -> None:
        """Stop at once: every runner is interrupted (:meth:`JobRunner.interrupt`) and every
        job held is given back from this thread through the ledger of its claim, also the job
        of a runner blocked in a measurement nothing can stop, or in a database call: its
        reservations in this worker's name released and its lease ended
        (:meth:`db.ledger.JobLedger.give_back`), after which that ledger reserves and renews
        nothing more, so the give-back holds whatever the runner does later (a result it
        measured is still stored). Then the runners' threads have up to
        :data:`STOP_GRACE_SECONDS` in all to end (their backends closed); one still blocked
        is left behind (a daemon thread)."""
        self._stop.set()
        for runner in self.runners:
            runner.interrupt()
        with self._held_lock:
            held = list(self._held.items())
        for job_id, job in held:
            log.info("worker %s: interrupted; job %s given back", self.worker_id, job_id)
            job.ledger.give_back(every_reservation=True)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _announce_held(self) -> None:
        """The claiming loop's presence heartbeat: busy with a held job, or idle."""
        held = self.held_jobs()
        self.heartbeat("busy" if held else "idle", held[0] if held else None)

    def _job_device_bytes(self, job: Job) -> int:
        """The device memory ``job`` will take here (:mod:`tuner.admission`): the backend
        factory's estimate, else the operator's buffers
        (:meth:`kernels.spec.OperatorSpec.buffer_bytes`), else 0 (an operator unknown here)."""
        estimate = self.runner.factory_abilities.device_bytes
        try:
            if estimate is not None:
                return int(estimate(job))
            return int(get_operator(job.operator).buffer_bytes(tuple(job.shape), job.dtype))
        except Exception:
            log.warning("job %s: its device memory cannot be estimated", job.id, exc_info=True)
            return 0

    def _admits(self, job: Job) -> tuple[bool, int]:
        """(whether ``job`` fits beside the jobs held, its estimated device bytes); logs a
        job left queued for want of memory, once. Without admission (a backend that does not
        report its memory: replay, CPU stand-ins) nothing is estimated."""
        if self.admission is None:
            return True, 0
        need = self._job_device_bytes(job)
        if self.admission.fits(need):
            return True, need
        if self._waiting != job.id:
            self._waiting = job.id
            log.info(
                "worker %s: job %s (%s %s %s, about %.2f GB of device memory) waits until "
                "the %d job(s) held here (%.2f GB) leave it room",
                self.worker_id, job.id, job.operator, job.shape_key, job.dtype, need / 1e9,
                len(self.held_jobs()), self.admission.held_bytes() / 1e9,
            )  # fmt: skip
        return False, need

    def _claim_held(self) -> Claim | None:
        """Claim a job none of whose group this worker holds and that fits the GPU's memory
        beside the jobs held (:mod:`tuner.admission`), and hold it. Called from the claiming
        loop only (jobs are added to the held ones there alone; runners only remove theirs,
        which at worst leaves out a group that just ended until the next poll). The next job
        is looked at before it is claimed: one that does not fit stays queued, untouched, and
        nothing is claimed. A fault after the claim (the job's load) gives the job back
        (:meth:`db.ledger.JobLedger.give_back`: the next claim, this worker's or another's,
        takes it at once) and is raised."""
        with self._held_lock:
            held = list(self._held.items())
        scope = self.scope() or queries.JobScope()
        # A warm start reads its operator and dtype on every GPU model: a held job's
        # (operator, dtype) is left out for each model this worker serves.
        groups = frozenset(
            (job.operator, job.dtype, model)
            for _, job in held
            for model in {job.gpu_model, *self.gpu_models}
        )
        scope = dataclasses.replace(
            scope,
            exclude_job_ids=scope.exclude_job_ids | frozenset(job_id for job_id, _ in held),
            exclude_groups=scope.exclude_groups | groups,
        )
        if held and self.admission is not None:
            upcoming = self.ledger.next_job(self.gpu_models, scope=scope)
            if upcoming is not None:
                if not self._admits(upcoming)[0]:
                    return None
                # That job only: an older one may have come back since (its lease ended).
                scope = dataclasses.replace(scope, job_ids=frozenset({upcoming.id}))
        claim = self.ledger.claim(
            self.gpu_models,
            scope=scope,
            max_workers_per_job=self.max_workers_per_job,
            min_configs_per_worker=self.min_configs_per_worker,
        )
        if claim is None:
            return None
        ledger = self.ledger.job(claim.job_id, helper=claim.helper)
        try:
            job = ledger.load()
        except BaseException:
            # Claimed, not held: unless given back now, it would wait out its lease.
            log.info("worker %s: job %s given back: its load failed", self.worker_id, claim.job_id)
            ledger.give_back()
            raise
        if job is None:
            return None
        admitted, need = self._admits(job)  # a job helped, or this worker's own resumed
        if not admitted:
            ledger.give_back()
            return None
        if self._waiting == job.id:
            self._waiting = None
        with self._held_lock:
            self._held[claim.job_id] = _HeldJob(
                job.operator, job.dtype, job.gpu_model, ledger, helper=claim.helper
            )
            if self.admission is not None:
                self.admission.hold(claim.job_id, need)
        return claim

    def _run_slot(
        self,
        slot: int,
        runner: JobRunner,
        inbox: queue.SimpleQueue[Claim | None],
        ended: queue.SimpleQueue[_RunEnded],
    ) -> None:
        """One runner thread: run each job handed to it (``None``: end), report its end
        (:meth:`_run_ended`) and wake the claiming loop."""
        while (claim := inbox.get()) is not None:
            report = _RunEnded(slot)
            try:
                report = self._run_ended(slot, runner, claim)
            finally:
                ended.put(report)
                self._wake.set()

    def _run_ended(self, slot: int, runner: JobRunner, claim: Claim) -> _RunEnded:
        """Run a claimed job on ``runner`` (:meth:`_run_claimed`) and say how it ended, in the
        loop's thread or a runner's. Never raises: an interrupt (any ``BaseException``, or a
        library's error wrapping one) is reported, and the loop stops the worker; an error
        (a bug: :meth:`JobRunner.run` fails a job rather than raise) is logged and reported
        without an outcome, and the loop backs off."""
        try:
            return _RunEnded(slot, outcome=self._run_claimed(runner, claim))
        except Exception as exc:
            if retry.is_interrupt(exc):
                return _RunEnded(slot, interrupt=exc)
            log.exception("job %s: its run raised", claim.job_id)
            return _RunEnded(slot)
        except BaseException as exc:
            return _RunEnded(slot, interrupt=exc)

    def _run_claimed(self, runner: JobRunner, claim: Claim) -> JobOutcome:
        """Run a claimed (and held) job to its end, then let go of it. The presence row says
        busy with it from the start (one try: the job's heartbeats say it again)."""
        job_id, helper = claim.job_id, claim.helper
        with self._held_lock:
            ledger = self._held[job_id].ledger
        try:
            with contextlib.suppress(Exception):
                self._job_heartbeat("busy", job_id)
            log.info("worker %s %s job %s", self.worker_id, "helps" if helper else "runs", job_id)
            outcome = runner.run(job_id, helper=helper, ledger=ledger)
        finally:
            with self._held_lock:
                self._held.pop(job_id, None)
                if self.admission is not None:
                    self.admission.release(job_id)
        _log_outcome(job_id, outcome)
        return outcome


#: Seconds an interrupted worker holding several jobs waits for its runner threads to end
#: (their backends closed) once it has given their jobs back (:meth:`Worker._give_back_held`),
#: and the default grace of a signalled worker before it is interrupted
#: (:func:`stop_on_signals`).
STOP_GRACE_SECONDS = 3.0


@contextlib.contextmanager
def stop_on_signals(
    worker: Worker,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    *,
    grace_seconds: float = STOP_GRACE_SECONDS,
) -> Iterator[None]:
    """While in the block, ``signals`` stop ``worker`` (enter it in the main thread, around
    :meth:`Worker.run_forever`); the previous handlers are put back after. Entered in another
    thread it raises ``ValueError`` (:func:`signal.signal`'s), leaving nothing behind.

    The first signal only asks for the worker's stop (:meth:`Worker.stop`): every loop ends at
    its next check, a running job after the measurement in flight (an isolated one is
    interrupted), giving back its reservations and lease. Nothing is interrupted half-way: an
    interrupt raised at a random point lands inside a database call, where a library may turn
    it into an error of its own (psycopg does, in SQLAlchemy's connection check) or leave a
    transaction open in a cleanup it cut short. Only if the worker is still running
    ``grace_seconds`` later (a call that blocks), or on a second signal, is ``KeyboardInterrupt``
    raised in the main thread; a wrapped one is recognised (:func:`db.retry.is_interrupt`).

    The handler takes no lock: it writes a byte to a pipe, and a thread of this block calls
    :meth:`Worker.stop` and starts the grace. A lock taken in a handler (an ``Event``'s) may be
    held by the very code the signal interrupted in the main thread, and never be released."""
    import _thread

    timers: list[threading.Timer] = []
    signalled = [False]  # written by the handler only (the main thread): no lock needed
    read_end, write_end = os.pipe()

    def handler(signum: int, frame: Any) -> None:
        if signalled[0] or worker.stopping:
            raise KeyboardInterrupt  # asked again, or the grace is over: now
        signalled[0] = True
        os.write(write_end, b"s")

    def stopper() -> None:
        if os.read(read_end, 1):  # empty: the block ended without a signal
            worker.stop()
            timer = threading.Timer(grace_seconds, _thread.interrupt_main)
            timer.daemon = True
            timers.append(timer)
            timer.start()

    thread = threading.Thread(target=stopper, name="kato-stop-on-signal", daemon=True)
    thread.start()
    previous: dict[int, Any] = {}
    try:
        # Inside the try: a handler refused (not the main thread) leaves no thread or pipe.
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_end)
        thread.join()
        os.close(read_end)
        for timer in timers:
            timer.cancel()
