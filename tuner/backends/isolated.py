"""Fault isolation: a backend whose measurements run in a child process the worker owns.

A kernel that faults (illegal or misaligned address, ``__trap()``) leaves its CUDA context with a
sticky error: every later call in that process fails. A kernel that deadlocks never returns. So
the worker measures through :class:`IsolatedBackend`, a :class:`Backend` proxy: the parent sends
each config over a pipe to a child (``multiprocessing`` "spawn" context: no CUDA state is ever
forked) that builds the real backend from a picklable :class:`BackendSpec` and compiles, verifies
and times it. The parent then records, for the config, one of:

- the child's result (a config-specific failure such as ``compile_error`` or ``verify_error`` is
  a normal result; the child stays up unless :meth:`Backend.healthy` says the context is dead,
  in which case it answers and exits);
- ``crashed``: the child died while measuring (abort, segfault, ``os._exit``);
- ``timeout``: no answer within the trial's limit (compile included): the child is killed.
  The limit is ``trial_timeout_s`` scaled to the task's predicted cost
  (:func:`tuner.trial_cost.trial_timeout_s`: a problem whose one launch takes seconds gets
  more, up to a cap), and the child is told it, so the backend fits its timing repeats into it
  (:attr:`Backend.trial_limit_s`).

A dead or killed child is replaced before the next config; the search never notices.
:func:`measuring_backend` is the one place that decides, for every tuning path (``kato worker``,
``kato serve``'s workers, ``kato tune``, ``kato.tune_kernel``), whether to measure in a child
and under which limit. Compiling
ahead (:meth:`IsolatedBackend.precompile`) runs nvcc in the parent, which needs no GPU, so the
child's GPU stays busy measuring while the next configs compile; before sending a config the
parent waits for its compile, and the child finds the cubin in the on-disk cache.

:meth:`IsolatedBackend.interrupt` (from another thread: a cancelled job) kills a running
measurement at once; :meth:`IsolatedBackend.evaluate` then raises :class:`TrialInterrupted`.

Warm spares (issue 35: a child's start is on each job's critical path at turnover). A fresh
child costs a new interpreter, the imports of numpy, Kato and the backend's modules (PyCUDA),
and the CUDA driver's start: about a second of CPU, more on a loaded host. A worker's backend
factory keeps a :class:`SpareChildren`: one idle child per worker that has done everything that
does not depend on a job (:func:`_warm_up`) and waits for one. The next job's
:class:`IsolatedBackend` (or a crashed child's replacement) takes it, sends it the job
(:class:`BackendSpec`, user operators, ``defer_prepare``) and it goes on exactly as a fresh
child (:func:`_child_main`); another spare is started in the background at once. Settled:

- Ownership: the factory that builds a worker's backends (:mod:`tuner.factories`: it knows the
  backend kind, device and imports) holds the pool; the worker's loop starts it and closes it
  (:class:`tuner.backends.abilities.KeepsSpares`, :meth:`tuner.worker.Worker.run_forever`).
  One-job paths (``kato tune``, ``kato.tune_kernel``) never start one: every child is fresh.
- No job state crosses jobs: a spare is handed out once, to one backend, which owns it from
  then on as its child (closes or kills it); a child is never given back to the pool. A spare
  found dead when taken is discarded and the job starts a fresh child; one that dies after it
  was taken, before it announced its device, is replaced by a fresh child once, without
  counting as a restart (:attr:`IsolatedBackend.restarts` counts replacements after a crash,
  a timeout or a dead context; :attr:`IsolatedBackend.child_pids` lists every child that
  served the backend, the spare included).
- The environment: a spawned child copies the parent's environment, ``sys.path`` and working
  directory when it starts, and the backends read variables at use in the child
  (``KATO_COMPILE_CACHE``: the cubin cache; ``CUDA_VISIBLE_DEVICES``: read by the driver when
  it starts, in the warm-up; a test backend's ``KATO_TEST_TIMED_BACKEND``), or at import. A
  spare started before one of these changed would differ from a fresh child, so a spare is
  handed out only if all three are as they were at its start, else it is replaced (a
  benchmark that sets ``KATO_COMPILE_CACHE`` per run, ``kato serve --api-workers`` setting
  ``KATO_DB_URL``: one cold start each).
- The GPU's turn: the warm-up of a ``pycuda`` spare starts the driver and retains the device's
  primary context (the CUDA context every child creates before announcing its device, outside
  any GPU turn, today as before): the spare creates it earlier, not additionally (one context
  per job either way), and an idle context runs nothing on the GPU. Its memory (a few hundred
  MB) is in every reading the device's memory admission takes (:mod:`tuner.admission`), and a
  spare started after a reading is within the admission's margin (1 GiB at least). The device
  set-up (inputs, buffers, verifier) still waits for the job's GPU turn with
  ``defer_prepare``. Every warm-up step is best effort: one that fails is done again, and
  reported, by the job's child as a fresh child would. The warm-up's reference to the context
  is dropped when the child closes its backend (``("close",)``), so that the context, with the
  job's buffers, ends there, inside the GPU turn that ends the job, not at the process's exit.
- Interrupts and the start timeout: unchanged; the start timeout counts from the moment the
  spare is handed its job.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kato.tuner.backends import shipping
from kato.tuner.backends.abilities import abilities_of
from kato.tuner.backends.base import (
    Backend,
    Config,
    DeviceInfo,
    DeviceMemory,
    TrialResult,
    TrialStatus,
)
from kato.tuner.compile_queue import CompileQueue, CompileStats
from kato.tuner.compile_slots import nvcc_slots
from kato.tuner.space import SearchSpace
from kato.tuner.trial_cost import check_measurable, launch_lower_bound_s
from kato.tuner.trial_cost import trial_timeout_s as scaled_trial_timeout_s

from kato import env
from kato.errors import KatoError
from kato.shared.gpus import find_gpu

log = logging.getLogger(__name__)

#: Default per-trial limit (compile, verify and time one config), seconds.
DEFAULT_TRIAL_TIMEOUT_S = 60.0
#: How long a new child may take to build its backend (CUDA context, buffers, verifier).
DEFAULT_START_TIMEOUT_S = 300.0
#: How long a child is given to close its backend, and then to exit, before it is killed.
CLOSE_WAIT_S = 10.0
#: How often the parent checks for an interrupt while a child measures.
_POLL_S = 0.05


class TrialInterrupted(KatoError):
    """The measurement was stopped from outside (:meth:`IsolatedBackend.interrupt`): the job
    was cancelled or lost. The config was not measured and must not be recorded."""


class ChildStartError(KatoError, RuntimeError):
    """The child process could not build its backend (no device, bad spec): not a config's
    fault, so it fails the job rather than a trial."""


class _ChildDied(ChildStartError):
    """The child died during its set-up without a word (no error reported)."""


@dataclass(frozen=True)
class BackendSpec:
    """A picklable description of the backend a child builds.

    Args:
        kind: ``"pycuda"``, ``"replay"``, or ``"module:function"``: a callable taking this spec
            and returning a :class:`Backend` (tests plant faulty backends this way). For kinds
            other than ``pycuda`` the parent builds one instance too, for :meth:`Backend.space`
            and :meth:`Backend.device` only: it must be cheap and need no GPU.
        operator, shape, dtype, device_index: the task (``pycuda``).
        replay_file: the Kernel Tuner cache file (``replay``).
        imports: modules the child imports first (e.g. one registering a test operator).
        options: extra keyword arguments for the backend, as (name, value) pairs.
    """

    kind: str
    operator: str | None = None
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    device_index: int = 0
    replay_file: str | None = None
    imports: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = field(default=())

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


def build_backend(spec: BackendSpec) -> Backend:
    """Build the real backend a spec describes (in the child; for non-GPU kinds also in the
    parent). Raises whatever the backend raises for problems of its own."""
    for module in spec.imports:
        importlib.import_module(module)
    if spec.kind == "pycuda":
        from kato.kernels import get_operator
        from kato.tuner.backends.pycuda import PyCudaBackend

        assert spec.operator and spec.dtype, "a pycuda spec needs operator, shape and dtype"
        options = {"defer_setup": True, **dict(spec.options)}  # the child prepares it
        return PyCudaBackend(
            get_operator(spec.operator),
            spec.shape,
            spec.dtype,
            device_index=spec.device_index,
            **options,
        )
    if spec.kind == "replay":
        from kato.tuner.backends.replay import ReplayBackend

        assert spec.replay_file, "a replay spec needs replay_file"
        return ReplayBackend(spec.replay_file, **dict(spec.options))
    module_name, _, attr = spec.kind.partition(":")
    if not attr:
        raise ValueError(f"unknown backend kind {spec.kind!r}: pycuda, replay or module:function")
    return getattr(importlib.import_module(module_name), attr)(spec)


def _user_operators(spec: BackendSpec) -> shipping.Package | None:
    """The operator of ``spec`` when it is a user operator (:mod:`kernels.user`), packed for
    the child to register (:mod:`tuner.backends.shipping`: its argument arrays in shared
    memory, not in the pipe): it exists in this process only (read from the database, or built
    by ``kato.tune_kernel``), not in a module the child could import. None for a built-in
    operator, or one whose spec cannot be pickled (left to the child's own registry). The
    caller releases the package when it starts no more children from it."""
    if not spec.operator:
        return None
    from kato.kernels import get_operator
    from kato.kernels.spec import InvalidInput
    from kato.kernels.user import UserOperatorSpec

    try:
        op = get_operator(spec.operator)
    except InvalidInput:
        return None
    if not isinstance(op, UserOperatorSpec):
        return None
    try:
        return shipping.pack((op,))
    except shipping.Unshippable as exc:
        log.warning("user operator %s cannot be sent to the measuring process: %s", op.name, exc)
        return None


def _child_main(
    conn: multiprocessing.connection.Connection,
    spec: BackendSpec,
    operators: shipping.Package | None = None,
    defer_prepare: bool = False,
) -> None:
    """The child: register ``operators`` (the parent's user operators, packed by
    :func:`_user_operators`), build the backend, announce its device, make its inputs
    (``prepare``, while the parent starts compiling; a user operator's reference kernel runs
    here), say so, then answer configs until told to close or the pipe closes. Exits (without
    closing the CUDA context cleanly: it may be dead) after a result whose backend reports
    itself unhealthy.

    With ``defer_prepare`` (the GPU is shared with other jobs' children) only the host part
    of the set-up (``prepare_inputs``: random inputs, float64 references) runs at once; the
    device part waits for the parent's ``("prepare",)``, sent at its GPU turn, so that it never
    overlaps another job's timing."""
    try:
        from kato.kernels.registry import register

        for op in operators.open() if operators is not None else ():
            register(op)
        backend = build_backend(spec)
        conn.send(("ready", backend.device()))
        prepare = abilities_of(backend).prepare
        if defer_prepare:
            # The parent sends ("prepare",) at its first GPU turn whatever the backend: take
            # it here, with or without a set-up to run, so the loop below sees only configs.
            prepare_inputs = getattr(backend, "prepare_inputs", None)
            if prepare is not None and prepare_inputs is not None:
                prepare_inputs()
            message = conn.recv()
            while message[0] == "memory":  # read before the set-up, to admit the job by it
                conn.send(("memory", _memory_of(backend)))
                message = conn.recv()
            if message[0] == "close":
                _close_and_say_so(conn, backend)
                return
        if prepare is not None:
            prepare()
        conn.send(("prepared",))
    except BaseException as exc:  # report why, then exit: the parent fails the job
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent went away
            break
        if message[0] == "close":
            _close_and_say_so(conn, backend)
            break
        if message[0] == "memory":
            conn.send(("memory", _memory_of(backend)))
            continue
        config = message[1]
        backend.trial_limit_s = message[2] if len(message) > 2 else None
        try:
            result = backend.evaluate(config)
        except Exception as exc:  # the contract says never; a backend bug fails the trial only
            result = TrialResult(
                config=dict(config),
                status=TrialStatus.CRASHED,
                error=f"backend raised {type(exc).__name__}: {exc}\n"
                + traceback.format_exc(limit=8)[-3000:],
            )
        healthy = result.ok or backend.healthy()
        conn.send(("result", result, healthy))
        if not healthy:
            os._exit(0)  # a dead CUDA context: the parent starts a fresh child
    conn.close()


def _close_and_say_so(conn: multiprocessing.connection.Connection, backend: Backend) -> None:
    """The child's answer to ``("close",)``: close the backend and drop the primary context a
    spare's warm-up retained (with the backend's, the child's references to it: nothing else in
    a measuring child starts CUDA's runtime, so the context, with every buffer of the job, ends
    here), then say ``("closed",)``, so that the parent's wait for the device to be free
    (:meth:`IsolatedBackend.release_device`) does not include this process's exit; a close
    that fails says ``("close_failed",)`` (the parent then kills this process)."""
    try:
        backend.close()
    except BaseException:
        # Its context may still be held: the parent kills this process at once (its end frees
        # the device) rather than taking the device for free.
        with contextlib.suppress(OSError):
            conn.send(("close_failed",))
        raise
    while _warm_contexts:
        from kato.tuner import cuda_driver

        device_index = _warm_contexts.pop()
        with contextlib.suppress(cuda_driver.CudaDriverError, OSError):
            cuda_driver.release_primary_context(device_index)
    with contextlib.suppress(OSError):
        conn.send(("closed",))


def _memory_of(backend: Backend) -> DeviceMemory | None:
    """The child's answer to ``("memory",)``: its backend's report, None if it has none or
    the query fails (a dead context: the parent then knows nothing of the device's memory)."""
    memory = abilities_of(backend).memory
    if memory is None:
        return None
    try:
        return memory()
    except Exception:
        log.warning("the device's memory could not be read", exc_info=True)
        return None


#: Devices whose primary context this process's warm-up retained (a spare: :func:`_warm_up`);
#: released when the child closes its backend (:func:`_close_and_say_so`).
_warm_contexts: list[int] = []


def _warm_up(kind: str, device_index: int, imports: tuple[str, ...]) -> None:
    """In a spare: what a child of ``kind`` on device ``device_index`` does before it knows its
    job (:func:`_child_main`'s and :func:`build_backend`'s imports, in their order: the operator
    registry, numpy and ``ml_dtypes`` with it, is most of a replay child's start; for ``pycuda``
    the driver's start and the device's primary context, held until the child closes its
    backend: see the module docstring). Raises what a step raises (the caller ignores it)."""
    importlib.import_module("kato.kernels.registry")
    for module in imports:
        importlib.import_module(module)
    if kind == "pycuda":
        from kato.tuner import cuda_driver
        from kato.tuner.backends.pycuda import _import_pycuda

        _import_pycuda().init()
        # Not made current: the backend retains it again and pushes it (no second context).
        cuda_driver.retain_primary_context(device_index)
        _warm_contexts.append(device_index)
        return
    if kind == "replay":
        importlib.import_module("kato.tuner.backends.replay")
        return
    module_name, _, attr = kind.partition(":")
    if attr:
        importlib.import_module(module_name)


def _spare_main(
    conn: multiprocessing.connection.Connection,
    kind: str,
    device_index: int,
    imports: tuple[str, ...],
) -> None:
    """A spare child: warm up (:func:`_warm_up`, best effort), say so (``("warm",)``), wait for
    a job (``("job", spec, operators, defer_prepare)``) and become its child
    (:func:`_child_main`); exit when the pipe closes first (its pool closed)."""
    with contextlib.suppress(Exception):  # the job's child repeats the step, and reports it
        _warm_up(kind, device_index, imports)
    try:
        conn.send(("warm",))
        message = conn.recv()
    except (EOFError, OSError, KeyboardInterrupt):  # the pool closed, or the worker stops
        return
    if message[0] == "job":
        _child_main(conn, *message[1:])


def _environment() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], str]:
    """What a spawned child copies from this process when it starts: the environment,
    ``sys.path`` and the working directory."""
    return env.inherited(), tuple(sys.path), os.getcwd()


