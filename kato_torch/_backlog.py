"""How far the GPU runs behind the host on a stream: the test that decides a ``WHEN_BUSY`` call.

A Kato call costs the host more than PyTorch's op (Python, ctypes launches). That cost is free
while the GPU still has at least that much queued work ahead of the call (a step bound by the
GPU), and paid in full when the GPU waits for the host (a step bound by the host, where the
queue is shallow even if not empty: a stream's ``query()`` says "busy" whenever one kernel is
in flight). :class:`Backlog` measures the lag itself: it records an event on the stream now and
then, stamped with the host's clock; an event recorded at least ``lag_ms`` ago that the GPU has
not reached yet means the GPU is at least that far behind.

Asking costs the host too (a stream object, a lock, sometimes an event recorded, an event
queried: a few microseconds on an H100's host), so kato_torch asks as little as it can:

- **Once per call.** A public function of :mod:`kato_torch.ops` (or a drop-in module's call)
  asks for every operator its forward and backward could run (a layer norm: two keys, a linear:
  three) and again inside the operator it runs; :func:`lagging` answers all of them with the
  call's first answer, inside :func:`enter` / :func:`leave` (the call's scope). A call outside
  any scope (an operator's backward, run by autograd) asks afresh each time.
- **Backing off where the answer keeps being "no".** A remembered fallback of a ``WHEN_BUSY``
  verdict (:mod:`kato_torch._fallbacks`: a function's or a drop-in module's call that ran
  PyTorch's op because the GPU kept up) asks through the :class:`Backoff` of its key (shared by
  the drop-in modules calling with it): after :data:`BACKOFF_AFTER` "no"s in a row it skips the
  question for 1 call, then 2, 4, ... up to :data:`MAX_SKIP` calls (each skipped call runs
  PyTorch's op, as a "no" would), probing twice between skips; any "yes" starts the count again.
  A skip also ends once :data:`MAX_SKIP_S` seconds have passed since it began, however few calls
  it skipped (a site called once per slow step). The first probe after a skip only marks the
  stream (its "no" is not counted): alone, it would read the mark of its own last probe, up to
  MAX_SKIP calls old (see :class:`Backlog`), which a GPU a few steps behind has long passed, so
  a site that no other site's questions mark would hear "no" forever. A step bound by the host,
  where the answer is always "no", then asks twice every :data:`MAX_SKIP` + 2 calls of each such
  site, or twice per :data:`MAX_SKIP_S` where that comes first; a step bound by the GPU, where
  it is "yes", asks on every call (and runs Kato's kernel). The price: a step that turns from
  host-bound to GPU-bound runs PyTorch's op for up to :data:`MAX_SKIP` + 2 more calls of each
  site (a site is called about once a step), and for no longer than :data:`MAX_SKIP_S` and two
  calls. A call while the stream is being captured into a CUDA graph (:func:`capturing`) is
  never skipped: the graph replays Kato's kernel without the host. A skipped call reads the
  host's clock (:data:`clock`, tens of nanoseconds), and a :class:`Backoff` is shared safely
  between threads (autograd's backward, ``nn.DataParallel``'s replicas).

:func:`stream_lags` and :func:`capturing` are the functions that touch CUDA: stand-ins replace
them where no GPU is (``benchmarks/kato_torch_mlp_host.py``, tests/torch_integration).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from kato_torch import policy as _policy


class Backlog:
    """Per-stream marks (host time, CUDA event), a few per ``lag_ms`` of host time.

    Marks are only recorded when :meth:`deep` is asked, so between sparse calls the newest
    mark old enough may be much older than ``lag_ms``: the answer then errs towards "not
    behind" (PyTorch's op), never the other way. Thread-safe (autograd's backward calls come
    from its own threads)."""

    def __init__(self, lag_ms: float):
        self.lag_s = lag_ms / 1e3
        self._lock = threading.Lock()
        # Keyed by (device, stream handle): every device's default stream has handle 0.
        self._marks: dict[tuple[int, int], deque[tuple[float, torch.cuda.Event]]] = {}
        # Spare events per device: an event records only on streams of its own device.
        self._spare: dict[int, list[torch.cuda.Event]] = {}

    def deep(self, stream: torch.cuda.Stream) -> bool:
        """Whether the GPU is at least ``lag_ms`` behind the host on ``stream``: an event
        recorded that long ago (or longer) is still pending. False until the stream has such a
        mark (its first calls). Marks the stream for later calls."""
        now = clock()
        device = stream.device_index
        with self._lock:
            marks = self._marks.setdefault((device, stream.cuda_stream), deque())
            spare = self._spare.setdefault(device, [])
            old = None
            while marks and now - marks[0][0] >= self.lag_s:
                if old is not None:
                    spare.append(old[1])
                old = marks.popleft()
            if old is not None:  # the newest mark old enough: kept for the next calls too
                marks.appendleft(old)
            if not marks or now - marks[-1][0] >= self.lag_s / 4:
                event = spare.pop() if spare else torch.cuda.Event()
                event.record(stream)
                marks.append((now, event))
            # Under the lock: another thread may recycle this event once it is dropped.
            return old is not None and not old[1].query()


#: The process's backlog test, at the lag that hides a Kato call's extra host cost.
BACKLOG = Backlog(_policy.MIN_SAVING_MS)

#: "No"s in a row after which a :class:`Backoff` starts skipping calls, and the most calls it
#: skips between two probes.
BACKOFF_AFTER = 8
MAX_SKIP = 64
#: The longest a :class:`Backoff` skips, in seconds of :data:`clock`, however few calls: a
#: backed-off site then asks at most twice per 0.1 s (a few microseconds, under 0.01% of the
#: host's time), and a step that turned GPU-bound waits at most 0.1 s for Kato's kernel.
MAX_SKIP_S = 0.1

#: The host's clock (seconds) that :class:`Backlog` stamps its marks with and
#: :class:`Backoff` times its skips by; a test may replace it (a simulated clock).
clock = time.perf_counter


def capturing() -> bool:
    """Whether the current device's stream is being captured into a CUDA graph (replayed
    without the host: Kato's kernel is then the one to capture). A stand-in may replace it
    where no GPU is, as :func:`stream_lags`."""
    return torch.cuda.is_current_stream_capturing()


def stream_lags(t: torch.Tensor) -> bool:
    """Whether the GPU of CUDA tensor ``t`` is far enough behind the host on the current stream
    that a Kato call's extra host cost is hidden (:data:`BACKLOG`), or that stream is being
    captured into a CUDA graph (replayed without the host; a capturing stream may not be
    queried). The capture test reads the current device's stream, which is ``t``'s wherever
    a graph is captured around it. Looked up by :func:`lagging` on every call: a stand-in
    may replace it (a CPU benchmark or test, where no stream exists)."""
    if capturing():
        return True
    return BACKLOG.deep(torch.cuda.current_stream(t.device))


_OUTSIDE = object()


class _Call(threading.local):
    #: The answer of the call in progress on this thread: ``_OUTSIDE`` (no call: every
    #: question is asked), None (a call that has not asked yet), or its answer.
    answer: object = _OUTSIDE


_call = _Call()


def lagging(t: torch.Tensor) -> bool:
    """:func:`stream_lags` for ``t``, asked once per call: inside a call's scope
    (:func:`enter`) the first answer is every later question's."""
    answer = _call.answer
    if answer is None:  # a call's first question
        answer = _call.answer = stream_lags(t)
    elif answer is _OUTSIDE:
        return stream_lags(t)
    return answer  # type: ignore[return-value]


