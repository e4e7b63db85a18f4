"""The framework baseline: PyTorch's own op timed on a job's problem, beside Kato's winner.

After a job's search the worker times torch's equivalent of the operator (:mod:`tuner.torch_ops`)
at the job's shape and dtype on the GPU the job ran on, with the method Kato's own timer uses
(CUDA events around batches queued behind a spin, inputs rotated past the L2, the median of the
batches), after checking torch's outputs against the same float64 references a Kato kernel
must match. The time is stored beside the winner (``kato_best_configs.framework_ms`` and
``framework``, e.g. ``"torch 2.13.0+cu130"``), and lookups report ``speedup`` = framework_ms /
time_ms, so a caller (``kato_torch``) can run torch's op where the tuned kernel is not faster.

The measurement runs in a child process of its own (``multiprocessing`` "spawn"), as a trial
does (:mod:`tuner.backends.isolated`): torch's CUDA context, its memory and any fault of its
kernels stay out of the worker, and it is bounded by a timeout. This module does not import
torch; the child does. A baseline that cannot be taken (torch missing, no CUDA device seen by
torch, another GPU model at that index, an operator without an equivalent: ``skipped``), that
fails (``failed``: an error, a crash, the timeout) is logged by the worker and not stored; the
job is ``done`` all the same. One whose outputs disagree with the references (``mismatch``: torch's
bfloat16 batch-norm backward, say, is outside Kato's tolerance on some elements) is timed and
stored all the same, with a warning: PyTorch's op is what a user runs in place of Kato's
(verified) kernel whatever its accuracy, so its time is still the never-slower policy's bar.

The compiled baseline: in the same child, once the eager op is timed, the same equivalent
compiled by ``torch.compile`` (Inductor, default mode, ``dynamic=False``, ``fullgraph`` where
dynamo traces the op whole) is checked against the same references and timed the same way
(:func:`tuner.torch_ops.measure_compiled`), stored as ``compiled_ms`` and ``compiled``
(``"torch.compile 2.14.1 inductor"``): what runs in Kato's place inside a compiled graph, the
policy's bar there (``kato_torch.policy``). The child sends the eager result first and the
compiled one after it, so the one timeout bounds both and a compile that overruns it (or
crashes the child) costs the compiled figure only. A compiled baseline that cannot be taken
(``skipped``: no Triton for the device, torch.compile raised) or ``failed`` is logged by the
worker and not stored; a ``mismatch`` is stored marked as the eager one is.

``KATO_FRAMEWORK_BASELINE`` (true by default; false, 0, no or off) turns both off;
``KATO_FRAMEWORK_COMPILED`` (true by default) the compiled one alone (compiling takes seconds
per key).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import secrets
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from kato import env
from kato.shared.gpus import normalize_gpu_name

if TYPE_CHECKING:
    from kato.kernels.spec import OperatorSpec, Problem

#: The environment variable that turns the baseline off (``service.settings.Settings``
#: documents it as ``framework_baseline``).
ENV_ENABLED = "KATO_FRAMEWORK_BASELINE"
#: The environment variable that turns the compiled baseline off (``Settings`` documents it as
#: ``framework_compiled``).
ENV_COMPILED = "KATO_FRAMEWORK_COMPILED"
#: Longest one baseline may take in its child (torch import, CUDA start, inputs, references,
#: verification and timing; then the compiled one's compile, check and timing), seconds.
DEFAULT_TIMEOUT_S = 300.0
#: How often the parent checks for a stop while the child measures.
_POLL_S = 0.05

#: Statuses of a :class:`FrameworkResult`.
OK, MISMATCH, SKIPPED, FAILED = "ok", "mismatch", "skipped", "failed"


class StopFlag(Protocol):
    """What stops a measurement: a ``threading.Event`` or anything with its ``is_set``."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class FrameworkResult:
    """One baseline measurement. ``framework`` names torch and its version (``"torch 2.13.0"``),
    ``op`` what ran (``"torch.softmax(x, dim=-1)"``), ``times_ms`` the per-call time of every
    timed batch (``ok`` and ``mismatch`` only), ``detail`` why a baseline is not ``ok`` (or the
    checks passed). ``compiled``: the same op compiled by ``torch.compile`` (an eager result's
    compiled baseline; None where it was not attempted)."""

    status: str
    framework: str | None = None
    op: str | None = None
    times_ms: tuple[float, ...] = field(default=())
    detail: str | None = None
    compiled: FrameworkResult | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK and bool(self.times_ms)

    @property
    def timed(self) -> bool:
        """Whether the op was timed: ``ok``, or a ``mismatch`` (timed all the same)."""
        return self.status in (OK, MISMATCH) and bool(self.times_ms)

    @property
    def time_ms(self) -> float | None:
        """The median per-call time (None unless :attr:`timed`)."""
        return statistics.median(self.times_ms) if self.timed else None


