"""``kato worker --backend replay``: a directory of recordings, whatever their names (the
versioned names ``kato export`` writes, as committed under data/spaces/h200), answers the jobs
of its problems and leaves every other job queued; files that say no problem, or two files of
one problem, stop the worker before it starts, with exit 2 and a message."""

from __future__ import annotations

import shutil

import pytest
from kato.db import queries
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator
from kato.service.cli import app
from paths import RECORDED, TABLE_SPACES
from typer.testing import CliRunner

from kato.shared.kt_cache import load_cache, save_cache


def _submit(sessions, operator, shape, dtype, budget=5) -> str:
    with sessions() as s:
        return queries.create_job(
            s, operator=operator, operator_version=get_operator(operator).version, shape=shape,
            dtype=dtype, gpu_model="H200", budget_configs=budget, strategy="grid",
        ).id  # fmt: skip


def _worker(replay, db, *extra):
    args = ["worker", "--backend", "replay", "--replay", str(replay), "--db", db,
            "--poll-seconds", "0.05", *extra]  # fmt: skip
    return CliRunner().invoke(app, args)


def test_a_directory_of_versioned_recordings_answers_its_problems_only(tmp_path):
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    sessions = session_factory(init_db(db))
    elsewhere = _submit(sessions, "softmax", [2048, 2048], "float32")  # no recording: queued
    own = _submit(sessions, "softmax", [8192, 1024], "float32")  # ..._1b5b54cc169a.json.gz
    result = _worker(TABLE_SPACES, db, "--max-jobs", "1")
    assert result.exit_code == 0, result.output
    with sessions() as s:
        done, waiting = queries.get_job(s, own), queries.get_job(s, elsewhere)
        assert (waiting.status, waiting.trials_done, waiting.error) == ("queued", 0, None)
        assert (done.status, done.trials_done) == ("done", 5)
    assert "11 recorded problem(s)" in result.output


def _copy(src, dst):
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
    return dst


@pytest.mark.parametrize(
    ("setup", "phrases"),
    [
        ("anonymous", ["conv.json", "does not say which problem", "<operator>_<gpu>_<shape>"]),
        ("twice", ["are both recordings of softmax", "keep one of them"]),
        ("other-gpu", ["no recording is for GPU model A100 80GB", "recordings are for H200"]),
        # A softmax cache renamed to another operator's name: not that operator's parameters.
        (
            "renamed",
            [
                "layernorm_H200_4096x4096_float16.json.gz",
                "are not layernorm's",
                "ROW_THREADS",
                "not a layernorm space",
            ],
        ),  # fmt: skip
        ("unregistered", ["banana_H200_4096x4096_float16.json", "unknown operator 'banana'"]),
        ("outside", ["VEC values [3, 2.0] are not among softmax's VEC values"]),
        ("nested-renamed", ["deep/er/layernorm_H200_4096x4096_float16", "are not layernorm's"]),
    ],
)
def test_recordings_that_cannot_answer_stop_the_worker_with_a_message(tmp_path, setup, phrases):
    recording = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
    folder = tmp_path / "recordings"
    extra: list[str] = ["--max-jobs", "0"]
    if setup == "anonymous":  # a Kernel Tuner cache of its own, under a name that says nothing
        cache = load_cache(recording)
        for name in ("kato_operator", "kato_operator_version", "dtype"):
            cache.extra.pop(name)
        save_cache(cache, folder / "conv.json")
    elif setup in ("renamed", "unregistered", "outside", "nested-renamed"):
        cache = load_cache(recording)
        for name in ("kato_operator", "kato_operator_version", "dtype"):
            cache.extra.pop(name)
        name = {
            "renamed": "layernorm_H200_4096x4096_float16.json.gz",
            "unregistered": "banana_H200_4096x4096_float16.json",
            "outside": recording.name,
            "nested-renamed": "deep/er/layernorm_H200_4096x4096_float16.json.gz",
        }[setup]
        if setup == "outside":  # values softmax does not have: an int outside, a float
            cache.tune_params["VEC"] = [*cache.tune_params["VEC"], 3, 2.0]
        save_cache(cache, folder / name)
    elif setup == "twice":
        _copy(recording, folder / recording.name)
        _copy(recording, folder / "softmax_H200_4096x4096_float16_1b5b54cc169a.json.gz")
    else:
        _copy(recording, folder / recording.name)
        extra += ["--gpu", "A100 80GB"]
    result = _worker(folder, f"sqlite:///{tmp_path / 'kato.db'}", *extra)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for phrase in phrases:
        assert phrase in text, text


def test_recordings_below_the_directory_answer_their_jobs(tmp_path):
    db = f"sqlite:///{tmp_path / 'kato.db'}"
    sessions = session_factory(init_db(db))
    recording = RECORDED / "softmax_H200_4096x4096_float16.json.gz"
    _copy(recording, tmp_path / "recordings" / "h200" / "softmax" / recording.name)
    _copy(recording, tmp_path / "recordings" / ".hidden" / "softmax_H200_1x1_float16.json.gz")
    own = _submit(sessions, "softmax", [4096, 4096], "float16")
    result = _worker(tmp_path / "recordings", db, "--max-jobs", "1")
    assert result.exit_code == 0, result.output
    assert "1 recorded problem(s)" in result.output  # the hidden folder is not searched
    with sessions() as s:
        assert (queries.get_job(s, own).status, queries.get_job(s, own).trials_done) == ("done", 5)
