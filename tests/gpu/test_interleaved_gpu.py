"""A worker holding several jobs on the H200 (issue 35): the jobs' GPU work takes turns, never
overlapping; every budget is exact; each job's GPU busy time is stored. The speed is
benchmarks/batch_tuning.py's to measure."""

from __future__ import annotations

from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner.backends.pycuda import describe_device
from kato.tuner.factories import pycuda_backend_factory
from kato.tuner.worker import Worker

KEYS = [
    ("relu", [1 << 20], "float16"),
    ("relu", [1 << 22], "float16"),
    ("transpose", [1024, 1024], "float32"),
    ("reduce_sum", [4096, 1024], "float32"),
]


def test_interleaved_jobs_take_turns_on_the_gpu_and_use_their_exact_budgets(tmp_path):
    model = describe_device(0).model
    url = f"sqlite:///{tmp_path / 'kato.db'}"
    sessions = session_factory(init_db(url))
    budget = 8
    with sessions() as s:
        jobs = queries.create_jobs(
            s,
            [
                dict(
                    operator=op,
                    operator_version=get_operator(op).version,
                    shape=shape,
                    dtype=dtype,
                    gpu_model=model,
                    budget_configs=budget,
                )  # fmt: skip
                for op, shape, dtype in KEYS
            ],
        )
        ids = [j.id for j in jobs]
    factory = pycuda_backend_factory(0, isolate=True, defer_prepare=True)
    worker = Worker(
        sessions, url, [model], factory, worker_id="gpu-interleaved", poll_seconds=0.05,
        jobs_at_once=3,
    )  # fmt: skip
    assert worker.run_forever(max_jobs=len(ids)) == len(ids)
    holds = sorted(worker.runner.gpu_gate.timeline())
    assert len(holds) >= budget * len(ids)
    for (_, end, _), (start, _, _) in zip(holds, holds[1:], strict=False):
        assert start >= end  # one measurement at a time
    assert len({holder for _, _, holder in holds}) == len(ids)
    with sessions() as s:
        for job_id in ids:
            job = queries.get_job(s, job_id)
            assert job is not None and job.status == "done", job
            trials = queries.job_trials(s, job_id)
            assert job.trials_done == budget == len({t.config_key for t in trials})
            assert job.gpu_busy_s and 0 < job.gpu_busy_fraction <= 1.0
