"""Warm start: a new job first measures the best configs already known for its operator elsewhere.

A *source* is what was measured for the same operator, operator version and dtype on another GPU
model and/or another shape: a set of (config, time) pairs. Sources are ranked by distance to the
job (sum over dimensions of ``|log2 a - log2 b|`` between the shapes, plus
:data:`OTHER_GPU_DISTANCE` for another GPU model), each source's configs by time. The seeds are
each source's fastest config valid here (:data:`SEEDS_PER_SOURCE`), nearest source first, without
duplicates, capped at :func:`seed_limit` of the job's budget. (:func:`rank_seed_configs` can take
more per source, rank by rank across the sources: that hurt more than it helped.)
``kato replay --warm-start`` ranks a recorded file's measurements with the same code.

Reading the database is read-only and never fails a job: any error gives no seeds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tuner.space import Config

log = logging.getLogger(__name__)

#: Distance added for a source on another GPU model (a shape twice as large in one dimension
#: counts 1.0): the same GPU at a nearby shape is usually the better guide.
OTHER_GPU_DISTANCE = 1.0
#: A job seeds from other GPU models' results only up to this budget (configs; never for a
#: time-only budget). Measured with ``benchmarks/search_quality.py --warm-start`` on the two
#: convolution files, each seeded from the other GPU: the seeds help at budget 10 (A100 0.58 ->
#: 0.68) and hurt from 25 on (A100 at 100: 0.93 -> 0.79, A4000: 0.94 -> 0.86, 20 seeds), with
#: the old and the new default strategy alike: another GPU's winners pull a search that can
#: afford its own design into their basin. Same-GPU sources (other shapes) seed every job.
OTHER_GPU_MAX_BUDGET = 20
#: Seeds never exceed this many, whatever the budget.
MAX_SEEDS = 10
#: Configs read per source (its fastest): more than are seeded, so that one valid at the job's
#: shape is among them where the source's fastest is not.
PER_SOURCE = 10
#: Seeds taken from one source at most: its fastest valid config. Measured on the 26 recorded
#: H200 spaces with a sibling shape (``benchmarks/warm_start_shapes.py``, 40 seeds, each source a
#: sibling's own 100-config run): the gain is the first seed's (where the sibling's best is
#: near-optimal here, 0.85-0.94 -> 0.999-1.000 at budget 10); the next ones only add harm where
#: it is not (10 per source: below the cold search on 6 / 2 / 3 of 26 spaces at budgets
#: 25 / 50 / 100; 1 per source: 2 / 1 / 0, the gains unchanged).
SEEDS_PER_SOURCE = 1


@dataclass
class Source:
    """What one other (GPU model, shape) measured: ``trials`` are (config, time_ms) pairs of OK
    results, in any order; ``distance`` ranks sources (smaller is nearer)."""

    name: str
    distance: float
    trials: list[tuple[Config, float]] = field(default_factory=list)
    other_gpu: bool = False


def seed_limit(budget_configs: int | None) -> int:
    """How many warm-start configs a job of this budget measures first: a tenth of the budget
    (at least 1, at most :data:`MAX_SEEDS`); :data:`MAX_SEEDS` for a time-only budget."""
    if budget_configs is None:
        return MAX_SEEDS
    return max(1, min(MAX_SEEDS, math.ceil(budget_configs / 10)))


def shape_distance(a: Sequence[int], b: Sequence[int]) -> float:
    """Sum over dimensions of ``|log2 a - log2 b|``; infinite for different ranks."""
    if len(a) != len(b) or any(x < 1 for x in (*a, *b)):
        return math.inf
    return sum(abs(math.log2(x) - math.log2(y)) for x, y in zip(a, b, strict=True))


def _key(config: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in config.items()))


def rank_seed_configs(
    sources: Sequence[Source],
    *,
    limit: int,
    per_source: int = PER_SOURCE,
    accept: Callable[[Config], bool] | None = None,
) -> list[Config]:
    """Seed configs from ``sources``: rank by rank (each source's fastest first), nearer sources
    first within a rank, duplicates and rejected configs (``accept`` False) skipped, at most
    ``limit``."""
    ordered = sorted(sources, key=lambda s: (s.distance, s.name))
    ranked: list[list[Config]] = []
    for source in ordered:
        best: dict[tuple, tuple[float, Config]] = {}
        for config, t in source.trials:
            if t is None or not math.isfinite(t):
                continue
            k = _key(config)
            if k not in best or t < best[k][0]:
                best[k] = (t, dict(config))
        configs = [c for _, c in sorted(best.values(), key=lambda tc: tc[0])]
        ranked.append([c for c in configs if accept is None or accept(c)][:per_source])
    out: list[Config] = []
    seen: set[tuple] = set()
    for rank in range(per_source):
        for configs in ranked:
            if rank < len(configs) and (k := _key(configs[rank])) not in seen:
                seen.add(k)
                out.append(configs[rank])
                if len(out) >= limit:
                    return out
    return out


def database_sources(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    dtype: str,
    shape: Sequence[int],
    gpu_model: str,
    exclude_job_id: str | None = None,
    per_source: int = PER_SOURCE,
) -> list[Source]:
    """Sources for a job from the database (read-only): the OK trials of other jobs of the same
    operator, version and dtype on another GPU model or shape of the same rank, plus the stored
    best configs of those keys; the fastest ``per_source`` configs of each (GPU model, shape)."""
    from db.models import BestConfig, Job, Trial

    shape = [int(s) for s in shape]
    own = (gpu_model, tuple(shape))
    by_source: dict[tuple[str, tuple[int, ...]], dict[tuple, tuple[Config, float]]] = {}

    def add(model: str, src_shape: Sequence[int], config: Config, t: float | None) -> None:
        src = (model, tuple(int(s) for s in src_shape))
        if src == own or t is None or not math.isfinite(t) or len(src[1]) != len(shape):
            return
        bucket = by_source.setdefault(src, {})
        k = _key(config)
        if k not in bucket or t < bucket[k][1]:
            bucket[k] = (dict(config), float(t))

    jobs = session.execute(
        select(Job.id, Job.gpu_model, Job.shape).where(
            Job.operator == operator,
            Job.operator_version == operator_version,
            Job.dtype == dtype,
        )
    ).all()
    for job_id, model, src_shape in jobs:
        if job_id == exclude_job_id or (model, tuple(src_shape)) == own:
            continue
        rows = session.execute(
            select(Trial.config, Trial.time_ms)
            .where(Trial.job_id == job_id, Trial.time_ms.is_not(None))
            .order_by(Trial.time_ms)
            .limit(per_source)
        ).all()
        for config, t in rows:
            add(model, src_shape, config, t)
    best_rows = session.execute(
        select(BestConfig.gpu_model, BestConfig.shape, BestConfig.config, BestConfig.time_ms).where(
            BestConfig.operator == operator,
            BestConfig.operator_version == operator_version,
            BestConfig.dtype == dtype,
        )
    ).all()
    for model, src_shape, config, t in best_rows:
        add(model, src_shape, config, t)
    return [
        Source(
            name=f"{model} {'x'.join(map(str, src_shape))}",
            distance=shape_distance(src_shape, shape)
            + (OTHER_GPU_DISTANCE if model != gpu_model else 0.0),
            trials=[(c, t) for c, t in bucket.values()],
            other_gpu=model != gpu_model,
        )
        for (model, src_shape), bucket in by_source.items()
    ]


def warm_start_configs(
    sessions: sessionmaker[Session], job: Any, accept: Callable[[Config], bool] | None = None
) -> list[Config]:
    """The configs ``job`` (a :class:`db.models.Job`) measures first, best first; [] when the
    database knows nothing usable or cannot be read (logged, never raised). Other GPU models'
    results seed only jobs of at most :data:`OTHER_GPU_MAX_BUDGET` configs."""
    try:
        with sessions() as session:
            sources = database_sources(
                session,
                operator=job.operator,
                operator_version=job.operator_version,
                dtype=job.dtype,
                shape=list(job.shape),
                gpu_model=job.gpu_model,
                exclude_job_id=job.id,
            )
        budget = job.budget_configs
        if budget is None or budget > OTHER_GPU_MAX_BUDGET:
            sources = [src for src in sources if not src.other_gpu]
        return rank_seed_configs(
            sources, limit=seed_limit(budget), accept=accept, per_source=SEEDS_PER_SOURCE
        )
    except Exception:  # a warm start is a bonus: never fail the job over it
        log.exception("warm start for job %s failed; searching without it", job.id)
        return []


def cache_source(cache: Any, name: str | None = None, distance: float = OTHER_GPU_DISTANCE):
    """A :class:`Source` from a recorded Kernel Tuner cache (``tuner.kt_cache``): every OK
    entry, as the database would hold another GPU's measurements of the same space."""
    params = cache.params
    trials = [
        ({p: entry[p] for p in params}, float(entry[cache.time_field]))
        for entry in cache.ok_entries().values()
    ]
    return Source(name=name or cache.device_name, distance=distance, trials=trials, other_gpu=True)
