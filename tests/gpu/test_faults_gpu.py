"""Fault isolation on a real GPU: a job whose space holds planted faulty kernels (out-of-bounds
write, infinite loop, __trap(), misaligned address) completes through the isolated pycuda
backend, records each as a failed trial with its error, finds the fastest correct config, and
the worker (this process) carries on. Budget: well under 60 s on the H200."""

from __future__ import annotations

import time

from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.tuner.backends.isolated import IsolatedBackend
from kato.tuner.factories import pycuda_backend_factory
from kato.tuner.worker import Worker

N = 1 << 22
TRIAL_TIMEOUT_S = 8.0


def test_planted_faults_are_failed_trials_and_the_job_completes(tmp_path):
    import faulty_op  # registers faulty_copy here (not at collection: other tests list operators)
    from kato.tuner.backends.pycuda import describe_device

    model = describe_device(0).model
    url = f"sqlite:///{tmp_path}/kato.db"
    sessions = session_factory(init_db(url))
    spec = faulty_op.FAULTY_COPY
    with sessions() as s:
        job_id = queries.create_job(
            s,
            operator=spec.name,
            operator_version=spec.version,
            shape=[N],
            dtype="float32",
            gpu_model=model,
            budget_configs=7,  # the whole valid space: 3 correct, 4 faulty
            strategy="grid",
        ).id
    made: list[IsolatedBackend] = []
    factory = pycuda_backend_factory(
        0, isolate=True, trial_timeout_s=TRIAL_TIMEOUT_S, imports=("faulty_op",)
    )

    def tracking(job):
        made.append(factory(job))
        return made[-1]

    start = time.monotonic()
    worker = Worker(sessions, url, [model], tracking, poll_seconds=0.01)
    outcome = worker.run_once()
    elapsed = time.monotonic() - start
    assert outcome is not None and outcome.status == "done", outcome
    assert worker.run_once() is None  # the worker is still working
    assert elapsed < 60, f"took {elapsed:.1f} s"

    with sessions() as s:
        job = queries.get_job(s, job_id)
        trials = {
            (t.config["MODE"], t.config["BLOCK_SIZE"]): t for t in queries.job_trials(s, job_id)
        }
    assert job.status == "done" and job.trials_done == 7 == len(trials)
    for mode in faulty_op.FAULTS:
        t = trials[(mode, 256)]
        expected = "timeout" if mode == 2 else ("launch_error", "crashed")
        assert t.status in expected and t.error, (mode, t.status, t.error)
    correct = [trials[(0, b)] for b in (128, 256, 512)]
    assert all(t.status == "ok" and t.time_ms > 0 for t in correct), [t.error for t in correct]
    fastest = min(correct, key=lambda t: t.time_ms)
    assert job.best_config == fastest.config and job.best_time_ms == fastest.time_ms
    assert made[0].restarts >= 4  # every fault replaced the measuring process