#: Characters a stored label may take (``kato_best_configs.framework`` and ``compiled``).
LABEL_CHARS = 64


def stored_label(result: FrameworkResult) -> str | None:
    """What a best-config row stores as its ``framework``: the name and version, marked
    ``" (mismatch)"`` where the op's outputs were outside Kato's tolerance, so that a lookup
    (and a reader of an export) sees which baselines did not verify."""
    if result.framework is None:
        return None
    suffix = f" ({MISMATCH})" if result.status == MISMATCH else ""
    # The columns (and export names) hold LABEL_CHARS: a long local version string
    # ("2.8.0a0+5228986c39.nv25.05") is cut, never the mismatch mark.
    return result.framework[: LABEL_CHARS - len(suffix)] + suffix


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether workers take the baseline: ``KATO_FRAMEWORK_BASELINE`` read as the service's
    settings read a boolean (true, 1, yes, on / false, 0, no, off; unset: true).

    Raises:
        ValueError: the variable holds something else (a worker says so at its first job).
    """
    return _boolean(ENV_ENABLED, env.get(ENV_ENABLED, environ))


def compiled_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the child also takes the compiled baseline: ``KATO_FRAMEWORK_COMPILED`` read as
    :func:`enabled` reads its variable (unset: true).

    Raises:
        ValueError: the variable holds something else (logged as the compiled one's reason).
    """
    return _boolean(ENV_COMPILED, env.get(ENV_COMPILED, environ))


def _boolean(name: str, value: str | None) -> bool:
    if value is None:
        return True
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value.strip())
    except ValidationError:
        raise ValueError(
            f"{name}={value!r}: expected true or false (1/0, yes/no, on/off)"
        ) from None


def _child_main(
    conn: multiprocessing.connection.Connection,
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    device_index: int,
    gpu_model: str | None,
    imports: tuple[str, ...],
    seed: int | None,
    wait_turn: bool = False,
    compiled: bool = False,
) -> None:
    """The measuring child: answers one :class:`FrameworkResult` and, with ``compiled`` where
    that one was timed, a second (:func:`measure_compiled_here`, on the same problem), then
    exits. With ``wait_turn`` it imports torch first, says ``("ready",)`` and waits for the
    parent's word before it touches the GPU (the parent's GPU turn: :func:`measure_in_child`);
    the parent gives the turn back with the first answer, and the child asks for it again in
    the same way once the compiled op is compiled and checked, before timing it."""
    if compiled and seed is None:
        seed = secrets.randbits(32)  # one problem for both baselines
    # Both baselines time the same problem: made once (its float64 references take seconds
    # for a large GEMM), kept until the compiled one is done; the child exits after.
    made: list[Problem] = []

    def problem_for(spec: OperatorSpec) -> Problem:
        if not made:
            import numpy as np

            made.append(spec.make_problem(tuple(shape), dtype, np.random.default_rng(seed)))
        return made[0]

    def await_turn() -> None:
        conn.send(("ready",))
        conn.recv()

    try:
        if wait_turn:
            with contextlib.suppress(ImportError):  # measure_here reports it
                import torch  # noqa: F401 - seconds of import, outside the GPU's turn
            await_turn()
        result = measure_here(
            operator, shape, dtype, device_index=device_index, gpu_model=gpu_model,
            imports=imports, seed=seed, problem_for=problem_for if compiled else None,
        )  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - anything is the baseline's failure, reported
        result = _failure(exc)
    try:
        conn.send(result)
        if compiled and result.timed:
            try:
                second = measure_compiled_here(
                    operator, shape, dtype, device_index=device_index, seed=seed,
                    before_timing=await_turn if wait_turn else None, problem_for=problem_for,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - the compiled baseline's failure
                second = _failure(exc)
            conn.send(second)
    finally:
        conn.close()


def _failure(exc: BaseException) -> FrameworkResult:
    """A ``failed`` result saying what a measurement raised."""
    detail = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=6)[-2000:]
    return FrameworkResult(FAILED, detail=detail)


