"""A sampled space's pool growing around the best configs, against a fixed pool (CPU only).

The space is Kernel Tuner's convolution example's (``benchmarks/large_space.py``: 3,145,728
combinations, 1,867,776 valid on an H200), which the search sees through a pool of 20 000
valid configs (:mod:`tuner.space`). The objective is synthetic and replayable (a function of
the config) where every parameter matters a little, so that the best configs are unlikely to
be in a uniform pool of 1 % of the space: a global basin, a wider second one 8 % slower at
its best, and 2 % of deterministic roughness. Each seed runs the default search (``forest``)
twice on the same space, with the rows growing around the best configs
(:data:`tuner.surrogate.GROW_MAX`) and with them fixed (``GROW_MAX = 0``): the best time found
after ``--budgets`` measured configs, paired by seed, and the search's own time per trial (the
proposals; evaluating is free).

    python3 benchmarks/pool_growth.py --seeds 6 --budgets 50 100

Results: docs/user_kernels.md (Large spaces).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from kato.tuner import surrogate  # noqa: E402
from kato.tuner.backends.base import TrialResult, TrialStatus  # noqa: E402
from kato.tuner.backends.pycuda import check_on_gpu, operator_space  # noqa: E402
from kato.tuner.search import Budget, Search  # noqa: E402
from large_space import DTYPE, SHAPE, convolution_spec  # noqa: E402

from kato.shared.gpus import find_gpu  # noqa: E402

#: The global basin's centre: every term of :func:`synthetic_ms` is smallest there.
BEST = {"filter_height": 11, "filter_width": 21, "block_size_x": 48, "block_size_y": 4,
        "tile_size_x": 3, "tile_size_y": 5, "use_padding": 1, "read_only": 1}  # fmt: skip
#: The second basin's centre: 8 % slower at its best, wider (a local optimum).
SECOND = {"block_size_x": 128, "block_size_y": 8, "tile_size_x": 1, "tile_size_y": 2}


def _rough(config: dict) -> float:
    """Deterministic roughness in [0, 0.02): the same for a config in every run."""
    key = ",".join(f"{k}={config[k]}" for k in sorted(config)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") / 2**32 * 0.02


def synthetic_ms(config: dict) -> float:
    """Every parameter matters a little, the block shape most; read-only loads pay off with
    padding only (an interaction); two basins."""
    c = config
    threads = c["block_size_x"] * c["block_size_y"]
    near = (
        abs(math.log2(threads / 192)) * 0.35
        + abs(c["block_size_x"] - BEST["block_size_x"]) / 16 * 0.04
        + abs(c["tile_size_x"] - BEST["tile_size_x"]) * 0.08
        + abs(c["tile_size_y"] - BEST["tile_size_y"]) * 0.06
        + abs(c["filter_height"] - BEST["filter_height"]) / 2 * 0.012
        + abs(c["filter_width"] - BEST["filter_width"]) / 2 * 0.012
        + (0.0 if c["use_padding"] == c["read_only"] == 1 else 0.1)
    )
    far = 0.08 + sum(abs(math.log2(c[k] / v)) * 0.12 for k, v in SECOND.items())
    far += 0.004 * abs(c["filter_height"] - c["filter_width"]) / 2
    return 1.0 + min(near, far) + _rough(c)


def run(space, seed: int, budgets: list[int], grow: int) -> tuple[list[float], float, int]:
    """The best time after each budget, the mean proposal time per trial (ms) and the rows the
    proposer grew, for one search of ``max(budgets)`` configs."""
    surrogate.GROW_MAX = grow

    def evaluate(config: dict) -> TrialResult:
        return TrialResult(
            config=dict(config), status=TrialStatus.OK, times_ms=[synthetic_ms(config)]
        )

    search = Search(space, evaluate, seed=seed)
    result = search.run(Budget(max_configs=max(budgets)))
    times = [r.time_ms for r in result.results.values()]
    bests = [min(times[:b]) for b in budgets]
    propose = statistics.mean(t.propose for t in result.timings) * 1e3
    model = getattr(search.proposer, "_model", None)
    grown = len(model.configs) - len(space.valid_configs()) if model is not None else 0
    return bests, propose, grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--budgets", type=int, nargs="+", default=[50, 100])
    args = parser.parse_args()
    op, gpu = convolution_spec(), find_gpu("H200")
    check = lambda config: check_on_gpu(op, SHAPE, DTYPE, gpu, config, "sm_90")  # noqa: E731
    space = operator_space(op, SHAPE, DTYPE, check, gpu)
    pool = space.valid_configs()  # the pool: these searches have no seeds to add to it
    in_pool, optimum = min(synthetic_ms(c) for c in pool), synthetic_ms(BEST)
    print(f"{len(space)} combinations, {space.count_valid()} valid, pool {len(pool)}; "
          f"best in the pool {in_pool:.3f} ms, global optimum {optimum:.3f} ms")  # fmt: skip
    grow = surrogate.GROW_MAX
    rows = []
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        fixed = run(space, seed, args.budgets, 0)
        grown = run(space, seed, args.budgets, grow)
        rows.append((seed, fixed, grown))
        cells = " | ".join(f"{f:.3f} -> {g:.3f}" for f, g in zip(fixed[0], grown[0], strict=True))
        print(f"seed {seed}: best fixed -> grown at {args.budgets}: {cells}; propose "
              f"{fixed[1]:.1f} / {grown[1]:.1f} ms a trial; rows grown {grown[2]} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    print(
        "| budget | fixed pool, mean best | grown, mean best | grown better / equal / worse "
        "| mean ratio grown / fixed |"
    )
    print("| --- | --- | --- | --- | --- |")
    for j, budget in enumerate(args.budgets):
        fixed = [r[1][0][j] for r in rows]
        grown = [r[2][0][j] for r in rows]
        better = sum(g < f for f, g in zip(fixed, grown, strict=True))
        equal = sum(g == f for f, g in zip(fixed, grown, strict=True))
        ratio = statistics.mean(g / f for f, g in zip(fixed, grown, strict=True))
        print(f"| {budget} | {statistics.mean(fixed):.3f} | {statistics.mean(grown):.3f} | "
              f"{better} / {equal} / {len(rows) - better - equal} | {ratio:.3f} |")  # fmt: skip
    print(f"propose per trial (ms): fixed {statistics.mean(r[1][1] for r in rows):.1f}, grown "
          f"{statistics.mean(r[2][1] for r in rows):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
