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
- with shared ``slots`` (:mod:`tuner.compile_slots`), a background thread takes its config
  only once a slot is free for the front's urgency, and compiles it under a want that a hint
  raises to ``NEXT`` and a :meth:`take`, :meth:`wait` or :meth:`wait_any` to ``NOW``;
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

from kato.tuner.compile_slots import Abandoned, CompileSlots, Urgency, Want, wanting

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
        slots: the nvcc slots this queue's compiles share with other queues (the worker's
            jobs: :func:`tuner.compile_slots.nvcc_slots`). A background thread then takes its
            config from the front of the queue only once a slot is free for it, by the front's
            urgency (hinted: ``NEXT``, the rest: ``BULK``), so that a hint given meanwhile is
            compiled first, and other queues' more urgent compiles go before this queue's
            speculative ones. None: threads take their config at once (no sharing).
    """

    def __init__(
        self,
        compile_fn: Callable[[Config], T],
        key: Callable[[Config], str],
        workers: int | None = None,
        slots: CompileSlots | None = None,
    ):
        self._compile = compile_fn
        self._key = key
        self._workers = max(1, workers or (os.cpu_count() or 2) - 1)
        self._slots = slots
        # Re-entrant: a future that is already done runs its done-callback (which takes the
        # lock) inside add_done_callback, while _fill holds it.
        self._lock = threading.RLock()
        # Not started, front first, with how soon each is wanted.
        self._queued: OrderedDict[str, tuple[Config, Urgency]] = OrderedDict()
        self._started: dict[str, concurrent.futures.Future[T]] = {}  # running or done
        self._wants: dict[str, Want] = {}  # of the started ones not taken yet
        self._turns: set[Want] = set()  # threads waiting for a slot to take the front
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
                    self._queued[k] = (dict(config), Urgency.BULK)
            self._fill()

    def hint(self, configs: Iterable[Config]) -> None:
        """Move ``configs`` to the front of the queue (queueing those not known yet), the first
        of them first: they are what the search expects to ask for next."""
        with self._lock:
            self._put_first(list(configs), Urgency.NEXT, queue_unknown=True)

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
        configs = list(configs)
        with self._lock:
            futures = [f for c in configs if (f := self._started.get(self._key(c))) is not None]
            # The caller blocks on these: started or queued, they are wanted NOW.
            self._put_first(configs, Urgency.NOW, queue_unknown=False)
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
            for turn in self._turns:
                turn.cancel()
            # Nobody takes a speculative compile after close: one waiting for a slot gives up
            # (it could wait long behind other jobs' wanted compiles).
            for want in self._wants.values():
                if want.urgency is Urgency.BULK:
                    want.cancel()
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
                if (want := self._wants.pop(k, None)) is not None:
                    want.raise_to(Urgency.NOW)  # someone waits for it now
            return future

    # (called with the lock held)

    def _put_first(self, configs: list[Config], urgency: Urgency, *, queue_unknown: bool) -> None:
        """Raise ``configs`` to ``urgency``: a started one's want; a queued one (and, with
        ``queue_unknown``, one not known yet) to the front of the queue, the first of them
        first; then the threads waiting to pick the front."""
        for config in reversed(configs):
            k = self._key(config)
            if k in self._started:
                if (want := self._wants.get(k)) is not None:
                    want.raise_to(urgency)
                continue
            queued = self._queued.get(k)
            if queued is None and not queue_unknown:
                continue
            # Never less urgent than it was (a hint must not lower a config a caller waits for).
            entry = (queued[0], min(urgency, queued[1])) if queued else (dict(config), urgency)
            self._queued[k] = entry
            self._queued.move_to_end(k, last=False)
        for turn in self._turns:
            turn.raise_to(self._front_urgency())
        self._fill()

    def _front_urgency(self) -> Urgency:
        return next(iter(self._queued.values()))[1] if self._queued else Urgency.BULK

    def _fill(self) -> None:
        while (
            not self._closed
            and len(self._queued) > len(self._turns)
            and self._running < self._workers
        ):
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._workers, "kato-precompile")
            self._running += 1
            if self._slots is None:  # nothing to wait for: the thread's config is the front now
                self._pool.submit(self._run, None, self._take_front())
            else:
                turn = Want(self._front_urgency())
                self._turns.add(turn)
                self._pool.submit(self._run, turn, None)

    def _take_front(self) -> _Picked[T] | None:
        if self._closed or not self._queued:
            return None
        k, (config, urgency) = self._queued.popitem(last=False)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        want = self._wants[k] = Want(urgency)
        self._started[k] = future
        return _Picked(k, config, future, want)

    # (in a pool thread)

    def _run(self, turn: Want | None, picked: _Picked[T] | None) -> None:
        """Compile ``picked``, or the front config once a slot is free for ``turn`` (the front's
        urgency, raised by hints), under the config's own want (raised by :meth:`take`)."""
        try:
            if turn is None:
                if picked is not None:
                    self._compile_picked(picked)
                return
            try:
                with self._slots.held(turn) as hold:  # type: ignore[union-attr]
                    with self._lock:
                        self._turns.discard(turn)
                        picked = self._take_front()
                    if picked is None:
                        return
                    if picked.want.urgency > turn.urgency:
                        # Less urgent than the turn (its hint was taken meanwhile): the slot
                        # may be the reserve, so the compile waits for one by its own want.
                        hold.release()
                    with self._slots.passing(hold):  # type: ignore[union-attr]
                        self._compile_picked(picked)
            except Abandoned:  # closed while waiting
                return
        finally:
            with self._lock:
                if turn is not None:
                    self._turns.discard(turn)
                self._running -= 1
                self._fill()

    def _compile_picked(self, picked: _Picked[T]) -> None:
        with wanting(picked.want):
            try:
                result = self._compile(picked.config)
            except BaseException as error:  # noqa: BLE001 - re-raised by take()
                picked.future.set_exception(error)
            else:
                picked.future.set_result(result)
        with self._lock:
            self._wants.pop(picked.key, None)


@dataclass
class _Picked(Generic[T]):
    """A config a background thread compiles: its key, its future and how soon it is wanted."""

    key: str
    config: Config
    future: concurrent.futures.Future[T]
    want: Want
