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


class Backlog:
    """Per-stream marks (host time, CUDA event), a few per ``lag_ms`` of host time."""

    def __init__(self, lag_ms: float):
        self.lag_s = lag_ms / 1e3
        self._lock = threading.Lock()  # autograd's backward calls come from its own threads
        self._marks: dict[int, deque[tuple[float, torch.cuda.Event]]] = {}
        self._spare: list[torch.cuda.Event] = []

    def deep(self, stream: torch.cuda.Stream) -> bool:
        """Whether the GPU is at least ``lag_ms`` behind the host on ``stream``: an event
        recorded that long ago (or longer) is still pending. False until the stream has such a
        mark (its first calls). Marks the stream for later calls."""
        now = time.perf_counter()
        with self._lock:
            marks = self._marks.setdefault(stream.cuda_stream, deque())
            old = None
            while marks and now - marks[0][0] >= self.lag_s:
                if old is not None:
                    self._spare.append(old[1])
                old = marks.popleft()
            if old is not None:  # the newest mark old enough: kept for the next calls too
                marks.appendleft(old)
            if not marks or now - marks[-1][0] >= self.lag_s / 4:
                event = self._spare.pop() if self._spare else torch.cuda.Event()
                event.record(stream)
                marks.append((now, event))
        return old is not None and not old[1].query()
