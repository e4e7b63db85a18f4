"""Fuzz the API against its own OpenAPI schema (schemathesis, in-process over ASGI).

Every documented operation gets generated requests, valid and invalid, with a live API token so
that the write routes are exercised past the 401. Checks: no 5xx, every status code documented,
every response body and content type as documented. Bounded (examples per operation,
derandomized) so the run is short and repeatable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from kato.db import queries, tokens
from kato.kernels import get_operator
from kato.service.app import create_app
from kato.service.settings import Settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


#: The fuzzed app, on a SQLite file of its own. Built at import because schemathesis reads the
#: schema when it parametrizes the test; its lazy-fixture alternative
#: (``schemathesis.pytest.from_fixture``) breaks on pytest 9.2 ("'Function' object has no
#: attribute '_nodeid'"), and a fresh install resolves that pytest.
_DB_DIR = tempfile.TemporaryDirectory(prefix="kato-fuzz-")
FUZZED_APP = create_app(
    Settings(db_url=f"sqlite:///{Path(_DB_DIR.name) / 'kato.db'}", max_queued_jobs=50)
)
schema = schemathesis.openapi.from_asgi("/openapi.json", FUZZED_APP)


@pytest.fixture(scope="module")
def fuzzed_app() -> Iterator[FastAPI]:
    """The fuzzed app with a token and a stored config, so reads find rows and writes pass auth."""
    app = FUZZED_APP
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
            config={
                "BLOCK_SIZE": 256,
                "VEC": 8,
                "STRATEGY": 0,
                "CACHE": 0,
                "MIN_BLOCKS": 1,
                "LANES": 32,
            },
            time_ms=0.05,
            job_id=None,
        )
    yield app
    app.state.engine.dispose()
    _DB_DIR.cleanup()


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
