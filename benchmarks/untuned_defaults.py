"""How close the config served for an untuned shape comes to that shape's optimum (issue 31).

Replays every whole operator space Kato brute-forced on the H200 (``data/spaces``, Kernel Tuner
cache format) whose operator has at least one other recorded space (a *sibling*), and reports
for each, as a fraction of the space's optimum (its best time / the served config's time):

- ``default``: the operator's ``default_config`` for the shape (what a lookup serves when the
  database knows nothing near it);
- ``nearest``: what a lookup served before the guard when the siblings were tuned and this
  shape was not: the winner of the nearest sibling of the same dtype within the service's
  ``nearest_max_distance`` (valid for this shape), else the default;
- ``guarded``: what a lookup serves now: the nearest sibling's winner only where it beat the
  default on its own shape by more than the service's ``nearest_min_gain`` (1.05), else the
  default (see docs/defaults.md).

Both lookups are the service's own selection, :func:`service.lookup.pick_best_config`, over the
siblings stored as a lookup reads them (each sibling's optimum as ``time_ms``, its default
config's recorded time as ``default_ms``, as a job that measured the default first stores
them; validity by the operator's ``check``, as the API's). No GPU: the times are the recorded
ones. Prints a table, writes JSON (``--out``).

    python3 benchmarks/untuned_defaults.py [--out data/benchmarks/untuned_defaults.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kato.db.queries import StoredConfig  # noqa: E402
from kato.kernels import get_operator  # noqa: E402
from kato.service.lookup import NEAREST_MIN_GAIN, ConfigGroup, pick_best_config  # noqa: E402

from kato.shared.kt_cache import KernelTunerCache, load_cache  # noqa: E402

SPACES = ROOT / "data" / "spaces"


@dataclass(frozen=True)
class Space:
    name: str
    operator: str
    dtype: str
    shape: tuple[int, ...]
    cache: KernelTunerCache
    times: dict[str, float]

    @property
    def best(self) -> float:
        return min(self.times.values())

    @property
    def winner(self) -> str:
        return min(self.times, key=self.times.__getitem__)

    @property
    def default(self) -> str:
        spec = get_operator(self.operator)
        return self.cache.key(spec.default_config(self.shape, self.dtype))

    def config(self, key: str) -> dict[str, Any]:
        """The config of entry ``key``, as a lookup serves it."""
        entry = self.cache.entries[key]
        return {name: entry[name] for name in self.cache.tune_params}

    def stored(self, row_id: int) -> StoredConfig:
        """This space's winner as a tuning job stores it: its optimum, and the default config's
        time measured beside it."""
        return StoredConfig(
            id=row_id, operator=self.operator, operator_version="recorded", shape=self.shape,
            shape_key="x".join(map(str, self.shape)), dtype=self.dtype, gpu_model="H200",
            compute_capability="9.0", cuda_version="recorded", config=self.config(self.winner),
            time_ms=self.best, job_id=None, updated_at=datetime.fromtimestamp(0, UTC),
            default_ms=self.times.get(self.default),
        )  # fmt: skip

    def fraction(self, key: str) -> float:
        """Optimum / time of config ``key``; 0 for a config this shape cannot run."""
        time = self.times.get(key)
        return self.best / time if time else 0.0


@dataclass
class Row:
    space: str
    siblings: int
    default: float
    nearest: float
    guarded: float
    nearest_from: str | None


def load_spaces(root: Path) -> list[Space]:
    spaces = []
    for path in sorted(root.glob("**/*.json.gz")):
        cache = load_cache(path)
        field = cache.time_field
        times = {k: float(e[field]) for k, e in cache.ok_entries().items()}
        spaces.append(
            Space(
                name=f"{path.parent.name}/{path.name.split('.json')[0]}",
                operator=cache.extra["kato_operator"],
                dtype=cache.extra["dtype"],
                shape=tuple(int(s) for s in cache.problem_size),
                cache=cache,
                times=times,
            )
        )
    return spaces


def served(
    space: Space, siblings: list[Space], max_distance: float, min_gain: float | None
) -> tuple[str, Space | None]:
    """The key of the config a lookup for ``space``'s shape serves with ``siblings`` stored
    (:func:`service.lookup.pick_best_config`, the service's selection), and the sibling it is
    from (None: the default)."""
    spec = get_operator(space.operator)
    group = ConfigGroup([s.stored(i) for i, s in enumerate(siblings)])
    row, _ = pick_best_config(
        group,
        space.shape,
        accept=lambda config: spec.check(config, space.shape, space.dtype) is None,
        max_distance=max_distance,
        min_gain=min_gain,
    )
    if row is None:
        return space.default, None
    return space.cache.key(dict(row.config)), siblings[row.id]


def evaluate(
    spaces: list[Space], max_distance: float, min_gain: float | None = NEAREST_MIN_GAIN
) -> list[Row]:
    rows = []
    for space in spaces:
        siblings = [s for s in spaces if s is not space and s.operator == space.operator]
        if not siblings:
            continue
        same = [s for s in siblings if s.dtype == space.dtype]  # a lookup's group
        nearest, source = served(space, same, max_distance, None)
        guarded, _ = served(space, same, max_distance, min_gain)
        rows.append(
            Row(
                space=space.name,
                siblings=len(siblings),
                default=space.fraction(space.default),
                nearest=space.fraction(nearest),
                guarded=space.fraction(guarded),
                nearest_from=source.name if source is not None else None,
            )
        )
    return rows


def summary(rows: list[Row]) -> dict[str, dict[str, float]]:
    return {
        policy: {
            "mean": statistics.fmean(getattr(r, policy) for r in rows),
            "worst": min(getattr(r, policy) for r in rows),
        }
        for policy in ("default", "nearest", "guarded")
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spaces", type=Path, default=SPACES)
    parser.add_argument(
        "--max-distance",
        type=float,
        default=None,
        help="nearest-shape limit (default: the service's setting)",
    )
    parser.add_argument(
        "--min-gain",
        type=float,
        default=None,
        help="the nearest-shape guard (default: the service's setting; 0: none)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from kato.service.settings import Settings

    settings = Settings()
    max_distance = settings.nearest_max_distance if args.max_distance is None else args.max_distance
    min_gain = settings.nearest_min_gain if args.min_gain is None else args.min_gain
    rows = evaluate(load_spaces(args.spaces), max_distance, min_gain)
    print(f"{'space':62s} {'default':>8s} {'nearest':>8s} {'guarded':>8s}")
    for r in rows:
        print(f"{r.space:62s} {r.default:8.3f} {r.nearest:8.3f} {r.guarded:8.3f}")
    totals = summary(rows)
    for stat in ("mean", "worst"):
        cells = " ".join(f"{totals[p][stat]:8.3f}" for p in ("default", "nearest", "guarded"))
        print(f"{stat:62s} {cells}")
    result = {
        "max_distance": max_distance,
        "guard": min_gain,
        "path": "kato.service.lookup.pick_best_config",
        "summary": totals,
        "rows": [asdict(r) for r in rows],
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
