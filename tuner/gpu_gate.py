"""One GPU, one measurement at a time: the gate the jobs a worker holds at once take turns at.

A worker may hold several jobs at once (:class:`tuner.worker.Worker`, ``jobs_at_once``): while
one job waits on nvcc or on its search, another measures. Every piece of GPU work of a job
(a measurement: verify and timed launches; its device set-up; the end of its backend's hold
on the device; the framework baseline) runs while holding the gate, so no two jobs' GPU work
ever overlaps and a timing sees the GPU alone, as it would with one job.

Turns are first come, first served (a ticket queue, not a plain lock: a job measuring in a
tight loop would otherwise take the lock again before a waiting job's thread wakes up).

The gate also keeps what each holder held it for, in seconds (:meth:`GpuGate.busy_s`): the
GPU's busy time per job, from which the worker stores its busy fraction. Holds that are not
counted (a backend's release of the device: no measurement, but no other job's either) are
kept apart (:meth:`GpuGate.uncounted`), so a benchmark can tell the GPU they keep from the rest
of its idle time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator

#: Holds kept for :meth:`GpuGate.timeline` (the most recent; a benchmark reads them).
TIMELINE_HOLDS = 200_000


class GpuGate:
    """A fair (FIFO) lock over one GPU, with the seconds each holder held it.

    ``hold(holder)`` is not re-entrant: a holder takes it for one piece of work at a time."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._busy: dict[str, float] = defaultdict(float)
        self._timeline: deque[tuple[float, float, str]] = deque(maxlen=TIMELINE_HOLDS)
        self._uncounted: deque[tuple[float, float, str]] = deque(maxlen=TIMELINE_HOLDS)
        self.waits = 0  # turns that had to wait for another holder (tests look at it)

    @contextlib.contextmanager
    def hold(self, holder: str, *, counted: bool = True) -> Iterator[None]:
        """Hold the GPU for one piece of work (blocks until every earlier caller is done);
        the seconds held are added to ``holder``'s busy time unless ``counted`` is False."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            if ticket != self._serving:
                self.waits += 1
            while ticket != self._serving:
                self._cond.wait()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            with self._cond:
                if counted:
                    self._busy[holder] += t1 - t0
                    self._timeline.append((t0, t1, holder))
                else:
                    self._uncounted.append((t0, t1, holder))
                self._serving += 1
                self._cond.notify_all()

    def busy_s(self, holder: str) -> float:
        """Seconds ``holder`` has held the gate (counted holds)."""
        with self._cond:
            return self._busy.get(holder, 0.0)

    def timeline(self) -> list[tuple[float, float, str]]:
        """The counted holds, oldest first: (start, end, holder), ``time.perf_counter`` seconds."""
        with self._cond:
            return list(self._timeline)

    def uncounted(self) -> list[tuple[float, float, str]]:
        """The holds that were not counted, oldest first, as :meth:`timeline` gives the rest."""
        with self._cond:
            return list(self._uncounted)

    def forget(self, holder: str) -> float:
        """Drop ``holder``'s count (its job ended) and return it."""
        with self._cond:
            return self._busy.pop(holder, 0.0)
