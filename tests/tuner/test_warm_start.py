"""Warm start: ranking of other GPUs' and shapes' measurements, the database query, the job
runner measuring the seeds first, and the replay path (``kato replay --warm-start``)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from kato.db import queries
from kato.db.ledger import Ledger
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.tuner.backends.replay import ReplayBackend
from kato.tuner.replay_eval import replay_search, warm_start_seeds
from kato.tuner.search import Budget, Search
from kato.tuner.warm_start import (
    MAX_SEEDS,
    OTHER_GPU_DISTANCE,
    OTHER_GPU_MAX_BUDGET,
    OTHER_VERSION_DISTANCE,
    SEEDS_PER_SOURCE,
    Source,
    database_sources,
    rank_seed_configs,
    seed_limit,
    shape_distance,
    warm_start_configs,
)
from kato.tuner.worker import Worker
from test_worker import DTYPE, SHAPE, CountingReplay, submit

from kato.shared.kt_cache import load_cache


def sources_in(session, *, shape, gpu_model, **query):
    """The ranked warm-start sources the database holds for a job of ``shape`` on
    ``gpu_model`` (:func:`db.queries.warm_start_sources`, ranked by :func:`database_sources`)."""
    measured = queries.warm_start_sources(session, shape=shape, gpu_model=gpu_model, **query)
    return database_sources(measured, shape=shape, gpu_model=gpu_model)


def _reader(sessions, job):
    """What the worker hands the warm start: the job's ledger's reader."""
    return Ledger(sessions, "test").job(job.id).warm_start_sources


def _default_key(space) -> str:
    """The key of softmax's default config for this module's shape: what every job measures
    before its warm start (tuner.job_runner.first_configs)."""
    default = get_operator("softmax").default_config(SHAPE, DTYPE)
    assert space.is_valid(default), "the recorded space holds the default config"
    return space.key(default)


def c(x: int) -> dict:
    return {"x": x}


def test_seed_limit_is_a_tenth_of_the_budget_capped():
    assert [seed_limit(b) for b in (1, 10, 25, 50, 100, 1000)] == [1, 1, 3, 5, 10, MAX_SEEDS]
    assert seed_limit(None) == MAX_SEEDS


def test_shape_distance():
    assert shape_distance([1024, 1024], [1024, 1024]) == 0
    assert shape_distance([1024, 4096], [2048, 1024]) == pytest.approx(3.0)
    assert shape_distance([8], [8, 8]) == float("inf")


def test_ranking_takes_each_sources_best_first_nearest_source_first():
    near = Source("near", 0.5, [(c(3), 3.0), (c(1), 1.0), (c(2), 2.0), (c(1), 0.5)])
    far = Source("far", 2.0, [(c(9), 9.0), (c(7), 1.0), (c(2), 0.1)])
    nan = Source("nan", 0.1, [(c(5), float("nan"))])
    got = rank_seed_configs([far, near, nan], limit=10)
    # rank 0: near's best (x=1, its faster duplicate kept), far's best (x=2); rank 1: near's
    # x=2 is a duplicate, far's x=7; rank 2: near's x=3, far's x=9. NaN times are dropped.
    assert got == [c(1), c(2), c(7), c(3), c(9)]
    assert rank_seed_configs([far, near], limit=2) == [c(1), c(2)]
    odd = rank_seed_configs([far, near], limit=10, accept=lambda cfg: cfg["x"] % 2 == 1)
    assert odd == [c(1), c(7), c(3), c(9)]


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/kato.db"
    return url, session_factory(init_db(url))


def test_a_job_measures_the_best_configs_of_another_gpu_first(db):
    """Job 1 tunes the recorded softmax space for "A100"; job 2, same operator and shape on the
    H200, first measures the operator's default config (every job records what a lookup served
    before it), then job 1's fastest config (one seed per source: SEEDS_PER_SOURCE)."""
    url, sessions = db
    spec = get_operator("softmax")
    # Job 1 on another GPU model (the replay backend answers for any model).
    with sessions() as s:
        job1 = queries.create_job(
            s,
            operator="softmax",
            operator_version=spec.version,
            shape=SHAPE,
            dtype="float16",
            gpu_model="A100",
            budget_configs=40,
        ).id
    Worker(sessions, url, ["A100"], lambda job: CountingReplay(), poll_seconds=0.01).run_once()
    with sessions() as s:
        trials = [t for t in queries.job_trials(s, job1) if t.time_ms is not None]
        expected = [t.config for t in sorted(trials, key=lambda t: t.time_ms)[:5]]
        sources = sources_in(
            s,
            operator="softmax",
            operator_version=spec.version,
            dtype="float16",
            shape=SHAPE,
            gpu_model="H200",
        )
    assert [src.name for src in sources] == ["A100 4096x4096"]
    assert sources[0].distance == pytest.approx(1.0)

    # Another GPU's winners seed small jobs only (OTHER_GPU_MAX_BUDGET); one source, one seed
    # (a tenth of the budget would allow 2).
    job2 = submit(sessions, budget=20)
    backend = CountingReplay()
    outcome = Worker(sessions, url, ["H200"], lambda job: backend, poll_seconds=0.01).run_once()
    assert outcome.job_id == job2 and outcome.status == "done"
    space = backend.space()
    default = spec.default_config(SHAPE, "float16")
    first = [space.key(default)] if space.is_valid(default) else []
    assert backend.measured[: len(first) + 1] == [*first, space.key(expected[0])]
    assert len(set(backend.measured)) == len(backend.measured) == 20

    with sessions() as s:
        big = queries.get_job(s, submit(sessions, budget=21))
        small = queries.get_job(s, submit(sessions, budget=OTHER_GPU_MAX_BUDGET))
    assert warm_start_configs(_reader(sessions, big), big) == []
    assert warm_start_configs(_reader(sessions, small), small) == expected[:1]
    assert SEEDS_PER_SOURCE == 1


