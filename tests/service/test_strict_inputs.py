"""Strict request input (issue 28, items 5 and 7): text that is not valid Unicode, lax types and
names holding control characters all get a 422 naming the field, on every route, never a 500
or a value silently coerced into another one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kato.db import tokens
from kato.service.app import create_app
from kato.service.settings import Settings

JOB = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
LOOKUP = {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16", "gpu": "H200"}
QUERY = "shape=4096x4096&dtype=float16&gpu=H200"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One app for the module (most requests here are refused; a fresh database per test
    would be most of the run time), with a token; server errors come back as 500s."""
    db = Path(tmp_path_factory.mktemp("strict")) / "kato.db"
    app = create_app(Settings(db_url=f"sqlite:///{db}", max_queued_jobs=1000))
    with app.state.session_factory() as session:
        secret = tokens.create_token(session, "strict")[1]
    headers = {"Authorization": f"Bearer {secret}"}
    with TestClient(app, raise_server_exceptions=False, headers=headers) as client:
        yield client
    app.state.engine.dispose()


def post_raw(client: TestClient, path: str, raw: bytes) -> Any:
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def errors(response: Any, status: int = 422) -> list[dict[str, Any]]:
    """The field errors of a 4xx answer (asserting its status and that its body is JSON)."""
    assert response.status_code == status, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert isinstance(detail, list), detail
    return detail


def locs(response: Any, status: int = 422) -> list[list[Any]]:
    return [e["loc"] for e in errors(response, status)]


# --- item 5: text that is not valid Unicode ----------------------------------------------------

#: (route, body with the placeholder TEXT, the loc naming the field that holds it)
SURROGATE_BODIES = [
    ("/v1/jobs", {**JOB, "operator": "TEXT"}, ["body", "operator"]),
    ("/v1/jobs", {**JOB, "gpu": "H200TEXT"}, ["body", "gpu"]),
    ("/v1/jobs", {**JOB, "shape": "4096xTEXT"}, ["body", "shape"]),
    ("/v1/jobs", {**JOB, "strategy": "TEXT"}, ["body", "strategy"]),
    ("/v1/jobs", {**JOB, "extra": "TEXT"}, ["body", "extra"]),
    ("/v1/jobs/batch", {"jobs": [JOB, {**JOB, "dtype": "TEXT"}]}, ["body", "jobs", 1, "dtype"]),
    ("/v1/configs/batch", {"lookups": [{**LOOKUP, "gpu": "TEXT"}]}, ["body", "lookups", 0, "gpu"]),
    (
        "/v1/configs/batch",
        {"lookups": [{**LOOKUP, "match": "TEXT"}]},
        ["body", "lookups", 0, "match"],
    ),
]


def _with(body: dict[str, Any], escape: str) -> bytes:
    """``body`` as JSON with ``escape`` (raw JSON text) in place of TEXT."""
    return json.dumps(body).replace("TEXT", escape).encode()


@pytest.mark.parametrize(("path", "body", "loc"), SURROGATE_BODIES)
@pytest.mark.parametrize("escape", ["\\ud800", "\\uDFFF", "\\udbff\\u0041", "x\\udc00"])
def test_a_lone_surrogate_escape_is_a_422_naming_its_field(
    client: TestClient, path: str, body: dict[str, Any], loc: list[Any], escape: str
) -> None:
    found = errors(post_raw(client, path, _with(body, escape)))
    assert [e["loc"] for e in found] == [loc]
    assert found[0]["type"] == "string_unicode"
    assert "surrogate" in found[0]["msg"]


@pytest.mark.parametrize(("path", "body", "loc"), SURROGATE_BODIES)
def test_bytes_that_are_not_utf8_are_a_422_naming_their_field(
    client: TestClient, path: str, body: dict[str, Any], loc: list[Any]
) -> None:
    # An encoded surrogate (CESU-8 "\xed\xa0\x80"), a stray continuation byte, a truncated
    # sequence: Python's json.loads decodes the first one leniently; the API must not.
    for raw in (b"\xed\xa0\x80", b"\x80", b"\xff", b"\xe2\x82"):
        response = post_raw(client, path, json.dumps(body).encode().replace(b"TEXT", raw))
        assert locs(response) == [loc], raw


def test_a_surrogate_in_a_key_is_named(client: TestClient) -> None:
    response = post_raw(client, "/v1/jobs", _with({**JOB, "TEXT": 1}, "\\ud800"))
    (error,) = errors(response)
    assert error["loc"] == ["body", "\\ud800"]
    assert "key" in error["msg"]