def enter(answer: bool | None = None) -> object:
    """Open a call's scope on this thread with ``answer`` (None: not asked yet); within a scope
    already open (a call made by another call), its answer stands. Returns what
    :func:`leave` takes."""
    outer = _call.answer
    if outer is _OUTSIDE:
        _call.answer = answer
    return outer


def leave(outer: object) -> None:
    """Close the scope :func:`enter` opened (``outer``: what it returned)."""
    if outer is _OUTSIDE:
        _call.answer = _OUTSIDE


class Backoff:
    """When one remembered ``WHEN_BUSY`` fallback asks the backlog (the module's docstring):
    every call until :data:`BACKOFF_AFTER` "no"s in a row, then twice after skipping 1, 2, 4,
    ... up to :data:`MAX_SKIP` calls, a skip ending early once :data:`MAX_SKIP_S` seconds have
    passed since it began; a "yes" starts again. The first question after a skip only marks
    the stream (a "no" there is not counted): asked alone, it would read the mark its previous
    question left, MAX_SKIP calls ago, which a GPU lagging by a few steps has passed, so a step
    that turned GPU-bound would hear "no" forever. A call while the stream is being captured
    into a CUDA graph is never skipped. Thread-safe; a copy (``deepcopy``, pickling a module
    that holds one) starts afresh."""

    __slots__ = ("_lock", "_noes", "_skip", "_left", "_until", "_fresh")

    def __init__(self, noes: int = 0):
        self._lock = threading.Lock()
        self._noes = 0  # "no"s in a row
        self._skip = 1  # calls the next backing off skips
        self._left = 0  # calls left to skip
        self._until = 0.0  # when the skip in progress ends at the latest (clock())
        self._fresh = True  # whether this site's previous call asked (its mark is recent)
        for _ in range(noes):
            self._count(False)

    def __reduce__(self) -> tuple:
        return Backoff, ()

    def lagging(self, t: torch.Tensor) -> bool:
        """:func:`lagging` for ``t``, or False without asking while this call is skipped."""
        # One lock around the question too: the schedule follows the calls in the order they
        # took it, whichever thread made them (this site's calls wait while it is asked).
        with self._lock:
            # A skip past its time asks (calls left or not) until _count starts the next one.
            if self._left and clock() < self._until and not capturing():
                self._left -= 1
                self._fresh = False
                return False
            answer = lagging(t)
            if answer or self._fresh:
                self._count(answer)
            self._fresh = True
            return answer

    def _count(self, answer: bool) -> None:
        if answer:
            self._noes, self._skip, self._left = 0, 1, 0
            return
        self._noes += 1
        if self._noes >= BACKOFF_AFTER:
            self._left, self._until = self._skip, clock() + MAX_SKIP_S
            self._skip = min(2 * self._skip, MAX_SKIP)
