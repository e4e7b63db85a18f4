"""How far the GPU runs behind the host on a stream: the test that decides a ``WHEN_BUSY`` call.

A Kato call costs the host more than PyTorch's op (Python, ctypes launches). That cost is free
while the GPU still has at least that much queued work ahead of the call (a step bound by the
GPU), and paid in full when the GPU waits for the host (a step bound by the host, where the
queue is shallow even if not empty: a stream's ``query()`` says "busy" whenever one kernel is
in flight). :class:`Backlog` measures the lag itself: it records an event on the stream now and
then, stamped with the host's clock; an event recorded at least ``lag_ms`` ago that the GPU has
not reached yet means the GPU is at least that far behind.
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
        now = time.perf_counter()
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


def lagging(t: torch.Tensor) -> bool:
    """Whether the GPU of CUDA tensor ``t`` is far enough behind the host on the current stream
    that a Kato call's extra host cost is hidden (:data:`BACKLOG`), or that stream is being
    captured into a CUDA graph (replayed without the host; a capturing stream may not be
    queried). The capture test reads the current device's stream, which is ``t``'s wherever
    a graph is captured around it."""
    if torch.cuda.is_current_stream_capturing():
        return True
    return BACKLOG.deep(torch.cuda.current_stream(t.device))
