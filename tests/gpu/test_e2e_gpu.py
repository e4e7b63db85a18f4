"""End to end on a GPU: submit a tuning job over REST, a worker tunes it, the API serves it."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from kato.db import tokens
from kato.service.app import create_app
from kato.service.lookup import NEAREST_MIN_GAIN
from kato.service.settings import Settings


def test_tune_softmax_through_the_rest_api(tmp_path):
    from kato.tuner.backends.pycuda import describe_device
    from kato.tuner.factories import pycuda_backend_factory
    from kato.tuner.worker import Worker

    model = describe_device(0).model
    db_url = f"sqlite:///{tmp_path}/kato.db"
    app = create_app(Settings(db_url=db_url))
    with TestClient(app) as client:
        with app.state.session_factory() as session:
            secret = tokens.create_token(session, "e2e")[1]
        client.headers["Authorization"] = f"Bearer {secret}"
        query = {"shape": "4096x4096", "dtype": "float16", "gpu": model}
        before = client.get("/v1/configs/softmax", params=query).json()
        assert before["source"] == "default"

        r = client.post(
            "/v1/jobs",
            json={
                "operator": "softmax",
                "shape": [4096, 4096],
                "dtype": "float16",
                "gpu": model,
                "budget": 12,
            },
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]

        worker = Worker(app.state.session_factory, db_url, [model], pycuda_backend_factory(0))
        outcome = worker.run_once()
        assert outcome is not None and outcome.job_id == job_id and outcome.status == "done"

        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "done" and job["trials_done"] == 12
        trials = client.get(f"/v1/jobs/{job_id}/trials").json()
        assert len(trials) == 12
        ok = [t for t in trials if t["status"] == "ok"]
        assert ok and all(t["registers"] > 0 and t["time_ms"] > 0 for t in ok)
        fastest = min(t["time_ms"] for t in ok)

        # The lookup cache serves a new winner within about its check interval (0.5 s): the
        # "default" answer above may be served until then (a short job finishes first).
        deadline = time.monotonic() + 10
        after = client.get("/v1/configs/softmax", params=query).json()
        while after["source"] == "default" and time.monotonic() < deadline:
            time.sleep(0.1)
            after = client.get("/v1/configs/softmax", params=query).json()
        assert after["source"] == "exact"
        assert after["time_ms"] == fastest
        assert after["compute_capability"] == "9.0" if model == "H200" else True
        # A neighbour's winner is served only where its job measured the default config and
        # the winner beat it by more than KATO_NEAREST_MIN_GAIN; else the default is.
        nearest = client.get("/v1/configs/softmax", params={**query, "shape": "4096x2048"}).json()
        assert after["default_ms"] is not None
        if after["default_ms"] > NEAREST_MIN_GAIN * after["time_ms"]:
            assert nearest["source"] == "nearest" and nearest["tuned_shape"] == [4096, 4096]
            assert nearest["config"] == after["config"]
        else:
            assert nearest["source"] == "default"
