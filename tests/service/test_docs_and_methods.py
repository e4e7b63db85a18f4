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
        ("PUT", "/v1/jobs", {"GET", "POST"}),
        ("PATCH", "/v1/jobs/0123abcd", {"GET", "DELETE"}),
        ("POST", "/v1/jobs/0123abcd", {"GET", "DELETE"}),
        ("PUT", "/v1/configs/batch", {"GET", "POST"}),
        ("DELETE", "/v1/configs/softmax", {"GET"}),
        ("POST", "/healthz", {"GET"}),
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
