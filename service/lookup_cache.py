"""An in-memory cache of config lookups: the hot read path answers without the database.

Lookups are the service's bulk traffic and their answers change only when a job stores a new
winner, so each API process keeps the encoded answers of recent lookups for ``ttl`` seconds
(``KATO_LOOKUP_CACHE_SECONDS``, default 1 s; 0 turns the cache off). Contract:

- only successful (200) answers are cached; errors are recomputed every time;
- the key is the request's path and query string as sent; :class:`LookupFastPath` answers a
  cached one before routing (reads open only), the route answers and fills the rest; a request
  with ``Cache-Control: no-cache`` is answered from the database (:func:`wants_fresh`);
- the app polls a fingerprint of the best-config table
  (:func:`db.queries.best_configs_version`) every ``check_seconds``
  (``KATO_LOOKUP_CACHE_CHECK_SECONDS``, default 0.5 s) and drops every answer when it changed
  (:meth:`LookupCache.set_version`), so a new winner is served by every API process within
  about ``check_seconds``; ``ttl`` (default 30 s) bounds an answer's age should polling stall;
- at most ``max_entries`` answers are kept (least recently stored evicted first), so hostile
  clients asking for endless distinct shapes cost bounded memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class LookupCache:
    """A thread-safe TTL cache of encoded responses, bounded in size."""

    def __init__(self, ttl: float, max_entries: int = 10_000):
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.version: object = None
        #: Bumped whenever answers are dropped; see :meth:`put`.
        self.generation = 0

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    def get(self, key: Hashable) -> bytes | None:
        """The cached answer for ``key``, or ``None`` (absent, expired or the cache is off)."""
        if not self.enabled:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] > time.monotonic():
                self.hits += 1
                return entry[1]
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None

    def put(self, key: Hashable, value: bytes, generation: int | None = None) -> None:
        """Keep ``value`` for ``key`` for ``ttl`` seconds (no-op when the cache is off).

        ``generation``: :attr:`generation` as read before the database was asked. If answers
        were dropped since (a new winner was seen while the lookup ran), ``value`` may be the
        old answer and is not kept: stored after the drop, it would be served for ``ttl``.
        """
        if not self.enabled:
            return
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            self._entries[key] = (time.monotonic() + self.ttl, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def set_version(self, version: object) -> bool:
        """Record the database's fingerprint; drop every answer if it changed. Returns whether
        it changed."""
        with self._lock:
            if version == self.version:
                return False
            self.version = version
            self._entries.clear()
            self.generation += 1
            return True

    def clear(self) -> None:
        """Forget every answer (e.g. after storing a winner in this process)."""
        with self._lock:
            self._entries.clear()
            self.generation += 1

    def __len__(self) -> int:
        return len(self._entries)


def raw_key(path: str, query_string: bytes) -> tuple[str, str, bytes]:
    """The cache key of a lookup: its path and query string as sent (one code version per
    process, so the operator's version need not be part of it)."""
    return ("GET", path, query_string)


def wants_fresh(headers: Any) -> bool:
    """Whether a request's raw ASGI headers carry ``Cache-Control: no-cache`` (or
    ``no-store``): the client asks for the database's answer, not a cached one (the Python
    client does after a job it waited for stored a winner, before the cache watcher has seen
    it). The fresh answer is still cached for the next request."""
    for name, value in headers:
        if name.lower() == b"cache-control" and (b"no-cache" in value or b"no-store" in value):
            return True
    return False


class LookupFastPath:
    """ASGI middleware: a ``GET /v1/configs/...`` whose answer is cached is answered here,
    before routing, parameter parsing and dependencies; everything else passes through.

    Only mounted while reads are open (``auth_reads`` off): a cached answer skips every check.
    """

    PREFIX = "/v1/configs/"

    def __init__(self, app: Any, cache: LookupCache):
        self.app = app
        self.cache = cache

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "GET"
            and scope["path"].startswith(self.PREFIX)
            and not wants_fresh(scope.get("headers", ()))
        ):
            body = self.cache.get(raw_key(scope["path"], scope.get("query_string", b"")))
            if body is not None:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
