"""PyTorch's baselines for stored winners that lack them (``kato baseline``).

A tuning job times PyTorch's own op after its search, eagerly and compiled by ``torch.compile``
(:mod:`tuner.framework`), and stores both beside its winner; ``kato_torch``'s never-slower
policy compares a winner with them (``speedup``, ``compiled_speedup``). Winners imported from
another database, tuned with the baseline turned off, or stored before the compiled baseline
existed have neither or only the eager one, and the policy then falls back to its guesses
(``kato_torch.policy.MIN_SPEEDUP_COMPILED`` inside a compiled graph). This module measures them
for the winners of one GPU model at their operators' current versions, on a local GPU of that
model, each in the isolated child the worker uses (:func:`tuner.framework.measure_in_child`),
and stores them on the rows: the config and its time stay as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kato.db import queries
from kato.db.models import BestConfig
from kato.kernels import list_operators
from kato.kernels.user import UserOperatorSpec
from kato.tuner import framework
from sqlalchemy import select

log = logging.getLogger(__name__)

#: ``measure(operator, shape, dtype, *, device_index, gpu_model, compiled, stop)`` ->
#: :class:`tuner.framework.FrameworkResult`: :func:`tuner.framework.measure_in_child` by default.
Measure = Callable[..., framework.FrameworkResult]


@dataclass(frozen=True)
class Winner:
    """A stored winner to measure PyTorch's baselines for (a detached copy of its row)."""

    row_id: int
    operator: str
    shape: tuple[int, ...]
    dtype: str
    time_ms: float
    framework_ms: float | None
    compiled_ms: float | None


@dataclass(frozen=True)
class Outcome:
    """What :func:`fill` did for one winner: ``status`` ``stored`` (the figures it stored), or
    the baseline's own status where it was not timed (``skipped``, ``failed``: ``detail`` says
    why), or ``gone`` (the row was replaced while PyTorch's op was timed)."""

    winner: Winner
    status: str
    framework_ms: float | None = None
    framework: str | None = None
    compiled_ms: float | None = None
    compiled: str | None = None
    detail: str | None = None

    @property
    def speedup(self) -> float | None:
        """PyTorch's eager time over the winner's (what a lookup reports)."""
        return self.framework_ms / self.winner.time_ms if self.framework_ms else None

    @property
    def compiled_speedup(self) -> float | None:
        return self.compiled_ms / self.winner.time_ms if self.compiled_ms else None


def measurable() -> list[Any]:
    """The registered operators whose PyTorch op can be timed: all but users' operators (no
    PyTorch equivalent: their baseline is always ``skipped``, so they would be measured, and
    counted as not stored, on every run)."""
    return [spec for spec in list_operators() if not isinstance(spec, UserOperatorSpec)]


def winners(
    session: Any,
    gpu_model: str,
    *,
    operators: Iterable[str] | None = None,
    missing_only: bool = True,
    compiled: bool = True,
) -> list[Winner]:
    """The winners of ``gpu_model`` at their operators' current versions (the operators
    registered here that have a PyTorch op: :func:`measurable`; ``operators`` narrows them),
    in operator, dtype and shape order; ``missing_only``: only those without an eager
    baseline or, with ``compiled``, without a compiled one."""
    versions = {spec.name: spec.version for spec in measurable()}
    wanted = set(versions) if operators is None else set(operators) & set(versions)
    rows = session.scalars(
        select(BestConfig)
        .where(BestConfig.gpu_model == gpu_model, BestConfig.operator.in_(sorted(wanted)))
        .order_by(BestConfig.operator, BestConfig.dtype, BestConfig.shape_key)
    ).all()
    out = []
    for row in rows:
        if row.operator_version != versions[row.operator]:
            continue
        lacking = row.framework_ms is None or (compiled and row.compiled_ms is None)
        if missing_only and not lacking:
            continue
        out.append(
            Winner(
                row.id,
                row.operator,
                tuple(row.shape),
                row.dtype,
                row.time_ms,
                row.framework_ms,
                row.compiled_ms,
            )  # fmt: skip
        )
    return out


def fill(
    sessions: Callable[[], Any],
    todo: Sequence[Winner],
    gpu_model: str,
    *,
    device_index: int = 0,
    compiled: bool = True,
    measure: Measure | None = None,
    stop: framework.StopFlag | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Time PyTorch's op for each winner of ``todo`` on CUDA device ``device_index`` (a GPU
    of ``gpu_model``: the measurement refuses another) and store the timed ones on their rows
    (:func:`db.queries.set_framework_baselines`), one commit each, so an interrupted run keeps
    what it measured. A timed ``mismatch`` is stored as the worker stores it (its label
    marked); a baseline not timed is reported and nothing is stored for it. Stops before the
    next winner once ``stop`` is set; ``on_outcome`` sees each outcome as it comes."""
    # Looked up per call, not bound at import: the measuring child is what a test replaces.
    measure = measure or framework.measure_in_child
    outcomes = []
    for winner in todo:
        if stop is not None and stop.is_set():
            break
        result = measure(
            winner.operator, winner.shape, winner.dtype, device_index=device_index,
            gpu_model=gpu_model, compiled=compiled, stop=stop,
        )  # fmt: skip
        outcome = _store(sessions, winner, result)
        log.info("baseline %s %s %s: %s", winner.operator, winner.shape, winner.dtype,
                 outcome.status if outcome.detail is None else f"{outcome.status}: "
                 f"{outcome.detail}")  # fmt: skip
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


def _store(
    sessions: Callable[[], Any], winner: Winner, result: framework.FrameworkResult
) -> Outcome:
    if not result.timed:
        return Outcome(winner, result.status, detail=result.detail)
    eager_ms, eager = result.time_ms, framework.stored_label(result)
    extra = result.compiled
    compiled_ms = extra.time_ms if extra is not None and extra.timed else None
    compiled = framework.stored_label(extra) if compiled_ms is not None else None
    with sessions() as session:
        kept = queries.set_framework_baselines(
            session, winner.row_id, framework_ms=eager_ms, framework=eager,
            compiled_ms=compiled_ms, compiled=compiled,
        )  # fmt: skip
    if not kept:
        return Outcome(winner, "gone", detail="the row was replaced while PyTorch's op was timed")
    detail = None
    if extra is not None and compiled_ms is None:
        detail = f"no compiled baseline ({extra.status}): {extra.detail}"
    return Outcome(winner, "stored", eager_ms, eager, compiled_ms, compiled, detail)
