"""The nvcc processes of one process, shared by every job's compiles in order of need.

A worker holding several jobs runs one compile queue per job (:mod:`tuner.compile_queue`), and
each queue compiles its job's space ahead on every core. Taken first come, first served, the
slots went to whichever job had queued most: a job that had just started, or whose search asked
for a config nobody had compiled, waited behind other jobs' speculative compiles while the GPU
had nothing to measure (a batch of 32 keys at three jobs at once on an H100: 2,431 nvcc runs for
1,600 configs measured, docs/results_h200.md "Session 14").

Here every request for a slot carries a :class:`Want`, whose :class:`Urgency` its owner may
raise while it waits (a speculative compile the search then hints, or that a measurement then
takes). A free slot goes to the most urgent waiter, the earliest of equals. Speculative
(``BULK``) compiles never hold the last ``reserved`` slots, so that a compile someone waits for
starts at once, without waiting for a running nvcc to end.

Contract (tests/tuner/test_compile_slots.py): at most ``slots`` holders at once; at most
``slots - reserved`` of them acquired as ``BULK``; a slot freed goes to the waiter with the
lowest ``(urgency, arrival)``; raising a waiting want's urgency (:meth:`Want.raise_to`) takes
effect at once.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import threading
from collections.abc import Iterator

__all__ = [
    "Abandoned",
    "CompileSlots",
    "Urgency",
    "Want",
    "current_want",
    "nvcc_slots",
    "release_passed",
    "wanting",
]


class Urgency(enum.IntEnum):
    """How soon a compile's result is needed (lower is sooner)."""

    #: A caller blocks on it now: a measurement takes it, or compiles it in its own thread.
    NOW = 0
    #: The search expects to ask for it within its next few proposals (a hint).
    NEXT = 1
    #: Compiled ahead on speculation: the rest of a job's space.
    BULK = 2


class Want:
    """The urgency of one compile request; its owner raises it while the request waits, and the
    slots it waits on hear of it."""

    def __init__(self, urgency: Urgency = Urgency.NOW):
        self._urgency = Urgency(urgency)
        self._slots: CompileSlots | None = None  # set while waiting
        self.cancelled = False

    @property
    def urgency(self) -> Urgency:
        return self._urgency

    def raise_to(self, urgency: Urgency) -> None:
        """Make the request at least as urgent as ``urgency`` (never less urgent)."""
        if urgency >= self._urgency:
            return
        self._urgency = Urgency(urgency)
        self._wake()

    def cancel(self) -> None:
        """Stop waiting: :meth:`CompileSlots.held` raises :class:`Abandoned` (its owner shuts
        down)."""
        self.cancelled = True
        self._wake()

    def _wake(self) -> None:
        """Tell the slots this want waits on (if any) that it changed."""
        slots = self._slots  # read after the change: a waiter that started meanwhile sees it
        if slots is not None:
            with slots._cond:
                slots._cond.notify_all()


_local = threading.local()


def current_want() -> Want:
    """The want of the compile this thread runs (:func:`wanting`), else a new ``NOW`` one: a
    caller that compiles in its own thread waits for the result."""
    want = getattr(_local, "want", None)
    return want if want is not None else Want(Urgency.NOW)


@contextlib.contextmanager
def wanting(want: Want) -> Iterator[Want]:
    """Compiles run by this thread inside the block ask for slots with ``want``."""
    previous = getattr(_local, "want", None)
    _local.want = want
    try:
        yield want
    finally:
        _local.want = previous


class Abandoned(Exception):
    """A want was cancelled while it waited for a slot."""


