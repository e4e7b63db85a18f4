"""Warm start: a new job first measures the best configs already known for its operator elsewhere.

A *source* is what was measured for the same operator and dtype on one (GPU model, shape): a set
of (config, time) pairs, read from one operator version (:func:`db.queries.warm_start_sources`,
ranked here by :func:`database_sources`): the job's own version where it measured anything
there, else the most recent other version (results of older kernel code, e.g. from before an
upgrade of Kato). The job's own (GPU model, shape) is a
source only at other versions: its winner there is the best guess for the new code.
Sources are ranked by distance to the job (sum over dimensions of ``|log2 a - log2 b|`` between
the shapes, plus :data:`OTHER_GPU_DISTANCE` for another GPU model, plus
:data:`OTHER_VERSION_DISTANCE` for another operator version), each source's configs by time.
The seeds are each source's fastest config valid here (:data:`SEEDS_PER_SOURCE`), nearest
source first, without duplicates, capped at :func:`seed_limit` of the job's budget.
(:func:`rank_seed_configs` can take more per source, rank by rank across the sources: that hurt
more than it helped.) Seeds are measured and verified like every other config, under the job's
own version: an older version's config is a guess, never a result.
``kato replay --warm-start`` ranks a recorded file's measurements with the same code.

Reading the database (the job's ledger does it) is read-only and never fails a job: any error
gives no seeds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kato.db import retry
from kato.db.queries import MeasuredSource
from kato.tuner.space import Config

log = logging.getLogger(__name__)

#: Distance added for a source on another GPU model (a shape twice as large in one dimension
#: counts 1.0): the same GPU at a nearby shape is usually the better guide.
OTHER_GPU_DISTANCE = 1.0
#: Distance added for a source measured at another version of the operator (older kernel code).
#: A judgement, not a measurement (no recorded space in the repository exists at two versions
#: of its operator): most version changes do not touch the kernel's speed at all (a tolerance, a
#: check, a spec refactor: the version hashes the spec's code too), so the job's own (GPU, shape)
#: at an older version is nearly the job itself and must come before every power-of-two sibling
#: shape (1.0) and another GPU (:data:`OTHER_GPU_DISTANCE`, 1.0). It stays above 0 so that, at
#: equal shape distance, what the current code measured comes first; only a current-version
#: shape within 2**0.1 = 7% in one dimension (practically the same problem, and measured on the
#: code that runs now) ranks before the own key's old winner. A source at another GPU *and*
#: version adds both.
OTHER_VERSION_DISTANCE = 0.1
#: A job seeds from other GPU models' results only up to this budget (configs; never for a
#: time-only budget): another GPU's winners help a small budget and pull a search that can
#: afford its own design into their basin (measured: docs/search.md, "Warm start"). Same-GPU
#: sources (other shapes) seed every job.
OTHER_GPU_MAX_BUDGET = 20
#: Seeds never exceed this many, whatever the budget.
MAX_SEEDS = 10
#: Configs read per source (its fastest): more than are seeded, so that one valid at the job's
#: shape is among them where the source's fastest is not.
PER_SOURCE = 10
#: Seeds taken from one source at most: its fastest valid config. The gain is the first seed's;
#: more from one source only cost budget where it is not near-optimal here (measured on the
#: recorded H200 spaces with a sibling shape: docs/search.md, "Warm start").
SEEDS_PER_SOURCE = 1


@dataclass
class Source:
    """What one other (GPU model, shape) measured: ``trials`` are (config, time_ms) pairs of OK
    results, in any order; ``distance`` ranks sources (smaller is nearer)."""

    name: str
    distance: float
    trials: list[tuple[Config, float]] = field(default_factory=list)
    other_gpu: bool = False
    #: Measured at another operator version than the job's (see :data:`OTHER_VERSION_DISTANCE`).
    other_version: bool = False


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
    first within a rank, duplicates and rejected configs (``accept`` False, or raising) skipped,
    at most ``limit``."""

    def accepted(config: Config) -> bool:
        # A config of older kernel code may lack a parameter or carry one the spec no longer
        # knows: a check that raises on it rejects that config, not the whole warm start.
        try:
            return accept is None or bool(accept(config))
        except Exception:
            log.debug("warm start: rejecting %r (its check raised)", config, exc_info=True)
            return False

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
        ranked.append([c for c in configs if accepted(c)][:per_source])
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


