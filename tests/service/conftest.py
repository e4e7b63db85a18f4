"""API fixtures: the app on a fresh SQLite file, a client that reports 500s as responses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.app import create_app
from service.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}")


@pytest.fixture
def app(settings: Settings) -> Iterator[FastAPI]:
    app = create_app(settings)
    yield app
    app.state.engine.dispose()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    # A server error must show up as a 500 response (and fail the test's status check), not as
    # an exception raised through the client.
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def session(app: FastAPI) -> Iterator[Session]:
    """A session on the app's database, to arrange rows the way a worker would."""
    with app.state.session_factory() as session:
        yield session
