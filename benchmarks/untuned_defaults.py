"""How close the config served for an untuned shape comes to that shape's optimum (issue 31).

Replays every whole operator space Kato brute-forced on the H200 (``data/spaces``, Kernel Tuner
cache format) whose operator has at least one other recorded space (a *sibling*), and reports
for each, as a fraction of the space's optimum (its best time / the served config's time):

- ``default``: the operator's ``default_config`` for the shape (what a lookup serves when the
  database knows nothing near it);
- ``nearest``: what a lookup serves today when the siblings were tuned and this shape was not:
  the winner of the nearest sibling of the same dtype within the service's
  ``nearest_max_distance`` (valid for this shape), else the default;
- ``guarded``: the nearest sibling's winner only where it beat the default on its own shape by
  more than 5%, else the default: the policy the data argues for (see docs/defaults.md).

No GPU: the times are the recorded ones. Prints a table, writes JSON (``--out``).

    python3 benchmarks/untuned_defaults.py [--out data/benchmarks/untuned_defaults.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kernels import get_operator  # noqa: E402
from tuner.kt_cache import KernelTunerCache, load_cache  # noqa: E402
from tuner.warm_start import shape_distance  # noqa: E402

SPACES = ROOT / "data" / "spaces"
#: The guarded policy serves a neighbour's winner only where it beat the default there by this.
GUARD = 1.05


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


def evaluate(spaces: list[Space], max_distance: float) -> list[Row]:
    rows = []
    for space in spaces:
        siblings = [s for s in spaces if s is not space and s.operator == space.operator]
        if not siblings:
            continue
        default = space.default
        near = sorted(
            (
                s
                for s in siblings
                if s.dtype == space.dtype
                and len(s.shape) == len(space.shape)
                and shape_distance(s.shape, space.shape) <= max_distance
                # Only a winner this shape can run is served (the lookup's validity check).
                and s.winner in space.cache.entries
            ),
            key=lambda s: shape_distance(s.shape, space.shape),
        )
        nearest = guarded = default
        source = None
        if near:
            neighbour = near[0]
            nearest, source = neighbour.winner, neighbour.name
            gain = neighbour.times.get(neighbour.default, math.inf) / neighbour.best
            if gain > GUARD:
                guarded = neighbour.winner
        rows.append(
            Row(
                space=space.name,
                siblings=len(siblings),
                default=space.fraction(default),
                nearest=space.fraction(nearest),
                guarded=space.fraction(guarded),
                nearest_from=source,
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    max_distance = args.max_distance
    if max_distance is None:
        from service.settings import Settings

        max_distance = Settings().nearest_max_distance
    rows = evaluate(load_spaces(args.spaces), max_distance)
    print(f"{'space':62s} {'default':>8s} {'nearest':>8s} {'guarded':>8s}")
    for r in rows:
        print(f"{r.space:62s} {r.default:8.3f} {r.nearest:8.3f} {r.guarded:8.3f}")
    totals = summary(rows)
    for stat in ("mean", "worst"):
        cells = " ".join(f"{totals[p][stat]:8.3f}" for p in ("default", "nearest", "guarded"))
        print(f"{stat:62s} {cells}")
    result = {
        "max_distance": max_distance,
        "guard": GUARD,
        "summary": totals,
        "rows": [asdict(r) for r in rows],
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
