"""A replay backend with planted faults, for the fault-isolation tests (importable as
``fault_backend``; a child process built from a BackendSpec finds it on the inherited sys.path).

``BackendSpec(kind="fault_backend:make", replay_file=..., options=(("faults", {...}),))`` where
``faults`` maps a config key to what evaluating it does in the measuring process:

- ``abort``: ``os.abort()`` (SIGABRT, like a CUDA driver assertion);
- ``exit``: ``os._exit(3)`` (the process vanishes without a word);
- ``hang``: sleeps forever (a deadlocked kernel);
- ``raise``: raises RuntimeError (a backend bug);
- ``poison``: returns a launch error and reports the backend unhealthy (a sticky CUDA error).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import time
from typing import Any

from kato.tuner.backends.base import Backend, DeviceMemory, TrialResult, TrialStatus
from kato.tuner.backends.isolated import BackendSpec
from kato.tuner.backends.replay import ReplayBackend


class FaultyReplay(ReplayBackend):
    def __init__(self, replay_file: str, faults: dict[str, str]):
        super().__init__(replay_file)
        self.faults = faults
        self._poisoned = False

    def evaluate(self, config: dict[str, Any]) -> TrialResult:
        if self._poisoned:  # a dead context fails everything after the fault
            return TrialResult(config=dict(config), status=TrialStatus.LAUNCH_ERROR, error="dead")
        mode = self.faults.get(self.cache.key(config))
        if mode == "abort":
            os.abort()
        if mode == "exit":
            os._exit(3)
        if mode == "hang":
            while True:
                time.sleep(3600)
        if mode == "raise":
            raise RuntimeError("planted backend bug")
        if mode == "poison":
            self._poisoned = True
            return TrialResult(
                config=dict(config),
                status=TrialStatus.LAUNCH_ERROR,
                error="LaunchError: an illegal memory access was encountered (planted)",
            )
        return super().evaluate(config)

    def healthy(self) -> bool:
        return not self._poisoned


def make(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    return FaultyReplay(spec.replay_file, dict(spec.option("faults", {})))


class SlowToPrepare(ReplayBackend):
    """A replay backend whose ``prepare`` (inputs and buffers, after the device is announced)
    takes ``prepare_s`` seconds, or raises when ``prepare_error`` is set."""

    def __init__(self, replay_file: str, prepare_s: float, prepare_error: str | None):
        super().__init__(replay_file)
        self.prepare_s, self.prepare_error = prepare_s, prepare_error

    def prepare(self) -> None:
        time.sleep(self.prepare_s)
        if self.prepare_error:
            raise MemoryError(self.prepare_error)


def make_slow(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    return SlowToPrepare(
        spec.replay_file, spec.option("prepare_s", 0.0), spec.option("prepare_error")
    )


class StagedPrepare(ReplayBackend):
    """A replay backend whose set-up has a host part (``prepare_inputs``) and a device part
    (``prepare``), each appending its name and a timestamp to the file ``log``."""

    def __init__(self, replay_file: str, log: str):
        super().__init__(replay_file)
        self.log = log

    def _note(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{what} {time.time()}\n")

    def prepare_inputs(self) -> None:
        self._note("inputs")

    def prepare(self) -> None:
        self._note("device")
        self.set_up = True

    def memory(self) -> DeviceMemory:
        """A 1000-byte device of which the set-up takes 400 bytes."""
        return DeviceMemory(free_bytes=600 if getattr(self, "set_up", False) else 1000,
                            total_bytes=1000)  # fmt: skip


def make_staged(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    return StagedPrepare(spec.replay_file, spec.option("log"))


def make_dying_once(spec: BackendSpec) -> Backend:
    """A replay backend whose first build, in any process, kills that process without a word
    (``os._exit(5)``): the file ``marker`` (an option) says the first build happened."""
    assert spec.replay_file is not None
    marker = spec.option("marker")
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os._exit(5)
    return ReplayBackend(spec.replay_file)


class SlowToExit(ReplayBackend):
    """A replay backend whose ``close`` appends ``closed`` and its process id to the file
    ``log`` and, in a measuring child, makes the child take ``exit_s`` seconds to exit (an
    interpreter's teardown)."""

    def __init__(self, replay_file: str, log: str, exit_s: float):
        super().__init__(replay_file)
        self.log, self.exit_s = log, exit_s

    def close(self) -> None:
        super().close()
        with open(self.log, "a") as f:
            f.write(f"closed {time.time()} {os.getpid()}\n")
        if multiprocessing.parent_process() is not None:
            # Run at the child's exit (multiprocessing ends a child with os._exit: no atexit).
            multiprocessing.util.Finalize(None, time.sleep, args=(self.exit_s,), exitpriority=0)


def make_slow_exit(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    return SlowToExit(spec.replay_file, spec.option("log"), spec.option("exit_s", 0.0))


class HangingClose(ReplayBackend):
    """A replay backend whose ``close`` never returns in a measuring child (a driver call that
    hangs); in the parent (its description of the task) it closes."""

    def close(self) -> None:
        while multiprocessing.parent_process() is not None:
            time.sleep(3600)


def make_hanging_close(spec: BackendSpec) -> Backend:
    assert spec.replay_file is not None
    return HangingClose(spec.replay_file)
