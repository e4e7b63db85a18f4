"""The order claims take a batch's jobs in (SQLite and PostgreSQL, issue 35): among the claimable
jobs of the oldest batch, the one whose group ((operator, dtype, GPU model)) has the most jobs
still to run, ties in queue order; batches, and jobs submitted alone, in queue order."""

from __future__ import annotations

from kato.db import queries
from kato.db.queries import JobScope

CLAIM = {"gpu_models": ["H200"], "lease_seconds": 60}


def _fields(operator: str, n: int, dtype: str = "float16") -> dict:
    return dict(
        operator=operator, operator_version="v1", shape=[n, 128], dtype=dtype,
        gpu_model="H200", budget_configs=10,
    )  # fmt: skip


def _batch(session, *jobs: tuple[str, int]) -> dict[str, str]:
    """Queue one batch; its jobs are named operator + shape's first dimension ("a1")."""
    created = queries.create_jobs(session, [_fields(op, n) for op, n in jobs])
    return {f"{op}{n}": job.id for (op, n), job in zip(jobs, created, strict=True)}


def _claim(session, held: dict[str, str], names: dict[str, str], worker: str = "w") -> str | None:
    """What a worker holding the jobs ``held`` (name -> operator) claims next: never a job of
    a group it holds (:class:`tuner.worker.Worker`'s claims)."""
    scope = JobScope(
        exclude_groups=frozenset((op, "float16", "H200") for op in held.values()),
        exclude_job_ids=frozenset(names[name] for name in held),
    )
    seen = queries.next_claimable_job(session, gpu_models=CLAIM["gpu_models"], scope=scope)
    job = queries.claim_next_job(session, worker_id=worker, scope=scope, **CLAIM)
    assert (seen.id if seen else None) == (job.id if job else None)  # the same order
    if job is None:
        return None
    return {v: k for k, v in names.items()}[job.id]


def _end(session, names: dict[str, str], held: dict[str, str], name: str) -> None:
    queries.finish_job(session, names[name], status="done")
    del held[name]


def test_two_slots_take_the_longest_chain_first(session):
    # x (one job) is first in the queue; a and b have three each.
    names = _batch(session, ("x", 1), ("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("b", 3))
    held: dict[str, str] = {}
    order = []
    for _ in range(2):
        name = _claim(session, held, names)
        held[name] = name[0]
        order.append(name)
    assert order == ["a1", "b1"]  # queue order would take x1 first, then a1

    # The slot freed by a1 takes a's next job (a has two left, x one), and so on.
    steps = [("a1", "a2"), ("b1", "b2"), ("a2", "x1"), ("b2", "a3"), ("x1", "b3")]
    for ended, want in steps:
        _end(session, names, held, ended)
        name = _claim(session, held, names)
        assert name == want, (ended, name)
        held[name] = name[0]
    assert _claim(session, held, names) is None


def test_ties_go_in_queue_order_and_a_group_s_jobs_stay_in_order(session):
    names = _batch(session, ("c", 1), ("b", 2), ("b", 1), ("a", 1), ("a", 2), ("c", 2))
    claimed = []
    while (name := _claim(session, {}, names)) is not None:
        claimed.append(name)
    # Two each: c1 in queue order; then b and a have two left, c one; then one each.
    assert claimed == ["c1", "b2", "a1", "b1", "a2", "c2"]
    for group in "abc":  # each group's jobs in queue order (b2 was queued before b1)
        assert [n for n in claimed if n[0] == group] == [n for n in names if n[0] == group]


def test_an_older_batch_and_a_job_submitted_alone_come_before_a_newer_batch(session):
    older = _batch(session, ("a", 1), ("b", 1))
    alone = queries.create_job(session, **_fields("c", 1)).id
    newer = _batch(session, ("d", 1), ("d", 2), ("d", 3), ("d", 4))
    names = {**older, "c1": alone, **newer}
    held: dict[str, str] = {}
    order = []
    for _ in range(3):  # three slots: the newer batch's long chain waits its turn
        name = _claim(session, held, names)
        held[name] = name[0]
        order.append(name)
    assert order == ["a1", "b1", "c1"]


def test_a_resumed_job_counts_in_its_group_s_chain(session):
    names = _batch(session, ("a", 1), ("a", 2), ("b", 1), ("b", 2), ("b", 3))
    gone = queries.claim_next_job(session, worker_id="gone", **{**CLAIM, "lease_seconds": 0})
    assert gone is not None and gone.id == names["b1"]  # b has three: the longest chain
    # Its worker died (the lease has run out): b still has three to run, b1 first.
    assert _claim(session, {}, names, worker="w2") == "b1"
