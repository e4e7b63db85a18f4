"""What a person at the terminal meets (issue 28, item 10): the docs pages work offline, and a
405 lists every method its path takes."""

from __future__ import annotations

import re
from urllib.parse import urljoin

import pytest
from fastapi.testclient import TestClient

#: src= / href= / url(...) references in an HTML page.
_REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url\(\s*["']?([^"')]+)""")
#: What would make a browser reach another host: a scheme, or a protocol-relative URL.
_EXTERNAL = re.compile(r"""(?i)\b(?:https?:)?//[a-z0-9.-]+""")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_their_assets_from_the_service(client: TestClient, page: str) -> None:
    response = client.get(page)
    assert response.status_code == 200
    html = response.text
    assert not _EXTERNAL.findall(html), _EXTERNAL.findall(html)
    references = [a or b for a, b in _REFERENCE.findall(html)]
    scripts = [r for r in references if r.endswith(".js")]
    assert scripts, html  # the page's UI comes from a script it references
    for reference in references:
        asset = client.get(urljoin(f"http://testserver{page}", reference))
        assert asset.status_code == 200, reference
        assert len(asset.content) > 1000 or not reference.endswith(".js"), reference
    assert "/openapi.json" in html


def test_swagger_ui_calls_no_validator(client: TestClient) -> None:
    # Swagger UI would otherwise send the schema to validator.swagger.io for its badge.
    assert '"validatorUrl": null' in client.get("/docs").text


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/jobs", {"GET", "HEAD", "POST"}),
        ("PATCH", "/v1/jobs/0123abcd", {"GET", "HEAD", "DELETE"}),
        ("POST", "/v1/jobs/0123abcd", {"GET", "HEAD", "DELETE"}),
        # A literal path is its own resource, not a value of a parametrised one (issue 28's
        # review): GET /v1/jobs/batch was a 404 (job 'batch'), GET /v1/configs/batch a 422.
        ("PUT", "/v1/configs/batch", {"POST"}),
        ("GET", "/v1/configs/batch", {"POST"}),
        ("GET", "/v1/jobs/batch", {"POST"}),
        ("DELETE", "/v1/jobs/batch", {"POST"}),
        ("DELETE", "/v1/configs/softmax", {"GET", "HEAD"}),
        ("POST", "/healthz", {"GET", "HEAD"}),
    ],
)
def test_a_405_lists_every_method_of_its_path(
    anonymous: TestClient, method: str, path: str, allowed: set[str]
) -> None:
    response = anonymous.request(method, path)
    assert response.status_code == 405, response.text
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed
    assert method in response.json()["detail"]
    for other in allowed - {"DELETE", "POST"}:  # a listed method is routed (no 405)
        assert anonymous.request(other, path).status_code != 405


@pytest.mark.parametrize(
    "path",
    [
        "/healthz",
        "/v1/ping",
        "/v1/jobs",
        "/v1/jobs/0123abcd",  # a 404: HEAD answers it as GET does
        "/v1/operators",
        "/v1/gpus",
        "/v1/workers",
        "/v1/configs/softmax?shape=4096x4096&dtype=float16&gpu=H200",
        "/v1/configs/softmax?shape=+4096x4096&dtype=float16&gpu=H200",  # a 422
    ],
)
def test_head_answers_like_get_without_a_body(anonymous: TestClient, path: str) -> None:
    get, head = anonymous.get(path), anonymous.head(path)
    assert head.status_code == get.status_code != 405, (head.status_code, get.text[:200])
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert int(head.headers["content-length"]) == len(get.content)


def test_head_where_get_is_not_taken_is_a_405(anonymous: TestClient) -> None:
    response = anonymous.head("/v1/jobs/batch")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.content == b""
