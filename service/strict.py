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

A JSON body is also bounded in shape before it is validated: at most :data:`MAX_OBJECT_KEYS`
keys per object, :data:`MAX_ARRAY_ITEMS` items per array, :data:`MAX_DEPTH` levels of nesting
(a 422 of type ``too_many_keys``, ``too_many_items`` or ``too_deep`` naming where). Validation
costs time per key and item (an object of 60,000 unknown keys took pydantic 0.4 s and 60,000
errors), and pydantic holds the GIL while it runs, so running it in a thread would not keep the
event loop free: the bound does. Decoding a large body (:data:`OFFLOAD_BYTES`) runs in a thread.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from collections.abc import Callable, Coroutine, Iterator
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute
from kato.kernels.spec import InvalidInput
from kato.service.deps import closing_sessions
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

#: A lone surrogate, a surrogate escape, or a byte ``surrogateescape`` stood in for.
_MAYBE_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: Most characters of the offending text echoed back, and most errors listed in a 422.
_ECHO = 200
MAX_ERRORS = 10
#: Most entries of an echoed list or object, and its deepest level echoed.
_ECHO_ITEMS = 10
_ECHO_DEPTH = 3
#: The shape of a JSON body: every object of a request body is a model of at most 9 fields,
#: the longest list 1000 lookups (``KATO_MAX_BATCH`` jobs, 256 by default).
MAX_OBJECT_KEYS = 100
MAX_ARRAY_ITEMS = 10_000
MAX_DEPTH = 32
#: Bodies from this size on are decoded in a thread (about 2 ms of json.loads and checks).
OFFLOAD_BYTES = 64 * 1024


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
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, cap_errors(errors))


