"""Backends' optional abilities (:mod:`tuner.backends.abilities`): a backend without them tunes a
job all the same; one that compiles ahead is asked ahead; one that can be interrupted is, on a
cancel. The worker on the replay backend against a real SQLite file."""

from __future__ import annotations

import threading

import pytest
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner.backends.abilities import (
    Interruptible,
    Precompiles,
    Prepares,
    ReleasesDevice,
    ReportsCompiled,
    TakesHints,
    WaitsCompiled,
    abilities_of,
    factory_abilities_of,
)
from kato.tuner.backends.base import Backend, TrialResult
from kato.tuner.backends.isolated import IsolatedBackend, TrialInterrupted
from kato.tuner.backends.pycuda import PyCudaBackend
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.factories import PyCudaBackends, ReplayBackends, find_recordings
from kato.tuner.worker import Worker
from paths import RECORDED

RECORDING = RECORDED / "softmax_H200_4096x4096_float16.json.gz"


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/kato.db"
    return url, session_factory(init_db(url))


def submit(sessions, budget: int) -> str:
    with sessions() as s:
        return queries.create_job(
            s,
            operator="softmax",
            operator_version=get_operator("softmax").version,
            shape=[4096, 4096],
            dtype="float16",
            gpu_model="H200",
            budget_configs=budget,
            seed=2,
        ).id


class Plain(Backend):
    """Only the :class:`Backend` contract: a replay behind it, no ability of its own."""

    name = "plain"

    def __init__(self) -> None:
        self.replay = ReplayBackend(RECORDING)
        self.measured: list[dict] = []

    def device(self):
        return self.replay.device()

    def space(self):
        return self.replay.space()

    def evaluate(self, config) -> TrialResult:
        self.measured.append(config)
        return self.replay.evaluate(config)


class CompilingAhead(Plain):
    """A replay that says it compiles ahead and logs what it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.precompiled: list[list[dict]] = []
        self.hinted: list[list[dict]] = []
        self.polled = 0

    def precompile(self, configs) -> None:
        self.precompiled.append(list(configs))

    def hint(self, configs) -> None:
        self.hinted.append(list(configs))

    def is_compiled(self, config) -> bool:
        self.polled += 1
        return True

    def wait_compiled(self, configs) -> None:
        pass


class Stoppable(Plain):
    """A replay whose fourth evaluation asks for the job's cancel and blocks until the worker
    interrupts it (from its heartbeat thread), as an isolated measurement would."""

    def __init__(self, cancel) -> None:
        super().__init__()
        self.cancel, self.interrupted = cancel, threading.Event()
        self.interrupted_from: str | None = None

    def interrupt(self) -> None:
        self.interrupted_from = threading.current_thread().name
        self.interrupted.set()

    def evaluate(self, config) -> TrialResult:
        if len(self.measured) == 3:
            self.cancel()
            if self.interrupted.wait(10):
                raise TrialInterrupted("interrupted")
        return super().evaluate(config)


def test_the_product_backends_declare_their_abilities():
    replay = abilities_of(ReplayBackend(RECORDING))
    assert (replay.prepare, replay.precompile, replay.hint, replay.interrupt) == (None,) * 4
    assert replay.is_compiled is None and replay.wait_compiled is None
    assert replay.measures_out_of_process is True  # nothing is timed
    # Method-only protocols answer for classes too (neither needs a GPU nor a child here).
    ahead = (Precompiles, TakesHints, ReportsCompiled, WaitsCompiled)
    assert all(issubclass(PyCudaBackend, p) for p in (Prepares, *ahead))
    assert not issubclass(PyCudaBackend, Interruptible)
    assert all(issubclass(IsolatedBackend, p) for p in (Interruptible, *ahead))
    assert not any(issubclass(ReplayBackend, p) for p in (Interruptible, Prepares, *ahead))
    assert issubclass(IsolatedBackend, ReleasesDevice)
    assert not any(issubclass(b, ReleasesDevice) for b in (PyCudaBackend, ReplayBackend))
    plain = abilities_of(Plain())
    assert plain == type(plain)()  # nothing at all, measured in this process


def test_the_product_factories_declare_their_abilities():
    factory = PyCudaBackends()
    gpu = factory_abilities_of(factory)
    assert gpu.runs_current_code is True and gpu.measure_framework is not None
    assert gpu.scoped is factory  # its scope is read at each claim, not here
    replay = factory_abilities_of(ReplayBackends(find_recordings(RECORDING)))
    assert replay.runs_current_code is False and replay.measure_framework is None
    assert [p.operator for p in replay.scope().problems] == ["softmax"]
    bare = factory_abilities_of(lambda job: Plain())
    assert bare.scope() is None and bare.runs_current_code and bare.measure_framework is None


def test_a_backend_without_abilities_tunes_a_job(db):
    url, sessions = db
    job_id = submit(sessions, budget=12)
    backend = Plain()
    worker = Worker(sessions, url, ["H200"], lambda job: backend, poll_seconds=0)
    assert worker.run_once().status == "done"
    with sessions() as s:
        assert queries.get_job(s, job_id).trials_done == 12
    assert len(backend.measured) == 12


def test_a_backend_that_compiles_ahead_is_asked_ahead_and_searches_the_same(tmp_path):
    plain, ahead = Plain(), CompilingAhead()
    for backend in (plain, ahead):
        url = f"sqlite:///{tmp_path}/{backend.name}-{len(tmp_path.name)}-{id(backend)}.db"
        sessions = session_factory(init_db(url))
        submit(sessions, budget=12)
        worker = Worker(sessions, url, ["H200"], lambda job, b=backend: b, poll_seconds=0)
        assert worker.run_once().status == "done"
    space = ahead.space()
    (precompiled,) = ahead.precompiled  # once, at the start: the whole (small) space
    assert len(precompiled) == len(space.valid_configs())
    assert ahead.hinted and all(space.is_valid(c) for batch in ahead.hinted for c in batch)
    assert ahead.polled > 0
    # Every config it reports compiled is measured in the order the plain backend's were.
    assert ahead.measured == plain.measured


def test_an_interruptible_backend_is_interrupted_on_a_cancel(db):
    url, sessions = db
    job_id = submit(sessions, budget=30)

    def cancel() -> None:
        with sessions() as s:
            queries.request_cancel(s, job_id)

    backend = Stoppable(cancel)
    worker = Worker(sessions, url, ["H200"], lambda job: backend, poll_seconds=0, lease_seconds=0.3)
    assert worker.run_once().status == "cancelled"
    assert backend.interrupted.is_set() and backend.interrupted_from == "kato-heartbeat"
    with sessions() as s:
        assert queries.get_job(s, job_id).status == "cancelled"
        assert queries.get_job(s, job_id).trials_done == 3