def test_no_sources_no_seeds(db):
    url, sessions = db
    job = submit(sessions, budget=20)
    backend = CountingReplay()
    assert Worker(sessions, url, ["H200"], lambda j: backend, poll_seconds=0.01).run_once()
    with sessions() as s:
        assert queries.get_job(s, job).status == "done"


@pytest.fixture(scope="module")
def conv_pair(shared_datasets):
    conv = sorted(f for f in shared_datasets if "convolution" in str(f))
    if len(conv) < 2:
        pytest.skip("needs both convolution files in the datasets")
    return load_cache(conv[0]), load_cache(conv[1])  # A100, A4000


def test_replay_warm_start_measures_the_siblings_best_first(conv_pair):
    a100, a4000 = conv_pair
    backend = ReplayBackend(a4000)
    seeds = warm_start_seeds(backend, a100, budget=50)
    ranked = sorted(a100.ok_entries().values(), key=lambda e: e["time"])
    # One source, one seed (SEEDS_PER_SOURCE), though a tenth of 50 would allow 5.
    assert seeds == [{p: e[p] for p in a100.params} for e in ranked[:1]]
    calls: list[dict] = []

    def evaluate(config):
        calls.append(config)
        return backend.evaluate(config)

    Search(backend.space(), evaluate, seed=0, seed_configs=seeds).run(Budget(max_configs=12))
    assert calls[:1] == seeds


def test_replay_warm_start_guarantees_the_siblings_best_at_budget_10(conv_pair):
    """Seeded from the A100's measurements, every A4000 search at budget 10 is at least as good
    as the A100's best config is on the A4000 (0.60 of its optimum); how much that helps on
    average is what benchmarks/search_quality.py --warm-start reports."""
    a100, a4000 = conv_pair
    warm = replay_search(a4000, budget=10, repeats=3, warm_start=a100)
    assert len(warm.seed_configs) == 1
    seeded = a4000.entries[a4000.key(warm.seed_configs[0])]["time"]
    assert warm.min_fraction_of_optimum >= a4000.best()[1]["time"] / seeded >= 0.6


# --- results of older versions of the operator (after an upgrade of Kato) --------------------

OLD, OLDER = "0ld0ld0ld0ld", "01de501de501"


def cfg(key: str) -> dict:
    """A softmax config from its Kernel Tuner key ("128,8,1,2,4"), at LANES=32 (a warp per row)."""
    names = ("BLOCK_SIZE", "VEC", "STRATEGY", "CACHE", "MIN_BLOCKS")
    return {**dict(zip(names, map(int, key.split(",")), strict=True)), "LANES": 32}


def store_best(sessions, config, *, version, shape=SHAPE, gpu="H200", dtype="float16", t=0.03):
    with sessions() as s:
        return queries.upsert_best_config(
            s,
            operator="softmax",
            operator_version=version,
            shape=shape,
            dtype=dtype,
            gpu_model=gpu,
            compute_capability="9.0",
            cuda_version="13.0",
            config=config,
            time_ms=t,
            job_id=None,
        ).id


def old_job_with_trials(sessions, trials, *, version, shape=SHAPE):
    """A finished job at ``version`` that measured ``trials`` ((config, time_ms) pairs)."""
    with sessions() as s:
        job = queries.create_job(
            s,
            operator="softmax",
            operator_version=version,
            shape=shape,
            dtype=DTYPE,
            gpu_model="H200",
            budget_configs=len(trials),
        )
        for n, (config, t) in enumerate(trials):
            queries.record_trial(
                s,
                job.id,
                number=n,
                config=config,
                config_key=",".join(map(str, config.values())),
                result={"status": "ok", "time_ms": t, "times_ms": [t]},
            )
        queries.finish_job(s, job.id, status="done")
        return job.id