def _running(process: Any) -> bool:
    """Whether ``process`` (a child) still runs: ``is_alive`` reaps a dead child, but answers
    True for one that something else reaped (its ``waitpid`` then fails); the pid's absence
    says so."""
    if not process.is_alive():
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by another user's process: not our child
        return False
    return True


@dataclass
class _Spare:
    process: Any
    conn: multiprocessing.connection.Connection
    environment: tuple[Any, ...]

    def stop(self) -> None:
        """Kill it (an idle spare holds nothing to save) and reap it."""
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


class SpareChildren:
    """At most one idle, warm measuring child for backends of ``kind`` on device
    ``device_index`` importing ``imports`` (see the module docstring); thread-safe.

    Contract: nothing is started before :meth:`start`. :meth:`take` hands the idle spare (alive,
    warm or still warming) to one :class:`IsolatedBackend` for good, and starts the next spare
    in a background thread at once; it returns None (the backend starts a fresh child) when the
    pool is not started, the spec is of another kind, device or imports, no spare is ready
    yet, or the spare is dead or was started with another environment (then replaced).
    :meth:`close` kills the idle spare and any being started, and waits for them: no process
    of the pool is left; :meth:`start` opens it again.

    ``started``: the pid of every spare started, in order; ``taken``: how many were handed out;
    ``discarded``: how many were replaced without being used (dead, or stale).
    """

    def __init__(self, kind: str, *, device_index: int = 0, imports: Sequence[str] = ()):
        self.kind, self.device_index, self.imports = kind, device_index, tuple(imports)
        self.started: list[int] = []
        self.taken = self.discarded = 0
        self._mp = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._open = False
        self._idle: _Spare | None = None
        self._refill: threading.Thread | None = None

    def fits(self, spec: BackendSpec) -> bool:
        """Whether this pool's spares are warmed for ``spec``'s kind, device and imports."""
        return (spec.kind, spec.device_index, tuple(spec.imports)) == (
            self.kind,
            self.device_index,
            self.imports,
        )

    def start(self) -> None:
        """Open the pool and start a spare now (if none is idle)."""
        with self._lock:
            self._open = True
            if self._idle is None:
                self._idle = self._spawn()

    def take(self, spec: BackendSpec) -> _Spare | None:
        """The idle spare for ``spec``'s backend, now its own (see the class docstring)."""
        if not self.fits(spec):
            return None
        stale = None
        with self._lock:
            if not self._open:
                return None
            spare, self._idle = self._idle, None
            if spare is not None and not _running(spare.process):
                log.warning("the spare measuring process died (%s): replaced",
                            _describe_exit(spare.process.exitcode))  # fmt: skip
                stale, spare = spare, None
            elif spare is not None and spare.environment != _environment():
                log.info(
                    "the spare measuring process started with another environment (%s): "
                    "replaced", _changes(spare.environment, _environment()),
                )  # fmt: skip
                stale, spare = spare, None
            if spare is not None:
                self.taken += 1
            if stale is not None:
                self.discarded += 1
            if self._refill is None or not self._refill.is_alive():
                self._refill = threading.Thread(
                    target=self._fill, name="kato-spare-child", daemon=True
                )
                self._refill.start()
        if stale is not None:
            stale.stop()
        return spare

    def idle_pid(self) -> int | None:
        """The pid of the idle spare, None if there is none now."""
        with self._lock:
            return self._idle.process.pid if self._idle is not None else None

    def wait_warm(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until an idle spare has warmed up; whether one has
        (benchmarks and tests: a spare taken before is still worth having)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spare = self._idle
                if spare is not None and spare.conn.poll(0):
                    return True
            time.sleep(_POLL_S)
        return False

    def close(self) -> None:
        """Kill the idle spare and any being started, and wait for them. Safe to call twice."""
        with self._lock:
            self._open = False
            spare, self._idle = self._idle, None
            refill = self._refill
        if refill is not None:
            refill.join()
        if spare is not None:
            spare.stop()

    def _fill(self) -> None:
        """The background start of the next spare (after a take)."""
        with self._lock:
            if self._open and self._idle is None:
                self._idle = self._spawn()

    def _spawn(self) -> _Spare | None:
        """Start a spare (under the lock: tens of ms for the parent); None if it cannot."""
        try:
            parent_conn, child_conn = self._mp.Pipe()
            process = self._mp.Process(
                target=_spare_main,
                args=(child_conn, self.kind, self.device_index, self.imports),
                name="kato-measure",
                daemon=True,
            )
            environment = _environment()
            process.start()
        except Exception:  # no spare: every job starts its own child, as without a pool
            log.warning("a spare measuring process could not start", exc_info=True)
            return None
        child_conn.close()
        self.started.append(process.pid)
        return _Spare(process, parent_conn, environment)


def _changes(before: tuple[Any, ...], now: tuple[Any, ...]) -> str:
    """Which of (environment, sys.path, working directory) differ: the variables by name."""
    parts = []
    old_env, new_env = dict(before[0]), dict(now[0])
    names = sorted(k for k in old_env.keys() | new_env.keys() if old_env.get(k) != new_env.get(k))
    if names:
        parts.append("variables " + ", ".join(names))
    if before[1] != now[1]:
        parts.append("sys.path")
    if before[2] != now[2]:
        parts.append("working directory")
    return "; ".join(parts)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class IsolatedBackend(Backend):
    """Measures in a child process built from ``spec``; see the module docstring.

    Args:
        spec: what the child builds.
        trial_timeout_s: longest one config may take in the child (compile, verify, time)
            where its cost is not predicted; the floor of the scaled limit
            (:attr:`trial_limit_s`) where it is.
        start_timeout_s: longest a child may take to start.
        compile_workers: parallel nvcc processes for :meth:`precompile` (pycuda; default: one
            per core but one).
        defer_prepare: the child makes its inputs at once but sets up the device only at the
            first evaluation (a worker sharing the GPU among jobs evaluates in its GPU turn).
        spares: a pool whose warm spare (:class:`SpareChildren`) each child of this backend,
            the first and every replacement, starts from where it has one for the spec; else
            (and without a pool) a fresh child is spawned.

    Raises:
        ChildStartError: the first child could not build its backend.
        tuner.trial_cost.UnmeasurableTask: the task's predicted launches alone exceed the
            capped limit (the child is stopped).

    Thread-safety: one thread evaluates; :meth:`interrupt` may be called from any thread.
    """

    measures_out_of_process = True  # the child times: this process's threads cannot pause it

    def __init__(
        self,
        spec: BackendSpec,
        *,
        trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        compile_workers: int | None = None,
        defer_prepare: bool = False,
        spares: SpareChildren | None = None,
    ):
        self.spec = spec
        self.defer_prepare = defer_prepare
        self.spares = spares
        self.name = f"isolated-{spec.kind}"
        self.trial_timeout_s = trial_timeout_s
        self.start_timeout_s = start_timeout_s
        self.compile_workers = compile_workers
        self.restarts = 0  # children replaced after a crash, a timeout or a dead context
        #: Every child that served this backend, in order (a spare taken included).
        self.child_pids: list[int] = []
        #: How many of them were spares (:class:`SpareChildren`).
        self.spares_taken = 0
        self._mp = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._interrupted = threading.Event()
        self._prepared = False  # the current child has made its inputs ("prepared" received)
        self._queue: CompileQueue[Any] | None = None
        # The user operator packed for its children once (its arrays in shared memory: every
        # replacement child maps the same block); released at close.
        self._operators: shipping.Package | None = None
        self._packed = False
        self._device_released = False
        try:
            self._info = self._start()
            self._space, self._launch_s = self._describe_task()
            check_measurable(trial_timeout_s, self._launch_s, self._what())
        except BaseException:
            self._kill()
            self._release_operators()
            raise
        #: The limit of each trial: ``trial_timeout_s`` scaled to the predicted launch time.
        self.trial_limit_s = scaled_trial_timeout_s(trial_timeout_s, self._launch_s)
        if self.trial_limit_s > trial_timeout_s:
            log.info(
                "one launch of %s takes at least %.3g s: per-trial limit %.0f s (floor %.0f s)",
                spec.operator or spec.kind, self._launch_s, self.trial_limit_s, trial_timeout_s,
            )  # fmt: skip

    # --- the child ------------------------------------------------------------------------

    def _start(self, *, spare: bool = True) -> DeviceInfo:
        """Start the child (a spare of :attr:`spares` where it has one, else a fresh one) and
        wait for its device. A spare that dies before announcing it, without a word, is
        replaced by a fresh child once (see the module docstring).

        Raises:
            TrialInterrupted, ChildStartError: as :meth:`_expect`.
        """
        if not self._packed:
            self._operators, self._packed = _user_operators(self.spec), True
        operators = self._operators
        taken = self.spares.take(self.spec) if spare and self.spares is not None else None
        if taken is not None:
            try:
                taken.conn.send(("job", self.spec, operators, self.defer_prepare))
            except OSError:  # it died since: its pipe is closed
                taken.stop()
                taken = None
        if taken is not None:
            self._process, self._conn = taken.process, taken.conn
            self.spares_taken += 1
        else:
            parent_conn, child_conn = self._mp.Pipe()
            process = self._mp.Process(
                target=_child_main,
                args=(child_conn, self.spec, operators, self.defer_prepare),
                name="kato-measure",
                daemon=True,
            )
            process.start()
            child_conn.close()  # so that the child's death closes the pipe (EOF) for us
            self._process, self._conn = process, parent_conn
        self._prepared = False
        self._device_released = False  # this child has not been told to close
        self.child_pids.append(self._process.pid)
        try:
            return self._expect("ready", ("start", "started", "starting"))[1]
        except _ChildDied as exc:
            if taken is None:
                raise
            log.warning("the spare measuring process died before its job started (%s): "
                        "starting a fresh one", exc)  # fmt: skip
            return self._start(spare=False)

    def _expect(self, kind: str, verb: tuple[str, str, str]) -> tuple[Any, ...]:
        """The child's next message, which must be ``kind`` (its set-up steps: "ready", then
        "prepared"), waited for up to ``start_timeout_s``; ``verb`` (infinitive, past,
        gerund) names the step in errors.

        Raises:
            TrialInterrupted: :meth:`interrupt` was called meanwhile (the child is killed).
            ChildStartError: the child reported an error, died, or took too long (killed).
        """
        do, done, doing = verb
        conn, process = self._conn, self._process
        assert conn is not None and process is not None
        deadline = time.monotonic() + self.start_timeout_s
        message: tuple[Any, ...] = ("warm",)
        while message[0] == "warm":  # a spare's word that it warmed up: not a step of the job
            while not conn.poll(_POLL_S):
                if self._interrupted.is_set():
                    self._kill()
                    raise TrialInterrupted(f"interrupted while the measuring process {done}")
                if time.monotonic() > deadline or not process.is_alive():
                    state = _describe_exit(process.exitcode)
                    died = not process.is_alive()
                    self._kill()
                    error = _ChildDied if died else ChildStartError
                    raise error(f"the measuring process did not {do} ({state})")
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._kill()
                raise _ChildDied(f"the measuring process died while {doing}") from None
        if message[0] != kind:
            self._kill()
            raise ChildStartError(f"the measuring process could not {do}: {message[1]}")
        return message

    def _kill(self) -> None:
        """Kill the child (if any) and forget it; the next evaluation starts a new one."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(10)

    def _retire(self) -> None:
        """The child exited by itself (dead context) or died: reap it."""
        self.restarts += 1
        self._kill()

    # --- Backend API ----------------------------------------------------------------------

    def _what(self) -> str:
        spec = self.spec
        if not spec.operator:
            return spec.replay_file or spec.kind
        shape = "x".join(str(d) for d in spec.shape)
        return f"{spec.operator} {shape} {spec.dtype} on {self._info.model}"

    def _describe_task(self) -> tuple[SearchSpace, float | None]:
        """The task's search space and the predicted lower bound of one launch (seconds, or
        None), found in this process without a GPU."""
        if self.spec.kind != "pycuda":
            shadow = build_backend(self.spec)  # cheap and GPU-free by the spec's contract
            try:
                return shadow.space(), shadow.launch_lower_bound_s()
            finally:
                shadow.close()
        from functools import partial

        from kato.kernels import get_operator
        from kato.tuner.backends.pycuda import check_on_gpu, operator_space

        assert self.spec.operator and self.spec.dtype
        op = get_operator(self.spec.operator)
        gpu = find_gpu(self._info.model)
        check = partial(check_on_gpu, op, self.spec.shape, self.spec.dtype, gpu)
        arch = self._info.arch
        space = operator_space(
            op, self.spec.shape, self.spec.dtype, lambda config: check(config, arch), gpu
        )
        return space, launch_lower_bound_s(op, self.spec.shape, self.spec.dtype, gpu)

    def device(self) -> DeviceInfo:
        return self._info

    def space(self) -> SearchSpace:
        return self._space

    def launch_lower_bound_s(self) -> float | None:
        return self._launch_s

    def interrupt(self) -> None:
        """Stop: kill a running measurement now; later evaluations raise TrialInterrupted."""
        self._interrupted.set()

    def evaluate(self, config: Config) -> TrialResult:
        """Measure ``config`` in the child. A crash or a timeout is a failed result (status
        ``crashed`` / ``timeout``), the child replaced.

        Raises:
            TrialInterrupted: :meth:`interrupt` was called (before or during the measurement).
            ChildStartError: a replacement child could not start (the device is gone).
        """
        if self._interrupted.is_set():
            raise TrialInterrupted("the backend was interrupted")
        self._wait_for_compile(config)
        if self._interrupted.is_set():  # a cancel during the wait: nvcc may still be running
            raise TrialInterrupted("the backend was interrupted")
        if self._process is None:
            self._start()
        self._await_prepared()
        assert self._conn is not None
        try:
            self._conn.send(("evaluate", dict(config), self.trial_limit_s))
        except (OSError, BrokenPipeError):
            return self._crashed(config)
        deadline = time.monotonic() + self.trial_limit_s
        while True:
            if self._interrupted.is_set():
                self._kill()
                raise TrialInterrupted("the measurement was interrupted")
            if self._conn.poll(_POLL_S):
                try:
                    _, result, healthy = self._conn.recv()
                except (EOFError, OSError):
                    return self._crashed(config)
                if not healthy:
                    log.warning("config %s left the CUDA context unusable: new child", config)
                    self._retire()
                return result
            if time.monotonic() > deadline:
                self.restarts += 1
                self._kill()
                return TrialResult(
                    config=dict(config),
                    status=TrialStatus.TIMEOUT,
                    error=(
                        f"no result within {self.trial_limit_s:g} s (compile, verify and "
                        f"time{self._limit_note()}); the measuring process was killed and "
                        "replaced"
                    ),
                )

    def _limit_note(self) -> str:
        if self.trial_limit_s <= self.trial_timeout_s or not self._launch_s:
            return ""
        return (
            f"; the limit of {self.trial_timeout_s:g} s scaled to one launch's predicted "
            f"minimum of {self._launch_s:.3g} s"
        )

    def prepare(self) -> None:
        """Have the child finish its set-up now (with ``defer_prepare``, its device buffers)
        and wait for it, instead of at the first evaluation; idempotent
        (:class:`tuner.backends.abilities.Prepares`). Raises as :meth:`_await_prepared`."""
        if self._process is None:
            self._start()
        self._await_prepared()

    def memory(self) -> DeviceMemory | None:
        """The device's memory as the child's backend reports it
        (:class:`tuner.backends.abilities.ReportsMemory`); None if it cannot tell, or the
        child is gone or does not answer within ``start_timeout_s`` (then it is replaced at
        the next evaluation). Before :meth:`prepare` with ``defer_prepare``, the child's
        buffers are not on the device yet."""
        conn, process = self._conn, self._process
        if conn is None or process is None:
            return None
        deadline = time.monotonic() + self.start_timeout_s
        try:
            conn.send(("memory",))
            while True:
                while not conn.poll(_POLL_S):
                    if time.monotonic() > deadline or not process.is_alive():
                        self._kill()
                        return None
                kind, *answer = conn.recv()
                if kind == "memory":
                    return answer[0]
                if kind != "prepared":  # its set-up failed: the next evaluation says why
                    self._kill()
                    return None
                self._prepared = True  # a child that sets up at once said so first
        except (EOFError, OSError):
            self._kill()
            return None

    def _await_prepared(self) -> None:
        """Wait (up to ``start_timeout_s``, not a trial's limit) until the child has made its
        inputs and buffers, which it does after announcing its device.

        Raises:
            TrialInterrupted: :meth:`interrupt` was called meanwhile.
            ChildStartError: the child failed to prepare, died, or took too long.
        """
        if not self._prepared:
            if self.defer_prepare and self._conn is not None:
                with contextlib.suppress(OSError):  # the child died: _expect says so
                    self._conn.send(("prepare",))
            self._expect("prepared", ("prepare", "prepared", "preparing"))
        self._prepared = True

    def _crashed(self, config: Config) -> TrialResult:
        process = self._process
        if process is not None:
            process.join(5)
        state = _describe_exit(process.exitcode if process is not None else None)
        self._retire()
        log.warning("measuring process died (%s) on config %s", state, config)
        return TrialResult(
            config=dict(config),
            status=TrialStatus.CRASHED,
            error=f"the measuring process died ({state}) while evaluating this config; replaced",
        )

    # --- compile ahead (pycuda) -----------------------------------------------------------

    def precompile(self, configs: Sequence[Config], max_workers: int | None = None) -> None:
        """Queue ``configs`` for compiling with nvcc in the parent, in parallel, into the on-disk
        cache the child reads (pycuda only; a no-op for other kinds)."""
        queue = self._compile_queue(max_workers)
        if queue is not None:
            queue.add(configs)

    def hint(self, configs: Sequence[Config]) -> None:
        """Compile ``configs`` next, before the rest of the queue (the search expects them)."""
        queue = self._compile_queue()
        if queue is not None:
            queue.hint(configs)

    def is_compiled(self, config: Config) -> bool:
        """Whether measuring ``config`` now would not wait on nvcc (pycuda: its compile ahead is
        done; other kinds compile nothing: always)."""
        if self.spec.kind != "pycuda":
            return True
        return self._queue is not None and self._queue.is_done(config)

    def wait_compiled(self, configs: Sequence[Config]) -> None:
        """Block until one of ``configs`` has finished compiling ahead (at once if none of them
        has started): the search then measures that one (``Search(wait_ready=...)``)."""
        if self._queue is not None:
            self._queue.wait_any(configs, stop=self._interrupted)

    @property
    def compile_stats(self) -> CompileStats:
        """Compiles taken ahead / inline, and seconds spent waiting on them."""
        return self._queue.stats if self._queue is not None else CompileStats()

    def _compile_queue(self, max_workers: int | None = None) -> CompileQueue[Any] | None:
        if self.spec.kind != "pycuda":
            return None
        if self._queue is None:
            from kato.kernels import get_operator
            from kato.tuner.backends.pycuda import compile_config

            op = get_operator(self.spec.operator or "")
            cache = self.spec.option("compile_cache")
            cache = Path(cache) if cache is not None else None
            arch, shape, dtype = self._info.arch, self.spec.shape, self.spec.dtype or ""

            def compile_one(config: Config) -> Any:
                return compile_config(op, shape, dtype, config, arch, cache)

            workers = max_workers or self.compile_workers
            self._queue = CompileQueue(compile_one, self._space.key, workers, nvcc_slots())
        return self._queue

    def _wait_for_compile(self, config: Config) -> None:
        """A compile of ``config`` started ahead: wait for it so the child does not run nvcc a
        second time (a compile error is the child's to report, as the trial's result); one not
        started yet is dropped from the queue (the child compiles it now, under the trial's
        timeout)."""
        queue = self._compile_queue()
        if queue is not None:
            queue.wait(config, stop=self._interrupted)

    def close_compiles(self) -> None:
        """Drop the compiles queued ahead and wait for the running ones (no GPU work)."""
        if self._queue is not None:
            self._queue.close()

    def release_device(self) -> None:
        """End the child's hold on the GPU: it closes its backend (buffers, modules, CUDA
        context) and says so; this returns then, leaving the child's process exit (the
        interpreter's teardown, most of a close's time) to :meth:`close`. A child that does
        not say so within :data:`CLOSE_WAIT_S` is killed (its end frees the device). Safe to
        call twice, and before :meth:`close`."""
        if self._conn is None or self._process is None or self._device_released:
            return
        self._device_released = True
        try:
            self._conn.send(("close",))
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._conn.poll(max(0.0, deadline - time.monotonic())):
                answer = self._conn.recv()[0]
                if answer == "closed":
                    return
                if answer == "close_failed":
                    break
        except (OSError, EOFError):  # the child went away: its context went with it
            return
        log.warning("the measuring process %s did not close its backend: killed",
                    self._process.pid)  # fmt: skip
        self._kill()  # its end frees the device

    def close(self) -> None:
        """Stop the child (politely, then by force) and the compile pool. Safe to call twice."""
        if self._queue is not None:
            self._queue.close()
        self.release_device()  # a no-op where it was released (or killed) already
        if self._process is not None:
            self._process.join(CLOSE_WAIT_S)
        self._kill()
        self._release_operators()

    def _release_operators(self) -> None:
        """Unlink the packed operator's block (children that mapped it keep their mapping)."""
        package, self._operators, self._packed = self._operators, None, False
        if package is not None:
            package.release()


