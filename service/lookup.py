"""The one lookup: which config to serve for an operator, shape, dtype and GPU model.

Exact -> nearest -> default, by the rules of docs/design.md ("Lookup"): the newest row
tuned for exactly the shape whose config is valid for it; else the nearest tuned shape of the
same operator, version, dtype and GPU model (least sum of ``|log2 ratio|`` over the
dimensions, then fastest, then lowest id) at most ``KATO_NEAREST_MAX_DISTANCE`` away, whose
config is valid for the shape and which beat the default config on its own shape by more than
``KATO_NEAREST_MIN_GAIN`` (the first valid neighbour decides); else the operator's default
config. ``db.queries`` only reads the rows (SQL); every decision is made here, and every
front asks here: the REST routes (``GET /v1/configs/{operator}`` and the batch), ``kato
lookup`` (through the app), ``kato.lookup``'s database mode and the benchmarks' direct reads.

A lookup is split into loading and selecting: :func:`load_config_group` reads the rows of one
(operator, version, dtype, GPU model) group once, as immutable values, and
:func:`pick_best_config` selects from them without the database. :class:`Lookups` answers one
lookup by :func:`lookup_best_config` (its indexed exact-shape query, and only (id, shape,
time) of the group for the nearest shape: cheaper for one lookup than whole rows), and a
batch's later lookups of a group from the group loaded once; both order nearest shapes by one
function, :func:`_nearest_first`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import sub
from typing import Any, Literal, TypeVar

from kato.db import queries
from kato.db.models import BestConfig
from kato.db.queries import GroupKey, StoredConfig, shape_key
from kato.kernels.spec import OperatorSpec
from sqlalchemy.orm import Session

__all__ = [
    "NEAREST_MIN_GAIN",
    "Answer",
    "ConfigGroup",
    "Lookups",
    "Match",
    "applies",
    "beats_default",
    "load_config_group",
    "lookup_best_config",
    "pick_best_config",
]

#: ``exact``: serve only a config tuned for exactly the shape asked for (else the default);
#: ``nearest`` (the default) also the nearest tuned shape's.
Match = Literal["exact", "nearest"]

_P = TypeVar("_P")

#: A lookup serves a winner tuned for another shape only where, on its own shape, it beat the
#: operator's default config by more than this factor (``default_ms > NEAREST_MIN_GAIN *
#: time_ms``); else the default is served: where the default was about as good as the tuned
#: optimum next door, a neighbour's winner is a worse bet here (measured: docs/defaults.md).
NEAREST_MIN_GAIN = 1.05


def beats_default(row: Any, min_gain: float | None = NEAREST_MIN_GAIN) -> bool:
    """Whether a stored winner may be served for another shape: it beat the default config on
    its own shape by more than ``min_gain`` (None or 0: no guard, any winner). A row whose
    default time is unknown (stored before migration 0006, or its job did not measure the
    default) is not known to beat it, and the recorded spaces say an unchecked neighbour is
    worse than the default on average: it is not served."""
    if not min_gain:
        return True
    return row.default_ms is not None and row.default_ms > min_gain * row.time_ms


#: A nearest-shape candidate: (shape, log2 of each dimension, time_ms, id, payload).
_Candidate = tuple[tuple[int, ...], tuple[float, ...], float, int, _P]


def _candidate(
    shape: Sequence[int], time_ms: float, row_id: int, payload: _P
) -> _Candidate[_P] | None:
    """A row as a nearest-shape candidate; ``None`` for a shape with a dimension below 1 (it has
    no log2 and never serves another shape)."""
    if not all(int(s) >= 1 for s in shape):
        return None
    return tuple(shape), tuple(math.log2(s) for s in shape), time_ms, row_id, payload


def _nearest_first(
    candidates: Iterable[_Candidate[_P]], shape: Sequence[int], max_distance: float | None
) -> list[_P]:
    """The payloads of ``candidates`` (all of ``shape``'s rank: the caller filters, once per
    group where it can), nearest first: least sum over dimensions of ``|log2 a - log2 b|``,
    then least ``time_ms``, then lowest id. Candidates of exactly ``shape`` are left out (they
    are the exact match's), and so are those farther than ``max_distance`` (inclusive bound;
    ``None``: no bound). The one nearest-shape ordering of every lookup."""
    shape = tuple(int(s) for s in shape)
    wanted = tuple(math.log2(s) for s in shape)
    ranked = []
    payloads = []
    for row_shape, logs, time_ms, row_id, payload in candidates:
        if row_shape == shape:
            continue
        # The terms |log2 a - log2 b| in dimension order, summed by the builtin: the distance
        # (ties included) is bit for bit the per-dimension sum lookups always used (sum() of
        # floats is compensated from Python 3.12, so a hand-written a + b could round a tie
        # differently). map() keeps the loop in C: this runs per stored row per lookup.
        distance = sum(map(abs, map(sub, logs, wanted)))
        if max_distance is None or distance <= max_distance:
            ranked.append((distance, time_ms, row_id, len(payloads)))
            payloads.append(payload)
    # Ids are unique, so the index after them never decides and payloads are never compared.
    ranked.sort()
    return [payloads[r[3]] for r in ranked]


class ConfigGroup:
    """The stored rows of one :data:`GroupKey`, indexed for :func:`pick_best_config`.

    Immutable after construction and free of database state, so one group can serve any number
    of lookups (from any thread). Built by :func:`load_config_group`, or from rows directly.
    """

    __slots__ = ("rows", "_exact", "_by_rank", "_config_class")

    def __init__(self, rows: Sequence[StoredConfig]) -> None:
        self.rows: tuple[StoredConfig, ...] = tuple(rows)
        exact: dict[str, list[StoredConfig]] = {}
        by_rank: dict[int, list[_Candidate[StoredConfig]]] = {}
        # Rows with equal configs share a class: winners of different shapes are often the
        # same config, and a lookup need not check one config twice (pick_best_config).
        classes: dict[str, int] = {}
        self._config_class: dict[int, int] = {}
        for row in self.rows:
            text = json.dumps(dict(row.config), sort_keys=True, default=repr)
            self._config_class[row.id] = classes.setdefault(text, len(classes))
            exact.setdefault(row.shape_key, []).append(row)
            candidate = _candidate(row.shape, row.time_ms, row.id, row)
            if candidate is not None:  # log2 once per row, not once per lookup
                by_rank.setdefault(len(row.shape), []).append(candidate)
        # The order of lookup_best_config's exact query: newest update first, then highest id.
        # UTCDateTime returns every timestamp timezone-aware in UTC and the database compares
        # the same instants, so Python's order is the database's.
        self._exact: dict[str, tuple[StoredConfig, ...]] = {
            key: tuple(sorted(same, key=lambda r: (r.updated_at, r.id), reverse=True))
            for key, same in exact.items()
        }
        self._by_rank: dict[int, tuple[_Candidate[StoredConfig], ...]] = {
            rank: tuple(candidates) for rank, candidates in by_rank.items()
        }

    def config_class(self, row: StoredConfig) -> int:
        """A number for ``row``'s config, equal for two rows of this group exactly when their
        configs are equal (as JSON: ``1``, ``1.0`` and ``true`` differ)."""
        return self._config_class[row.id]

    def exact(self, shape: Sequence[int]) -> tuple[StoredConfig, ...]:
        """The rows tuned for exactly ``shape``, newest ``updated_at`` first, then highest id."""
        return self._exact.get(shape_key(shape), ())

    def nearest(
        self, shape: Sequence[int], max_distance: float | None = None
    ) -> list[StoredConfig]:
        """The rows of ``shape``'s rank tuned for another shape, nearest first (the order of
        :func:`lookup_best_config`: least log2 distance, then least ``time_ms``, then lowest
        id), none farther than ``max_distance`` (inclusive; ``None``: no bound)."""
        return _nearest_first(self._by_rank.get(len(shape), ()), shape, max_distance)


def load_config_group(
    session: Session, *, operator: str, operator_version: str, dtype: str, gpu_model: str
) -> ConfigGroup:
    """Every stored row of one group, read in one query, as a :class:`ConfigGroup`.

    The group is a snapshot: rows stored after this call are not in it. Reads only.
    """
    return ConfigGroup(
        queries.config_group_rows(
            session,
            operator=operator,
            operator_version=operator_version,
            dtype=dtype,
            gpu_model=gpu_model,
        )
    )


def pick_best_config(
    group: ConfigGroup,
    shape: Sequence[int],
    *,
    accept: Callable[[dict[str, Any]], bool] | None = None,
    max_distance: float | None = None,
    nearest: bool = True,
    min_gain: float | None = NEAREST_MIN_GAIN,
) -> tuple[StoredConfig | None, str]:
    """:func:`lookup_best_config`'s selection over a loaded group; no database, no side
    effects besides calling ``accept``.

    Returns ``(row, "exact")`` for the first row of exactly ``shape`` that ``accept`` passes
    (newest ``updated_at`` first, then highest id); else ``(row, "nearest")`` for the first
    accepted row of :meth:`ConfigGroup.nearest` (least log2 distance, then least ``time_ms``,
    then lowest id; at most ``max_distance`` away, inclusive) where it :func:`beats_default`
    by ``min_gain`` (the first accepted row decides: one that does not leaves the default);
    else ``(None, "default")``. ``nearest=False`` stops after the exact shape (what
    ``match=exact`` serves), which saves the nearest search whose answer would be thrown away.

    ``accept`` must depend on the config alone (a spec check for this shape and dtype does):
    it gets a copy of each candidate's config, in the order above, until one passes, and is
    called once per distinct config (a later row with a config already rejected is skipped
    unchecked), so a lookup costs at most one check per distinct config of the group.
    """
    verdicts: dict[int, bool] = {}

    def first_accepted(rows: Iterable[StoredConfig]) -> StoredConfig | None:
        for row in rows:
            if accept is None:
                return row
            config_class = group.config_class(row)
            verdict = verdicts.get(config_class)
            if verdict is None:
                verdict = verdicts[config_class] = bool(accept(dict(row.config)))
            if verdict:
                return row
        return None

    row = first_accepted(group.exact(shape))
    if row is not None:
        return row, "exact"
    if nearest:
        row = first_accepted(group.nearest(shape, max_distance))
        if row is not None and beats_default(row, min_gain):
            return row, "nearest"
    return None, "default"


def lookup_best_config(
    session: Session,
    *,
    operator: str,
    operator_version: str,
    shape: Sequence[int],
    dtype: str,
    gpu_model: str,
    accept: Callable[[dict[str, Any]], bool] | None = None,
    max_distance: float | None = None,
    min_gain: float | None = NEAREST_MIN_GAIN,
) -> tuple[BestConfig | None, str]:
    """The best stored config for a request, and where it comes from.

    Returns ``(row, "exact")`` for a row of the same shape (if rows differ only by compute
    capability or CUDA version, the most recently updated); else ``(row, "nearest")`` for the
    row of the same operator, version, dtype, GPU model and rank whose shape is closest (least
    sum over dimensions of ``|log2 a - log2 b|``; ties go to the fastest); else
    ``(None, "default")``. ``accept`` (optional) rejects configs that are not valid for the
    requested shape, e.g. ``lambda c: spec.check(c, shape, dtype) is None``. ``max_distance``
    (optional) is the farthest a nearest shape may be (the same log2 distance; 0 serves exact
    shapes only): a winner tuned for a very different shape can be slower than the default.
    The nearest accepted row is served only where it :func:`beats_default` by ``min_gain``
    (else the default: ``(None, "default")``).
    :func:`pick_best_config` selects the same way from a group loaded once
    (:func:`load_config_group`), for many lookups; both order nearest shapes by one function.
    """
    shape = [int(s) for s in shape]
    key = {
        "operator": operator,
        "operator_version": operator_version,
        "dtype": dtype,
        "gpu_model": gpu_model,
    }
    # ``accept`` (a spec check) costs far more than a row: it runs on the candidates in order
    # until one passes, not on every stored shape.
    # The exact shape first, by the index: a hit stops here without reading the group.
    for row in queries.exact_best_configs(session, **key, shape=shape):  # newest first
        if accept is None or accept(dict(row.config)):  # a copy, as pick_best_config's
            return row, "exact"
    # The nearest shape: only (id, shape, time) of the group's rows, ordered as
    # pick_best_config orders them, then the candidates loaded one by one until one passes.
    candidates = []
    for row_id, row_shape, time_ms in queries.group_shapes(session, **key):
        if len(row_shape) == len(shape):
            candidate = _candidate(row_shape, time_ms, row_id, row_id)
            if candidate is not None:
                candidates.append(candidate)
    for row_id in _nearest_first(candidates, shape, max_distance):
        row = queries.best_config_row(session, row_id)
        if row is not None and (accept is None or accept(dict(row.config))):
            if beats_default(row, min_gain):
                return row, "nearest"
            break  # the nearest valid neighbour decides, as pick_best_config's
    return None, "default"


def applies(
    spec: OperatorSpec, config: Mapping[str, Any], shape: Sequence[int], dtype: str
) -> bool:
    """Whether a stored config (tuned for some shape) is valid for this shape and dtype."""
    try:
        return spec.check(dict(config), list(shape), dtype) is None
    except (KeyError, TypeError, ValueError, ArithmeticError):  # a config of an older space
        return False


@dataclass(frozen=True)
class Answer:
    """What is served: ``source`` ``exact``, ``nearest`` (``row`` tuned for ``row.shape``) or
    ``default`` (``row`` None); ``config`` the config itself (the row's, or the operator's
    default config for the shape)."""

    source: str
    config: dict[str, Any]
    row: BestConfig | StoredConfig | None = None

    @property
    def speedup(self) -> float | None:
        """The served winner's stored speedup over the framework's own op (on its shape)."""
        row = self.row
        if row is None or not row.framework_ms or not row.time_ms:
            return None
        return row.framework_ms / row.time_ms

    @property
    def compiled_speedup(self) -> float | None:
        """The served winner's stored speedup over the framework's op compiled by
        ``torch.compile`` (on its shape)."""
        row = self.row
        if row is None or not row.compiled_ms or not row.time_ms:
            return None
        return row.compiled_ms / row.time_ms


class Lookups:
    """Answers lookups from one open session, by the module's rules.

    :meth:`pick` answers as ``GET /v1/configs/{operator}`` does. With ``batch`` (``POST
    /v1/configs/batch``), the first :data:`LOAD_AFTER` lookups of a group are answered that
    way too (its indexed queries), then the group is read once (:func:`load_config_group`)
    and the rest of the batch selects from it in memory (:func:`pick_best_config`, the same
    selection): loading a group reads every row of it, configs included, which for a few
    lookups in a large group costs more than it saves (one lookup in a group of 50,000 rows:
    5 ms by the exact-shape index, 2.2 s by loading the group). The spec check stays lazy: it
    runs on one lookup's candidates in order until one passes. The session must stay open
    while lookups are asked; the groups read are a snapshot (a winner stored meanwhile is
    served from the next batch). One object per request or batch, used by one thread.
    """

    #: Lookups of one group answered one by one before the group is loaded (batch only).
    LOAD_AFTER = 4

    def __init__(
        self,
        session: Session,
        *,
        max_distance: float | None,
        min_gain: float | None = NEAREST_MIN_GAIN,
        batch: bool = False,
    ) -> None:
        self._session = session
        self._max_distance = max_distance
        self._min_gain = min_gain
        self._batch = batch
        self._groups: dict[GroupKey, ConfigGroup] = {}
        self._seen: dict[GroupKey, int] = {}

    def pick(
        self,
        spec: OperatorSpec,
        shape: Sequence[int],
        dtype: str,
        gpu_model: str,
        match: Match = "nearest",
    ) -> tuple[BestConfig | StoredConfig | None, str]:
        """``(row, source)`` to serve (``(None, "default")``: the default config). With
        ``match="exact"`` a config tuned for another shape is not served."""
        shape = [int(s) for s in shape]
        key = (spec.name, spec.version, dtype, gpu_model)
        group_of = {
            "operator": spec.name,
            "operator_version": spec.version,
            "dtype": dtype,
            "gpu_model": gpu_model,
        }

        def accept(config: Mapping[str, Any]) -> bool:
            return applies(spec, config, shape, dtype)

        if self._batch:
            self._seen[key] = self._seen.get(key, 0) + 1
        if not self._batch or (key not in self._groups and self._seen[key] <= self.LOAD_AFTER):
            row, source = lookup_best_config(
                self._session,
                **group_of,
                shape=shape,
                accept=accept,
                max_distance=self._max_distance,
                min_gain=self._min_gain,
            )
            if row is not None and (match == "nearest" or source == "exact"):
                return row, source
            return None, "default"
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = load_config_group(self._session, **group_of)
        # match=exact drops a nearest row: do not look for one.
        return pick_best_config(
            group,
            shape,
            accept=accept,
            max_distance=self._max_distance,
            min_gain=self._min_gain,
            nearest=match == "nearest",
        )

    def answer(
        self,
        spec: OperatorSpec,
        shape: Sequence[int],
        dtype: str,
        gpu_model: str,
        match: Match = "nearest",
    ) -> Answer:
        """:meth:`pick`'s answer with the config to use (the default config where nothing
        stored is served)."""
        row, source = self.pick(spec, shape, dtype, gpu_model, match)
        if row is None:
            return Answer("default", dict(spec.default_config(list(shape), dtype)))
        return Answer(source, dict(row.config), row)
