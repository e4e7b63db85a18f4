"""A fleet on several GPUs of one host, in one run (issue 36): one ``kato worker`` process per
GPU on one database, a batch, a job they share, faults, and device selection.

Steps (``--steps``, default all four, in this order):

- ``batch``: 16 jobs of different operators and shapes queued as one batch in a fresh database,
  one worker process per GPU (``kato worker --device i``; ``--bind visible``:
  ``CUDA_VISIBLE_DEVICES=i`` and ``--device 0``), run to the end; then the same batch on 1 GPU
  (a fresh database). Reported: every job done exactly once (done, trials == distinct configs
  == budget, numbers 0..n-1, no reservation left), each GPU's share of the jobs, of the trials
  and of the GPU busy seconds (a job's stored ``gpu_busy_s`` split by who measured its trials),
  wall time (first start to last end, from the database) and jobs/hour; ``scaling``: jobs/hour
  on N GPUs over 1. No helping here (``--max-workers-per-job 1``; ``--batch-helpers``):
  the shares are then each worker's own jobs.
- ``shared``: one large job (``--shared-budget``) that every GPU's worker helps with
  (``--max-workers-per-job N``): budget reached exactly, no config measured twice, how many
  trials each GPU measured; on the GPU the winner is then re-timed on each GPU in a process of
  its own (``--device i``), the slowest over the fastest within 3%.
- ``faults``: two jobs, one per GPU; ``kill -9`` the worker of the first mid-job, restart a
  worker on that GPU (``--no-restart``: leave the job to the other worker): the job resumes
  from its stored trials (those stored before the kill unchanged, trial count == distinct
  configs == budget), the other job finishes unharmed (its worker never stopped, every trial
  its own). On the GPU also a planted faulty kernel (tests/gpu/faulty_op.py: out-of-bounds
  write, infinite loop, ``__trap()``, misaligned address) tuned on GPU 1 while GPU 0 tunes a
  normal job: the faults are failed trials, the job on GPU 0 has none. The faulty job's worker
  is this script's own process (``worker`` below): ``kato worker`` cannot import the test's
  operator into its measuring child.
- ``device``: a worker bound to GPU 1 (``--device 1``, then ``CUDA_VISIBLE_DEVICES=1``) tunes a
  job while ``nvidia-smi --query-compute-apps=pid,gpu_uuid`` is sampled: every process of the
  worker (it and its measuring child) seen on GPU 1's uuid only (``nvidia-smi -L``). Skipped,
  with the reason, without nvidia-smi or a second GPU.

Modes: the GPU (every visible GPU; ``--gpus N``: the first N), or ``--replay DIR --devices N
--delay S``: N replay worker processes standing in for N GPUs (CI: the scheduling, resumption
and accounting, not the speed; what needs a GPU is reported as skipped with the reason).
Database: a SQLite file per run (default), or ``--db URL`` (PostgreSQL: a fresh schema per
run, dropped after it). Exit status 1 when any step found a problem.

    python3 benchmarks/fleet_gpus.py --out $OUT/fleet_gpus.json
    python3 benchmarks/fleet_gpus.py --replay data/spaces --devices 2 --delay 0.02
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kato.db import queries  # noqa: E402
from kato.db.models import RESERVED  # noqa: E402
from kato.db.session import init_db, session_factory  # noqa: E402
from kato.kernels import get_operator  # noqa: E402

from benchmarks.batch_tuning import DTYPES, GPU_KEYS, Key, replay_recordings  # noqa: E402

STEPS = ("batch", "shared", "faults", "device")
#: Jobs of the batch (the issue's 16).
BATCH_JOBS = 16
#: The shared job's winner re-timed on each GPU: slowest over fastest at most this.
RETIME_TOLERANCE = 0.03
#: Trial statuses of a measurement that failed (kato.shared.status).
FAILED = ("launch_error", "crashed", "timeout")
#: The shared job's key on the GPU, and the replay one where recorded (a large space).
SHARED_KEY = Key("softmax", (32768, 4096), "float16")
#: The planted-faults job: faulty_op's whole valid space (3 correct configs, 4 faulty).
FAULTY_SHAPE, FAULTY_BUDGET = (1 << 22,), 7
ENDED = ("done", "failed", "cancelled")


@dataclass
class Fleet:
    """How this run starts worker processes: the backend, the physical device of each fleet
    GPU (``devices[i]``), leases and polls, where the logs go."""

    backend: str  # pycuda | replay
    devices: list[int]
    gpu_model: str
    workdir: Path
    base_db: str | None = None
    replay: Path | None = None
    delay: float = 0.0
    lease: float = 5.0
    poll: float = 0.2
    bind: str = "device"  # device: --device i; visible: CUDA_VISIBLE_DEVICES=i --device 0
    jobs_at_once: int | None = None
    strategy: str | None = None
    trial_timeout: float = 8.0
    #: Replay: the problems recorded in ``replay`` (at their operators' current versions).
    recorded: list[Key] = field(default_factory=list)
    _schemas: list[str] = field(default_factory=list)

    def database(self, label: str) -> str:
        """A fresh database for one run: a SQLite file, or a new schema of ``base_db``."""
        if self.base_db is None or self.base_db.startswith("sqlite"):
            path = self.workdir / f"{label}.db"
            path.unlink(missing_ok=True)
            return f"sqlite:///{path}"
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        schema = f"kato_fleet_{label}_{uuid.uuid4().hex[:8]}"
        admin = create_engine(self.base_db, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
        self._schemas.append(schema)
        url = make_url(self.base_db).update_query_dict({"options": f"-csearch_path={schema}"})
        return url.render_as_string(hide_password=False)

    def drop_schemas(self) -> None:
        if not self._schemas:
            return
        from sqlalchemy import create_engine, text

        admin = create_engine(self.base_db, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            for schema in self._schemas:
                connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
        self._schemas.clear()

    def env(self, gpu: int) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p
                for p in [str(ROOT), str(ROOT / "tests" / "gpu"), os.environ.get("PYTHONPATH")]
                if p
            ),
            "KATO_FRAMEWORK_BASELINE": "false",  # PyTorch's baseline is not tuning
            "PYTHONUNBUFFERED": "1",
        }
        if self.backend == "pycuda":
            # CUDA's own order may differ from nvidia-smi's on mixed hosts: the fleet's GPU i
            # is nvidia-smi's GPU i, which the device step checks against.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            if self.bind == "visible":
                env["CUDA_VISIBLE_DEVICES"] = str(self.devices[gpu])
        return env

    def device_option(self, gpu: int) -> str:
        return (
            "0" if self.backend == "pycuda" and self.bind == "visible" else str(self.devices[gpu])
        )

    def start(
        self, gpu: int, url: str, worker_id: str, *, helpers: int = 1, faulty: bool = False
    ) -> Worker:
        """A worker process for fleet GPU ``gpu`` on ``url``, at most ``helpers`` workers per
        job; ``faulty``: this script's worker, which claims only the planted-faults job."""
        log = self.workdir / f"{worker_id}.log"
        common = [
            "--db", url, "--device", self.device_option(gpu), "--worker-id", worker_id,
            "--lease-seconds", str(self.lease), "--poll-seconds", str(self.poll),
            "--max-workers-per-job", str(helpers),
        ]  # fmt: skip
        if faulty:
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", *common]
            cmd += ["--trial-timeout", str(self.trial_timeout)]
        else:
            cmd = [sys.executable, "-m", "kato.service.cli", "worker", *common]
            cmd += ["--backend", self.backend]
            if self.backend == "replay":
                cmd += ["--replay", str(self.replay), "--replay-delay", str(self.delay)]
                cmd += ["--gpu", self.gpu_model]
            if self.jobs_at_once:
                cmd += ["--jobs-at-once", str(self.jobs_at_once)]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env(gpu), stdout=out, stderr=subprocess.STDOUT
            )
        return Worker(gpu, worker_id, proc, log)

    def job_fields(self, key: Key, budget: int, seed: int, **extra: Any) -> dict[str, Any]:
        fields = dict(
            operator=key.operator,
            operator_version=get_operator(key.operator).version,
            shape=list(key.shape),
            dtype=key.dtype,
            gpu_model=self.gpu_model,
            budget_configs=budget,
            seed=seed,
        )
        if self.strategy:
            fields["strategy"] = self.strategy
        return {**fields, **extra}


