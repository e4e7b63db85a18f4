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

``KATO_FRAMEWORK_BASELINE`` (true by default; false, 0, no or off) turns it off.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kato import env
from kato.shared.gpus import normalize_gpu_name

#: The environment variable that turns the baseline off (``service.settings.Settings``
#: documents it as ``framework_baseline``).
ENV_ENABLED = "KATO_FRAMEWORK_BASELINE"
#: Longest one baseline may take in its child (torch import, CUDA start, inputs, references,
#: verification and timing), seconds.
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
    checks passed)."""

    status: str
    framework: str | None = None
    op: str | None = None
    times_ms: tuple[float, ...] = field(default=())
    detail: str | None = None

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


def stored_label(result: FrameworkResult) -> str | None:
    """What a best-config row stores as its ``framework``: the name and version, marked
    ``" (mismatch)"`` where the op's outputs were outside Kato's tolerance, so that a lookup
    (and a reader of an export) sees which baselines did not verify."""
    if result.framework is None or result.status != MISMATCH:
        return result.framework
    return f"{result.framework} ({MISMATCH})"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether workers take the baseline: ``KATO_FRAMEWORK_BASELINE`` read as the service's
    settings read a boolean (true, 1, yes, on / false, 0, no, off; unset: true).

    Raises:
        ValueError: the variable holds something else (a worker says so at its first job).
    """
    value = env.get(ENV_ENABLED, environ)
    if value is None:
        return True
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value.strip())
    except ValidationError:
        raise ValueError(
            f"{ENV_ENABLED}={value!r}: expected true or false (1/0, yes/no, on/off)"
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
) -> None:
    """The measuring child: answers one :class:`FrameworkResult` and exits. With ``wait_turn``
    it imports torch first, says ``("ready",)`` and waits for the parent's word before it
    touches the GPU (the parent's GPU turn: :func:`measure_in_child`)."""
    try:
        if wait_turn:
            with contextlib.suppress(ImportError):  # measure_here reports it
                import torch  # noqa: F401 - seconds of import, outside the GPU's turn
            conn.send(("ready",))
            conn.recv()
        result = measure_here(
            operator, shape, dtype, device_index=device_index, gpu_model=gpu_model,
            imports=imports, seed=seed,
        )  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - anything is the baseline's failure, reported
        detail = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=6)[-2000:]
        result = FrameworkResult(FAILED, detail=detail)
    try:
        conn.send(result)
    finally:
        conn.close()


def measure_here(
    operator: str,
    shape: Sequence[int],
    dtype: str,
    *,
    device_index: int = 0,
    gpu_model: str | None = None,
    imports: Sequence[str] = (),
    seed: int | None = None,
) -> FrameworkResult:
    """The baseline in this process: ``skipped`` where torch does not import, sees no CUDA
    device ``device_index``, sees another GPU model there than ``gpu_model`` (the job's, in
    the catalog's spelling), or the operator has no torch equivalent; else
    :func:`tuner.torch_ops.measure` (which imports torch). ``imports``: modules to import first
    (one registering the operator)."""
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
    return torch_ops.measure(spec, shape, dtype, device_index=device_index, seed=seed)


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
) -> FrameworkResult:
    """:func:`measure_here` in a fresh child process (spawned: no CUDA state is inherited),
    waited for at most ``timeout_s`` and until ``stop`` is set (the child is then killed: a
    ``failed`` result). A child that dies without answering is ``failed`` too. Never raises
    for the measurement's own faults.

    ``turn``: the GPU's turn (a worker sharing its GPU among jobs, :mod:`tuner.gpu_gate`),
    entered only once the child has imported torch and held until it answers."""
    context = multiprocessing.get_context("spawn")
    if turn is not None:
        parent_conn, child_conn = context.Pipe(duplex=True)
    else:
        parent_conn, child_conn = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main,
        args=(child_conn, operator, tuple(shape), dtype, device_index, gpu_model,
              tuple(imports), seed, turn is not None),
        name="kato-framework",
        daemon=True,
    )  # fmt: skip
    process.start()
    child_conn.close()  # the child's death closes the pipe for us (EOF)
    with contextlib.ExitStack() as held:
        return _answer(parent_conn, process, timeout_s, stop, turn, held)


def _answer(
    parent_conn: Any,
    process: Any,
    timeout_s: float,
    stop: StopFlag | None,
    turn: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    held: contextlib.ExitStack,
) -> FrameworkResult:
    """The child's answer to :func:`measure_in_child` (its turn entered into ``held`` when it
    says it is ready)."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            answer = _next_message(parent_conn, process, deadline, timeout_s, stop)
            if isinstance(answer, FrameworkResult) or turn is None or answer != ("ready",):
                return _checked(answer)
            held.enter_context(turn())
            parent_conn.send(("go",))
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
