"""Which jobs a worker holding several at once on one GPU may add: admission by device memory.

Each job a worker holds keeps its device buffers (every input copy it times over, a pristine
set, the references) and, measuring in a child, that child's CUDA context, for as long as it
runs. Jobs held together must fit the GPU together, or the last one's set-up fails. So before
the worker takes another job while it holds some, it estimates the job's need
(:class:`tuner.backends.abilities.EstimatesMemory`) and admits it only if

    sum of the held jobs' needs + the new job's need + margin <= the memory free for its jobs

where the memory free for its jobs is read from the device by each job's backend right before
the job's device set-up (:class:`tuner.backends.abilities.ReportsMemory`, in the job's GPU turn,
when every earlier held job's buffers are on the device), plus the needs of the jobs then set
up whose backends have not closed since: what the GPU leaves to this worker's jobs, other
processes' use counted out. A job stays held from its backend's close (its memory free on the
device, the next reading sees it) until its run ends: its framework baseline runs between. The
margin (:func:`margin_bytes`) covers what the estimate leaves out: loaded modules, local memory
the driver reserves for a kernel that spills, a context larger than assumed.

A job that does not fit is not taken (it stays queued: another worker may take it) and the
worker takes nothing else meanwhile, so the job comes next, first in queue order, once enough
of the held jobs have ended; it never fails for it. A job held alone is always admitted (as a
worker holding one job at a time does). While a held job has not set up yet, no job is
admitted: the reading it takes is what the next admission needs. A worker whose backends
cannot report memory (a replay: no device) admits every job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

#: The margin is this share of the device's total memory, and at least :data:`MIN_MARGIN_BYTES`.
MARGIN_FRACTION = 0.05
MIN_MARGIN_BYTES = 1 << 30


def margin_bytes(total_bytes: int) -> int:
    """The safety margin of an admission on a device of ``total_bytes``."""
    return max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * total_bytes))


@dataclass
class _Held:
    need: int
    set_up: bool = False
    closed: bool = False


class MemoryAdmission:
    """The memory ledger of one worker's held jobs (see the module docstring). Thread-safe:
    the worker's claiming thread asks :meth:`fits` and calls :meth:`hold`; each job's runner
    thread calls :meth:`set_up` and :meth:`release`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        #: Bytes the GPU leaves to this worker's jobs (the last reading), None: never read.
        self._available: int | None = None
        self._total: int | None = None

    def fits(self, need: int) -> bool:
        """Whether a job needing ``need`` bytes may be held now, with the jobs held."""
        with self._lock:
            if not self._held:
                return True
            if any(not h.set_up for h in self._held.values()):
                return False  # its reading, taken before its set-up, is what decides
            if self._available is None or self._total is None:
                return True  # the device's memory is unknown: nothing to hold a job back for
            held = sum(h.need for h in self._held.values())
            return held + need + margin_bytes(self._total) <= self._available

    def hold(self, job_id: str, need: int) -> None:
        """Count ``job_id`` (needing ``need`` bytes) as held, not set up yet."""
        with self._lock:
            self._held[job_id] = _Held(need)

    def set_up(self, job_id: str, free_bytes: int | None, total_bytes: int | None) -> None:
        """``job_id``'s backend read the device (``free_bytes`` and ``total_bytes``; None if
        it cannot tell: the last reading stands) right before the job's device set-up, which
        follows at once; the jobs set up before it hold their buffers in that reading."""
        with self._lock:
            held = self._held.get(job_id)
            if held is None:
                return
            if free_bytes is not None and total_bytes is not None:  # else the last reading holds
                # A closed job's memory is in free_bytes already; its need stays held (the
                # framework baseline that follows the close takes about as much).
                set_up = sum(
                    h.need
                    for j, h in self._held.items()
                    if h.set_up and not h.closed and j != job_id
                )
                self._available = free_bytes + set_up
                self._total = total_bytes
            held.set_up = True

    def closed(self, job_id: str) -> None:
        """``job_id``'s backend closed (in a GPU turn: no reading is taken meanwhile): its
        buffers are off the device, which the next reading shows, but it stays held (its
        need counted) until :meth:`release`."""
        with self._lock:
            held = self._held.get(job_id)
            if held is not None:
                held.closed = True

    def release(self, job_id: str) -> None:
        """``job_id`` ended here (its backend closed): its memory is free again."""
        with self._lock:
            self._held.pop(job_id, None)

    def held_bytes(self) -> int:
        """The needs of the jobs held now, summed."""
        with self._lock:
            return sum(h.need for h in self._held.values())