@dataclass
class Worker:
    gpu: int
    worker_id: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def stop(workers: list[Worker]) -> None:
    """SIGTERM every worker still running (each gives its job back), SIGKILL after 15 s."""
    for w in workers:
        if w.alive():
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(15)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait(5)


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, theirs, and so on (from /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_times(pids: list[int]) -> dict[int, str]:
    """Each of ``pids`` still running -> its start time (``/proc/<pid>/stat`` field 22), which
    tells it from a later process that was given its pid."""
    found = {}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        found[pid] = text.rsplit(")", 1)[1].split()[19]
    return found


def kill_left(started: dict[int, str]) -> list[int]:
    """SIGKILL those of ``started`` (:func:`start_times`) that still run as the same processes;
    which they were. A killed worker's measuring child should end once its pipe closes: one
    left behind would hold its GPU through the steps that follow."""
    left = [pid for pid, at in start_times(list(started)).items() if started[pid] == at]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, workers: list[Worker]
) -> float:
    """Poll ``check`` until true; seconds waited. Raises ``TimeoutError`` (with the workers'
    log tails) after ``timeout`` s or when every worker has exited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        if workers and not any(w.alive() for w in workers):
            break
        time.sleep(0.1)
    tails = "\n".join(f"--- {w.worker_id}\n{w.tail()}" for w in workers)
    raise TimeoutError(f"{what}: not after {time.monotonic() - start:.0f} s\n{tails}")


def start_all(
    fleet: Fleet, gpus: list[int], url: str, prefix: str, timeout: float, **options: Any
) -> list[Worker]:
    """A worker per GPU of ``gpus`` (ids ``<prefix>-gpu<i>``), returned once each has written
    its presence row: jobs queued after that find every worker polling (a worker's start, a few
    seconds, is not part of any figure)."""
    workers = [fleet.start(g, url, f"{prefix}-gpu{g}", **options) for g in gpus]
    sessions = session_factory(init_db(url))

    def registered() -> bool:
        with sessions() as s:
            return {w.worker_id for w in workers} <= {r.id for r in fleet_rows(s)}

    try:
        wait_until(registered, timeout, f"{prefix}: the workers' start", workers)
    except TimeoutError:
        stop(workers)
        raise
    return workers


def fleet_rows(session) -> list[Any]:
    from kato.db import fleet as presence

    return presence.list_workers(session)


def jobs_ended(sessions, ids: list[str]) -> bool:
    with sessions() as s:
        return all(queries.get_job(s, j).status in ENDED for j in ids)


def check_job(sessions, job_id: str, budget: int, name: str) -> tuple[dict[str, Any], list[str]]:
    """A job's row and trials: the figures, and what is wrong with them (done, budget exact,
    every config once, numbers 0..n-1, no reservation left, best = the fastest ok trial)."""
    with sessions() as s:
        job = queries.get_job(s, job_id)
        trials = sorted(queries.job_trials(s, job_id), key=lambda t: t.number)
    keys = [t.config_key for t in trials]
    ok = [t.time_ms for t in trials if t.status == "ok" and t.time_ms is not None]
    row = {
        "job_id": job_id,
        "status": job.status,
        "worker_id": job.worker_id,
        "trials": len(trials),
        "distinct_configs": len(set(keys)),
        "trials_done": job.trials_done,
        "measured_by": dict(Counter(t.reserved_by for t in trials)),
        "statuses": dict(Counter(t.status for t in trials)),
        "best_ms": job.best_time_ms,
        "best_config": job.best_config,
        "gpu_busy_s": job.gpu_busy_s,
        "started_at": job.started_at.timestamp() if job.started_at else None,
        "finished_at": job.finished_at.timestamp() if job.finished_at else None,
    }
    problems = []
    if job.status != "done":
        problems.append(f"{name}: {job.status} ({job.error})")
    if not (len(trials) == len(set(keys)) == job.trials_done == budget):
        problems.append(
            f"{name}: {len(trials)} trials, {len(set(keys))} distinct, trials_done "
            f"{job.trials_done}, budget {budget}"
        )
    if [t.number for t in trials] != list(range(len(trials))):
        problems.append(f"{name}: trial numbers repeat or skip")
    if any(t.status == RESERVED for t in trials):
        problems.append(f"{name}: a reservation left behind")
    if ok and job.best_time_ms != min(ok):
        problems.append(f"{name}: best {job.best_time_ms} is not the fastest ok trial {min(ok)}")
    return row, problems


# --- batch -----------------------------------------------------------------------------------


def batch_keys(fleet: Fleet) -> list[Key]:
    """16 keys of different operators and shapes: on the GPU four operators (one cubin serves
    every shape of a config) x four shapes, float16 and float32 alternating; on replay the
    recordings in ``--replay``, taken operator by operator in turn."""
    if fleet.backend == "pycuda":
        return [
            Key(op, shape, DTYPES[i % 2])
            for op, shapes in GPU_KEYS.items()
            for i, shape in enumerate(shapes)
        ][:BATCH_JOBS]
    by_op: dict[str, list[Key]] = {}
    for key in fleet.recorded:
        by_op.setdefault(key.operator, []).append(key)
    for keys in by_op.values():
        keys.sort(key=lambda k: (k.dtype, k.shape))
    chosen: list[Key] = []
    while len(chosen) < BATCH_JOBS and any(by_op.values()):
        for op in sorted(by_op):
            if by_op[op] and len(chosen) < BATCH_JOBS:
                chosen.append(by_op[op].pop(0))
    return chosen


def run_batch(
    fleet: Fleet, keys: list[Key], gpus: list[int], budget: int, helpers: int, label: str,
    timeout: float,
) -> dict[str, Any]:  # fmt: skip
    """One worker per GPU of ``gpus`` (fleet indices) on a fresh database, then ``keys``
    queued as one batch, run until every job has ended; the report (module docstring)."""
    url = fleet.database(label)
    sessions = session_factory(init_db(url))
    problems: list[str] = []
    workers = start_all(fleet, gpus, url, label, timeout, helpers=helpers)
    try:
        with sessions() as s:
            jobs = queries.create_jobs(
                s, [fleet.job_fields(k, budget, seed=i) for i, k in enumerate(keys)]
            )
            ids = [j.id for j in jobs]
        queued = time.time()
        wait_until(lambda: jobs_ended(sessions, ids), timeout, f"{label}: every job", workers)
        from_queue = time.time() - queued
        problems += [
            f"{w.worker_id} exited ({w.proc.returncode})" for w in workers if not w.alive()
        ]
    except TimeoutError as exc:
        from_queue = None
        problems.append(str(exc))
    finally:
        stop(workers)
    gpu_of = {w.worker_id: w.gpu for w in workers}
    per_job, per_gpu = {}, {g: {"jobs": 0, "trials": 0, "busy_s": 0.0} for g in gpus}
    job_problems: list[str] = []
    for job_id, key in zip(ids, keys, strict=True):
        row, wrong = check_job(sessions, job_id, budget, key.name)
        job_problems += wrong
        owner = gpu_of.get(row["worker_id"])
        row["gpu"] = owner
        per_job[key.name] = row
        if owner is None:
            job_problems.append(f"{key.name}: owned by {row['worker_id']}, not this run's")
            continue
        per_gpu[owner]["jobs"] += 1
        for worker_id, n in row["measured_by"].items():
            g = gpu_of.get(worker_id)
            if g is None:
                job_problems.append(f"{key.name}: {n} trial(s) by {worker_id}, not this run's")
                continue
            per_gpu[g]["trials"] += n
            # A job's busy seconds are every measuring worker's together: split by trials.
            per_gpu[g]["busy_s"] += (row["gpu_busy_s"] or 0.0) * n / max(row["trials"], 1)
    starts = [r["started_at"] for r in per_job.values() if r["started_at"]]
    ends = [r["finished_at"] for r in per_job.values() if r["finished_at"]]
    wall = max(ends) - min(starts) if starts and ends else None
    done = sum(r["status"] == "done" for r in per_job.values())
    for g, share in per_gpu.items():
        share["job_share"] = share["jobs"] / len(keys)
        share["busy_fraction"] = share["busy_s"] / wall if wall else None
        if share["jobs"] == 0:
            problems.append(f"GPU {g} ran no job of the batch")
    return {
        "label": label,
        "gpus": len(gpus),
        "jobs": len(keys),
        "budget": budget,
        "max_workers_per_job": helpers,
        "jobs_done": done,
        "every_job_done_once": not job_problems and done == len(keys),
        "wall_s": wall,
        "wall_from_queue_s": from_queue,
        "jobs_per_hour": done / wall * 3600 if wall else None,
        "configs_measured": sum(r["trials"] for r in per_job.values()),
        "per_gpu": {str(g): v for g, v in per_gpu.items()},
        "per_job": per_job,
        "problems": job_problems + problems,
    }


def step_batch(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    keys = batch_keys(fleet)
    gpus = list(range(len(fleet.devices)))
    result: dict[str, Any] = {"keys": [k.name for k in keys], "runs": {}}
    runs = [(f"batch-{len(gpus)}gpu", gpus)]
    if len(gpus) > 1:
        runs.append(("batch-1gpu", [0]))
    for label, which in runs:
        with compile_cache(fleet, label):
            run = run_batch(
                fleet, keys, which, args.budget, args.batch_helpers, label, args.step_timeout
            )
        result["runs"][str(len(which))] = run
        print_batch(run)
    many, one = result["runs"].get(str(len(gpus))), result["runs"].get("1")
    if len(gpus) > 1 and many["jobs_per_hour"] and one["jobs_per_hour"]:
        result["scaling"] = many["jobs_per_hour"] / one["jobs_per_hour"]
        print(f"batch: scaling {len(gpus)} GPUs over 1: {result['scaling']:.2f}x")
    result["problems"] = [p for r in result["runs"].values() for p in r["problems"]]
    if len(keys) < BATCH_JOBS:
        result["problems"].append(f"only {len(keys)} keys for the batch of {BATCH_JOBS}")
    return result


@contextlib.contextmanager
def compile_cache(fleet: Fleet, label: str) -> Iterator[None]:
    """GPU: a cold nvcc cache of the run's own (the workers inherit it), so that the 1-GPU run
    does not reuse the N-GPU run's compiles."""
    if fleet.backend != "pycuda":
        yield
        return
    saved = os.environ.get("KATO_COMPILE_CACHE")
    os.environ["KATO_COMPILE_CACHE"] = str(fleet.workdir / f"cubins-{label}")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KATO_COMPILE_CACHE", None)
        else:
            os.environ["KATO_COMPILE_CACHE"] = saved


