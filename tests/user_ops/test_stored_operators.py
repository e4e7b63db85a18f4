"""User operators stored in the database: versions, the registry source, the API (scope, 4xx
for bad specs) and a worker on the replay backend tuning one that is then served."""

from __future__ import annotations

import copy
import threading
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kato.db import operators as stored
from kato.db import tokens
from kato.db.session import init_db, session_factory
from kato.kernels import get_operator, list_operators
from kato.kernels.spec import InvalidInput
from kato.kernels.user import load_folder
from kato.service.app import create_app
from kato.service.settings import Settings
from kato.tuner.factories import replay_backend_factory
from kato.tuner.worker import Worker

from user_ops.recording import record


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _body(folder: Path, **spec_changes) -> dict:
    spec = tomllib.loads((folder / "kato.toml").read_text()) | spec_changes
    files = {p.name: p.read_text() for p in folder.glob("*.cu")}
    return {"spec": spec, "files": files}


@pytest.fixture
def app(tmp_path):
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'kato.db'}"))
    yield app
    app.state.engine.dispose()


def _token(app, **flags) -> str:
    with app.state.session_factory() as session:
        token, secret = tokens.create_token(session, "t", admin=flags.get("admin", False))
        token.operators = flags.get("operators", False)
        session.commit()
        return secret


def test_versions_are_kept_and_unchanged_folders_found(tmp_path, vector_add_dir):
    engine = init_db(f"sqlite:///{tmp_path / 'db.sqlite'}")
    sessions = session_factory(engine)
    body = _body(vector_add_dir, name="stored_va")
    with sessions() as session:
        first = stored.add_operator(session, stored.parse_definition(body))
        again = stored.add_operator(session, stored.parse_definition(body))
        body["spec"]["restrictions"] = ["block_size_x * tile_size_x <= 2048"]
        second = stored.add_operator(session, stored.parse_definition(body))
        assert (first.created, again.created, second.created) == (True, False, True)
        assert first.version == again.version != second.version
        assert second.versions == 2
        assert [r.version for r in stored.versions(session, "stored_va")] == [
            first.version,
            second.version,
        ]
        assert [r.version for r in stored.newest(session)] == [second.version]
        with pytest.raises(InvalidInput, match="taken by a built-in"):
            stored.add_operator(
                session, stored.parse_definition(_body(vector_add_dir, name="relu"))
            )
    source = stored.use_database(sessions)
    try:
        op = get_operator("stored_va")
        assert op.version == second.version
        assert "does not hold" in op.check(
            {"block_size_x": 1024, "tile_size_x": 4}, (10,), "float32"
        )
        assert "stored_va" in [s.name for s in list_operators()]
    finally:
        from kato.kernels import registry

        registry.remove_source(source)
    engine.dispose()


def test_post_needs_the_operators_scope(app, vector_add_dir):
    body = _body(vector_add_dir, name="api_va")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/operators", json=body)
        assert r.status_code == 401
        r = client.post("/v1/operators", json=body, headers=bearer(_token(app)))
        assert r.status_code == 403 and "--operators" in r.json()["detail"]
        secret = _token(app, operators=True)
        r = client.post("/v1/operators", json=body, headers=bearer(secret))
        assert r.status_code == 201, r.text
        version = r.json()["version"]
        assert r.json() == {
            "name": "api_va",
            "version": version,
            "created": True,
            "versions": 1,
            "updated": [],
        }
        r = client.post("/v1/operators", json=body, headers=bearer(_token(app, admin=True)))
        assert r.status_code == 200 and r.json()["created"] is False
        listed = client.get("/v1/operators").json()
        assert {"api_va", "softmax"} <= {o["name"] for o in listed}
        one = client.get("/v1/operators/api_va").json()
        assert one["version"] == version and one["space_size"] == 24
        versions = client.get("/v1/operators/api_va/versions").json()
        assert [(v["version"], v["current"]) for v in versions] == [(version, True)]
        assert client.get("/v1/operators/nothing/versions").status_code == 404


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"restrictions": ["block_size_x * unroll <= 1024"]}, "unknown name 'unroll'"),
        ({"restrictions": ["().__class__.__bases__"]}, "attribute access"),
        ({"grid_div_x": ["__import__('os').getpid()"]}, "may be called"),
        ({"bytes": "open('/etc/passwd')"}, "unknown function 'open'"),
        ({"name": "softmax"}, "taken by a built-in"),
        ({"template": "missing.cu"}, "missing: missing.cu"),
        ({"tune_params": {}}, "tune_params"),
        ({"arguments": [{"name": "c", "dtype": "float32"}]}, "give size"),
    ],
)
def test_bad_specs_are_422_with_the_reason(app, vector_add_dir, changes, says):
    body = _body(vector_add_dir, **({"name": "bad_va"} | changes))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/operators", json=body, headers=bearer(_token(app, operators=True)))
    assert r.status_code == 422, r.text
    assert says in str(r.json()["detail"])


