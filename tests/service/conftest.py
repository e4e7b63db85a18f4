"""API fixtures: the app on a fresh SQLite file, a client that reports 500s as responses and
sends an API token (writes need one), and a client without a token (``anonymous``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import tokens
from kato.service.app import create_app
from kato.service.settings import Settings
from sqlalchemy.orm import Session


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}")


@pytest.fixture
def app(settings: Settings) -> Iterator[FastAPI]:
    app = create_app(settings)
    yield app
    app.state.engine.dispose()


@pytest.fixture
def token(app: FastAPI) -> str:
    """The secret of a fresh API token (default queue limit)."""
    with app.state.session_factory() as session:
        return tokens.create_token(session, "tests")[1]


@pytest.fixture
def client(app: FastAPI, token: str) -> Iterator[TestClient]:
    # A server error must show up as a 500 response (and fail the test's status check), not as
    # an exception raised through the client.
    with TestClient(app, raise_server_exceptions=False, headers=bearer(token)) as client:
        yield client


@pytest.fixture
def anonymous(app: FastAPI) -> Iterator[TestClient]:
    """A client that sends no token."""
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def session(app: FastAPI) -> Iterator[Session]:
    """A session on the app's database, to arrange rows the way a worker would."""
    with app.state.session_factory() as session:
        yield session