def test_after_a_version_change_a_job_seeds_from_its_own_keys_old_winner_first(db):
    """Every key of the operator holds results of older kernel code only, as after an upgrade;
    a sibling shape is re-tuned at the new version. The job's own key at the newest old version
    seeds first (before the current-version sibling one doubling away), then the current
    sibling (not its stale old winner), then an old-only sibling; the oldest version of the
    own key, and a queued new-version job with nothing measured, change nothing."""
    url, sessions = db
    spec = get_operator("softmax")
    own_old, own_older = cfg("32,2,0,0,0"), cfg("128,8,1,2,4")
    sibling_now, sibling_stale, sibling_old = (
        cfg("32,8,1,1,2"),
        cfg("256,8,1,2,0"),
        cfg("512,4,1,2,0"),
    )
    from kato.db.models import BestConfig

    older = store_best(sessions, own_older, version=OLDER, t=0.020)  # faster, but older code
    store_best(sessions, own_old, version=OLD, t=0.025)
    with sessions() as s:  # OLDER measured last year
        s.get(BestConfig, older).updated_at = datetime(2025, 1, 1, tzinfo=UTC)
        s.commit()
    store_best(sessions, sibling_now, version=spec.version, shape=[8192, 4096])
    store_best(sessions, sibling_stale, version=OLD, shape=[8192, 4096], t=0.001)
    old_job_with_trials(sessions, [(sibling_old, 0.02)], version=OLD, shape=[2048, 4096])
    with sessions() as s:  # what `kato retune` leaves: queued at the new version, no trials
        queued = queries.create_job(
            s,
            operator="softmax",
            operator_version=spec.version,
            shape=[2048, 4096],
            dtype=DTYPE,
            gpu_model="H200",
            budget_configs=50,
        )
        sources = sources_in(
            s,
            operator="softmax",
            operator_version=spec.version,
            dtype=DTYPE,
            shape=SHAPE,
            gpu_model="H200",
        )
    ranked = sorted(sources, key=lambda src: src.distance)
    assert [(src.name, src.other_version) for src in ranked] == [
        (f"H200 4096x4096 @{OLD}", True),
        ("H200 8192x4096", False),
        (f"H200 2048x4096 @{OLD}", True),
    ]
    assert [src.distance for src in ranked] == pytest.approx(
        [OTHER_VERSION_DISTANCE, 1.0, 1.0 + OTHER_VERSION_DISTANCE]
    )
    assert min(1.0, OTHER_GPU_DISTANCE) > OTHER_VERSION_DISTANCE  # before a doubling, a GPU
    assert ranked[0].trials == [(own_old, 0.025)] and ranked[1].trials == [(sibling_now, 0.03)]

    with sessions() as s:  # out of the worker's way (still nothing measured)
        queries.request_cancel(s, queued.id)
    job = submit(sessions, budget=30)  # a tenth: 3 seeds
    backend = CountingReplay()
    with sessions() as s:
        found = queries.get_job(s, job)
    seeds = warm_start_configs(_reader(sessions, found), found, backend.space().is_valid)
    assert seeds == [own_old, sibling_now, sibling_old]
    outcome = Worker(sessions, url, ["H200"], lambda j: backend, poll_seconds=0.01).run_once()
    assert outcome.job_id == job and outcome.status == "done"
    # Measured first (after the default config every job times), under the new version.
    keys = [backend.space().key(c) for c in seeds]
    assert backend.measured[:4] == [_default_key(backend.space()), *keys]
    with sessions() as s:
        first = queries.job_trials(s, job)[1]
        assert first.config == own_old and first.job.operator_version == spec.version


def test_a_key_re_tuned_at_the_current_version_stops_seeding_its_old_winner(db):
    """Once another job measured the job's own key at the current version (its best stored,
    or a finished job's OK trials), that key's older versions are no source."""
    _url, sessions = db
    spec = get_operator("softmax")
    store_best(sessions, cfg("32,2,0,0,0"), version=OLD, t=0.025)

    def own_sources() -> list[str]:
        with sessions() as s:
            sources = sources_in(
                s, operator="softmax", operator_version=spec.version, dtype=DTYPE, shape=SHAPE,
                gpu_model="H200",
            )  # fmt: skip
        return [src.name for src in sources]

    assert own_sources() == [f"H200 4096x4096 @{OLD}"]
    old_job_with_trials(sessions, [(cfg("128,8,1,2,4"), 0.02)], version=spec.version)
    assert own_sources() == []
    store_best(sessions, cfg("128,8,1,2,4"), version=spec.version, t=0.02)
    assert own_sources() == []


