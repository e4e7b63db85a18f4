"""``KatoClient``: tuned configs for a training framework, in microseconds once cached.

Layers, fastest first:

1. an in-process dict keyed by the call's own arguments ``(operator, shape, dtype, gpu)``: a hit
   is one dict read and one clock read, no lock, no normalisation (pass the shape as a tuple or
   ``torch.Size``; a list works but takes the slower path every time);
2. per server lookup (after normalising and applying the policy) a shared slot, so different
   spellings of one lookup share one answer;
3. the on-disk cache (:mod:`kato_client.disk`), shared by processes, surviving restarts;
4. the service over HTTP (``GET /v1/configs/{operator}``, ``POST /v1/configs/batch``).

An answer older than ``ttl`` seconds is still served at once, and revalidated in the background
(one worker thread, at most one pending revalidation per lookup). When the service cannot be
reached, cached answers keep being served; a lookup never seen before gets the operator's default
config from the local operator spec (source ``default``) and is asked again later. Either way a
:class:`KatoOfflineWarning` is issued once per client.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kato import env
from kato.errors import KatoError, ServiceError  # noqa: F401 (KatoError: its old home)
from kato.shared.status import TERMINAL_STATUSES
from kato_client.device import detect_gpu, normalize
from kato_client.disk import DiskCache, default_cache_dir
from kato_client.policy import (
    POLICIES,
    Key,
    RequestKey,
    config_valid,
    dtype_name,
    request_key,
    shape_tuple,
)

log = logging.getLogger("kato_client")

DEFAULT_URL = "http://127.0.0.1:8000"
#: Most lookups per ``POST /v1/configs/batch`` (the service's limit).
BATCH_LIMIT = 1000
#: After :meth:`KatoClient.invalidate`, seconds during which that group's lookups bypass the
#: service's cache (its watcher checks every 0.5 s by default; 60 covers a slow database).
FRESH_SECONDS = 60.0

_now = time.time


class KatoUnavailable(ServiceError):
    """The service could not be reached (connection refused, timeout, 5xx)."""


class KatoOfflineWarning(UserWarning):
    """Issued once per client when lookups are served without the service."""


@dataclass(frozen=True)
class Lookup:
    """One answer. ``shape`` is the shape that was looked up (the bucket, under the bucket
    policy); ``source`` is ``exact`` (tuned for it), ``nearest`` (tuned for ``tuned_shape``) or
    ``default``; ``fetched_at`` is when the service answered (``0.0`` for a local default).

    The figures are the service's, measured on ``tuned_shape`` (a ``nearest`` answer's are its
    neighbour's; a ``default`` answer has none), each None where not measured or where the
    service is older than them: ``time_ms`` the served config, ``default_ms`` the operator's
    default config, ``framework_ms`` PyTorch's own op on the same inputs (``framework`` names
    it, e.g. ``"torch 2.13.0+cu130"``), ``speedup`` = ``framework_ms / time_ms`` (above 1:
    Kato's config is faster than PyTorch's op), ``compiled_ms`` the same op compiled by
    ``torch.compile`` (``compiled`` names it, e.g. ``"torch.compile 2.14.1 inductor"``),
    ``compiled_speedup`` = ``compiled_ms / time_ms`` (the bar inside a compiled graph)."""

    operator: str
    shape: tuple[int, ...]
    dtype: str
    gpu: str
    config: dict[str, Any]
    source: str
    tuned_shape: tuple[int, ...] | None
    time_ms: float | None
    operator_version: str | None
    fetched_at: float
    default_ms: float | None = None
    framework_ms: float | None = None
    framework: str | None = None
    speedup: float | None = None
    compiled_ms: float | None = None
    compiled: str | None = None
    compiled_speedup: float | None = None

    @classmethod
    def from_answer(cls, answer: Mapping[str, Any], fetched_at: float) -> Lookup:
        tuned = answer.get("tuned_shape")
        time_ms, framework_ms = answer.get("time_ms"), answer.get("framework_ms")
        speedup = answer.get("speedup")
        if speedup is None and framework_ms is not None and time_ms:
            speedup = framework_ms / time_ms
        compiled_ms, compiled_speedup = answer.get("compiled_ms"), answer.get("compiled_speedup")
        if compiled_speedup is None and compiled_ms is not None and time_ms:
            compiled_speedup = compiled_ms / time_ms
        return cls(
            operator=str(answer["operator"]),
            shape=tuple(int(d) for d in answer["shape"]),
            dtype=str(answer["dtype"]),
            gpu=str(answer["gpu"]),
            config=dict(answer["config"]),
            source=str(answer["source"]),
            tuned_shape=tuple(int(d) for d in tuned) if tuned else None,
            time_ms=time_ms,
            operator_version=answer.get("operator_version"),
            fetched_at=fetched_at,
            default_ms=answer.get("default_ms"),
            framework_ms=framework_ms,
            framework=answer.get("framework"),
            speedup=speedup,
            compiled_ms=compiled_ms,
            compiled=answer.get("compiled"),
            compiled_speedup=compiled_speedup,
        )


class _Slot:
    """The current answer to one server lookup, shared by every call that maps to it."""

    __slots__ = ("config", "expires", "lookup", "rkey", "aliases")

    def __init__(self, rkey: RequestKey, lookup: Lookup, expires: float) -> None:
        self.rkey = rkey
        self.lookup = lookup
        self.config = lookup.config
        self.expires = expires
        self.aliases: list[tuple[Any, ...]] = []  # in-process keys that point here

    def update(self, lookup: Lookup, expires: float) -> None:
        self.lookup = lookup
        self.config = lookup.config
        self.expires = expires


def _disk_key(rkey: RequestKey) -> str:
    operator, shape, dtype, gpu, match = rkey
    return json.dumps([operator, list(shape), dtype, gpu, match], separators=(",", ":"))


class KatoClient:
    """A client of one Kato service.

    Args:
        url: the service (default ``KATO_URL``, else ``http://127.0.0.1:8000``).
        token: API token for writes (``submit``); default ``KATO_TOKEN``. Sent as
            ``Authorization: Bearer <token>``.
        gpu: GPU model for lookups that name none; default: this process's device, detected on
            first use (:func:`kato_client.device.detect_gpu`).
        policy: ``"exact"``, ``"nearest"`` (default) or ``"bucket"`` (:mod:`kato_client.policy`).
        cache_dir: directory of the on-disk cache (default ``KATO_CACHE_DIR``, else the user cache
            directory); ``disk_cache=False`` keeps answers in memory only.
        ttl: seconds after which an answer is revalidated in the background (still served).
        retry_s: after a failed revalidation (service down), seconds before trying again.
        timeout: HTTP timeout in seconds.
        http: an ``httpx.Client`` to use instead of one of our own (tests, custom transports).

    Thread-safe. Several processes may share one ``cache_dir``.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        gpu: str | None = None,
        policy: str = "nearest",
        cache_dir: str | Path | None = None,
        disk_cache: bool = True,
        ttl: float = 3600.0,
        retry_s: float = 30.0,
        timeout: float = 10.0,
        http: httpx.Client | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.url = (url or (env.get("KATO_URL") or "").strip() or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else (env.get("KATO_TOKEN") or None)
        self.policy = policy
        self.ttl = float(ttl)
        self.retry_s = float(retry_s)
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout)
        self._owns_http = http is None
        self._disk = DiskCache(cache_dir or default_cache_dir(), self.url) if disk_cache else None
        self._gpu = normalize(gpu) if gpu else None
        self._gpu_names: dict[str, str] = {}
        self._memo: dict[tuple[Any, ...], _Slot] = {}
        self._slots: dict[RequestKey, _Slot] = {}
        self._lock = threading.Lock()  # gpu detection, pending set, executor creation
        self._pending: set[RequestKey] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._warned_offline = False
        #: (operator, dtype, gpu) -> monotonic time until which lookups of that group ask the
        #: service for the database's answer (``Cache-Control: no-cache``): set by
        #: :meth:`invalidate`, because the service's own cache may still hold the old answer
        #: for up to its check interval after a job stored a winner.
        self._fresh_until: dict[tuple[str, str, str], float] = {}
        #: Bumped by :meth:`invalidate`: a revalidation that started before it does not store
        #: its (possibly old) answer.
        self._epoch = 0
        #: HTTP requests sent so far (lookups, batches, jobs).
        self.http_requests = 0

    # --- the hot path -------------------------------------------------------------------------

    def config(
        self, operator: str, shape: Sequence[int], dtype: Any, gpu: str | None = None
    ) -> dict[str, Any]:
        """The config to launch ``operator`` with on ``shape``/``dtype`` (a dict of parameter
        values; shared with the cache: do not modify it).

        ``gpu`` defaults to the client's GPU. Raises :class:`KatoError` for a lookup the service
        rejects (unknown operator, bad shape), :class:`KatoUnavailable` when the service is
        down and nothing is cached and the operator is not known locally either.
        """
        try:
            slot = self._memo[(operator, shape, dtype, gpu)]
        except (KeyError, TypeError):
            return self._miss(operator, shape, dtype, gpu).config
        config = slot.config  # read first: the revalidation may replace it before we return
        if slot.expires < _now():
            self._revalidate_later(slot)
        return config

    def lookup(
        self, operator: str, shape: Sequence[int], dtype: Any, gpu: str | None = None
    ) -> Lookup:
        """Like :meth:`config`, with where the config comes from (:class:`Lookup`)."""
        try:
            slot = self._memo[(operator, shape, dtype, gpu)]
        except (KeyError, TypeError):
            slot = self._miss(operator, shape, dtype, gpu)
        lookup = slot.lookup  # read first: the revalidation may replace it before we return
        if slot.expires < _now():
            self._revalidate_later(slot)
        return lookup

    # --- keys ---------------------------------------------------------------------------------

    @property
    def gpu(self) -> str:
        """The GPU model of lookups that name none (detected on first use)."""
        if self._gpu is None:
            with self._lock:
                if self._gpu is None:
                    self._gpu = detect_gpu()
        return self._gpu

    def _gpu_name(self, gpu: str | None) -> str:
        if gpu is None:
            return self.gpu
        name = self._gpu_names.get(gpu)
        if name is None:
            name = self._gpu_names[gpu] = normalize(gpu)
        return name

    def _key(self, operator: str, shape: Any, dtype: Any, gpu: str | None = None) -> Key:
        return (str(operator), shape_tuple(shape), dtype_name(dtype), self._gpu_name(gpu))

    # --- misses -------------------------------------------------------------------------------

    def _miss(self, operator: str, shape: Any, dtype: Any, gpu: str | None) -> _Slot:
        key = self._key(operator, shape, dtype, gpu)
        slot = self._memo.get(key)
        if slot is None:
            slot = self._resolve(key)
            self._remember(key, slot)
        with contextlib.suppress(TypeError):  # an unhashable shape (a list): the normalised key
            self._remember((operator, shape, dtype, gpu), slot)
        return slot

    def _remember(self, memo_key: tuple[Any, ...], slot: _Slot) -> None:
        self._memo[memo_key] = slot
        slot.aliases.append(memo_key)

    def _resolve(self, key: Key) -> _Slot:
        """The slot answering ``key`` under the client's policy (may ask the service)."""
        rkey = request_key(key, self.policy)
        slot = self._slot(rkey)
        if self.policy == "bucket" and rkey[1] != key[1]:
            lookup = slot.lookup
            if not config_valid(key[0], lookup.operator_version, lookup.config, key):
                slot = self._slot((*key, "nearest"))
        return slot

    def _slot(self, rkey: RequestKey) -> _Slot:
        slot = self._slots.get(rkey)
        if slot is not None:
            return slot
        now = _now()
        stored = self._disk.get(_disk_key(rkey)) if self._disk is not None else None
        if stored is not None:
            answer, fetched_at = stored
            slot = _Slot(rkey, Lookup.from_answer(answer, fetched_at), fetched_at + self.ttl)
        else:
            try:
                answer = self._get(rkey)
            except KatoUnavailable as exc:
                slot = self._offline_default(rkey, exc)
            else:
                self._store(rkey, answer, now)
                slot = _Slot(rkey, Lookup.from_answer(answer, now), now + self.ttl)
        self._slots[rkey] = slot
        if slot.expires < now:
            self._revalidate_later(slot)
        return slot

    def _offline_default(self, rkey: RequestKey, exc: Exception) -> _Slot:
        """The local operator spec's default config, while the service is down."""
        operator, shape, dtype, gpu, _ = rkey
        try:
            from kato.kernels import get_operator

            spec = get_operator(operator)
            spec.validate(list(shape), dtype)
            config = dict(spec.default_config(list(shape), dtype))
        except Exception:
            raise KatoUnavailable(
                f"{self.url} unreachable ({exc}) and nothing cached for {operator} "
                f"{'x'.join(map(str, shape))} {dtype} on {gpu}"
            ) from exc
        self._warn_offline(exc)
        lookup = Lookup(
            operator, shape, dtype, gpu, config, "default", None, None, spec.version, 0.0
        )
        return _Slot(rkey, lookup, _now() + self.retry_s)

    def _store(self, rkey: RequestKey, answer: dict[str, Any], fetched_at: float) -> None:
        if self._disk is not None:
            self._disk.put(_disk_key(rkey), answer, fetched_at)

    def _warn_offline(self, exc: Exception) -> None:
        if not self._warned_offline:
            self._warned_offline = True
            message = (
                f"Kato service {self.url} unreachable ({exc}); serving cached configs "
                "(or operator defaults) until it answers again"
            )
            log.warning(message)
            warnings.warn(message, KatoOfflineWarning, stacklevel=4)

    # --- background revalidation --------------------------------------------------------------

    def _revalidate_later(self, slot: _Slot) -> None:
        """Queue one revalidation of ``slot`` (none if one is pending)."""
        with self._lock:
            if slot.rkey in self._pending:
                return
            self._pending.add(slot.rkey)
            slot.expires = _now() + self.retry_s  # hits stop asking until this one is done
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kato-revalidate")
            self._executor.submit(self._revalidate, slot)

    def _revalidate(self, slot: _Slot) -> None:
        # The lookup stays pending until the slot holds the new answer: wait_idle() returning
        # means the revalidation is visible to the next hit.
        try:
            now = _now()
            epoch = self._epoch
            try:
                answer = self._get(slot.rkey)
            except KatoUnavailable as exc:
                self._warn_offline(exc)
                return
            except Exception as exc:  # a 4xx now (operator removed, ...): keep serving the old one
                log.warning("kato client: revalidating %s failed: %s", slot.rkey, exc)
                return
            if epoch != self._epoch:
                return  # invalidated meanwhile: the answer may predate the new winner
            self._store(slot.rkey, answer, now)
            old = slot.config
            slot.update(Lookup.from_answer(answer, now), now + self.ttl)
            if self.policy == "bucket" and slot.config != old:
                # Shapes served from a bucket must be checked against the new config again.
                for alias in slot.aliases:
                    if self._memo.get(alias) is slot:
                        self._memo.pop(alias, None)
                slot.aliases.clear()
        finally:
            with self._lock:
                self._pending.discard(slot.rkey)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no revalidation is pending (each one's answer is then served); ``False``
        on timeout (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # --- HTTP ---------------------------------------------------------------------------------

    def _headers(self, token: str | None = None) -> dict[str, str]:
        token = token if token is not None else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request; the decoded JSON of a 2xx answer.

        Raises:
            KatoUnavailable: connection failure, timeout or 5xx.
            ServiceError: any other non-2xx answer (with the service's ``detail``).
        """
        self.http_requests += 1
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise KatoUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise KatoUnavailable(f"{method} {path}: HTTP {response.status_code}", 503)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            hint = ""
            if response.status_code in (401, 403):
                hint = " (pass token= to KatoClient or set KATO_TOKEN)"
            raise ServiceError(
                f"{method} {path}: HTTP {response.status_code}: {detail}{hint}",
                response.status_code,
            )
        return response.json()

    def _get(self, rkey: RequestKey) -> dict[str, Any]:
        operator, shape, dtype, gpu, match = rkey
        fresh = self._fresh_until.get((operator, dtype, gpu), 0.0) > time.monotonic()
        return self._request(
            "GET",
            f"/v1/configs/{operator}",
            params={"shape": "x".join(map(str, shape)), "dtype": dtype, "gpu": gpu, "match": match},
            headers={"Cache-Control": "no-cache"} if fresh else None,
        )

    # --- prefetch -----------------------------------------------------------------------------

    def prefetch(self, keys: Iterable[Sequence[Any] | Mapping[str, Any]]) -> list[Lookup]:
        """Fetch the answers to many lookups in one request (per 1000 lookups) and cache them.

        Each key is ``(operator, shape, dtype)`` or ``(operator, shape, dtype, gpu)`` or a
        mapping with those names. Lookups already cached and fresh (memory or disk) are not
        asked again. Returns one :class:`Lookup` per key, in order. Under the bucket policy, a
        shape whose bucket config does not fit it costs one more batch request.

        Raises:
            ServiceError: some lookups were rejected (the others are cached); the message
                lists them.
        """
        normalized = []
        for item in keys:
            if isinstance(item, Mapping):
                normalized.append(
                    self._key(item["operator"], item["shape"], item["dtype"], item.get("gpu"))
                )
            else:
                normalized.append(self._key(*item))
        first = [request_key(key, self.policy) for key in normalized]
        errors = self._fetch_missing(first)
        if self.policy == "bucket":
            second = [
                (*key, "nearest")
                for key, rkey in zip(normalized, first, strict=True)
                if rkey in self._slots
                and rkey[1] != key[1]
                and not config_valid(
                    key[0],
                    self._slots[rkey].lookup.operator_version,
                    self._slots[rkey].config,
                    key,
                )
            ]
            errors += self._fetch_missing(second)
        if errors:
            raise ServiceError(f"{len(errors)} lookup(s) rejected: " + "; ".join(errors[:5]))
        result = []
        for key in normalized:
            slot = self._memo.get(key)
            if slot is None:
                slot = self._resolve(key)
                self._remember(key, slot)
            result.append(slot.lookup)
        return result

    def _fetch_missing(self, rkeys: list[RequestKey]) -> list[str]:
        """Fill slots for ``rkeys`` not cached fresh, with one batch request per 1000."""
        now = _now()
        missing: list[RequestKey] = []
        for rkey in dict.fromkeys(rkeys):
            slot = self._slots.get(rkey)
            if slot is not None and slot.expires >= now:
                continue
            stored = self._disk.get(_disk_key(rkey)) if self._disk is not None else None
            if stored is not None and stored[1] + self.ttl >= now:
                answer, fetched_at = stored
                self._put_slot(rkey, Lookup.from_answer(answer, fetched_at), fetched_at + self.ttl)
                continue
            missing.append(rkey)
        errors: list[str] = []
        for start in range(0, len(missing), BATCH_LIMIT):
            chunk = missing[start : start + BATCH_LIMIT]
            body = {
                "lookups": [
                    {"operator": o, "shape": list(s), "dtype": d, "gpu": g, "match": m}
                    for o, s, d, g, m in chunk
                ]
            }
            try:
                answers = self._request("POST", "/v1/configs/batch", json=body)["results"]
            except KatoUnavailable as exc:
                self._warn_offline(exc)  # _slot serves disk entries or defaults later
                return errors
            for rkey, item in zip(chunk, answers, strict=True):
                if item["status"] != 200:
                    errors.append(f"{rkey[0]} {'x'.join(map(str, rkey[1]))}: {item['detail']}")
                    continue
                self._store(rkey, item["result"], now)
                self._put_slot(rkey, Lookup.from_answer(item["result"], now), now + self.ttl)
        return errors

    def _put_slot(self, rkey: RequestKey, lookup: Lookup, expires: float) -> None:
        slot = self._slots.get(rkey)
        if slot is None:
            self._slots[rkey] = _Slot(rkey, lookup, expires)
        else:
            slot.update(lookup, expires)

    # --- jobs ---------------------------------------------------------------------------------

    def submit(
        self,
        operator: str,
        shape: Sequence[int],
        dtype: Any,
        gpu: str | None = None,
        *,
        budget: int | None = None,
        budget_seconds: float | None = None,
        strategy: str | None = None,
        seed: int | None = None,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Queue a tuning job (``POST /v1/jobs``); the job as the service describes it (``id``,
        ``status``, ...). ``token`` overrides the client's token.

        Raises:
            ServiceError: rejected (bad input: 422; missing or wrong token: 401/403).
            KatoUnavailable: the service is down.
        """
        operator, dims, dtype_text, gpu_name = self._key(operator, shape, dtype, gpu)
        body: dict[str, Any] = {
            "operator": operator,
            "shape": list(dims),
            "dtype": dtype_text,
            "gpu": gpu_name,
        }
        optional = {"budget": budget, "budget_seconds": budget_seconds, "strategy": strategy}
        body.update({k: v for k, v in optional.items() if v is not None})
        if seed is not None:
            body["seed"] = seed
        return self._request("POST", "/v1/jobs", json=body, headers=self._headers(token))

    def submit_batch(
        self,
        jobs: Iterable[Mapping[str, Any]],
        gpu: str | None = None,
        *,
        budget: int | None = None,
        budget_seconds: float | None = None,
        strategy: str | None = None,
        token: str | None = None,
    ) -> list[dict[str, Any]]:
        """Queue several tuning jobs as one batch (``POST /v1/jobs/batch``: all or none). Each
        job is a mapping with ``operator``, ``shape`` and ``dtype`` (and optionally ``gpu``,
        ``budget``, ``budget_seconds``, ``strategy``, ``seed``); the keyword arguments are the
        defaults for every job that does not set its own. Returns the jobs as the service
        describes them, in order.

        Raises:
            ServiceError: rejected (bad input: 422 naming the job's index; quota: 429).
            KatoUnavailable: the service is down.
        """
        bodies = []
        for job in jobs:
            operator, dims, dtype_text, gpu_name = self._key(
                job["operator"], job["shape"], job["dtype"], job.get("gpu", gpu)
            )
            body: dict[str, Any] = {
                "operator": operator,
                "shape": list(dims),
                "dtype": dtype_text,
                "gpu": gpu_name,
            }
            defaults = {"budget": budget, "budget_seconds": budget_seconds, "strategy": strategy}
            for name, default in defaults.items():
                value = job.get(name, default)
                if value is not None:
                    body[name] = value
            if job.get("seed") is not None:
                body["seed"] = job["seed"]
            bodies.append(body)
        if not bodies:
            return []
        return self._request(
            "POST", "/v1/jobs/batch", json={"jobs": bodies}, headers=self._headers(token)
        )

    def job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``."""
        return self._request("GET", f"/v1/jobs/{job_id}", headers=self._headers())

    def wait(
        self, job_id: str, timeout: float | None = None, poll_s: float = 1.0
    ) -> dict[str, Any]:
        """Poll a job until it is ``done``, ``failed`` or ``cancelled``; return it. A ``done``
        job's lookups are dropped from the caches, so the next ``config`` asks the service.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in TERMINAL_STATUSES:
                if job["status"] == "done":
                    self.invalidate(job["operator"], job["dtype"], job["gpu"])
                return job
            if deadline is not None and time.monotonic() + poll_s > deadline:
                raise TimeoutError(
                    f"job {job_id} still {job['status']} after {timeout} s "
                    f"({job.get('trials_done')} trials done)"
                )
            time.sleep(poll_s)

    def invalidate(self, operator: str, dtype: Any, gpu: str | None = None) -> None:
        """Forget every cached answer for ``operator``, ``dtype`` and ``gpu`` (memory and disk).

        For the next :data:`FRESH_SECONDS` the lookups of that group ask the service past its
        own cache (which drops a replaced answer only on its next check), and a revalidation
        already on its way is not stored.
        """
        dtype_text, gpu_name = dtype_name(dtype), self._gpu_name(gpu)
        self._epoch += 1
        self._fresh_until[(operator, dtype_text, gpu_name)] = time.monotonic() + FRESH_SECONDS
        for rkey in [
            k for k in self._slots if (k[0], k[2], k[3]) == (operator, dtype_text, gpu_name)
        ]:
            slot = self._slots.pop(rkey)
            for alias in slot.aliases:
                self._memo.pop(alias, None)
        if self._disk is not None:
            self._disk.forget(operator, dtype_text, gpu_name)

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the background thread and close connections (the caches stay on disk)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._owns_http:
            self._http.close()
        if self._disk is not None:
            self._disk.close()

    def __enter__(self) -> KatoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
