"""Write-behind: a search's bookkeeping writes run on one background thread, in order.

After each measurement the search stores the result twice (the job's trial row, the Optuna
study's finished trial): about 15-30 ms of database work per config, as long as measuring a
fast kernel. Nothing in the next proposal reads those rows (the search keeps its results in
memory), so they can be written while the GPU measures the next config instead of before it.

Contract:

- Writes run one at a time, in submission order, on one thread, from the next :meth:`release`
  on: the search releases them as it starts a measurement, so that they run while the
  measuring thread waits on the GPU, not while the search proposes (Python code on both
  threads would take turns on the GIL and slow the proposal by as much as the writes take).
- A write that raises does not stop the later ones; its exception is raised again in the
  submitting thread, by the first :meth:`WriteBehind.release` after it finished or by
  :meth:`WriteBehind.flush` (a failed write can end the search a few measurements late, never
  silently).
- :meth:`WriteBehind.flush` returns once every write submitted before it has finished: the
  search flushes before it returns, so a finished search has stored every result it measured.
- A process that dies loses at most the writes still queued (in practice the last result):
  the job's resume measures those configs again, as it does the one measuring at the time.
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
        self._pending: deque[Future[Any]] = deque()
        self._held: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        """Run ``write(*args)`` after the writes submitted before it, from the next
        :meth:`release` on (now, in this thread, if disabled)."""
        if not self.enabled:
            write(*args)
            return
        self._held.append((write, args))

    def release(self) -> None:
        """Start the writes submitted so far on the background thread.

        Raises:
            Exception: the first failure of an earlier write not raised yet.
        """
        earlier = len(self._pending)
        if self._held:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kato-write-behind")
            for write, args in self._held:
                self._pending.append(self._pool.submit(write, *args))
            self._held.clear()
        self._raise_finished(earlier)  # after queueing: a failure never drops the writes held

    def flush(self, *, raise_errors: bool = True) -> None:
        """Wait for every submitted write. The first failure is raised after all have finished
        (with ``raise_errors=False`` every failure is logged instead: the caller is already
        handling an exception that must not be replaced)."""
        try:
            self.release()
        except Exception as error:  # an earlier write's failure: raised after the others
            self._pending.appendleft(_failed(error))
        first: BaseException | None = None
        while self._pending:
            error = self._pending.popleft().exception()
            if error is None:
                continue
            if raise_errors and first is None:
                first = error
            else:
                log.error("a background write failed", exc_info=error)
        if first is not None:
            raise first

    def close(self, *, raise_errors: bool = False) -> None:
        """:meth:`flush`, then stop the thread (a later :meth:`submit` starts another). Safe to
        call twice."""
        try:
            self.flush(raise_errors=raise_errors)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _raise_finished(self, limit: int) -> None:
        """Raise the failure of the oldest finished writes (of the first ``limit``: those
        released before), if one failed."""
        for _ in range(limit):
            if not self._pending or not self._pending[0].done():
                return
            error = self._pending.popleft().exception()
            if error is not None:
                raise error


def _failed(error: BaseException) -> Future[Any]:
    """A finished future holding ``error`` (a failure already taken off the queue)."""
    future: Future[Any] = Future()
    future.set_exception(error)
    return future