def print_batch(run: dict[str, Any]) -> None:
    wall = run["wall_s"]
    print(
        f"{run['label']}: {run['jobs_done']}/{run['jobs']} jobs done x {run['budget']} configs"
        + (f", {wall:.1f} s, {run['jobs_per_hour']:.0f} jobs/hour" if wall else "")
        + (f" (from queueing {run['wall_from_queue_s']:.1f} s)" if run["wall_from_queue_s"] else "")
    )
    print("  GPU  jobs  share  trials  busy s  busy")
    for g, share in run["per_gpu"].items():
        busy = share["busy_fraction"]
        print(
            f"  {g:>3}  {share['jobs']:>4}  {share['job_share']:>5.0%}  {share['trials']:>6}  "
            f"{share['busy_s']:>6.1f}  " + (f"{busy:.0%}" if busy is not None else "-")
        )
    for p in run["problems"]:
        print(f"  PROBLEM {p}")


# --- shared ----------------------------------------------------------------------------------


def shared_key(fleet: Fleet, keys: list[Key]) -> Key:
    """The GPU's :data:`SHARED_KEY`; on replay that one where recorded, else the batch's
    first."""
    if fleet.backend == "pycuda":
        return SHARED_KEY
    return SHARED_KEY if SHARED_KEY in fleet.recorded else keys[0]