def cap_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first :data:`MAX_ERRORS` field errors, then one entry (``type``
    ``too_many_errors``) counting the others: a 422 stays small however many fields are bad."""
    if len(errors) <= MAX_ERRORS:
        return errors
    more = len(errors) - MAX_ERRORS
    return [
        *errors[:MAX_ERRORS],
        {
            "type": "too_many_errors",
            "loc": ["body"],
            "msg": f"{more} more errors not shown; fix these and send the request again",
            "input": None,
        },
    ]


def echo(value: Any, depth: int = 0) -> Any:
    """A bounded, strict-JSON copy of an input for an error reply: text cut to 200 characters
    (surrogates escaped), at most 10 entries of a list or object and 3 levels of them, NaN and
    infinities as text, anything else as its ``str`` (an exception in ``ctx``). A 422 can then
    neither turn into a 500 nor grow with its input."""
    if isinstance(value, str):
        return escape_surrogates(value[:_ECHO])
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 64 else str(value)[:_ECHO]
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes):
        return echo(value[: _ECHO * 4].decode("utf-8", errors="replace"), depth)
    if isinstance(value, dict | list | tuple) and depth >= _ECHO_DEPTH:
        return "..."
    if isinstance(value, dict):
        items = itertools.islice(value.items(), _ECHO_ITEMS)
        return {escape_surrogates(str(k)[:_ECHO]): echo(v, depth + 1) for k, v in items}
    if isinstance(value, list | tuple):
        return [echo(v, depth + 1) for v in itertools.islice(value, _ECHO_ITEMS)]
    return escape_surrogates(str(value)[:_ECHO])


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


def _shape_error(kind: str, loc: list[Any], msg: str) -> HTTPException:
    return _unprocessable([{"type": kind, "loc": ["body", *loc], "msg": msg, "input": None}])


def _too_deep(loc: list[Any]) -> HTTPException:
    return _shape_error(
        "too_deep",
        loc,
        f"the JSON body nests deeper than {MAX_DEPTH} levels; "
        "no request body nests more than a few",
    )


def check_shape(value: Any) -> None:
    """Refuse a decoded JSON value past the shape limits (see the module docstring) before
    anything validates it. Iterative, and it visits containers only: its cost is the number of
    values, whatever their nesting.

    Raises:
        HTTPException: 422 (``too_many_keys``, ``too_many_items``, ``too_deep``) naming the
            first object or array past a limit.
    """
    stack: list[tuple[list[Any], Any]] = [([], value)]
    while stack:
        loc, item = stack.pop()
        if len(loc) >= MAX_DEPTH:
            raise _too_deep(loc[:4])
        if isinstance(item, dict):
            if len(item) > MAX_OBJECT_KEYS:
                raise _shape_error(
                    "too_many_keys",
                    loc,
                    f"a JSON object of {len(item)} keys; at most {MAX_OBJECT_KEYS} are accepted "
                    "(the fields of this request are listed in /docs)",
                )
            children: Iterator[tuple[Any, Any]] = iter(item.items())
        elif isinstance(item, list):
            if len(item) > MAX_ARRAY_ITEMS:
                raise _shape_error(
                    "too_many_items",
                    loc,
                    f"a JSON array of {len(item)} items; at most {MAX_ARRAY_ITEMS} are accepted "
                    "(split it into several requests)",
                )
            children = enumerate(item)
        else:
            continue
        stack.extend(
            ([*loc, escape_surrogates(key[:_ECHO]) if isinstance(key, str) else key], child)
            for key, child in children
            if isinstance(child, dict | list)
        )


def decode_json(body: bytes) -> Any:
    """A request body as JSON, strictly, and bounded in shape (see the module docstring).

    Raises:
        json.JSONDecodeError: not JSON (FastAPI answers 422 ``json_invalid``).
        HTTPException: 422 naming the field, or the key, holding text that is not valid
            Unicode, or a ``NaN`` / ``Infinity`` literal, or the object or array past a shape
            limit (:func:`check_shape`).
    """
    # surrogateescape: bytes that are not UTF-8 become lone surrogates, found below with the
    # field that holds them, as are the surrogates json.loads makes from escapes.
    text = body.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # nested past the interpreter's limit: past ours too
        raise _too_deep([]) from None
    check_shape(value)
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
            raise _unprocessable(found)
    return value


class StrictJSONRequest(Request):
    """A request whose :meth:`json` is :func:`decode_json`, in a thread for a body of
    :data:`OFFLOAD_BYTES` or more (json.loads lets the event loop run meanwhile)."""

    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            body = await self.body()
            if len(body) >= OFFLOAD_BYTES:
                self._strict_json = await run_in_threadpool(decode_json, body)
            else:
                self._strict_json = decode_json(body)
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` that decodes its JSON body with :func:`decode_json` (FastAPI's hook for
    a custom request class). Every router of the app uses it. A sync endpoint closes its
    database session in its own thread (:func:`service.deps.closing_sessions`)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, closing_sessions(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler


#: A shape as text: positive integers in ASCII digits without sign or leading zero, joined by
#: ``x`` or ``,`` (``4096x4096``, ``4096,4096``); nothing else (no blank, ``X``, ``+``, ``04096``:
#: one shape has one spelling, which the lookup cache and logs key on).
SHAPE_TEXT = re.compile(r"[1-9][0-9]{0,18}(?:[x,][1-9][0-9]{0,18})*")
SHAPE_FORMAT = (
    "positive integers without sign or leading zeros, joined by 'x' or ',' "
    "(e.g. 4096x4096 or 4096,4096)"
)


def parse_shape(text: str) -> list[int]:
    """``"4096x4096"`` or ``"4096,4096"`` -> ``[4096, 4096]``, by :data:`SHAPE_TEXT` only (the
    dimensions' range is the caller's to check).

    Raises:
        InvalidInput: (a ``ValueError``, a 422) saying the format.
    """
    if not SHAPE_TEXT.fullmatch(text):
        raise InvalidInput(f"shape must be {SHAPE_FORMAT}; got {escape_surrogates(text[:100])!r}")
    return [int(p) for p in re.split("[x,]", text)]


# --- methods: HEAD, and literal paths before parametrised ones ---------------------------------


def literal_methods(app: Any, path: str) -> set[str] | None:
    """The methods the API documents at exactly ``path`` when it has no parameter in it
    (``/v1/jobs/batch``; from ``app.openapi()``, built once), or None where no such path is.

    A literal path names a resource of its own: ``GET /v1/jobs/batch`` is a method the batch
    route does not take (405), not the job whose id is ``batch`` (404), and ``GET
    /v1/configs/batch`` not a lookup of an operator named ``batch`` (422). HEAD goes with GET.
    """
    literal = getattr(app.state, "literal_paths", None)
    if literal is None:
        literal = {}
        try:
            paths = app.openapi().get("paths", {})
        except Exception:  # a route the schema cannot describe: no literal rule, not a 500
            logging.getLogger(__name__).exception("no OpenAPI schema: no literal-path 405s")
            paths = {}
        for route_path, item in paths.items():
            if "{" not in route_path:
                methods = {m.upper() for m in item if m.upper() in _HTTP_METHODS}
                literal[route_path] = methods | ({"HEAD"} if "GET" in methods else set())
        app.state.literal_paths = literal
    return literal.get(path)


#: The methods a 405's ``Allow`` may list, in its order.
_HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class HttpMethods:
    """ASGI middleware: HEAD answered as GET without a body (RFC 9110: the same status and
    headers, ``Content-Length`` included), and a method that a literal path's routes do not
    take answered 405 with their ``Allow`` before a parametrised route can take the path
    (:func:`literal_methods`). Needs ``scope["app"]`` (set by Starlette) for the routes."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        routes = scope["app"].router.routes
        allowed = literal_methods(scope["app"], path)
        if allowed is not None and method not in allowed:
            listed = [m for m in _HTTP_METHODS if m in allowed]
            detail = f"{method} is not allowed here; this path takes {', '.join(listed)}"
            headers = {"Allow": ", ".join(listed)}
            text = json.dumps({"detail": detail}, separators=(",", ":"))
            body = b"" if method == "HEAD" else text.encode()
            response = Response(body, 405, headers=headers, media_type="application/json")
            await response(scope, receive, send)
            return
        if method != "HEAD" or _routed(routes, scope, "HEAD"):
            await self.app(scope, receive, send)
            return
        if not _routed(routes, scope, "GET"):
            await self.app(scope, receive, send)  # the router answers its 405 or 404
            return

        async def headers_only(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # the body is dropped; its length is in the headers already
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def _routed(routes: Any, scope: Scope, method: str) -> bool:
    """Whether some route takes ``method`` at the request's path (or a mount owns it)."""
    from starlette.routing import Match, Mount

    probe = {**scope, "method": method}
    for route in routes:
        match = route.matches(probe)[0]
        if match == Match.FULL or (isinstance(route, Mount) and match != Match.NONE):
            return True
    return False
