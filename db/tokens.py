"""API tokens: create, verify, revoke, list; and the per-token queue quota.

A token's secret is ``secrets.token_urlsafe(32)`` (256 random bits), shown once by ``kato token
create``; the database keeps only its SHA-256 (``kato_api_tokens.secret_sha256``, unique), so a
leaked database does not leak usable secrets. Verifying looks the token up by the hash of the
presented secret (an indexed equality on a digest, which leaks nothing useful through timing)
and compares the digests again with :func:`hmac.compare_digest`.

Functions that change state commit, like those of :mod:`db.queries`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from kato.db import ids, retry
from kato.db.models import ApiToken, Job, utcnow
from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from kato.errors import KatoError

log = logging.getLogger(__name__)

#: Secrets are prefixed so that they are recognisable in logs and secret scanners.
SECRET_PREFIX = "kato_"
#: ``last_used_at`` is written at most this often per token (reads would otherwise all write).
LAST_USED_RESOLUTION = timedelta(seconds=60)
#: Job statuses that count against a token's queue quota.
LIVE_STATUSES = ("queued", "running")


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of a token secret, as stored."""
    return hashlib.sha256(secret.encode("utf-8", errors="surrogatepass")).hexdigest()


def create_token(
    session: Session, name: str, *, max_queued_jobs: int | None = None, admin: bool = False
) -> tuple[ApiToken, str]:
    """Create a token and commit; return the row and the secret (shown once, never stored).

    ``max_queued_jobs``: most queued + running jobs the token may have at once (``None``: the
    service's ``max_queued_jobs`` setting). ``admin``: the token may cancel any job, not only
    its own and tokenless ones. Raises ``ValueError`` for an empty name, one that is not
    printable text (``str.isprintable``) or a non-positive limit.
    """
    name = name.strip()
    if not name or len(name) > 255:
        raise ValueError("a token name must be 1 to 255 characters")
    if not name.isprintable():
        # Names are printed (kato token list, API errors): no escape sequences, no NUL.
        raise ValueError(
            f"a token name must be printable text, without control or invisible characters; "
            f"got {name[:100]!r}"
        )
    if max_queued_jobs is not None and not 1 <= max_queued_jobs <= 2**31 - 1:
        raise ValueError(f"max_queued_jobs must be at least 1, got {max_queued_jobs}")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(
        name=name,
        secret_sha256=hash_secret(secret),
        max_queued_jobs=max_queued_jobs,
        admin=admin,
    )
    session.add(token)
    session.commit()
    return token, secret


def find_token(session: Session, secret: str) -> ApiToken | None:
    """The token whose secret this is (revoked or not), or ``None``. Reads only."""
    if not secret or len(secret) > 512:
        return None
    digest = hash_secret(secret)
    token = session.scalars(select(ApiToken).where(ApiToken.secret_sha256 == digest)).first()
    if token is None or not hmac.compare_digest(token.secret_sha256, digest):
        return None
    return token


@dataclass(frozen=True)
class Verified:
    """The outcome of :func:`verify_token`: ``token`` is ``None`` for an unknown secret."""

    token: ApiToken | None

    @property
    def ok(self) -> bool:
        return self.token is not None and self.token.revoked_at is None

    @property
    def revoked(self) -> bool:
        return self.token is not None and self.token.revoked_at is not None


def verify_token(session: Session, secret: str, *, touch: bool = True) -> Verified:
    """Check a presented secret (reads only, in ``session``). For a live token and ``touch``,
    record ``last_used_at`` as a best effort (:func:`touch_last_used`): a database that
    cannot take the write does not fail the check."""
    token = find_token(session, secret)
    if token is not None and token.revoked_at is None and touch:
        touch_last_used(session.get_bind(), token.id, token.last_used_at)
    return Verified(token)


#: When this process last tried, and failed or is still trying, to record each token's use
#: (``time.monotonic``): a database that refuses the write (read-only) is not asked again on
#: every request, nor by every request that arrives while a try runs.
_touch_tries: dict[str, float] = {}
_touch_lock = threading.Lock()


