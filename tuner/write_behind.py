"""Write-behind: a search's bookkeeping writes run on one background thread, in order.

After each measurement a worker's search stores the result (the job's trial row,
``Search(on_result=...)``): a few ms of database work per config, as long as measuring a fast
kernel. Nothing in the next
proposal reads those rows (the search keeps its results in memory), so they can be written
while the GPU measures the next config instead of before it.

Contract:

- Writes run one at a time, in submission order, on one thread, from the next
  :meth:`WriteBehind.release` on: the search releases them as it starts a measurement, so that
  they run while the measuring thread waits on the GPU, not while the search proposes (Python
  code on both threads would take turns on the GIL and slow the proposal by as much as the
  writes take).
- At most one batch is outstanding: :meth:`WriteBehind.release` first waits for the writes it
  released before. Writes slower than the measurements slow the search down to their pace
  instead of piling up, so a process that dies loses at most the last result's writes (the
  job's resume measures that config again, as it does the one measuring at the time).
- A write that raises does not stop the later ones; its exception is raised again in the
  submitting thread by the next :meth:`WriteBehind.release` or :meth:`WriteBehind.flush` (a
  failed write ends the search one measurement late, never silently).
- :meth:`WriteBehind.flush` returns once every write submitted before it has finished: the
  search flushes before it returns, so a finished search has stored every result it measured.
- Disabled (``enabled=False``), :meth:`WriteBehind.submit` writes at once, in the caller's
  thread. Only enable it where a busy thread cannot disturb a measurement: a measurement timed
  in this process (a Python loop launching kernels between two CUDA events) would count every
  pause the writer's share of the GIL causes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class WriteBehind:
    """Ordered background writes for one search; see the module docstring."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future[Any]] = deque()  # released, maybe not finished
        self._held: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        """Run ``write(*args)`` after the writes submitted before it, from the next
        :meth:`release` on (now, in this thread, if disabled)."""
        if not self.enabled:
            write(*args)
            return
        self._held.append((write, args))

    def release(self) -> None:
        """Wait for the writes released before, then start those submitted since on the
        background thread.

        Raises:
            Exception: the first failure among the writes released before (those submitted
                since are started all the same: a failure never drops a write).
        """
        error = self._drain()
        if self._held:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kato-write-behind")
            for write, args in self._held:
                self._pending.append(self._pool.submit(write, *args))
            self._held.clear()
        if error is not None:
            raise error

    def flush(self, *, raise_errors: bool = True) -> None:
        """Wait for every submitted write. The first failure is raised after all have finished
        (with ``raise_errors=False`` it is logged instead, like every later one: the caller is
        already handling an exception that must not be replaced)."""
        first: BaseException | None = None
        try:
            self.release()
        except Exception as error:  # an earlier write's failure: raised once the rest are done
            first = error
        later = self._drain()
        if later is not None:
            if first is None:
                first = later
            else:
                log.error("a background write failed", exc_info=later)
        if first is None:
            return
        if raise_errors:
            raise first
        log.error("a background write failed", exc_info=first)

    def close(self, *, raise_errors: bool = False) -> None:
        """:meth:`flush`, then stop the thread (a later :meth:`submit` starts another). Safe to
        call twice."""
        try:
            self.flush(raise_errors=raise_errors)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _drain(self) -> BaseException | None:
        """Wait for every released write; the first failure (a later one is logged)."""
        first: BaseException | None = None
        while self._pending:
            error = self._pending.popleft().exception()
            if error is None:
                continue
            if first is None:
                first = error
            else:
                log.error("a background write failed", exc_info=error)
        return first