def test_files_that_are_not_an_object_are_422(app):
    with TestClient(app, raise_server_exceptions=False) as client:
        secret = _token(app, operators=True)
        r = client.post("/v1/operators", json={"spec": {}, "files": []}, headers=bearer(secret))
        assert r.status_code == 422
        r = client.post("/v1/operators", json={"spec": {}}, headers=bearer(secret))
        assert r.status_code == 422


def _tune_on_replay(app, client, name: str, shape: tuple[int, ...], budget: int, tmp_path) -> dict:
    """Submit a job for the stored operator ``name``, let a replay worker (a recorded space of
    its version) run it, and return the recorded space's fastest config."""
    path, best = record(get_operator(name), shape, tmp_path / "rec" / f"{name}.json")
    r = client.post(
        "/v1/jobs",
        json={"operator": name, "shape": list(shape), "dtype": "float32", "gpu": "H200",
              "budget": budget, "strategy": "grid"},
    )  # fmt: skip
    assert r.status_code == 202, r.text
    worker = Worker(
        app.state.session_factory, app.state.settings.db_url, ["H200"],
        replay_backend_factory(path.parent), worker_id="w-user", poll_seconds=0.01,
    )  # fmt: skip
    thread = threading.Thread(target=worker.run_forever, kwargs={"max_jobs": 1})
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    job = client.get(f"/v1/jobs/{r.json()['id']}").json()
    assert job["status"] == "done", job
    return best


def _served(client, name: str, shape: tuple[int, ...]) -> dict:
    """What GET /v1/configs serves now (no-cache: not an answer the API process cached)."""
    params = {"shape": ",".join(map(str, shape)), "dtype": "float32", "gpu": "H200"}
    fresh = {"Cache-Control": "no-cache"}
    return client.get(f"/v1/configs/{name}", params=params, headers=fresh).json()


def test_an_api_registered_operator_is_tuned_on_replay_and_served(app, vector_add_dir, tmp_path):
    """Register through the API, submit a job, a replay worker (a recorded space of that
    operator's version) tunes it, and GET /v1/configs serves the recorded space's fastest."""
    body = _body(vector_add_dir, name="served_va")
    secret = _token(app, operators=True)
    with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
        assert client.post("/v1/operators", json=body).status_code == 201
        shape = (1 << 20,)
        best = _tune_on_replay(app, client, "served_va", shape, 23, tmp_path)
        served = _served(client, "served_va", shape)
        assert served["source"] == "exact"
        assert served["config"] == best