def touch_last_used(
    bind: Engine | Connection, token_id: str, last_used_at: datetime | None
) -> bool:
    """Set the token's ``last_used_at`` to now, at most once per :data:`LAST_USED_RESOLUTION`
    (by the stored value and by this process's last try), on a connection of its own, without
    waiting for a lock another transaction holds (SQLite's write lock, the token's row under a
    submission). Best effort: a fault of the database (read-only, busy, unreachable:
    :func:`db.retry.is_transient`) is swallowed, so that an authenticated read works on a
    database that takes no writes. Whether the time was recorded."""
    if last_used_at is not None and utcnow() - last_used_at < LAST_USED_RESOLUTION:
        return False
    now = time.monotonic()
    with _touch_lock:
        if now - _touch_tries.get(token_id, -math.inf) < LAST_USED_RESOLUTION.total_seconds():
            return False
        _touch_tries[token_id] = now
        if len(_touch_tries) > 10_000:  # forget the oldest: a bound, not a leak
            for stale in sorted(_touch_tries, key=_touch_tries.__getitem__)[:5_000]:
                del _touch_tries[stale]
    engine = bind.engine if isinstance(bind, Connection) else bind
    try:
        with engine.connect() as connection:
            dialect = connection.dialect.name
            if dialect == "postgresql":
                connection.exec_driver_sql("SET LOCAL lock_timeout = 100")
            elif dialect == "sqlite":
                busy = connection.exec_driver_sql("PRAGMA busy_timeout").scalar()
                connection.exec_driver_sql("PRAGMA busy_timeout = 0")
            try:
                connection.execute(
                    update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=utcnow())
                )
                connection.commit()
            finally:
                if dialect == "sqlite":
                    connection.rollback()
                    connection.exec_driver_sql(f"PRAGMA busy_timeout = {int(busy or 0)}")
    except SQLAlchemyError as error:
        if not retry.is_transient(error):
            raise
        log.debug("token %s: last_used_at not recorded: %s", token_id, retry.describe(error))
        return False
    with _touch_lock:  # recorded: the stored time throttles from now on
        _touch_tries.pop(token_id, None)
    return True


def mark_used(session: Session, token_id: str) -> None:
    """Set ``last_used_at`` to now, without committing.

    As the first write of a transaction it also serialises the token's writers: PostgreSQL locks
    the token's row, SQLite takes the database's write lock. :func:`check_quota` relies on it.
    """
    session.execute(
        update(ApiToken)
        .where(ApiToken.id == token_id)
        .values(last_used_at=utcnow())
        .execution_options(synchronize_session=False)
    )


#: A token id that matches no token (:class:`db.ids.UnknownId`).
UnknownTokenId = ids.UnknownId
#: A token id prefix that starts several ids (:class:`db.ids.AmbiguousId`).
AmbiguousTokenId = ids.AmbiguousId
MIN_ID_PREFIX = ids.MIN_ID_PREFIX


def find_by_id(session: Session, given: str) -> ApiToken:
    """The token with id ``given``, or whose id is the only one starting with it
    (:func:`db.ids.find_by_id`: case-insensitive, a listing's ellipsis dropped). Reads only.

    Raises:
        UnknownTokenId: no such id or prefix, or a prefix shorter than :data:`MIN_ID_PREFIX`.
        AmbiguousTokenId: the prefix starts several ids.
    """
    return ids.find_by_id(session, ApiToken, given, what="token")


def revoke_token(session: Session, token_id: str) -> ApiToken | None:
    """Revoke a token and commit (already revoked: unchanged); ``None`` if there is no such id.

    The row stays, so that the jobs it submitted keep their owner.
    """
    token = session.get(ApiToken, token_id)
    if token is None:
        return None
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return token


def list_tokens(session: Session) -> list[ApiToken]:
    """Every token, oldest first (revoked ones included)."""
    return list(session.scalars(select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)))


def count_tokens(session: Session, *, live_only: bool = True) -> int:
    """How many tokens exist (by default: not revoked)."""
    stmt = select(func.count()).select_from(ApiToken)
    if live_only:
        stmt = stmt.where(ApiToken.revoked_at.is_(None))
    return int(session.scalar(stmt) or 0)


def live_jobs(session: Session, token_id: str) -> int:
    """Queued + running jobs submitted with this token."""
    stmt = (
        select(func.count())
        .select_from(Job)
        .where(Job.token_id == token_id, Job.status.in_(LIVE_STATUSES))
    )
    return int(session.scalar(stmt) or 0)


@dataclass(frozen=True)
class QuotaExceeded(KatoError):
    """Submitting ``adding`` more jobs would take the token past ``limit`` live jobs."""

    live: int
    adding: int
    limit: int

    def __str__(self) -> str:
        return (
            f"this token has {self.live} queued or running job(s) and may have at most "
            f"{self.limit}; submitting {self.adding} more would exceed that: wait for some to "
            "finish or cancel some"
        )


def check_quota(session: Session, token: ApiToken, adding: int, default_limit: int) -> None:
    """Raise :class:`QuotaExceeded` if ``adding`` jobs do not fit the token's quota.

    Call it in the transaction that then inserts the jobs: it first writes the token's row
    (:func:`mark_used`), which serialises concurrent submissions of the same token (PostgreSQL:
    row lock; SQLite: write lock) until that transaction commits or rolls back, so two requests
    cannot both take the last free place. On :class:`QuotaExceeded` the caller rolls back.
    """
    limit = token.max_queued_jobs or default_limit
    mark_used(session, token.id)
    live = live_jobs(session, token.id)
    if live + adding > limit:
        raise QuotaExceeded(live=live, adding=adding, limit=limit)
