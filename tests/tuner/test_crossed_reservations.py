"""Two workers sharing a job whose configs cross (issue 35's reservation order): worker A has
measured c1 and finds c2 reserved by worker B; B, for its part, stores c2 only once A's record
of c1 is stored (as it would, waiting for a config A holds). A must write its records before
it waits for another worker's result, or neither goes on."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from fleet_helpers import queue_recordings
from kato.db import fleet, queries
from kato.db.ledger import Ledger
from kato.db.models import RESERVED
from kato.db.session import init_db, session_factory
from kato.tuner.factories import ReplayBackends
from kato.tuner.job_runner import JobRunner

from tests.tuner.test_interleaved_worker import recordings_by_group


class FirstIsSlow(ReplayBackends):
    """Replay whose first measurement takes ``first_s`` (the window worker B reserves in)."""

    def __init__(self, recordings, first_s: float) -> None:
        super().__init__(recordings)
        self.first_s, self.measured = first_s, 0

    def __call__(self, job):  # type: ignore[no-untyped-def]
        backend = super().__call__(job)
        evaluate, outer = backend.evaluate, self

        def timed(config: dict[str, Any]):
            outer.measured += 1
            if outer.measured == 1:
                time.sleep(outer.first_s)
            return evaluate(config)

        backend.evaluate = timed  # type: ignore[method-assign]
        return backend


def _run(tmp_path: Path, name: str, recording, budget: int, during=None):
    url = f"sqlite:///{tmp_path / name}"
    sessions = session_factory(init_db(url))
    (job_id,) = queue_recordings(sessions, [recording], budget)
    runner = JobRunner(
        sessions, url, FirstIsSlow([recording], first_s=1.0 if during else 0.0),
        worker_id="A", sync_seconds=600,  # A never reads B's reservations ahead
    )  # fmt: skip
    with sessions() as s:
        assert queries.claim_next_job(s, gpu_models=["H200"], worker_id="A", lease_seconds=60)
    side = threading.Thread(target=during, args=(sessions, job_id)) if during else None
    if side is not None:
        side.start()
    outcome = runner.run(job_id)
    if side is not None:
        side.join(60)
    with sessions() as s:
        trials = sorted(queries.job_trials(s, job_id), key=lambda t: t.number)
    return outcome, trials


def test_a_worker_writes_its_records_before_it_waits_for_another_workers_result(tmp_path):
    (recording,) = recordings_by_group(per_group=1, groups=1)
    # The order A proposes in (the same seed, the same results: the same proposals).
    _, alone = _run(tmp_path, "alone.db", recording, budget=3)
    c1, c2 = alone[0], alone[1]
    waited: list[float] = []

    def worker_b(sessions, job_id: str) -> None:
        with sessions() as s:  # B is live: its reservation is never released as stale
            fleet.heartbeat_worker(
                s, worker_id="B", hostname="b", pid=2, gpu_models=["H200"], backend="replay",
                status="busy", current_job_id=job_id,
            )  # fmt: skip
        b = Ledger(sessions, "B", lease_seconds=60).job(job_id)

        def status(key: str) -> str | None:
            with sessions() as s:
                rows = [t for t in queries.job_trials(s, job_id) if t.config_key == key]
            return rows[0].status if rows else None

        deadline = time.monotonic() + 30
        while status(c1.config_key) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # A reserved c1 and measures it (1 s)
        assert b.reserve(dict(c2.config), c2.config_key) == "reserved"
        t0 = time.monotonic()
        while status(c1.config_key) == RESERVED and time.monotonic() - t0 < 8:
            time.sleep(0.02)  # B stores c2 once A's c1 is stored
        waited.append(time.monotonic() - t0)
        b.record(c2.config_key, c2.result())

    outcome, trials = _run(tmp_path, "shared.db", recording, budget=3, during=worker_b)
    assert outcome.status == "done", outcome.error
    assert waited and waited[0] < 8, "A waited for B's result holding its own record back"
    assert [t.config_key for t in trials] == [t.config_key for t in alone]
    assert [t.reserved_by for t in trials][:2] == ["A", "B"]