def test_an_old_config_that_no_longer_validates_is_skipped(db):
    """An old winner with a parameter the spec no longer has (renamed) is not seeded: its
    source's fastest config valid now is; the replay space's check raises on it (KeyError),
    which rejects that config only, not the whole warm start."""
    url, sessions = db
    renamed = {"THREADS": 128, "VEC": 8, "STRATEGY": 1, "CACHE": 2, "MIN_BLOCKS": 4, "LANES": 32}
    valid = cfg("32,8,1,1,2")
    store_best(sessions, renamed, version=OLD, t=0.01)
    old_job_with_trials(sessions, [(renamed, 0.01), (valid, 0.02)], version=OLD)
    job = submit(sessions, budget=10)  # one seed
    backend = CountingReplay()
    with pytest.raises(KeyError):
        backend.space().is_valid(renamed)
    with sessions() as s:
        found = queries.get_job(s, job)
        seeds = warm_start_configs(_reader(sessions, found), found, backend.space().is_valid)
        assert seeds == [valid]
        spec = get_operator("softmax")
        # The spec's own check rejects it with a reason instead of raising: skipped the same.
        spec_check = lambda c: spec.check(c, SHAPE, DTYPE) is None  # noqa: E731
        assert warm_start_configs(_reader(sessions, found), found, spec_check) == [valid]
    outcome = Worker(sessions, url, ["H200"], lambda j: backend, poll_seconds=0.01).run_once()
    assert outcome.status == "done"
    assert backend.measured[:2] == [_default_key(backend.space()), backend.space().key(valid)]


def test_nothing_changes_without_an_old_version(db):
    """With results of the current version only, the sources are what they always were (no
    version mark, no extra distance); older results of another dtype or operator are never
    read."""
    _, sessions = db
    spec = get_operator("softmax")
    sibling = cfg("32,8,1,1,2")
    store_best(sessions, sibling, version=spec.version, shape=[2048, 4096])
    store_best(sessions, cfg("128,8,1,2,4"), version=OLD, dtype="float32")
    with sessions() as s:
        other = queries.create_job(
            s,
            operator="layernorm",
            operator_version=OLD,
            shape=SHAPE,
            dtype=DTYPE,
            gpu_model="H200",
            budget_configs=1,
        )
        queries.record_trial(
            s,
            other.id,
            number=0,
            config=cfg("32,2,0,0,0"),
            config_key="32,2,0,0,0",
            result={"status": "ok", "time_ms": 0.001},
        )
        sources = sources_in(
            s,
            operator="softmax",
            operator_version=spec.version,
            dtype=DTYPE,
            shape=SHAPE,
            gpu_model="H200",
        )
    assert [(src.name, src.distance, src.other_version) for src in sources] == [
        ("H200 2048x4096", 1.0, False)
    ]
    job = submit(sessions, budget=30)
    with sessions() as s:
        found = queries.get_job(s, job)
    assert warm_start_configs(_reader(sessions, found), found) == [sibling]


def test_a_broken_database_gives_no_seeds_never_a_failed_job():
    job = SimpleNamespace(
        id="x", operator="softmax", operator_version="v", dtype=DTYPE, shape=SHAPE,
        gpu_model="H200", budget_configs=10,
    )  # fmt: skip

    def broken(**_query):
        raise RuntimeError("database gone")

    assert warm_start_configs(broken, job) == []


def test_a_database_blip_is_a_warning_and_a_bug_a_traceback(caplog):
    """A transient fault of the (not retried) read logs one line: a connection cut is expected
    in a fleet and no reason for a traceback in the worker's log; any other error keeps its
    traceback (a bug in the ranking must be seen)."""
    import sqlalchemy.exc

    job = SimpleNamespace(
        id="x", operator="softmax", operator_version="v", dtype=DTYPE, shape=SHAPE,
        gpu_model="H200", budget_configs=10,
    )  # fmt: skip

    def cut(**_query):
        raise sqlalchemy.exc.OperationalError(
            "SELECT 1", {}, Exception("server closed"), connection_invalidated=True
        )

    def bug(**_query):
        raise KeyError("time_ms")

    caplog.set_level("WARNING", logger="kato.tuner.warm_start")
    assert warm_start_configs(cut, job) == []
    assert "the database read failed" in caplog.text and "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)
    caplog.clear()
    assert warm_start_configs(bug, job) == []
    assert any(r.exc_info for r in caplog.records)
