"""Cancelling through the API: an admin token may cancel any job (a revoked token's jobs too);
anonymous callers and ordinary tokens keep their rules (their own jobs and tokenless ones)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import tokens
from kato.service.app import create_app
from kato.service.settings import Settings

JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _token(app: FastAPI, name: str, **kw) -> tuple[str, str]:
    with app.state.session_factory() as session:
        token, secret = tokens.create_token(session, name, **kw)
        return token.id, secret


def test_an_admin_token_cancels_another_tokens_job(app: FastAPI, anonymous: TestClient) -> None:
    owner_id, owner = _token(app, "owner")
    _, other = _token(app, "other")
    _, admin = _token(app, "ops", admin=True)
    job = anonymous.post("/v1/jobs", json=JOB, headers=bearer(owner)).json()
    refused = anonymous.delete(f"/v1/jobs/{job['id']}", headers=bearer(other))
    assert refused.status_code == 403, refused.text
    assert "another API token" in refused.json()["detail"]
    assert anonymous.delete(f"/v1/jobs/{job['id']}").status_code == 401
    assert anonymous.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
    # The owner's token is revoked: its job is left to an admin.
    with app.state.session_factory() as session:
        tokens.revoke_token(session, owner_id)
    assert anonymous.delete(f"/v1/jobs/{job['id']}", headers=bearer(owner)).status_code == 403
    cancelled = anonymous.delete(f"/v1/jobs/{job['id']}", headers=bearer(admin))
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    assert anonymous.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"


def test_an_admin_token_gets_404_for_an_unknown_job(app: FastAPI, anonymous: TestClient) -> None:
    _, admin = _token(app, "ops", admin=True)
    missing = anonymous.delete(f"/v1/jobs/{'0' * 32}", headers=bearer(admin))
    assert missing.status_code == 404


def test_ordinary_tokens_keep_their_rules(app: FastAPI, anonymous: TestClient) -> None:
    _, mine = _token(app, "mine")
    own = anonymous.post("/v1/jobs", json=JOB, headers=bearer(mine)).json()
    assert anonymous.delete(f"/v1/jobs/{own['id']}", headers=bearer(mine)).status_code == 200


def test_a_revoked_admin_token_cancels_nothing(app: FastAPI, anonymous: TestClient) -> None:
    _, owner = _token(app, "owner")
    admin_id, admin = _token(app, "ops", admin=True)
    job = anonymous.post("/v1/jobs", json=JOB, headers=bearer(owner)).json()
    with app.state.session_factory() as session:
        tokens.revoke_token(session, admin_id)
    assert anonymous.delete(f"/v1/jobs/{job['id']}", headers=bearer(admin)).status_code == 403
    assert anonymous.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"


def test_anonymous_cancel_with_auth_off_keeps_todays_rule(tmp_path) -> None:
    """With KATO_AUTH_REQUIRED=false an anonymous caller may cancel any job, as before (whoever
    reaches the port may write)."""
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'k.db'}", auth_required=False))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            _, owner = _token(app, "owner")
            owned = client.post("/v1/jobs", json=JOB, headers=bearer(owner)).json()
            free = client.post("/v1/jobs", json=JOB).json()
            assert client.delete(f"/v1/jobs/{free['id']}").status_code == 200
            assert client.delete(f"/v1/jobs/{owned['id']}").status_code == 200
    finally:
        app.state.engine.dispose()