def measure_here(
    operator: str,
    shape: Sequence[int],
    dtype: str,
    *,
    device_index: int = 0,
    gpu_model: str | None = None,
    imports: Sequence[str] = (),
    seed: int | None = None,
    problem_for: Callable[[OperatorSpec], Problem] | None = None,
) -> FrameworkResult:
    """The baseline in this process: ``skipped`` where torch does not import, sees no CUDA
    device ``device_index``, sees another GPU model there than ``gpu_model`` (the job's, in
    the catalog's spelling), or the operator has no torch equivalent; else
    :func:`tuner.torch_ops.measure` (which imports torch). ``imports``: modules to import first
    (one registering the operator). ``problem_for``: the problem to time, given the spec
    (default: made from ``seed``)."""
    import importlib

    for module in imports:
        importlib.import_module(module)
    try:
        import torch
    except ImportError as exc:
        return FrameworkResult(SKIPPED, detail=f"torch does not import: {exc}")
    framework = f"torch {torch.__version__}"
    if not torch.cuda.is_available() or torch.cuda.device_count() <= device_index:
        return FrameworkResult(
            SKIPPED, framework, detail=f"torch sees no CUDA device {device_index}"
        )

    seen = normalize_gpu_name(torch.cuda.get_device_name(device_index))
    if gpu_model is not None and seen != gpu_model:
        return FrameworkResult(
            SKIPPED,
            framework,
            detail=f"torch's CUDA device {device_index} is a {seen}, the job ran on a {gpu_model}",
        )
    from kato.kernels import get_operator
    from kato.tuner import torch_ops

    spec = get_operator(operator)
    if operator not in torch_ops.EQUIVALENTS:
        return FrameworkResult(SKIPPED, framework, detail=f"no torch equivalent of {operator}")
    problem = problem_for(spec) if problem_for is not None else None
    return torch_ops.measure(
        spec, shape, dtype, device_index=device_index, problem=problem, seed=seed
    )


def measure_compiled_here(
    operator: str,
    shape: Sequence[int],
    dtype: str,
    *,
    device_index: int = 0,
    seed: int | None = None,
    before_timing: Callable[[], object] | None = None,
    problem_for: Callable[[OperatorSpec], Problem] | None = None,
) -> FrameworkResult:
    """The compiled baseline in this process, after :func:`measure_here` timed the eager one
    (so torch, the device and the equivalent are known good):
    :func:`tuner.torch_ops.measure_compiled` (``before_timing``: called just before the
    timing; ``problem_for``: as for :func:`measure_here`, the eager baseline's problem).
    Inductor compiles in this process (``compile_threads`` 1: no pool of compile workers
    outlives or outgrows the child)."""
    import torch._inductor.config
    from kato.kernels import get_operator
    from kato.tuner import torch_ops

    torch._inductor.config.compile_threads = 1
    spec = get_operator(operator)
    return torch_ops.measure_compiled(
        spec, shape, dtype, device_index=device_index, seed=seed, before_timing=before_timing,
        problem=problem_for(spec) if problem_for is not None else None,
    )  # fmt: skip


