"""benchmarks/batch_order.py: the order that gives each job of a batch its nearest tuned
neighbour, and the replay of a batch in a given order."""

from __future__ import annotations

from paths import SPACES

from benchmarks import batch_order


def test_warm_order_starts_central_then_always_takes_the_nearest_to_a_tuned_shape():
    shapes = [(64,), (1,), (16,), (4096,), (8,)]
    # 16 is the centre (the median of the log2 sizes); then 8 (1 doubling from 16), 64 (2 from
    # 16), 1 (3 from 8), 4096 last.
    assert batch_order.warm_order(shapes) == [2, 4, 0, 1, 3]
    assert batch_order.warm_order([(4, 4)]) == [0]
    assert batch_order.warm_order([]) == []


def test_a_replayed_batch_counts_each_jobs_configs_to_the_target():
    softmax = next(v for k, v in batch_order.groups(SPACES).items() if k.startswith("softmax/"))
    order = batch_order.warm_order([tuple(c.problem_size) for c in softmax])
    needed = batch_order.run_batch(softmax, order, budget=20, seed=0, target=0.98)
    assert len(needed) == len(softmax)
    assert all(1 <= n <= 21 for n in needed)
    # The target 0 is met by the first config every job measures (its default).
    assert batch_order.run_batch(softmax, order, budget=5, seed=0, target=0.0) == [1] * len(softmax)
