"""Request body size limit: a pure ASGI middleware (no buffering, no per-request task).

A request whose ``Content-Length`` exceeds the limit is answered 413 before its body is read; a
body sent without a length (chunked) is counted as it streams in and cut off with a 413 as soon
as it passes the limit, so an endless body costs at most ``max_bytes`` of memory.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit; an ``HTTPException`` so
    that FastAPI's body parsing re-raises it as it is and the app answers 413."""

    def __init__(self, max_bytes: int):
        super().__init__(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"request body larger than {max_bytes} bytes (KATO_MAX_BODY_BYTES); "
            "split the batch into several requests",
        )


class BodySizeLimit:
    """Reject request bodies over ``max_bytes`` with a 413 ``{"detail": ...}``."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Send, status_code: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status_code,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                text = value.decode("latin-1").strip()
                if not text.isdigit():
                    await self._reject(send, 400, f"invalid Content-Length {text[:40]!r}")
                    return
                if int(text) > limit:
                    await self._reject(send, 413, BodyTooLarge(limit).detail)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await self._reject(send, 413, str(exc.detail))


def content_too_large_detail(max_bytes: int) -> Any:
    """The 413 message for ``max_bytes`` (for tests and docs)."""
    return BodyTooLarge(max_bytes).detail
