"""Large user spaces on the CPU: Kernel Tuner's convolution example's 3,145,728 combinations.

Measures (no GPU): the time to filter the whole product with the vectorised check
(``UserOperatorSpec.screen`` through ``SearchSpace.filter_mask``) against the per-config
``check`` (timed on a random sample and scaled), checks that the two agree on that sample, the
time to build the sampled space's pool, and the search's proposal overhead per trial (default
strategy, a synthetic time per config, no measuring) over ``--trials`` trials.

    python3 benchmarks/large_space.py --trials 100
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from kato.kernels.user import OperatorDefinition, UserOperatorSpec  # noqa: E402
from kato.tuner.backends.base import TrialResult, TrialStatus  # noqa: E402
from kato.tuner.backends.pycuda import check_on_gpu, operator_space  # noqa: E402
from kato.tuner.search import Budget, Search  # noqa: E402

from kato.shared.gpus import find_gpu  # noqa: E402

SHAPE, DTYPE = (4096, 4096), "float32"


def convolution_spec() -> UserOperatorSpec:
    """Kernel Tuner's ``examples/cuda/convolution.py`` space (its filter sizes tuned too)."""
    spec = {
        "name": "convolution_large", "template": "conv.cu", "kernel_name": "convolution_kernel",
        "shape": ["w", "h"], "verify": False,
        "tune_params": {
            "filter_height": list(range(3, 35, 2)), "filter_width": list(range(3, 35, 2)),
            "block_size_x": [16 * i for i in range(1, 9)],
            "block_size_y": [2**i for i in range(6)],
            "tile_size_x": list(range(1, 9)), "tile_size_y": list(range(1, 9)),
            "use_padding": [0, 1], "read_only": [0, 1],
        },
        "restrictions": ["use_padding==0 or (block_size_x % 32 != 0)"],
        "grid_div_x": ["block_size_x", "tile_size_x"],
        "grid_div_y": ["block_size_y", "tile_size_y"],
        "arguments": [
            {"name": "out", "dtype": "float32", "size": "w * h", "output": True},
            {"name": "inp", "dtype": "float32", "size": "(w + 32) * (h + 32)"},
        ],
    }  # fmt: skip
    template = "__global__ void convolution_kernel(float *out, const float *inp) {}\n"
    return UserOperatorSpec(OperatorDefinition(spec=spec, files={"conv.cu": template}))


def synthetic_ms(config: dict) -> float:
    """A smooth landscape with a single best region (only the search's overhead is measured)."""
    threads = config["block_size_x"] * config["block_size_y"]
    work = config["tile_size_x"] * config["tile_size_y"]
    return (
        1.0 + abs(math.log2(threads / 256)) + abs(math.log2(work / 4)) * 0.5
        + 0.1 * config["use_padding"] + 0.05 * config["read_only"]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--sample", type=int, default=20_000, help="configs checked one by one")
    args = parser.parse_args()
    op, gpu = convolution_spec(), find_gpu("H200")

    def check(config: dict) -> str | None:
        return check_on_gpu(op, SHAPE, DTYPE, gpu, config, "sm_90")

    space = operator_space(op, SHAPE, DTYPE, check, gpu)
    t0 = time.perf_counter()
    mask = space.filter_mask()
    filtered_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    flat = np.sort(rng.choice(len(space), args.sample, replace=False))
    configs = space.configs_at(flat)
    t0 = time.perf_counter()
    one_by_one = [check(c) is None for c in configs]
    per_config_s = (time.perf_counter() - t0) / len(configs)
    agree = one_by_one == mask[flat].tolist()
    t0 = time.perf_counter()
    pool = space.valid_configs()
    pool_s = time.perf_counter() - t0
    print(f"combinations {len(space)}, valid {int(mask.sum())}, sampled {space.sampled}")
    print(f"vectorised filter of the product: {filtered_s:.2f} s "
          f"({filtered_s / len(space) * 1e6:.2f} us a combination)")  # fmt: skip
    whole = per_config_s * len(space)
    print(f"per-config check: {per_config_s * 1e6:.0f} us a config -> {whole:.0f} s for the "
          f"product; agree on {len(configs)}: {agree}")  # fmt: skip
    print(f"pool of {len(pool)} valid configs in {pool_s:.2f} s")

    def evaluate(config: dict) -> TrialResult:
        times = [synthetic_ms(config)]
        return TrialResult(config=dict(config), status=TrialStatus.OK, times_ms=times)

    search = Search(space, evaluate, seed=0)
    t0 = time.perf_counter()
    result = search.run(Budget(max_configs=args.trials))
    total = time.perf_counter() - t0
    best = result.best.time_ms if result.best else float("nan")
    print(f"search: {args.trials} trials in {total:.2f} s, {total / args.trials * 1e3:.1f} ms a "
          f"trial (proposal and bookkeeping; evaluate is free); best {best:.3f} ms (the "
          f"synthetic landscape's optimum is 1.0)")  # fmt: skip


if __name__ == "__main__":
    main()