def _fastest_per_config(
    measured: Sequence[tuple[Config, float | None]],
) -> list[tuple[Config, float]]:
    """Each distinct config of ``measured`` once, with its fastest finite time."""
    fastest: dict[tuple, tuple[Config, float]] = {}
    for config, t in measured:
        if t is None or not math.isfinite(t):
            continue
        k = _key(config)
        if k not in fastest or t < fastest[k][1]:
            fastest[k] = (dict(config), float(t))
    return list(fastest.values())


def database_sources(
    measured: Sequence[MeasuredSource], *, shape: Sequence[int], gpu_model: str
) -> list[Source]:
    """The database's measurements for a job (:func:`db.queries.warm_start_sources`: one
    version per (GPU model, shape)) as ranked sources: each at its shape distance to the job's
    ``shape``, :data:`OTHER_GPU_DISTANCE` farther on another GPU model than ``gpu_model`` and
    :data:`OTHER_VERSION_DISTANCE` farther at another operator version."""
    return [
        Source(
            name=f"{src.gpu_model} {'x'.join(map(str, src.shape))}"
            + (f" @{src.operator_version}" if src.other_version else ""),
            distance=shape_distance(src.shape, shape)
            + (OTHER_GPU_DISTANCE if src.gpu_model != gpu_model else 0.0)
            + (OTHER_VERSION_DISTANCE if src.other_version else 0.0),
            trials=_fastest_per_config(src.trials),
            other_gpu=src.gpu_model != gpu_model,
            other_version=src.other_version,
        )
        for src in measured
    ]


#: Reads what the database measured for a job: ``read(per_source=N)`` (the job's ledger,
#: :meth:`db.ledger.JobLedger.warm_start_sources`).
SourceReader = Callable[..., Sequence[MeasuredSource]]


def warm_start_configs(
    read: SourceReader, job: Any, accept: Callable[[Config], bool] | None = None
) -> list[Config]:
    """The configs ``job`` (a :class:`db.models.Job`) measures first, best first, from what
    ``read`` finds in the database; [] when it knows nothing usable or cannot be read (logged,
    never raised). Other GPU models' results seed only jobs of at most
    :data:`OTHER_GPU_MAX_BUDGET` configs."""
    try:
        sources = database_sources(
            read(per_source=PER_SOURCE), shape=list(job.shape), gpu_model=job.gpu_model
        )
        budget = job.budget_configs
        if budget is None or budget > OTHER_GPU_MAX_BUDGET:
            sources = [src for src in sources if not src.other_gpu]
        return rank_seed_configs(
            sources, limit=seed_limit(budget), accept=accept, per_source=SEEDS_PER_SOURCE
        )
    except Exception as exc:  # a warm start is a bonus: never fail the job over it
        if retry.is_transient(exc):  # a database blip (the read is not retried): no traceback
            log.warning(
                "warm start for job %s: the database read failed (%s); searching without it",
                job.id, retry.describe(exc),
            )  # fmt: skip
        else:
            log.exception("warm start for job %s failed; searching without it", job.id)
        return []


def cache_source(cache: Any, name: str | None = None, distance: float = OTHER_GPU_DISTANCE):
    """A :class:`Source` from a recorded Kernel Tuner cache (``kato.shared.kt_cache``): every OK
    entry, as the database would hold another GPU's measurements of the same space."""
    params = cache.params
    trials = [
        ({p: entry[p] for p in params}, float(entry[cache.time_field]))
        for entry in cache.ok_entries().values()
    ]
    return Source(name=name or cache.device_name, distance=distance, trials=trials, other_gpu=True)