def step_shared(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    key = shared_key(fleet, batch_keys(fleet))
    gpus = list(range(len(fleet.devices)))
    budget = args.shared_budget
    url = fleet.database("shared")
    sessions = session_factory(init_db(url))
    problems: list[str] = []
    workers = start_all(fleet, gpus, url, "shared", args.step_timeout, helpers=len(gpus))
    try:
        with sessions() as s:
            job_id = queries.create_job(s, **fleet.job_fields(key, budget, seed=1)).id
        t0 = time.time()
        wait_until(lambda: jobs_ended(sessions, [job_id]), args.step_timeout, "shared", workers)
        wall = time.time() - t0
    except TimeoutError as exc:
        problems.append(str(exc))
        wall = None
    finally:
        stop(workers)
    row, wrong = check_job(sessions, job_id, budget, key.name)
    problems += wrong
    gpu_of = {w.worker_id: w.gpu for w in workers}
    by_gpu = {str(gpu_of.get(w, w)): n for w, n in row["measured_by"].items()}
    if len(gpus) > 1 and len(row["measured_by"]) < len(gpus):
        problems.append(f"not shared by every GPU: trials by {by_gpu}")
    result = {
        "key": key.name,
        "budget": budget,
        "trials": row["trials"],
        "distinct_configs": row["distinct_configs"],
        "trials_by_gpu": by_gpu,
        "wall_s": wall,
        "best_ms": row["best_ms"],
        "best_config": row["best_config"],
        "statuses": row["statuses"],
        "problems": problems,
    }
    if fleet.backend != "pycuda":
        result["retime"] = {"skipped": "needs a GPU: replay times are the recording's"}
    elif row["best_config"] is None:
        problems.append("no winner to re-time")
    else:
        result["retime"] = retime_everywhere(fleet, key, row["best_config"], args.retime_rounds)
        problems += result["retime"]["problems"]
    print(
        f"shared: {key.name} budget {budget}: {row['trials']} trials, "
        f"{row['distinct_configs']} distinct, by GPU {by_gpu}" + (f", {wall:.1f} s" if wall else "")
    )
    if "spread" in result.get("retime", {}):
        r = result["retime"]
        print(f"  winner re-timed per GPU (ms): {r['ms_by_gpu']}, spread {r['spread']:.4f}")
    for p in problems:
        print(f"  PROBLEM {p}")
    return result


def retime_everywhere(fleet: Fleet, key: Key, config: dict, rounds: int) -> dict[str, Any]:
    """The winner timed on each GPU, one process per GPU, one after the other (no two GPUs
    busy at once: each GPU's clocks and the host as when alone)."""
    times, problems = {}, []
    for g in range(len(fleet.devices)):
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "retime", "--operator", key.operator,
            "--shape", ",".join(map(str, key.shape)), "--dtype", key.dtype,
            "--config", json.dumps(config), "--device", fleet.device_option(g),
            "--rounds", str(rounds),
        ]  # fmt: skip
        done = subprocess.run(
            cmd, cwd=ROOT, env=fleet.env(g), capture_output=True, text=True, timeout=300
        )
        try:
            times[str(g)] = json.loads(done.stdout.strip().splitlines()[-1])["median_ms"]
        except (IndexError, ValueError, KeyError):
            problems.append(f"re-time on GPU {g} failed: {(done.stdout + done.stderr)[-500:]}")
    result: dict[str, Any] = {"ms_by_gpu": times, "rounds": rounds, "problems": problems}
    if len(times) == len(fleet.devices) and all(times.values()):
        spread = max(times.values()) / min(times.values())
        result["spread"] = spread
        if spread > 1 + RETIME_TOLERANCE:
            problems.append(f"winner times differ by {spread - 1:.1%} across GPUs: {times}")
    return result