def test_a_changed_backward_section_keeps_the_forward_s_results_served(
    app, scaled_mul_dir, scaled_mul_backward_dir, tmp_path
):
    """Adding, changing and removing the forward's [backward] section (the version leaves it
    out) replace it in the stored version, which every process rebuilds, and the forward's
    tuned config stays served; an edited template is a new version, untuned."""
    backward = _body(scaled_mul_backward_dir, name="kept_mul_bwd")
    section = tomllib.loads((scaled_mul_dir / "kato.toml").read_text())["backward"]
    section["operator"] = "kept_mul_bwd"
    plain = _body(scaled_mul_dir, name="kept_mul")
    del plain["spec"]["backward"]
    swapped = section | {"gradients": {"grad_a": "b", "grad_b": "a"}}
    other = stored.DatabaseOperators(app.state.session_factory, refresh_s=0.0)  # another host
    shape = (1 << 20,)
    secret = _token(app, operators=True)
    with TestClient(app, raise_server_exceptions=False, headers=bearer(secret)) as client:
        assert client.post("/v1/operators", json=backward).status_code == 201
        r = client.post("/v1/operators", json=plain)
        assert r.status_code == 201, r.text
        version = r.json()["version"]
        best = _tune_on_replay(app, client, "kept_mul", shape, 14, tmp_path)
        served = _served(client, "kept_mul", shape)
        assert (served["source"], served["config"]) == ("exact", best)
        assert [s.model.backward for s in other() if s.name == "kept_mul"] == [None]
        for now in (section, swapped, None):
            body = copy.deepcopy(plain)
            if now is not None:
                body["spec"]["backward"] = now
            r = client.post("/v1/operators", json=body)
            assert r.status_code == 200, r.text
            assert r.json() == {"name": "kept_mul", "version": version, "created": False,
                                "versions": 1, "updated": ["backward"]}  # fmt: skip
            assert client.get("/v1/operators/kept_mul").json()["backward"] == now
            (seen,) = [s for s in other() if s.name == "kept_mul"]
            assert seen.version == version
            assert (seen.model.backward and seen.model.backward.model_dump()) == now
            served = _served(client, "kept_mul", shape)
            assert (served["source"], served["config"], served["operator_version"]) == (
                "exact", best, version
            )  # fmt: skip
        edited = copy.deepcopy(plain)
        edited["files"]["scaled_mul.cu"] += "\n// edited\n"
        r = client.post("/v1/operators", json=edited)
        assert r.status_code == 201 and r.json()["version"] != version
        assert r.json()["versions"] == 2
        served = _served(client, "kept_mul", shape)
        assert (served["source"], served["operator_version"]) == ("default", r.json()["version"])


def test_folder_model_refuses_code_in_every_expression_field(vector_add_dir):
    d = load_folder(vector_add_dir)
    for field in ("shared_memory", "bytes", "flops"):
        spec = d.spec.model_dump() | {field: "(lambda: 0)()"}
        with pytest.raises(InvalidInput):
            stored.parse_definition({"spec": spec, "files": d.files})


def test_migration_0005_upgrades_a_database_with_tokens(tmp_path):
    from alembic import command
    from kato.db.session import alembic_config, current_revision, head_revision, make_engine
    from sqlalchemy import inspect, text

    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0004")
        connection.execute(
            text(
                "INSERT INTO kato_api_tokens (id, name, secret_sha256, created_at, admin)"
                " VALUES ('t1', 'old', 'abc', '2026-01-01 00:00:00+00:00', false)"
            )
        )
    init_db(engine)
    assert current_revision(engine) == head_revision()
    assert "kato_user_operators" in inspect(engine).get_table_names()
    with engine.connect() as connection:
        assert connection.execute(text("SELECT operators FROM kato_api_tokens")).scalar() == 0
    engine.dispose()


def test_a_database_outage_keeps_the_last_operators(tmp_path, vector_add_dir, caplog):
    import logging

    engine = init_db(f"sqlite:///{tmp_path / 'db.sqlite'}")
    sessions = session_factory(engine)
    with sessions() as session:
        stored.add_operator(
            session, stored.parse_definition(_body(vector_add_dir, name="outage_va"))
        )
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("database down")
        return sessions()

    source = stored.DatabaseOperators(flaky, refresh_s=0.0)
    assert [s.name for s in source()] == ["outage_va"]
    with caplog.at_level(logging.WARNING, logger="kato.db.operators"):
        for _ in range(3):
            assert [s.name for s in source()] == ["outage_va"]
    assert caplog.text.count("database down") == 1  # once per outage, not per lookup
    engine.dispose()
