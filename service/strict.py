"""Strict decoding of what a request says in text: its URL and its JSON body.

Python and Starlette decode leniently: ``json.loads`` turns ``"\\ud800"`` (and the bytes
``ED A0 80``) into a lone surrogate, a ``str`` that cannot be encoded again, and Starlette
reads ``%FF`` in a URL as U+FFFD. Such text later breaks whatever encodes it (an error reply, a
database driver) or is silently matched as something else. Here it is refused at the door,
before routing, with a 422 whose ``detail`` has FastAPI's field-error form (``loc``, ``msg``,
``type: "string_unicode"``, ``input``) naming where the bad text is:

- :class:`StrictURL` (ASGI middleware): the path and every query parameter must be
  percent-encoded UTF-8 (``loc`` ``["path"]`` or ``["query", name]``);
- :class:`StrictJSONRoute` (the ``route_class`` of every router): a JSON body must be UTF-8
  (RFC 8259) with no lone surrogate, and holds numbers, not ``NaN`` or ``Infinity``
  (``loc`` ``["body", ...]`` down to the field, or the key, holding it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine, Iterator
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

#: A lone surrogate, a surrogate escape, or a byte ``surrogateescape`` stood in for.
_MAYBE_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: Most characters of the offending text echoed back, and most errors listed.
_ECHO = 200
_MAX_ERRORS = 10


def escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``"\\ud800"``), so that it can
    be encoded as UTF-8 (an error reply can always echo what was sent)."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unicode_error(loc: list[Any], msg: str, text: str) -> dict[str, Any]:
    """One field error, in the form of FastAPI's validation errors."""
    return {
        "type": "string_unicode",
        "loc": loc,
        "msg": msg,
        "input": escape_surrogates(text[:_ECHO]),
    }


def _unprocessable(errors: list[dict[str, Any]]) -> HTTPException:
    # An HTTPException, not a RequestValidationError: FastAPI re-raises it as it is from body
    # parsing (anything else raised there becomes a bare 400).
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, errors)


# --- the URL --------------------------------------------------------------------------------


def _decode_component(raw: bytes) -> str | None:
    """A percent-encoded URL component as text, or ``None`` if it is not UTF-8 (raw bytes
    beyond ASCII count as not encoded: Starlette would read them as latin-1)."""
    if not raw.isascii():
        return None
    try:
        return unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return None


def url_errors(scope: Scope) -> list[dict[str, Any]]:
    """The field errors of a request's path and query string (empty: both are valid text)."""
    found = []
    raw_path = scope.get("raw_path")
    if raw_path and _decode_component(raw_path) is None:
        found.append(
            unicode_error(
                ["path"],
                "the URL path is not valid UTF-8 once percent-decoded",
                raw_path.decode("latin-1"),
            )
        )
    query: bytes = scope.get("query_string", b"")
    if query and (b"%" in query or not query.isascii()):
        for pair in query.split(b"&"):
            name, _, value = pair.partition(b"=")
            name_text = _decode_component(name.replace(b"+", b" "))
            if name_text is None:
                found.append(
                    unicode_error(
                        ["query"],
                        "a query parameter's name is not valid UTF-8 once percent-decoded",
                        name.decode("latin-1"),
                    )
                )
            elif _decode_component(value.replace(b"+", b" ")) is None:
                found.append(
                    unicode_error(
                        ["query", name_text],
                        "the value is not valid UTF-8 once percent-decoded",
                        value.decode("latin-1"),
                    )
                )
    return found


class StrictURL:
    """ASGI middleware: a request whose path or query string is not percent-encoded UTF-8 is
    answered 422 (see the module docstring) before it is routed."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            found = url_errors(scope)
            if found:
                body = json.dumps({"detail": found}, separators=(",", ":")).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": status.HTTP_422_UNPROCESSABLE_CONTENT,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


# --- the JSON body --------------------------------------------------------------------------


def _strings(value: Any) -> Iterator[tuple[list[Any], str, bool]]:
    """Every string in a decoded JSON value: (its location, the text, whether it is a key).
    Iterative: a body nested as deep as ``json.loads`` allows cannot exhaust the stack here."""
    stack: list[tuple[list[Any], Any]] = [([], value)]
    while stack:
        loc, item = stack.pop()
        if isinstance(item, str):
            yield loc, item, False
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                here = [*loc, escape_surrogates(key)]
                stack.append((here, child))
                stack.append((here, _Key(key)))
        elif isinstance(item, list):
            stack.extend(([*loc, index], child) for index, child in reversed(list(enumerate(item))))
        elif isinstance(item, _Key):
            yield loc, item.text, True


class _Key:
    """A key of a JSON object, on :func:`_strings`' stack (told apart from a string value)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _no_constant(name: str) -> Any:
    raise _unprocessable(
        [
            {
                "type": "json_invalid",
                "loc": ["body"],
                "msg": f"{name} is not a JSON number; send a finite number",
                "input": name,
            }
        ]
    )


def decode_json(body: bytes) -> Any:
    """A request body as JSON, strictly (see the module docstring).

    Raises:
        json.JSONDecodeError: not JSON (FastAPI answers 422 ``json_invalid``).
        HTTPException: 422 naming the field, or the key, holding text that is not valid
            Unicode, or a ``NaN`` / ``Infinity`` literal.
    """
    # surrogateescape: bytes that are not UTF-8 become lone surrogates, found below with the
    # field that holds them, as are the surrogates json.loads makes from escapes.
    text = body.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    value = json.loads(text, parse_constant=_no_constant)
    if _MAYBE_SURROGATE.search(text):
        found = [
            unicode_error(
                ["body", *loc],
                ("a key" if is_key else "the text")
                + " holds a lone surrogate or bytes that are not UTF-8; send valid Unicode",
                text_,
            )
            for loc, text_, is_key in _strings(value)
            if _SURROGATE.search(text_)
        ]
        if found:
            raise _unprocessable(found[:_MAX_ERRORS])
    return value


class StrictJSONRequest(Request):
    """A request whose :meth:`json` is :func:`decode_json`."""

    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = decode_json(await self.body())
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` that decodes its JSON body with :func:`decode_json` (FastAPI's hook for
    a custom request class). Every router of the app uses it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