def measure_in_child(
    operator: str,
    shape: Sequence[int],
    dtype: str,
    *,
    device_index: int = 0,
    gpu_model: str | None = None,
    imports: Sequence[str] = (),
    seed: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stop: StopFlag | None = None,
    turn: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    compiled: bool | None = None,
) -> FrameworkResult:
    """:func:`measure_here` in a fresh child process (spawned: no CUDA state is inherited),
    waited for at most ``timeout_s`` and until ``stop`` is set (the child is then killed: a
    ``failed`` result). A child that dies without answering is ``failed`` too. Never raises
    for the measurement's own faults.

    ``compiled`` (None: :func:`compiled_enabled`): a timed result also carries the compiled
    baseline (:attr:`FrameworkResult.compiled`), measured after it within the same
    ``timeout_s``; one not answered in time (or stopped, or the child died) is ``failed``
    and the eager result is kept. A bad ``KATO_FRAMEWORK_COMPILED`` makes it ``skipped``.

    ``turn``: the GPU's turn (a worker sharing its GPU among jobs, :mod:`tuner.gpu_gate`),
    entered only once the child has imported torch and held until it answers; with the
    compiled baseline, given back while the child compiles and entered again for its timing."""
    setting_error = None
    if compiled is None:
        try:
            compiled = compiled_enabled()
        except ValueError as exc:
            compiled, setting_error = False, str(exc)
    result = _in_child(
        operator, shape, dtype, device_index, gpu_model, imports, seed, timeout_s, stop, turn,
        compiled,
    )  # fmt: skip
    if setting_error is not None and result.timed:
        return replace(result, compiled=FrameworkResult(SKIPPED, detail=setting_error))
    return result


def _in_child(
    operator: str,
    shape: Sequence[int],
    dtype: str,
    device_index: int,
    gpu_model: str | None,
    imports: Sequence[str],
    seed: int | None,
    timeout_s: float,
    stop: StopFlag | None,
    turn: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    compiled: bool,
) -> FrameworkResult:
    """:func:`measure_in_child`'s child, started and answered (``compiled``: taken or not)."""
    context = multiprocessing.get_context("spawn")
    if turn is not None:
        parent_conn, child_conn = context.Pipe(duplex=True)
    else:
        parent_conn, child_conn = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main,
        args=(child_conn, operator, tuple(shape), dtype, device_index, gpu_model,
              tuple(imports), seed, turn is not None, compiled),
        name="kato-framework",
        daemon=True,
    )  # fmt: skip
    process.start()
    child_conn.close()  # the child's death closes the pipe for us (EOF)
    with contextlib.ExitStack() as held:
        return _answer(parent_conn, process, timeout_s, stop, turn, held, compiled)


def _answer(
    parent_conn: Any,
    process: Any,
    timeout_s: float,
    stop: StopFlag | None,
    turn: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    held: contextlib.ExitStack,
    compiled: bool = False,
) -> FrameworkResult:
    """The child's answer to :func:`measure_in_child` (its turn entered into ``held`` whenever
    it says it is ready), with ``compiled`` the compiled baseline's after a timed one."""
    deadline = time.monotonic() + timeout_s
    eager: FrameworkResult | None = None
    try:
        while True:
            answer = _next_message(parent_conn, process, deadline, timeout_s, stop)
            asks_turn = not isinstance(answer, FrameworkResult) and answer == ("ready",)
            if turn is not None and asks_turn:
                held.enter_context(turn())
                parent_conn.send(("go",))
                continue
            if eager is not None:
                return replace(eager, compiled=_checked(answer))
            eager = _checked(answer)
            if not (compiled and eager.timed):
                return eager
            held.close()  # the GPU is free while the child compiles; it asks again to time
    finally:
        parent_conn.close()
        if process.is_alive():
            process.kill()
        process.join(10)


def _checked(answer: Any) -> FrameworkResult:
    if not isinstance(answer, FrameworkResult):
        return FrameworkResult(FAILED, detail=f"unexpected answer {answer!r:.200}")
    return answer


def _next_message(
    parent_conn: Any, process: Any, deadline: float, timeout_s: float, stop: StopFlag | None
) -> Any:
    """The child's next message, or a failed result (stopped, too late, died)."""
    while not parent_conn.poll(_POLL_S):
        if stop is not None and stop.is_set():
            return FrameworkResult(FAILED, detail="stopped: the job ended meanwhile")
        if time.monotonic() > deadline:
            return FrameworkResult(FAILED, detail=f"no answer within {timeout_s:g} s")
        if not process.is_alive() and not parent_conn.poll(0):
            return FrameworkResult(
                FAILED, detail=f"the measuring process died (exit code {process.exitcode})"
            )
    try:
        return parent_conn.recv()
    except (EOFError, OSError):
        return FrameworkResult(FAILED, detail="the measuring process died while answering")
