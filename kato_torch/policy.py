"""Which implementation runs a call: Kato's tuned kernel or PyTorch's own op, and what was asked.

The policy ("never slower than the framework", issue 30) is decided per (operator, shape, dtype,
device) from what the configured client serves:

- ``"auto"`` (the default): Kato's kernel only where the service holds a winner tuned for this
  exact shape that was measured faster than PyTorch's op on the same inputs (the lookup's
  ``speedup`` at least :data:`MIN_SPEEDUP`, 1.05). Anything else (untuned, nearest-shape or
  default answers, an old service that reports no framework time, no client, the service down)
  runs PyTorch's op, so an untuned shape never makes a step slower than plain PyTorch. The
  winner must also save :data:`MIN_SAVING_MS` per call (the host's cost of a Kato call). A
  winner over the bar that saves less is :data:`WHEN_BUSY` in eager mode (:func:`verdict`): its
  kernel runs while the GPU is at least :data:`MIN_SAVING_MS` behind the host on the caller's
  stream (a step bound by the GPU, where the host's extra cost hides behind the queue;
  :mod:`kato_torch._backlog`), PyTorch's op otherwise (a step bound by the host). Asking costs
  the host too, so a call asks once whatever number of keys it decides, and a remembered
  fallback whose answer keeps being "no" backs off: after 8 in a row it asks twice per 3, 4,
  6, ... up to 66 calls or per 0.1 s, whichever comes first (PyTorch's op in between), until
  a "yes" (a host-bound step then asks rarely, a GPU-bound one on every call;
  :class:`kato_torch._backlog.Backoff`).

  Inside a ``torch.compile`` graph (``compiled``) the bar is what Inductor runs in Kato's
  place: where the answer reports ``compiled_speedup`` (``compiled_ms / time_ms``: the same
  op compiled by ``torch.compile``, timed by the worker after the eager one,
  :mod:`tuner.framework`), Kato's kernel must beat that by :data:`MIN_SPEEDUP_OVER_COMPILED`
  (the op compiled alone; in a model Inductor also fuses it with its neighbours) and save
  :data:`MIN_SAVING_MS` against ``compiled_ms``. Where it does not (a service or a row older
  than the compiled baseline, a key whose compile failed), the eager ``speedup`` must reach
  :data:`MIN_SPEEDUP_COMPILED` (a guess at Inductor's fusions) with the saving against
  ``framework_ms``. A compiled call is never :data:`WHEN_BUSY`: under either rule a winner
  over the bar that saves less runs PyTorch's op.

  A call whose tensors are not in the layout Kato's kernel takes (``relayout``: a channels-last
  activation for the NCHW batch-norm kernels, or any in a compiled graph where Inductor's
  layout optimisation makes convolution activations channels-last) runs PyTorch's op under
  "auto": a copy into the kernel's layout and one back cost about what the op itself does,
  and the winner's times leave them out.
- ``"kato"``: always Kato's kernel (the served config, else the operator's default).
- ``"torch"``: always PyTorch's op.

A mapping sets it per operator (``{"matmul": "torch", "*": "auto"}``; ``"*"`` is the rest).
Decisions are cached per key until :func:`configure` is called again; :func:`decide` is folded
to a constant by ``torch.compile`` (shapes are static there), so a compiled graph holds either
Kato's custom op or PyTorch's own ops, which Inductor may fuse.

Every decision is also what :func:`record` captures: the (operator, shape, dtype) keys a step
would tune.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

POLICIES = ("auto", "kato", "torch")
#: The stored speedup "auto" asks of a winner: the winner's time is the best of many configs'
#: medians (biased low by the noise the search selected for), and PyTorch's op is timed once.
MIN_SPEEDUP = 1.05
#: What "auto" asks inside a ``torch.compile`` graph of an answer without ``compiled_speedup``:
#: Inductor fuses a norm, softmax or loss with the elementwise ops around it, which an opaque
#: custom op prevents, so Kato's kernel must beat PyTorch's eager op by more than that fusion
#: saves (a residual add and a cast each cost a pass over the tensor the norm reads once).
MIN_SPEEDUP_COMPILED = 2.0
#: What "auto" asks inside a ``torch.compile`` graph over the measured compiled baseline
#: (``compiled_speedup``): that baseline is the op compiled alone, while in a model's graph
#: Inductor also fuses it with its neighbours (a residual add, a cast, an activation), which an
#: opaque Kato op prevents; a margin over 1.05 for that, until a model's compiled step says more.
MIN_SPEEDUP_OVER_COMPILED = 1.2
#: The GPU time (ms) an eager Kato call must save over PyTorch's op, where the answer reports
#: both times: a Kato call costs the host 0.17-0.26 ms more than PyTorch's own (a layer norm's
#: forward + backward on the H200 host, docs/results_h200.md), which a launch-bound step pays
#: in full; one saving a few microseconds of GPU time makes such a step slower.
MIN_SAVING_MS = 0.1

#: Verdicts of :func:`verdict`: PyTorch's op; Kato's kernel; Kato's kernel only while the GPU
#: runs far enough behind the host on the caller's stream (decided per call by the caller).
TORCH, KATO, WHEN_BUSY = 0, 1, 2

_lock = threading.Lock()
_settings: dict[str, Any] = {"client": None, "gpu": None, "policy": {"*": "auto"}}
_decisions: dict[tuple[Any, ...], int] = {}
_recorders: list[Recorder] = []
#: Operators with no PyTorch op to fall back on (users' kernels): "auto" runs Kato's for them.
_without_equivalent: set[str] = set()
#: Bumped by every :func:`set_settings`: callers' own caches of decisions compare it.
_generation = 0


def normalise_policy(policy: str | Mapping[str, str]) -> dict[str, str]:
    """``policy`` as ``{operator or "*": "auto" | "kato" | "torch"}``; raises ValueError naming
    the bad entry."""
    table = {"*": policy} if isinstance(policy, str) else dict(policy)
    table.setdefault("*", "auto")
    for name, value in table.items():
        if value not in POLICIES:
            raise ValueError(
                f"kato_torch policy for {name!r} must be one of {', '.join(POLICIES)}, "
                f"got {value!r}"
            )
    return table


def set_settings(client: Any, gpu: str | None, policy: str | Mapping[str, str]) -> None:
    """Replace the client, GPU model and policy; forget every cached decision."""
    global _generation
    table = normalise_policy(policy)
    with _lock:
        _settings.update(client=client, gpu=gpu, policy=table)
        _decisions.clear()
        _generation += 1


def without_framework_equivalent(operator: str) -> None:
    """Mark ``operator`` as having no PyTorch equivalent: under ``"auto"`` it runs Kato's
    kernel (there is nothing else to run); ``"torch"`` still never does."""
    global _generation
    with _lock:
        _without_equivalent.add(operator)
        for key in [k for k in _decisions if k[0] == operator]:
            del _decisions[key]
        _generation += 1  # callers' caches (kato_torch.ops) drop their old answers too


def generation() -> int:
    """Changes whenever the settings do (a cached decision older than it is stale)."""
    return _generation


def recording() -> bool:
    """Whether a :func:`record` block is active (every decision must then be seen by it)."""
    return bool(_recorders)


def settings() -> dict[str, Any]:
    """The current ``client``, ``gpu`` and ``policy`` (a copy)."""
    with _lock:
        return {**_settings, "policy": dict(_settings["policy"])}


def policy_for(operator: str) -> str:
    table = _settings["policy"]
    return table.get(operator, table["*"])


def served(operator: str, shape: tuple[int, ...], dtype: str) -> Any:
    """The client's answer for this key (a Lookup, a mapping, or None without a client or when
    the lookup fails: the service being down must not stop training)."""
    client, gpu = _settings["client"], _settings["gpu"]
    if client is None:
        return None
    try:
        ask = getattr(client, "lookup", None) or client.config
        return ask(operator, shape, dtype, gpu=gpu)
    except Exception as exc:
        log.warning("config lookup for %s %s %s failed: %s", operator, shape, dtype, exc)
        return None


def _field(answer: Any, name: str) -> Any:
    if isinstance(answer, Mapping):
        return answer.get(name)
    return getattr(answer, name, None)


def served_config(answer: Any) -> tuple[dict[str, Any], str]:
    """(config, source) of a client's answer: a Lookup (``.config``, ``.source``), a mapping in
    the service's shape (``{"config": ..., "source": ...}``), or a bare config mapping (what a
    ``config()`` method returns; source ``"client"``)."""
    if isinstance(answer, Mapping):
        if isinstance(answer.get("config"), Mapping):
            return dict(answer["config"]), str(answer.get("source", "client"))
        return dict(answer), "client"
    return dict(getattr(answer, "config", None) or {}), str(getattr(answer, "source", "client"))


def judge(answer: Any, compiled: bool = False) -> int:
    """:data:`KATO` where ``answer`` is a winner tuned for this very shape that beat the
    framework by the bar and, where the answer reports ``time_ms`` and the bar's time, saves
    at least :data:`MIN_SAVING_MS` of GPU time per call; :data:`WHEN_BUSY` where it beat the
    bar but saves less, for an eager call; else :data:`TORCH`. The bar: ``speedup`` (eager
    PyTorch, ``framework_ms``) against :data:`MIN_SPEEDUP`; for a call in a compiled graph
    ``compiled_speedup`` (``compiled_ms``) against :data:`MIN_SPEEDUP_OVER_COMPILED` where the
    answer has it, else ``speedup`` against :data:`MIN_SPEEDUP_COMPILED` (the module's
    docstring), and in either case the eager verdict must be :data:`KATO` too: the op's
    implementation decides again, eagerly, when the graph runs, and a "yes" at trace time
    that runs PyTorch's op then is an opaque op that only blocks Inductor's fusions."""
    if answer is None or _field(answer, "source") != "exact":
        return TORCH
    eager = _over(answer, _field(answer, "speedup"), MIN_SPEEDUP, "framework_ms")
    if not compiled:
        return eager
    if eager != KATO:
        return TORCH
    compiled_speedup = _field(answer, "compiled_speedup")
    if compiled_speedup is not None:
        verdict = _over(answer, compiled_speedup, MIN_SPEEDUP_OVER_COMPILED, "compiled_ms")
    else:
        verdict = _over(answer, _field(answer, "speedup"), MIN_SPEEDUP_COMPILED, "framework_ms")
    # A graph cannot ask the queue at trace time: a small saving is no "yes" there.
    return KATO if verdict == KATO else TORCH


def _over(answer: Any, speedup: Any, bar: float, baseline: str) -> int:
    """KATO where ``speedup`` reaches ``bar`` and the saving against ``baseline`` (a field of
    the answer, ms) is at least MIN_SAVING_MS or unknown; WHEN_BUSY where only the saving
    falls short; TORCH otherwise."""
    if speedup is None or float(speedup) < bar:
        return TORCH
    time_ms, baseline_ms = _field(answer, "time_ms"), _field(answer, baseline)
    if time_ms is None or baseline_ms is None:
        return KATO
    return KATO if float(baseline_ms) - float(time_ms) >= MIN_SAVING_MS else WHEN_BUSY


def known_faster(answer: Any, compiled: bool = False) -> bool:
    """Whether :func:`judge` says :data:`KATO` for ``answer``."""
    return judge(answer, compiled) == KATO


def _verdict(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    device: str,
    compiled: bool,
    relayout: bool = False,
) -> int:
    for recorder in list(_recorders):
        recorder.add(operator, shape, dtype)
    if device != "cuda":
        return TORCH
    key = (operator, shape, dtype, compiled, relayout)
    decision = _decisions.get(key)
    if decision is None:
        policy = policy_for(operator)
        if policy == "auto":
            if relayout:
                # The winner was timed on its own layout: the copies in and out are not in it.
                decision = TORCH
            elif operator in _without_equivalent:
                decision = KATO
            else:
                decision = judge(served(operator, shape, dtype), compiled)
        else:
            decision = KATO if policy == "kato" else TORCH
        _decisions[key] = decision
    return decision


def verdict(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    device: str,
    compiled: bool = False,
    relayout: bool = False,
) -> int:
    """:data:`KATO`: run Kato's ``operator`` kernel for this key; :data:`TORCH`: PyTorch's op;
    :data:`WHEN_BUSY`: Kato's kernel while the GPU is :data:`MIN_SAVING_MS` or more behind the
    host on the caller's CUDA stream, else PyTorch's op (the caller measures on every call;
    eager calls only). ``device`` is
    the tensor's device type (anything but ``"cuda"`` is always PyTorch); ``compiled``: the
    call is being traced into a ``torch.compile`` graph; ``relayout``: Kato's kernel would
    need the call's tensors copied into the layout it takes and its outputs copied back (a
    channels-last activation for an NCHW kernel), which "auto" answers with PyTorch's op (the
    copies cost about as much as the op; a winner's times leave them out). Records the key in
    every active :func:`record`."""
    return _verdict(operator, tuple(int(d) for d in shape), dtype, device, compiled, relayout)


def decide(
    operator: str,
    shape: tuple[int, ...],
    dtype: str,
    device: str,
    compiled: bool = False,
    relayout: bool = False,
) -> bool:
    """Whether :func:`verdict` is :data:`KATO` (Kato's kernel on every call)."""
    return verdict(operator, shape, dtype, device, compiled, relayout) == KATO


@dataclass(frozen=True, order=True)
class Key:
    """One (operator, shape, dtype) a step ran through kato_torch."""

    operator: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Recorder:
    """The keys seen while a :func:`record` block ran, in first-seen order."""

    keys: list[Key] = field(default_factory=list)
    _seen: set[Key] = field(default_factory=set, repr=False)

    def add(self, operator: str, shape: tuple[int, ...], dtype: str) -> None:
        key = Key(operator, shape, dtype)
        with _lock:
            if key not in self._seen:
                self._seen.add(key)
                self.keys.append(key)

    def untuned(self, client: Any = None, gpu: str | None = None) -> list[Key]:
        """The keys the service holds no winner for at that exact shape (``client``: the
        configured one by default)."""
        client = client if client is not None else _settings["client"]
        if client is None:
            raise ValueError("untuned() needs a client: pass one or call kato_torch.configure")
        gpu = gpu if gpu is not None else _settings["gpu"]
        ask = getattr(client, "lookup", None) or client.config
        return [k for k in self.keys if _field(ask(k.operator, k.shape, k.dtype, gpu=gpu),
                                                 "source") != "exact"]  # fmt: skip

    def submit(
        self,
        client: Any = None,
        *,
        budget: int | None = None,
        gpu: str | None = None,
        only_untuned: bool = True,
        **options: Any,
    ) -> list[dict[str, Any]]:
        """Queue one tuning job per key (the untuned ones by default) as one batch
        (``client.submit_batch``, ``POST /v1/jobs/batch``); returns the jobs as the service
        describes them. ``options`` go to every job (``budget_seconds``, ``strategy``)."""
        client = client if client is not None else _settings["client"]
        if client is None:
            raise ValueError("submit() needs a client: pass one or call kato_torch.configure")
        gpu = gpu if gpu is not None else _settings["gpu"]
        keys = self.untuned(client, gpu) if only_untuned else list(self.keys)
        if not keys:
            return []
        jobs = [{"operator": k.operator, "shape": list(k.shape), "dtype": k.dtype} for k in keys]
        return client.submit_batch(jobs, gpu=gpu, budget=budget, **options)


@contextmanager
def record() -> Iterator[Recorder]:
    """``with kato_torch.record() as rec: step()`` lists in ``rec.keys`` every (operator, shape,
    dtype) the step ran through kato_torch (forward and backward operators alike, whichever
    implementation the policy picked). Eager mode only: a compiled graph decided at trace time."""
    recorder = Recorder()
    with _lock:
        _recorders.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            _recorders.remove(recorder)
