"""Stored results after an upgrade of Kato: the result keys to tune again (``kato retune``).

An operator's version hashes its CUDA template, its space and its spec's code (see
``kernels/spec.py``), and lookups serve only the current version's best configs: after an
upgrade that changed an operator, each of its keys falls back to the default config until it is
tuned again. :func:`find_stale_keys` lists those keys (operator, shape, dtype, GPU model: every
stored best config only at other versions), and :func:`queue_retune` queues one job per key at
the current version. Such a job is warm-started from the key's old winner
(``tuner.warm_start``), which it measures first, under the new code: the old result is a guess,
never served.

Both take a :class:`Session`, return plain values and know nothing of the operator registry:
the caller passes the current versions (and, optionally, a validity check), so they work on any
database and are testable without the CLI.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from kato.db.models import BestConfig, Job, Trial, utcnow
from kato.db.queries import create_jobs, shape_key
from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from kato.shared.status import TERMINAL_STATUSES

#: Configs a re-tuning job measures by default: half the default cold budget
#: (``KATO_DEFAULT_BUDGET_CONFIGS``, 100). Its first seed is the key's own old winner, and a cold
#: search of 50 configs already comes close to the optimum on the recorded spaces, so even a
#: version change that moved the optimum costs little (docs/search.md, "Re-tuning budget").
DEFAULT_RETUNE_BUDGET = 50

#: Job statuses that mean a key is already being tuned.
LIVE_STATUSES = ("queued", "running")

#: Why a stale key is not queued (:attr:`StaleKey.skip`).
SKIP_UNREGISTERED = "operator no longer registered"
SKIP_LIVE_JOB = "a job is queued, or running at the current version"
SKIP_INVALID = "no longer valid"
SKIP_FAILED = "its last job at the current version failed (retry with --retry-failed)"


@dataclass(frozen=True)
class StaleKey:
    """A result key whose stored best configs are all at versions other than its operator's
    current one.

    ``old_versions``: those versions, the most recently updated first; ``old_best_time_ms``:
    the fastest of their best configs (any compute capability or CUDA version);
    ``current_version``: the operator's version now (``None``: no longer registered).
    ``skip``: why it is not to be queued (``None``: it is), one of the ``SKIP_*`` texts, with
    the job id or the check's reason after a colon where there is one.
    """

    operator: str
    shape: tuple[int, ...]
    dtype: str
    gpu_model: str
    old_versions: tuple[str, ...]
    old_best_time_ms: float
    current_version: str | None
    skip: str | None = None

    @property
    def shape_key(self) -> str:
        return shape_key(self.shape)


#: A result key here: operator, shape key, dtype, GPU model.
_Key = tuple[str, str, str, str]

#: ``check(operator, shape, dtype, gpu_model)``: why the current operator cannot tune this key
#: (``None``: it can), e.g. a dtype the operator dropped, buffers larger than the GPU's memory.
KeyCheck = Callable[[str, Sequence[int], str, str], str | None]


def find_stale_keys(
    session: Session,
    current_versions: Mapping[str, str],
    *,
    operators: Collection[str] | None = None,
    gpu_model: str | None = None,
    check: KeyCheck | None = None,
    retry_failed: bool = False,
) -> list[StaleKey]:
    """Every result key (operator, shape, dtype, GPU model) with a stored best config, none of
    them at the operator's current version, sorted by operator, dtype, GPU model and shape.
    Read-only.

    ``current_versions`` maps each registered operator to its version; a key of an operator
    absent from it is returned with :data:`SKIP_UNREGISTERED` (reported, never queued). A key
    with a job at the current version that is queued or running, or one of another version
    that has measured nothing and is queued or abandoned (its worker moves it to the current
    version), gets :data:`SKIP_LIVE_JOB`, one that
    ``check`` rejects :data:`SKIP_INVALID`. ``operators`` / ``gpu_model`` (exact stored names)
    keep only those keys. A key whose latest job at the current version failed gets
    :data:`SKIP_FAILED` unless ``retry_failed`` (queueing it on every run would fail it again
    for the same reason, e.g. a shape its GPU cannot hold). Compute capability and CUDA
    version are not part of the key here: a job tunes on whatever GPU of the model claims it,
    as every job does.
    """
    stmt = select(
        BestConfig.operator,
        BestConfig.shape,
        BestConfig.shape_key,
        BestConfig.dtype,
        BestConfig.gpu_model,
        BestConfig.operator_version,
        BestConfig.time_ms,
        BestConfig.updated_at,
    )
    if operators is not None:
        stmt = stmt.where(BestConfig.operator.in_(list(operators)))
    if gpu_model is not None:
        stmt = stmt.where(BestConfig.gpu_model == gpu_model)

    shapes: dict[_Key, tuple[int, ...]] = {}
    current: set[_Key] = set()
    old: dict[_Key, dict[str, tuple[datetime, float]]] = {}  # version -> (newest, fastest)
    for op, shape, skey, dtype, model, version, time_ms, updated in session.execute(stmt):
        key = (op, skey, dtype, model)
        shapes.setdefault(key, tuple(int(s) for s in shape))
        if version == current_versions.get(op):
            current.add(key)
            continue
        newest, fastest = old.setdefault(key, {}).get(version, (updated, time_ms))
        old[key][version] = (max(newest, updated), min(fastest, time_ms))

    # One pass over the jobs: which keys are being tuned (``live``), and how each key's latest
    # finished job at the current version ended (``ended``: key -> (finished at, status, id)).
    now = utcnow()
    live: dict[_Key, str] = {}
    ended: dict[_Key, tuple[float, str, str]] = {}
    jobs_stmt = select(
        Job.id,
        Job.operator,
        Job.shape_key,
        Job.dtype,
        Job.gpu_model,
        Job.operator_version,
        Job.status,
        Job.lease_expires_at,
        Job.finished_at,
        exists().where(Trial.job_id == Job.id),
    ).where(Job.status.in_(LIVE_STATUSES + TERMINAL_STATUSES))
    for row in session.execute(jobs_stmt):
        job_id, op, skey, dtype, model, version, status, lease, finished, has_trials = row
        key = (op, skey, dtype, model)
        at_current = version == current_versions.get(op)
        if status in LIVE_STATUSES:
            # A job of another version counts when the worker that claims it next will move
            # it to the current version (tuner.job_runner._check_operator_version): it has
            # measured nothing and is queued, or its worker died (the lease expired).
            claimable = status == "queued" or (lease is not None and lease < now)
            if at_current or (claimable and not has_trials):
                live.setdefault(key, job_id)
        elif at_current:
            when = finished.timestamp() if finished is not None else -math.inf
            if key not in ended or (when, job_id) > ended[key][::2]:
                ended[key] = (when, status, job_id)

    stale = []
    for key in sorted(old.keys() - current, key=lambda k: (k[0], k[2], k[3], shapes[k])):
        op, _skey, dtype, model = key
        versions = old[key]
        skip = None
        if op not in current_versions:
            skip = SKIP_UNREGISTERED
        elif key in live:
            skip = f"{SKIP_LIVE_JOB}: {live[key]}"
        elif check is not None and (reason := check(op, shapes[key], dtype, model)) is not None:
            skip = f"{SKIP_INVALID}: {reason}"
        elif not retry_failed and key in ended and ended[key][1] == "failed":
            skip = f"{SKIP_FAILED}: {ended[key][2]}"
        stale.append(
            StaleKey(
                operator=op,
                shape=shapes[key],
                dtype=dtype,
                gpu_model=model,
                old_versions=tuple(sorted(versions, key=lambda v: versions[v][0], reverse=True)),
                old_best_time_ms=min(t for _, t in versions.values()),
                current_version=current_versions.get(op),
                skip=skip,
            )
        )
    return stale


def queue_retune(
    session: Session,
    keys: Sequence[StaleKey],
    *,
    budget_configs: int = DEFAULT_RETUNE_BUDGET,
) -> list[str]:
    """Queue one job per key of ``keys`` that is to be queued (``skip`` is ``None``), at the
    key's current version, in the order given, all in one transaction (all or none), and
    commit; returns the new jobs' ids in that order (none: nothing written).

    The jobs are the CLI's own (no API token), with the default strategy and seed. Not atomic
    with :func:`find_stale_keys`: two runs at the same moment can both queue a key (the second
    job only tunes it again).
    """
    todo = [k for k in keys if k.skip is None]
    if any(k.current_version is None for k in todo):
        raise ValueError("queue_retune: a key of an unregistered operator cannot be queued")
    if not todo:
        return []
    jobs = create_jobs(
        session,
        [
            {
                "operator": k.operator,
                "operator_version": k.current_version,
                "shape": list(k.shape),
                "dtype": k.dtype,
                "gpu_model": k.gpu_model,
                "budget_configs": budget_configs,
            }
            for k in todo
        ],
    )
    return [job.id for job in jobs]
