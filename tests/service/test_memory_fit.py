"""The device-memory check takes each operator's buffer sizes from its spec.

A product of the shape's dimensions is not a size: matmul's M x N x K is its work, its buffers are
M*K + K*N + M*N elements. A committed H200 matmul winner must be served, and jobs for it queued.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db.importer import import_paths
from kato.kernels import DTYPES, get_operator, list_operators

from kato_client import KatoClient

REPO = Path(__file__).resolve().parents[2]
MATMUL_WINNER = sorted((REPO / "data" / "h200").glob("matmul_H200_4096x4096x4096_float32_*.json"))


@pytest.fixture
def stored_matmul(app: FastAPI) -> dict:
    """The committed H200 matmul 4096^3 float32 winner, imported into the app's database."""
    assert MATMUL_WINNER, "data/h200 holds a matmul 4096^3 float32 winner"
    with app.state.session_factory() as session:
        import_paths(session, MATMUL_WINNER)
    spec = get_operator("matmul")
    return {"spec": spec, "shape": "4096x4096x4096"}


def test_stored_matmul_winner_is_served(client: TestClient, stored_matmul: dict) -> None:
    query = {"shape": stored_matmul["shape"], "dtype": "float32", "gpu": "H200"}
    response = client.get("/v1/configs/matmul", params=query)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["source"] == "exact"
    assert stored_matmul["spec"].check(body["config"], [4096] * 3, "float32") is None


def test_matmul_lookups_batches_and_jobs_pass_the_memory_check(client: TestClient) -> None:
    item = {"operator": "matmul", "shape": [8192, 8192, 8192], "dtype": "float16", "gpu": "H200"}
    batch = client.post("/v1/configs/batch", json={"lookups": [item]})
    assert batch.status_code == 200, batch.text
    (result,) = batch.json()["results"]
    assert result["status"] == 200, result
    assert result["result"]["source"] == "default"
    job = client.post("/v1/jobs", json={**item, "budget": 10})
    assert job.status_code in (201, 202), job.text
    assert job.json()["shape"] == [8192, 8192, 8192]


def test_matmul_that_cannot_fit_is_refused_with_its_real_size(client: TestClient) -> None:
    # A and B are 1.6e6 elements each, C is 4e10: 4 bytes + the float32 reference copy of C.
    m, n, k = 200_000, 200_000, 8
    needed = get_operator("matmul").buffer_bytes((m, n, k), "float32")
    assert needed == (m * k + k * n + m * n) * 4 + 4 * m * n
    response = client.get(
        "/v1/configs/matmul", params={"shape": f"{m}x{n}x{k}", "dtype": "float32", "gpu": "H200"}
    )
    assert response.status_code == 422
    assert response.json()["detail"] == (
        f"shape {m}x{n}x{k} in float32 needs {needed / 1e9:,.1f} GB of device memory; "
        "H200 has 141.0 GB"
    )


def test_client_lookup_of_a_stored_matmul_winner(app: FastAPI, stored_matmul: dict) -> None:
    with (
        TestClient(app, raise_server_exceptions=False) as http,
        KatoClient(str(http.base_url), gpu="H200", http=http, disk_cache=False) as kato,
    ):
        found = kato.lookup("matmul", (4096, 4096, 4096), "float32")
    assert found.source == "exact"


@pytest.mark.parametrize("spec", list_operators(), ids=lambda spec: spec.name)
def test_buffer_bytes_counts_every_device_buffer(spec) -> None:
    """Each spec's buffer_bytes is at least the arrays its problem puts on the device, and not
    far above them (a spec that counted work instead of buffers would be far above)."""
    shape = _small_shape(spec)
    for dtype in spec.dtypes:
        problem = spec.make_problem(shape, dtype, np.random.default_rng(0))
        device = problem.nbytes
        claimed = spec.buffer_bytes(shape, dtype)
        assert isinstance(claimed, int)
        assert claimed >= device, (spec.name, dtype, claimed, device)
        # Float32 reference copies of the outputs (the backend keeps them) and fixed-size
        # scratch are allowed on top.
        reference = sum(4 * r.size for r in problem.references)
        assert claimed <= device + reference + 2**20, (spec.name, dtype, claimed, device)
        assert DTYPES[dtype]  # every dtype it lists is a known one


def _small_shape(spec) -> tuple[int, ...]:
    """A small shape the spec accepts, awkward sizes where it allows them."""
    candidates = {1: (5000,), 2: (37, 300), 3: (67, 45, 33), 4: (3, 5, 7, 9)}
    shape = candidates[spec.rank]
    dtype = spec.dtypes[0]
    for attempt in (shape, tuple(64 for _ in shape), tuple(256 for _ in shape)):
        try:
            return tuple(spec.validate(attempt, dtype))
        except ValueError:
            continue
    raise AssertionError(f"no small shape found for {spec.name}")
