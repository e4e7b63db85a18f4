"""Fuzz the API against its own OpenAPI schema (schemathesis, in-process over ASGI).

Every documented operation gets generated requests, valid and invalid, with a live API token so
that the write routes are exercised past the 401. Checks: no 5xx, every status code documented,
every response body and content type as documented. Bounded (examples per operation,
derandomized) so the run is short and repeatable.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from db import queries, tokens
from kernels import get_operator
from service.app import create_app
from service.settings import Settings

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    db = Path(tmp_path_factory.mktemp("fuzz")) / "kato.db"
    app = create_app(Settings(db_url=f"sqlite:///{db}", max_queued_jobs=50))
    with app.state.session_factory() as session:
        app.state.fuzz_secret = tokens.create_token(session, "fuzz")[1]
        queries.upsert_best_config(
            session,
            operator="softmax",
            operator_version=get_operator("softmax").version,
            shape=[4096, 4096],
            dtype="float16",
            gpu_model="H200",
            compute_capability="9.0",
            cuda_version="13.0",
            config={"BLOCK_SIZE": 256, "VEC": 8, "STRATEGY": 0, "CACHE": 0, "MIN_BLOCKS": 1},
            time_ms=0.05,
            job_id=None,
        )
    yield app
    app.state.engine.dispose()


@pytest.fixture(scope="module")
def api_schema(fuzzed_app: FastAPI) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=int(os.environ.get("KATO_FUZZ_EXAMPLES", "30")),
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case: schemathesis.Case, fuzzed_app: FastAPI) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {fuzzed_app.state.fuzz_secret}"}, checks=CHECKS
    )
