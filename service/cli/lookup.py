"""``kato lookup``: the config a service (or the database, through the app) serves."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from kato.service.cli.common import (
    DbOption,
    app,
    emit,
    fail,
    load_settings,
    one_line,
    open_engine,
)


@app.command()
def lookup(
    operator: Annotated[str, typer.Argument()],
    shape: Annotated[str, typer.Option(help="e.g. 4096x4096")],
    dtype: Annotated[str, typer.Option()] = "float32",
    gpu: Annotated[str, typer.Option(help="GPU model, e.g. H200")] = "H200",
    url: Annotated[str | None, typer.Option(help="ask a running service instead of the DB")] = None,
    db: DbOption = None,
) -> None:
    """Print the tuned config for an operator, shape, dtype and GPU (exact, nearest or default)."""
    if url:
        import httpx

        try:
            r = httpx.get(
                f"{url.rstrip('/')}/v1/configs/{operator}",
                params={"shape": shape, "dtype": dtype, "gpu": gpu},
                timeout=30,
            )
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            fail(f"--url {url}: not a service URL ({one_line(exc)}); e.g. http://127.0.0.1:8000")
        except httpx.HTTPError as exc:  # refused, unresolvable, timed out
            fail(
                f"cannot reach the Kato service at {url}: {one_line(exc)}; is `kato serve` "
                "running there? Check --url (e.g. http://127.0.0.1:8000)"
            )
        emit(_answer(r, url), True)
        return
    import asyncio

    import httpx
    from kato.service.app import create_app

    settings = load_settings(db)
    api = create_app(settings, engine=open_engine(settings.db_url))

    async def ask() -> httpx.Response:
        # The app answers in this process, through its routes as a served request would be
        # (httpx's ASGI transport: no socket, and not Starlette's TestClient, a test tool).
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://kato") as client:
            return await client.get(
                f"/v1/configs/{operator}", params={"shape": shape, "dtype": dtype, "gpu": gpu}
            )

    r = asyncio.run(ask())
    api.state.engine.dispose()
    if r.status_code != 200:
        fail(f"{r.status_code}: {r.json().get('detail', r.text)}")
    emit(r.json(), True)


def _answer(r, url: str) -> dict[str, Any]:
    """The JSON object of the service at ``url``'s 200 answer; else the command ends with the
    service's detail, or (an answer that is not the service's JSON) a word on the URL."""
    try:
        data = r.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        fail(
            f"{url} did not answer as a Kato service (HTTP {r.status_code}, "
            f"{r.headers.get('content-type', 'no content type')}): check --url"
        )
    if r.status_code != 200:
        fail(f"{r.status_code}: {data.get('detail', r.text)}")
    return data