def retime_main(argv: list[str]) -> None:
    """``retime``: one config's median time on one device, as JSON on the last line."""
    from statistics import median

    from kato.tuner.backends.pycuda import PyCudaBackend

    parser = argparse.ArgumentParser(prog="fleet_gpus.py retime")
    parser.add_argument("--operator", required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    backend = PyCudaBackend(
        get_operator(args.operator), shape, args.dtype, device_index=args.device, seed=1
    )
    try:
        config = json.loads(args.config)
        results = [backend.evaluate(config) for _ in range(args.rounds)]
    finally:
        backend.close()
    ms = [r.time_ms for r in results if r.time_ms is not None]
    print(json.dumps({"median_ms": median(ms) if ms else None, "times_ms": ms}))


# --- faults ----------------------------------------------------------------------------------


def step_faults(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if len(fleet.devices) < 2:
        return {"skipped": "needs 2 GPUs", "problems": []}
    result["kill"] = kill_and_resume(fleet, args)
    if fleet.backend == "pycuda":
        result["planted"] = planted_faults(fleet, args)
    else:
        result["planted"] = {
            "skipped": "needs a GPU: the planted faults are kernels (tests/gpu/faulty_op.py)"
        }
    result["problems"] = [p for part in result.values() for p in part.get("problems", [])]
    return result


def kill_and_resume(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """A worker on each of GPU 0 and 1, two jobs queued, one each; ``kill -9`` the worker of
    the first once a third of it is measured; a new worker on its GPU (unless
    ``--no-restart``) or the other GPU's worker resumes it after its lease. A process of the
    killed worker still running when the step ends (its measuring child) is a problem, and
    killed."""
    keys = batch_keys(fleet)
    budget = args.faults_budget
    url = fleet.database("faults")
    sessions = session_factory(init_db(url))
    result: dict[str, Any] = {"budget": budget, "keys": [keys[0].name, keys[1].name]}
    problems: list[str] = []
    orphans: dict[int, str] = {}  # the killed worker's processes (start_times)
    # One job per worker, whatever the fleet's --jobs-at-once: the check below needs the two
    # jobs on two GPUs (a worker holding both would lose both to the kill).
    single = Fleet(**{**fleet.__dict__, "jobs_at_once": 1, "_schemas": fleet._schemas})
    workers = start_all(single, [0, 1], url, "faults", args.step_timeout, helpers=1)
    try:
        with sessions() as s:
            victim, other = (
                j.id
                for j in queries.create_jobs(
                    s, [fleet.job_fields(keys[0], budget, 2), fleet.job_fields(keys[1], budget, 3)]
                )
            )

        def both_measuring() -> bool:
            with sessions() as s:
                v, o = queries.get_job(s, victim), queries.get_job(s, other)
                return v.trials_done >= budget // 3 and o.trials_done >= 1

        wait_until(both_measuring, args.step_timeout, "faults: both jobs measuring", workers)
        with sessions() as s:
            owner_id = queries.get_job(s, victim).worker_id
        (killed,) = [w for w in workers if w.worker_id == owner_id]
        (survivor,) = [w for w in workers if w is not killed]
        orphans = start_times(descendants(killed.proc.pid))
        os.kill(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait(10)
        killed_at = time.time()
        with sessions() as s:
            kept = {
                t.config_key: (t.id, t.status, t.time_ms, t.reserved_by)
                for t in queries.job_trials(s, victim)
                if t.status != RESERVED
            }
            state = queries.get_job(s, victim)
            result["at_kill"] = {
                "killed": killed.worker_id,
                "victim_status": state.status,
                "victim_trials_done": state.trials_done,
                "victim_trials_stored": len(kept),
                "other_trials_done": queries.get_job(s, other).trials_done,
            }
        if state.status != "running" or len(kept) >= budget:
            problems.append(f"the killed worker's job was not mid-job: {result['at_kill']}")
        time.sleep(1.0)
        result["children_left_1s_after_kill"] = [
            pid for pid, at in start_times(list(orphans)).items() if orphans[pid] == at
        ]
        if not args.no_restart:
            restarted = f"faults-gpu{killed.gpu}-restarted"
            workers.append(single.start(killed.gpu, url, restarted, helpers=1))
        alive = [w for w in workers if w is not killed]
        wait_until(
            lambda: jobs_ended(sessions, [victim, other]), args.step_timeout, "faults", alive
        )
        result["resumed_within_s"] = time.time() - killed_at
        result["other_worker_alive"] = survivor.alive()
        if not survivor.alive():
            problems.append(f"the other GPU's worker exited ({survivor.proc.returncode})")
    except TimeoutError as exc:
        problems.append(str(exc))
        return {**result, "problems": problems}
    finally:
        stop(workers)
        if left := kill_left(orphans):
            problems.append(f"the killed worker's processes {left} outlived the step: killed")
    victim_row, wrong = check_job(sessions, victim, budget, "killed worker's job")
    problems += wrong
    other_row, wrong = check_job(sessions, other, budget, "other GPU's job")
    problems += wrong
    with sessions() as s:
        after = {
            t.config_key: (t.id, t.status, t.time_ms, t.reserved_by)
            for t in queries.job_trials(s, victim)
        }
    changed = [k for k, v in kept.items() if after.get(k) != v]
    if changed:
        problems.append(f"{len(changed)} trial(s) stored before the kill changed or went")
    if not kept:
        problems.append("nothing was stored before the kill: nothing to resume from")
    if victim_row["worker_id"] == killed.worker_id:
        problems.append("the killed worker's job was not resumed by another worker")
    if set(other_row["measured_by"]) != {survivor.worker_id}:
        problems.append(f"the other job measured by {other_row['measured_by']}")
    result.update(
        victim=victim_row,
        other=other_row,
        resumed_by=victim_row["worker_id"],
        stored_before_kill_kept=len(kept) - len(changed),
        measured_after_kill=victim_row["trials"] - len(kept),
        problems=problems,
    )
    print(
        f"faults: kill -9 {killed.worker_id} at {len(kept)}/{budget} stored trials; resumed by "
        f"{victim_row['worker_id']} within {result['resumed_within_s']:.1f} s: "
        f"{victim_row['trials']} trials, {victim_row['distinct_configs']} distinct, "
        f"{len(kept) - len(changed)} kept; other GPU's job {other_row['status']}, "
        f"{other_row['trials']} trials"
    )
    for p in problems:
        print(f"  PROBLEM {p}")
    return result


def planted_faults(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """GPU: the planted-faults job on GPU 1 (this script's worker, which imports faulty_op)
    while GPU 0's ``kato worker`` tunes a normal job."""
    import faulty_op  # noqa: F401  (tests/gpu on sys.path: main adds it)

    url = fleet.database("planted")
    sessions = session_factory(init_db(url))
    normal_key = batch_keys(fleet)[2]
    with sessions() as s:
        faulty = queries.create_job(
            s,
            operator="faulty_copy",
            operator_version=get_operator("faulty_copy").version,
            shape=list(FAULTY_SHAPE),
            dtype="float32",
            gpu_model=fleet.gpu_model,
            budget_configs=FAULTY_BUDGET,
            strategy="grid",
        ).id
        normal = queries.create_job(s, **fleet.job_fields(normal_key, args.faults_budget, 4)).id
    workers = [
        fleet.start(1, url, "planted-gpu1", faulty=True),
        fleet.start(0, url, "planted-gpu0"),
    ]
    problems: list[str] = []
    try:
        wait_until(
            lambda: jobs_ended(sessions, [faulty, normal]), args.step_timeout, "planted", workers
        )
        problems += [f"{w.worker_id} exited" for w in workers if not w.alive()]
    except TimeoutError as exc:
        problems.append(str(exc))
    finally:
        stop(workers)
    faulty_row, wrong = check_job(sessions, faulty, FAULTY_BUDGET, "planted-faults job")
    problems += wrong
    normal_row, wrong = check_job(sessions, normal, args.faults_budget, "GPU 0's job")
    problems += wrong
    with sessions() as s:
        trials = queries.job_trials(s, faulty)
    by_mode = {t.config["MODE"]: t.status for t in trials if t.config.get("BLOCK_SIZE") == 256}
    for mode in faulty_op.FAULTS:
        if by_mode.get(mode) not in FAILED:
            problems.append(f"planted fault {mode} recorded as {by_mode.get(mode)}")
    if any(s in FAILED for s in normal_row["statuses"]):
        problems.append(f"GPU 0's job has failed trials: {normal_row['statuses']}")
    if set(normal_row["measured_by"]) != {"planted-gpu0"}:
        problems.append(f"GPU 0's job measured by {normal_row['measured_by']}")
    print(
        f"planted faults on GPU 1: {faulty_row['statuses']}; GPU 0's job "
        f"{normal_row['status']} {normal_row['statuses']}"
    )
    for p in problems:
        print(f"  PROBLEM {p}")
    return {
        "faulty": faulty_row,
        "by_mode": {str(m): s for m, s in by_mode.items()},
        "other": normal_row,
        "problems": problems,
    }


def worker_main(argv: list[str]) -> None:
    """``worker``: a pycuda worker that imports tests/gpu/faulty_op.py into its measuring child
    and claims only faulty_copy jobs (``kato worker`` has no such option: no service code
    imports a test's operator)."""
    import faulty_op  # noqa: F401
    from kato.db.queries import JobScope
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.worker import Worker as TuningWorker
    from kato.tuner.worker import stop_on_signals

    parser = argparse.ArgumentParser(prog="fleet_gpus.py worker")
    parser.add_argument("--db", required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--lease-seconds", type=float, default=5.0)
    parser.add_argument("--poll-seconds", type=float, default=0.2)
    parser.add_argument("--max-workers-per-job", type=int, default=1)
    parser.add_argument("--trial-timeout", type=float, default=8.0)
    args = parser.parse_args(argv)
    model = describe_device(args.device).model
    factory = pycuda_backend_factory(
        args.device, isolate=True, trial_timeout_s=args.trial_timeout, imports=("faulty_op",)
    )
    worker = TuningWorker(
        session_factory(init_db(args.db)), args.db, [model], factory,
        worker_id=args.worker_id, lease_seconds=args.lease_seconds,
        poll_seconds=args.poll_seconds, devices=[{"index": args.device, "model": model}],
        max_workers_per_job=args.max_workers_per_job,
        scope=JobScope(operators=frozenset({"faulty_copy"})),
    )  # fmt: skip
    with stop_on_signals(worker):
        worker.run_forever()


# --- device ----------------------------------------------------------------------------------


def nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True
    ).stdout


def parse_gpu_list(text: str) -> dict[int, str]:
    """Physical index -> uuid from ``nvidia-smi -L`` ("GPU 1: NVIDIA H200 (UUID: GPU-...)";
    MIG lines, indented, left out)."""
    found = {}
    for line in text.splitlines():
        if line.startswith("GPU ") and "(UUID: " in line:
            index = int(line.split(":", 1)[0].split()[1])
            found[index] = line.rsplit("(UUID: ", 1)[1].rstrip().rstrip(")").strip()
    return found


def apps_of(text: str, pids: set[int] | None) -> Counter[str]:
    """GPU uuid -> how many of ``pids`` (``None``: any) hold a context on it, from ``nvidia-smi
    --query-compute-apps=pid,gpu_uuid --format=csv,noheader`` ("1234, GPU-...")."""
    seen: Counter[str] = Counter()
    for line in text.splitlines():
        pid, _, gpu_uuid = (part.strip() for part in line.partition(","))
        if pid.isdigit() and (pids is None or int(pid) in pids) and gpu_uuid:
            seen[gpu_uuid] += 1
    return seen


def step_device(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    if fleet.backend != "pycuda":
        return {"skipped": "needs a GPU and nvidia-smi (replay workers use no device)",
                "problems": []}  # fmt: skip
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and [v.strip() for v in visible.split(",")] != [
        str(i) for i in range(len(visible.split(",")))
    ]:
        # CUDA's indices are then not nvidia-smi's, which the uuids below are read by.
        return {"skipped": f"CUDA_VISIBLE_DEVICES={visible} renumbers the GPUs: run the device "
                "step without it", "problems": []}  # fmt: skip
    if shutil.which("nvidia-smi") is None:
        return {"skipped": "no nvidia-smi on this machine", "problems": []}
    if len(fleet.devices) < 2:
        return {"skipped": "needs a second GPU", "problems": []}
    uuids = parse_gpu_list(nvidia_smi("-L"))
    target = fleet.devices[1]
    result: dict[str, Any] = {"gpu_uuids": {str(k): v for k, v in uuids.items()}, "runs": {}}
    problems: list[str] = []
    for bind in ("device", "visible"):
        run = bound_run(fleet, bind, uuids, target, args)
        result["runs"][bind] = run
        problems += [f"bind {bind}: {p}" for p in run["problems"]]
        print(
            f"device ({'--device 1' if bind == 'device' else 'CUDA_VISIBLE_DEVICES=1'}): "
            f"{run['samples']} samples, {run['judged_by']} seen on "
            f"{run['seen_on'] or run['any_process_seen_on']}"
        )
    result["problems"] = problems
    for p in problems:
        print(f"  PROBLEM {p}")
    return result


def bound_run(
    fleet: Fleet, bind: str, uuids: dict[int, str], target: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One worker on fleet GPU 1 (bound as ``bind`` says) tunes a job; ``nvidia-smi`` sampled
    every 0.3 s: on which GPUs the worker's processes held a context."""
    bound = Fleet(**{**fleet.__dict__, "bind": bind, "_schemas": fleet._schemas})
    url = bound.database(f"device-{bind}")
    sessions = session_factory(init_db(url))
    key = batch_keys(fleet)[3]
    with sessions() as s:
        job_id = queries.create_job(s, **bound.job_fields(key, args.faults_budget, 5)).id
    worker = bound.start(1, url, f"device-{bind}-gpu1", helpers=1)
    seen: Counter[str] = Counter()
    anyone: Counter[str] = Counter()  # every process's contexts: this run is the GPUs' only user
    samples, problems = 0, []
    try:
        deadline = time.monotonic() + args.step_timeout
        while not jobs_ended(sessions, [job_id]) and time.monotonic() < deadline:
            ours = {worker.proc.pid, *descendants(worker.proc.pid)}
            out = nvidia_smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
            samples += 1
            seen.update(apps_of(out, ours))
            anyone.update(apps_of(out, None))
            time.sleep(0.3)
    finally:
        stop([worker])
    row, wrong = check_job(sessions, job_id, args.faults_budget, key.name)
    problems += wrong
    names = {v: k for k, v in uuids.items()}
    seen_on = {f"GPU {names.get(u, u)}": n for u, n in seen.items()}
    anyone_on = {f"GPU {names.get(u, u)}": n for u, n in anyone.items()}
    # In a container nvidia-smi may list the host's pids, none of them ours: then every
    # context seen (nothing else uses these GPUs during the run) must be on the target.
    judged, by = (seen, "the worker's processes") if seen else (anyone, "every process")
    if not judged:
        problems.append("no process seen on any GPU during the run (too short a job?)")
    elif set(judged) != {uuids.get(target)}:
        problems.append(f"{by} seen on {seen_on or anyone_on}, expected GPU {target} only")
    return {
        "samples": samples,
        "seen_on": seen_on,
        "any_process_seen_on": anyone_on,
        "judged_by": by,
        "job": row,
        "problems": problems,
    }


def replay_subset(fleet: Fleet, directory: Path) -> Path:
    """Fill ``fleet.recorded`` from ``directory``; a folder of links to the recordings the
    steps use (the batch's and the shared job's): each worker loads only those at its start."""
    by_key = {
        Key(r.problem.operator, tuple(r.problem.shape), r.problem.dtype): r
        for r in replay_recordings([directory], fleet.gpu_model)
    }
    fleet.recorded = list(by_key)
    keys = batch_keys(fleet)
    subset = fleet.workdir / "replay"
    subset.mkdir()
    for key in {*keys, shared_key(fleet, keys)}:
        path = by_key[key].path.resolve()
        (subset / path.name).symlink_to(path)
    return subset


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the steps asked for (module docstring); the report (also ``--out``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", default=",".join(STEPS), help="comma-separated: " + " ".join(STEPS)
    )
    parser.add_argument("--gpus", type=int, help="GPU: use the first N visible GPUs")
    parser.add_argument(
        "--device-map",
        help="GPU: the physical device of each fleet GPU, comma-separated (0,0: a smoke run of "
        "two workers on one GPU)",
    )
    parser.add_argument("--replay", type=Path, help="recorded spaces instead of GPUs")
    parser.add_argument("--devices", type=int, default=2, help="replay: simulated GPUs")
    parser.add_argument("--delay", type=float, default=0.02, help="replay: seconds per trial")
    parser.add_argument("--gpu-model", default="H200", help="replay: the recordings' GPU model")
    parser.add_argument("--db", help="SQLAlchemy URL (PostgreSQL: a fresh schema per run)")
    parser.add_argument("--budget", type=int, default=30, help="configs per batch job")
    parser.add_argument("--batch-helpers", type=int, default=1, help="batch: workers per job")
    parser.add_argument("--shared-budget", type=int, default=120)
    parser.add_argument("--faults-budget", type=int, default=60)
    parser.add_argument("--strategy", help="every job's search (default: the service's)")
    parser.add_argument("--jobs-at-once", type=int, help="jobs a worker holds at once")
    parser.add_argument("--bind", choices=("device", "visible"), default="device")
    parser.add_argument("--lease", type=float, default=5.0, help="workers' lease, seconds")
    parser.add_argument("--retime-rounds", type=int, default=5)
    parser.add_argument("--no-restart", action="store_true", help="faults: no worker restarted")
    parser.add_argument("--step-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, help="write the report as JSON")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = set(steps) - set(STEPS)
    if unknown:
        parser.error(f"unknown step(s) {sorted(unknown)}: {' '.join(STEPS)}")
    sys.path.append(str(ROOT / "tests" / "gpu"))  # faulty_op, for the planted faults

    with tempfile.TemporaryDirectory(prefix="kato-fleet-") as tmp:
        if args.replay is not None:
            fleet = Fleet(
                "replay", list(range(args.devices)), args.gpu_model, Path(tmp), args.db,
                replay=args.replay.resolve(), delay=args.delay, lease=args.lease,
                bind=args.bind, jobs_at_once=args.jobs_at_once, strategy=args.strategy,
            )  # fmt: skip
            fleet.replay = replay_subset(fleet, args.replay)
        else:
            from kato.tuner.backends.pycuda import describe_device, device_count

            if args.device_map:
                devices = [int(d) for d in args.device_map.split(",")]
            else:
                devices = list(range(device_count()))[: args.gpus]
            if not devices:
                parser.error("no CUDA device visible (--replay DIR runs without one)")
            fleet = Fleet(
                "pycuda", devices, describe_device(devices[0]).model, Path(tmp), args.db,
                lease=args.lease, bind=args.bind, jobs_at_once=args.jobs_at_once,
                strategy=args.strategy,
            )  # fmt: skip
        report: dict[str, Any] = {
            "command": "python3 benchmarks/fleet_gpus.py " + " ".join(argv),
            "backend": fleet.backend,
            "devices": fleet.devices,
            "gpu_model": fleet.gpu_model,
            "database": "postgresql" if args.db and not args.db.startswith("sqlite") else "sqlite",
            "steps": steps,
        }
        run = {"batch": step_batch, "shared": step_shared, "faults": step_faults,
               "device": step_device}  # fmt: skip
        try:
            for step in steps:
                print(f"=== {step} ({len(fleet.devices)} {fleet.backend} device(s))", flush=True)
                started = time.monotonic()
                try:
                    report[step] = run[step](fleet, args)
                except (TimeoutError, OSError, subprocess.SubprocessError) as exc:
                    # A step that could not run (a worker that never started) ends only itself.
                    report[step] = {"problems": [f"did not run: {exc}"]}
                    print(f"{step}: PROBLEM did not run: {exc}")
                report[step]["step_s"] = time.monotonic() - started
                if report[step].get("skipped"):
                    print(f"{step}: skipped: {report[step]['skipped']}")
                if args.out:  # after each step: a call cut short still leaves the first
                    write(args.out, report)
        finally:
            fleet.drop_schemas()
    report["problems"] = [f"{s}: {p}" for s in steps for p in report[s].get("problems", [])]
    report["ok"] = not report["problems"]
    print("fleet: " + ("ok" if report["ok"] else f"{len(report['problems'])} problem(s)"))
    if args.out:
        write(args.out, report)
    return report


def write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "retime":
        retime_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.path.append(str(ROOT / "tests" / "gpu"))
        worker_main(sys.argv[2:])
    else:
        sys.exit(0 if main()["ok"] else 1)
