"""Helpers for the multi-process queue tests (importable as ``fleet_helpers``): start real
``kato worker`` processes on the replay backend, submit jobs, wait for states."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kato.db import queries
from kato.db.models import Job
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from paths import RECORDED, REPO

SHAPE, DTYPE = [4096, 4096], "float16"


def sessions_for(url: str):
    return session_factory(init_db(url))


def submit(sessions, budget: int, *, strategy: str = "grid", seed: int = 0) -> str:
    """Queue a softmax job on H200. ``grid`` by default: every proposal is a fresh valid config,
    so a trial costs one Optuna ask and tell (the RDB storage is the slow part on SQLite)."""
    with sessions() as s:
        return queries.create_job(
            s,
            operator="softmax",
            operator_version=get_operator("softmax").version,
            shape=SHAPE,
            dtype=DTYPE,
            gpu_model="H200",
            budget_configs=budget,
            strategy=strategy,
            seed=seed,
        ).id


def queue_recordings(
    sessions,
    recordings: Sequence[Any],
    budget: int | Sequence[int],
    *,
    seeded: bool = False,
    gpu_model: str | None = "H200",
) -> list[str]:
    """Queue one job per recording (its problem's operator, version, shape and dtype) in one
    ``create_jobs`` batch, on ``gpu_model`` (``None``: the recording's own). ``budget``: the
    configs of every job, or one per recording; ``seeded``: job i gets seed i, else seed 0.
    Returns the job ids in the recordings' order."""
    budgets = [budget] * len(recordings) if isinstance(budget, int) else list(budget)
    if len(budgets) != len(recordings):
        raise ValueError(f"{len(budgets)} budgets for {len(recordings)} recordings")
    fields = [
        dict(
            operator=r.problem.operator,
            operator_version=r.problem.operator_version,
            shape=list(r.problem.shape),
            dtype=r.problem.dtype,
            gpu_model=gpu_model or r.problem.gpu_model,
            budget_configs=b,
            seed=i if seeded else 0,
        )
        for i, (r, b) in enumerate(zip(recordings, budgets, strict=True))
    ]
    with sessions() as s:
        return [job.id for job in queries.create_jobs(s, fields)]


def start_worker(
    url: str,
    log: Path,
    *,
    delay: float = 0.0,
    lease: float = 2.0,
    poll: float = 0.2,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``kato worker --backend replay`` in its own process (output to ``log``; ``env``: more
    environment variables)."""
    cmd = [
        sys.executable,
        "-m",
        "kato.service.cli",
        "worker",
        "--db",
        url,
        "--backend",
        "replay",
        "--replay",
        str(RECORDED),
        "--lease-seconds",
        str(lease),
        "--poll-seconds",
        str(poll),
        "--replay-delay",
        str(delay),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, procs=(), logs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    tails = "\n".join(Path(p).read_text()[-3000:] for p in logs if Path(p).exists())
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tails}")


def job(sessions, job_id: str) -> Job:
    with sessions() as s:
        found = queries.get_job(s, job_id)
        assert found is not None
        return found


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def claim_until_empty(url: str, worker_id: str) -> list[str]:
    """Claim jobs (lease 60 s) until none is left; the ids claimed (run in a child process)."""
    sessions = session_factory(init_db(url))
    claimed = []
    while True:
        with sessions() as s:
            found = queries.claim_next_job(
                s, gpu_models=["H200"], worker_id=worker_id, lease_seconds=60
            )
            if found is None:
                return claimed
            claimed.append(found.id)