def test_a_surrogate_pair_is_valid_text(client: TestClient) -> None:
    # U+1F600 as its escaped pair is one valid character: an unknown operator, not bad text.
    response = post_raw(client, "/v1/jobs", _with({**JOB, "operator": "TEXT"}, "\\ud83d\\ude00"))
    assert response.status_code == 422
    assert "unknown operator" in response.json()["detail"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(client: TestClient, literal: str) -> None:
    for path, body in (
        ("/v1/jobs", {**JOB, "budget_seconds": "TEXT"}),
        ("/v1/configs/batch", {"lookups": [{**LOOKUP, "shape": ["TEXT"]}]}),
    ):
        raw = json.dumps(body).replace('"TEXT"', literal).encode()
        (error,) = errors(post_raw(client, path, raw))
        assert error["type"] == "json_invalid" and "not a JSON number" in error["msg"]


def test_every_route_with_a_body_refuses_bad_text(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    posted = 0
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if "requestBody" not in operation:
                continue
            url = path.replace("{job_id}", "0" * 32).replace("{operator}", "softmax")
            response = client.request(
                method,
                url,
                content=b'{"\\ud800": "\\udfff"}',
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 422, (method, path, response.text)
            assert response.json()["detail"][0]["type"] == "string_unicode"
            posted += 1
    assert posted >= 3


@pytest.mark.parametrize("bad", ["%ED%A0%80", "%FF", "%C3", "%80abc", "%F4%90%80%80"])
@pytest.mark.parametrize(
    ("url", "loc"),
    [
        ("/v1/configs/softmax?shape=4096x4096&dtype=float16&gpu=H200{bad}", ["query", "gpu"]),
        ("/v1/configs/softmax?shape=4096x4096{bad}&dtype=float16&gpu=H200", ["query", "shape"]),
        ("/v1/configs/softmax?{bad}=1&" + QUERY, ["query"]),
        ("/v1/jobs?status=queued{bad}", ["query", "status"]),
        ("/v1/workers?limit=1{bad}", ["query", "limit"]),
        ("/v1/operators?x={bad}", ["query", "x"]),
        ("/v1/gpus/H200{bad}", ["path"]),
        ("/v1/configs/softmax{bad}?" + QUERY, ["path"]),
        ("/v1/jobs/{bad}/trials", ["path"]),
    ],
)
def test_percent_encoded_text_that_is_not_utf8_is_a_422(
    client: TestClient, url: str, loc: list[str], bad: str
) -> None:
    (error,) = errors(client.get(url.format(bad=bad)))
    assert error["type"] == "string_unicode"
    assert error["loc"][: len(loc)] == loc
    assert "UTF-8" in error["msg"]


def _asgi_get(app: FastAPI, path: str, query_string: bytes) -> tuple[int, Any]:
    """A GET sent straight to the ASGI app, with a query string no HTTP client would send."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query_string,
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_raw_bytes_in_a_query_string_are_refused(app: FastAPI) -> None:
    # Not percent-encoded at all: servers pass such bytes through and Starlette would read
    # them as latin-1 ("Ã©" for "é"), so they are refused, not misread.
    query = b"shape=4096x4096&dtype=float16&gpu=H200"
    assert _asgi_get(app, "/v1/configs/softmax", query)[0] == 200
    for raw in (b"\xc3\xa9", b"\xff"):
        status, body = _asgi_get(app, "/v1/configs/softmax", query + raw)
        assert status == 422 and body["detail"][0]["loc"] == ["query", "gpu"], body


def test_valid_percent_encoded_utf8_still_works(client: TestClient) -> None:
    # U+00E9 percent-encoded as UTF-8: valid text (an unknown GPU model, named as sent).
    response = client.get("/v1/configs/softmax?shape=4096x4096&dtype=float16&gpu=H%C3%A9")
    assert response.status_code == 422
    assert "unknown GPU model 'Hé'" in response.json()["detail"]
    assert (
        client.get("/v1/configs/softmax?shape=4096%2C4096&dtype=float16&gpu=H200").status_code
        == 200
    )


# --- item 7: strict types ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"shape": [True, 4096]}, ["body", "shape", 0]),
        ({"shape": [4096, False]}, ["body", "shape", 1]),
        ({"shape": ["4096", 4096]}, ["body", "shape", 0]),
        ({"shape": [4096.0, 4096]}, ["body", "shape", 0]),
        ({"budget": True}, ["body", "budget"]),
        ({"budget": "5"}, ["body", "budget"]),
        ({"budget": 5.0}, ["body", "budget"]),
        ({"seed": True}, ["body", "seed"]),
        ({"seed": "1"}, ["body", "seed"]),
        ({"budget_seconds": True}, ["body", "budget_seconds"]),
        ({"budget_seconds": "60"}, ["body", "budget_seconds"]),
        ({"operator": 1}, ["body", "operator"]),
        ({"gpu": ["H200"]}, ["body", "gpu"]),
        ({"strategy": True}, ["body", "strategy"]),
    ],
)
def test_job_fields_take_strict_types(
    client: TestClient, change: dict[str, Any], loc: list[Any]
) -> None:
    queued = len(client.get("/v1/jobs?limit=1000").json())
    assert locs(client.post("/v1/jobs", json={**JOB, **change})) == [loc]
    batch = client.post("/v1/jobs/batch", json={"jobs": [JOB, {**JOB, **change}]})
    assert locs(batch) == [["body", "jobs", 1, *loc[1:]]]
    assert len(client.get("/v1/jobs?limit=1000").json()) == queued  # nothing was queued


def test_numbers_of_the_right_type_are_taken(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={**JOB, "budget": 5, "seed": 7, "budget_seconds": 1})
    assert response.status_code == 202, response.text
    job = response.json()
    assert (job["budget"], job["seed"], job["budget_seconds"]) == (5, 7, 1.0)
    response = client.post("/v1/jobs", json={**JOB, "budget_seconds": 90.5})
    assert response.status_code == 202 and response.json()["budget_seconds"] == 90.5


@pytest.mark.parametrize(
    "shape",
    [
        "\u0664\u0660\u0669\u0666x4096",  # Arabic-Indic 4096
        "\uff14\uff10\uff19\uff16x4096",  # fullwidth 4096
        "4096x\u0967\u0966",  # Devanagari 10
        "4096\u2003x4096",  # an em space
        "4096x4096\u00a0",  # a no-break space
        "4096\nx4096",
        "4096x4096\x00",
        # One spelling per shape (issue 28's review): no sign, leading zero, blank or 'X'.
        "+4096x4096",
        "-4096x4096",
        "04096x4096",
        "4096X4096",
        " 4096x4096",
        "4096 x 4096",
        "4096x4096,",
        "4096xx4096",
        "0x4096",
        "",
    ],
)
def test_shape_strings_take_ascii_digits_only(client: TestClient, shape: str) -> None:
    response = client.post("/v1/jobs", json={**JOB, "shape": shape})
    assert response.status_code == 422 and FORMAT in response.text
    response = client.get(
        "/v1/configs/softmax", params={"shape": shape, "dtype": "float16", "gpu": "H200"}
    )
    assert response.status_code == 422 and FORMAT in response.text
    response = client.post("/v1/configs/batch", json={"lookups": [{**LOOKUP, "shape": shape}]})
    assert response.status_code == 200
    (result,) = response.json()["results"]
    assert result["status"] == 422 and FORMAT in result["detail"]


#: What a 422 for a shape string says: the format.
FORMAT = "shape must be positive integers without sign or leading zeros, joined by 'x' or ','"


def test_ascii_shape_strings_still_parse(client: TestClient) -> None:
    for shape in ("4096x4096", "4096,4096"):
        response = client.post("/v1/jobs", json={**JOB, "shape": shape})
        assert response.status_code == 202 and response.json()["shape"] == [4096, 4096], shape
        response = client.get(
            "/v1/configs/softmax", params={"shape": shape, "dtype": "float16", "gpu": "H200"}
        )
        assert response.status_code == 200 and response.json()["shape"] == [4096, 4096], shape
    response = client.post("/v1/jobs", json={**JOB, "shape": "1048576x128"})
    assert response.status_code == 202 and response.json()["shape"] == [1048576, 128]


NAMES = [
    "H200\u0000",
    "H200\x7f",
    "\tH200",
    "H200\n",
    "H200\u200b",
    "H200\u202e",
    "H200\u0085",
    "H200\u2028",
    "H\u00a0200",
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("field", ["operator", "dtype", "gpu"])
def test_names_with_control_characters_are_refused(
    client: TestClient, field: str, name: str
) -> None:
    value = name.replace("H200", {"operator": "softmax", "dtype": "float16", "gpu": "H200"}[field])
    (error,) = errors(client.post("/v1/jobs", json={**JOB, field: value}))
    assert error["loc"] == ["body", field] and "printable" in error["msg"]
    (error,) = errors(
        client.post("/v1/configs/batch", json={"lookups": [{**LOOKUP, field: value}]})
    )
    assert error["loc"] == ["body", "lookups", 0, field]
    if field != "operator":
        query = {"shape": "4096x4096", "dtype": "float16", "gpu": "H200", field: value}
        (error,) = errors(client.get("/v1/configs/softmax", params=query))
        assert error["loc"] == ["query", field] and "printable" in error["msg"]


@pytest.mark.parametrize("name", NAMES)
def test_path_names_with_control_characters_are_refused(client: TestClient, name: str) -> None:
    response = client.get(f"/v1/gpus/{quote(name)}")
    (error,) = errors(response)  # never the H200 entry
    assert error["loc"] == ["path", "name"] and "printable" in error["msg"]
    response = client.get(f"/v1/configs/{quote(name.replace('H200', 'softmax'))}?{QUERY}")
    assert response.status_code == 404 and "unknown operator" in response.text


def test_printable_names_still_resolve(client: TestClient) -> None:
    assert client.get("/v1/gpus/NVIDIA H200").json()["name"] == "H200"
    response = client.post("/v1/jobs", json={**JOB, "gpu": "NVIDIA H200"})
    assert response.status_code == 202 and response.json()["gpu"] == "H200"


@pytest.mark.parametrize(
    ("url", "loc"),
    [
        ("/v1/jobs?limit=1_0", ["query", "limit"]),
        ("/v1/jobs?limit=%2010", ["query", "limit"]),
        ("/v1/jobs?limit=10.0", ["query", "limit"]),
        ("/v1/jobs?limit=%D9%A1%D9%A0", ["query", "limit"]),
        ("/v1/workers?limit=%EF%BC%91", ["query", "limit"]),
        ("/v1/workers?live=yes", ["query", "live"]),
        ("/v1/workers?live=1", ["query", "live"]),
    ],
)
def test_query_numbers_and_flags_are_strict(client: TestClient, url: str, loc: list[str]) -> None:
    assert locs(client.get(url)) == [loc]


def test_query_numbers_and_flags_still_parse(client: TestClient) -> None:
    assert client.get("/v1/jobs?limit=10").status_code == 200
    assert client.get("/v1/workers?limit=5&live=true").status_code == 200
    assert client.get("/v1/workers?live=False").status_code == 200
    assert locs(client.get("/v1/jobs?limit=0")) == [["query", "limit"]]


def test_lookup_batch_items_take_strict_types(client: TestClient) -> None:
    for change, loc in (
        ({"shape": [True, 4096]}, ["body", "lookups", 0, "shape"]),
        ({"shape": ["4096", "4096"]}, ["body", "lookups", 0, "shape"]),
        ({"gpu": 200}, ["body", "lookups", 0, "gpu"]),
    ):
        response = client.post("/v1/configs/batch", json={"lookups": [{**LOOKUP, **change}]})
        assert all(loc_[: len(loc)] == loc for loc_ in locs(response)), response.text


def test_the_openapi_schema_still_describes_the_types(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    job = schema["components"]["schemas"]["JobCreate"]["properties"]
    assert job["budget"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}
    assert job["seed"]["type"] == "integer"
    seconds = job["budget_seconds"]["anyOf"][0]
    assert seconds["type"] == "number" and seconds["minimum"] == 1
    for field in ("operator", "dtype", "gpu"):
        assert job[field]["type"] == "string" and "pattern" in job[field], field
    params = {p["name"]: p["schema"] for p in schema["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert params["limit"]["type"] == "integer" and params["limit"]["maximum"] == 1000


@pytest.mark.parametrize("name", ["ci\x00", "ci\x1b[2J", "ci\u202eelif", "c\ni"])
def test_token_names_with_control_characters_are_refused(tmp_path: Any, name: str) -> None:
    # A name is printed by `kato token list`: an escape sequence in it would drive the terminal.
    from kato.service.cli import app as cli
    from typer.testing import CliRunner

    db = str(tmp_path / "kato.db")
    result = CliRunner().invoke(cli, ["token", "create", name, "--db", db])
    assert result.exit_code == 2, result.output
    assert "printable" in result.output
    listed = CliRunner().invoke(cli, ["token", "list", "--json", "--db", db])
    assert listed.exit_code == 0 and listed.stdout.strip() == ""  # JSON lines: no token
    assert CliRunner().invoke(cli, ["token", "create", "ci fleet", "--db", db]).exit_code == 0