def measuring_backend(
    spec: BackendSpec,
    *,
    isolate: bool,
    trial_timeout_s: float,
    defer_prepare: bool = False,
    spares: SpareChildren | None = None,
) -> Backend:
    """The backend every tuning path measures ``spec`` through: with ``isolate``, an
    :class:`IsolatedBackend` (a hung or faulting config is a ``timeout`` / ``crashed`` trial and
    the search goes on); without (for debugging), the backend itself in this process, which
    nothing can stop mid-trial but which still fits its timing repeats into the same scaled
    limit (:attr:`Backend.trial_limit_s`).

    ``trial_timeout_s`` is the configured per-trial limit (``KATO_TRIAL_TIMEOUT_SECONDS``), the
    floor of the limit scaled to the task's predicted cost (:mod:`tuner.trial_cost`).
    ``spares`` (isolated only; unused in process): the worker's pool of warm children
    (:class:`SpareChildren`) the backend's children start from.

    Raises:
        ChildStartError: (isolated) the child could not build its backend.
        tuner.trial_cost.UnmeasurableTask: the launches every trial makes, at the task's
            predicted lower bound, exceed the capped limit: no config could be measured.
        Whatever the backend raises for problems of its own (in process).
    """
    if isolate:
        return IsolatedBackend(
            spec, trial_timeout_s=trial_timeout_s, defer_prepare=defer_prepare, spares=spares
        )
    backend = build_backend(spec)
    launch_s = backend.launch_lower_bound_s()
    try:
        check_measurable(trial_timeout_s, launch_s, spec.operator or spec.kind)
    except BaseException:
        backend.close()
        raise
    backend.trial_limit_s = scaled_trial_timeout_s(trial_timeout_s, launch_s)
    return backend
