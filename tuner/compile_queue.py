"""Compile ahead, most wanted first: a bounded pool of compile threads fed from a priority queue.

The pycuda backend compiles configs in the background while the GPU measures others. Handing a
whole space to a thread pool at once compiles it in the order given, so the configs the search
asks for next sit queued behind ones it never asks for and measuring waits on nvcc (about 40% of a
job's time on the H200: docs/results_h200.md, "Where Kato's time goes"). Here at most
``workers`` compiles run at once, taken from the front of a queue; :meth:`CompileQueue.hint`
puts the configs the search expects to ask for next at the front (``tuner.surrogate`` names
them after each proposal), and :meth:`CompileQueue.add` appends the bulk at the back.

Contract (tests/tuner/test_compile_queue.py):

- every config is compiled at most once by the queue, and :meth:`take` returns its result (or
  raises its error): waiting for a compile that has started, compiling in the calling thread
  one that has not (it does not queue behind the others), and removing it from the queue;
- at most ``workers`` background compiles run at once; hinted configs start before the bulk,
  the latest hint first;
- :meth:`close` cancels what has not started and waits for what has.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Seconds between looks at a ``stop`` event while waiting on a compile.
_STOP_POLL_S = 0.05


def _settled(future: concurrent.futures.Future[Any], stop: threading.Event | None) -> bool:
    """Wait on ``future`` (at most one slice when ``stop`` is given): True once it is done
    (its error is not raised) or ``stop`` is set."""
    if stop is None:
        future.exception()
        return True
    try:
        future.exception(timeout=_STOP_POLL_S)
    except concurrent.futures.TimeoutError:
        return stop.is_set()
    return True


Config = dict[str, Any]


@dataclass
class CompileStats:
    """Where the compiles that were taken came from and how long taking them blocked.

    ``ahead``: started in the background before they were asked for (done or running);
    ``inline``: compiled on demand in the calling thread; ``wait_s``: seconds :meth:`take`
    blocked, the time the GPU sat idle on the compiler.
    """

    ahead: int = 0
    inline: int = 0
    wait_s: float = 0.0


class CompileQueue(Generic[T]):
    """Compiles configs with ``compile_fn`` in up to ``workers`` background threads.

    Args:
        compile_fn: compiles one config (may raise; the error is re-raised by :meth:`take`).
        key: a config's identity (configs with the same key are compiled once).
        workers: background compiles at most at once (None: one nvcc process per core less
            one, so that an inline compile and the measuring thread still get a core).
    """

    def __init__(
        self,
        compile_fn: Callable[[Config], T],
        key: Callable[[Config], str],
        workers: int | None = None,
    ):
        self._compile = compile_fn
        self._key = key
        self._workers = max(1, workers or (os.cpu_count() or 2) - 1)
        # Re-entrant: a future that is already done runs its done-callback (which takes the
        # lock) inside add_done_callback, while _fill holds it.
        self._lock = threading.RLock()
        self._queued: OrderedDict[str, Config] = OrderedDict()  # not started, front first
        self._started: dict[str, concurrent.futures.Future[T]] = {}  # running or done
        self._running = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.stats = CompileStats()

    def add(self, configs: Iterable[Config]) -> None:
        """Queue ``configs`` at the back, in order (those already known are left where they are)."""
        with self._lock:
            for config in configs:
                k = self._key(config)
                if k not in self._queued and k not in self._started:
                    self._queued[k] = dict(config)
            self._fill()

    def hint(self, configs: Iterable[Config]) -> None:
        """Move ``configs`` to the front of the queue (queueing those not known yet), the first
        of them first: they are what the search expects to ask for next."""
        with self._lock:
            for config in reversed(list(configs)):
                k = self._key(config)
                if k in self._started:
                    continue
                self._queued[k] = self._queued.get(k, dict(config))
                self._queued.move_to_end(k, last=False)
            self._fill()

    def take(self, config: Config) -> T:
        """The compiled ``config``: waits for its compile if started, else compiles it now in
        this thread (and drops it from the queue)."""
        started = time.perf_counter()
        try:
            future = self._claim(config)
            return future.result() if future is not None else self._compile(dict(config))
        finally:
            self.stats.wait_s += time.perf_counter() - started

    def wait(self, config: Config, stop: threading.Event | None = None) -> bool:
        """Wait for ``config``'s compile if it has started (True; its error is swallowed: the
        caller compiles or reports it itself) and drop it from the queue if it has not (False):
        for a caller that compiles elsewhere (the isolated backend's child). With ``stop``, the
        wait also ends when it is set (a cancel need not wait for a slow nvcc)."""
        started = time.perf_counter()
        try:
            future = self._claim(config)
            if future is not None:
                while not _settled(future, stop):
                    pass
            return future is not None
        finally:
            self.stats.wait_s += time.perf_counter() - started

    def is_done(self, config: Config) -> bool:
        """Whether ``config``'s background compile has finished (successfully or not): taking
        it now would not wait on the compiler."""
        with self._lock:
            future = self._started.get(self._key(config))
            return future is not None and future.done()

    def wait_any(
        self,
        configs: Iterable[Config],
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> bool:
        """Block until the background compile of one of ``configs`` has finished (or
        ``timeout`` seconds, or ``stop`` is set): True when one has; False at once when none
        of them has started. The time blocked counts as waiting on the compiler
        (:attr:`stats`)."""
        with self._lock:
            futures = [f for c in configs if (f := self._started.get(self._key(c))) is not None]
        if not futures:
            return False
        started = time.perf_counter()
        deadline = None if timeout is None else started + timeout
        try:
            while True:
                # In slices when ``stop`` is given, so that a cancel ends the wait within one.
                step = _STOP_POLL_S if stop is not None else None
                if deadline is not None:
                    left = max(0.0, deadline - time.perf_counter())
                    step = left if step is None else min(step, left)
                done, _ = concurrent.futures.wait(
                    futures, timeout=step, return_when=concurrent.futures.FIRST_COMPLETED
                )
                if done:
                    return True
                if stop is not None and stop.is_set():
                    return False
                if deadline is not None and time.perf_counter() >= deadline:
                    return False
        finally:
            self.stats.wait_s += time.perf_counter() - started

    def pending(self) -> int:
        """Configs queued and not started."""
        with self._lock:
            return len(self._queued)

    def close(self) -> None:
        """Drop what has not started; wait for the compiles running."""
        with self._lock:
            self._closed = True
            self._queued.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- internals ---------------------------------------------------------------------------

    def _claim(self, config: Config) -> concurrent.futures.Future[T] | None:
        """Take ``config`` out of the queue: its started compile, or None (dropped if queued)."""
        k = self._key(config)
        with self._lock:
            future = self._started.pop(k, None)
            if future is None:
                self._queued.pop(k, None)
                self.stats.inline += 1
            else:
                self.stats.ahead += 1
            return future

    # (called with the lock held)

    def _fill(self) -> None:
        while not self._closed and self._queued and self._running < self._workers:
            k, config = self._queued.popitem(last=False)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._workers, "kato-precompile")
            self._running += 1
            future = self._pool.submit(self._compile, config)
            self._started[k] = future
            future.add_done_callback(self._done)

    def _done(self, _: concurrent.futures.Future[T]) -> None:
        with self._lock:
            self._running -= 1
            self._fill()