class CompileSlots:
    """``slots`` places for an nvcc process, handed out by urgency.

    Args:
        slots: nvcc processes at most at once (default: one per core).
        reserved: slots a ``BULK`` request never takes (default: one in eight, at least one
            where there are two or more slots).
    """

    def __init__(self, slots: int | None = None, reserved: int | None = None):
        self.slots = max(1, slots if slots is not None else os.cpu_count() or 1)
        if reserved is None:
            reserved = max(1, self.slots // 8) if self.slots > 1 else 0
        self.reserved = min(max(0, reserved), self.slots - 1)
        self._cond = threading.Condition()
        self._held = 0
        self._held_bulk = 0
        self._waiting: dict[int, Want] = {}
        self._arrivals = itertools.count()

    @contextlib.contextmanager
    def held(self, want: Want | None = None) -> Iterator[_Hold]:
        """Hold a slot for the block, waiting for one by ``want``'s urgency (default: this
        thread's :func:`current_want`).

        Raises:
            Abandoned: ``want`` was cancelled before a slot was free for it.
        """
        want = want if want is not None else current_want()
        passed = self._passed()
        if passed is not None:  # released by the block that passed it
            yield passed
            return
        with self._cond:
            ticket = next(self._arrivals)
            self._waiting[ticket] = want
            want._slots = self
            try:
                while not self._may_take(ticket, want):
                    if want.cancelled:
                        raise Abandoned
                    self._cond.wait()
            finally:
                del self._waiting[ticket]
                want._slots = None
            bulk = want.urgency is Urgency.BULK
            self._held += 1
            self._held_bulk += bulk
            # The next waiter may be able to take a slot too (one freed for several, or a
            # bulk waiter passed over for the reserve).
            self._cond.notify_all()
        hold = _Hold(self, bulk)
        try:
            yield hold
        finally:
            hold.release()

    @contextlib.contextmanager
    def passing(self, hold: _Hold) -> Iterator[None]:
        """Inside ``hold``'s :meth:`held` block: every :meth:`held` of this thread within this
        block uses ``hold``'s slot, while it is held, instead of waiting for another (a compile
        queue's thread hands the slot it picked its config with to that config's nvcc runs, so
        that no other thread picks a config with the same free slot meanwhile)."""
        previous = getattr(_local, "passed", None)
        _local.passed = hold
        try:
            yield
        finally:
            _local.passed = previous

    def _passed(self) -> _Hold | None:
        """This thread's slot handed on by :meth:`passing`, while not given back: every
        :meth:`held` of the thread inside that block uses it (they run one after another; a
        compile that runs nvcc twice must not wait for a second slot while holding one)."""
        hold = getattr(_local, "passed", None)
        if hold is None or hold.slots is not self or hold.released:
            return None
        return hold

    def counts(self) -> tuple[int, int, int]:
        """(holders, of them acquired as bulk, waiters): for tests and diagnostics."""
        with self._cond:
            return self._held, self._held_bulk, len(self._waiting)

    def _may_take(self, ticket: int, want: Want) -> bool:
        """Called with the lock held."""
        if self._held >= self.slots:
            return False
        if want.urgency is Urgency.BULK and self._held_bulk >= self.slots - self.reserved:
            return False
        rank = (want.urgency, ticket)
        # The most urgent waiter goes first; a bulk one held back by the reserve does not
        # stand in the way of an urgent one behind it (it ranks after every urgent one anyway).
        return all((other.urgency, t) >= rank for t, other in self._waiting.items() if t != ticket)


class _Hold:
    """One slot held; :meth:`release` gives it back (once, however often it is called)."""

    def __init__(self, slots: CompileSlots, bulk: bool):
        self.slots = slots
        self.bulk = bulk
        self.released = False

    def release(self) -> None:
        with self.slots._cond:
            if self.released:
                return
            self.released = True
            self.slots._held -= 1
            self.slots._held_bulk -= self.bulk
            self.slots._cond.notify_all()


def release_passed() -> None:
    """Give back a slot this thread was handed (:meth:`CompileSlots.passing`) and has not used:
    called before it waits on something other than a slot (another caller's nvcc run of the
    same source), which may itself be waiting for that slot."""
    hold = getattr(_local, "passed", None)
    if hold is not None:
        _local.passed = None
        hold.release()


_PROCESS_SLOTS: CompileSlots | None = None
_PROCESS_SLOTS_LOCK = threading.Lock()


def nvcc_slots() -> CompileSlots:
    """The slots of this process's nvcc runs (one per core), shared by every compile queue."""
    global _PROCESS_SLOTS
    with _PROCESS_SLOTS_LOCK:
        if _PROCESS_SLOTS is None:
            _PROCESS_SLOTS = CompileSlots()
        return _PROCESS_SLOTS
