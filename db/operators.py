"""User operators stored in the database: add (versioned), list, and serve to the registry.

A stored operator is a declarative definition (:class:`kernels.user.OperatorDefinition`: the
spec and its CUDA files' text), validated before it is stored; nothing is compiled here and no
Python of the user's is ever run. Workers and API processes see the stored operators through
:class:`DatabaseOperators`, a source of :mod:`kernels.registry` (:func:`use_database`), which
rereads the newest version of each name at most every few seconds.

A version hashes what decides a variant's code, launch, check and timing, not the spec's
description or ``[backward]`` section (:data:`kernels.user.spec.UNVERSIONED_FIELDS`): adding
the same version with other ones replaces them in its row, and every process rebuilds it, so
the results stored under the version stay served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kato.db.models import UserOperator
from kato.kernels import registry
from kato.kernels.spec import InvalidInput
from kato.kernels.user import OperatorDefinition, UserOperatorSpec, definition
from kato.kernels.user.backward import backward_operator
from kato.kernels.user.spec import UNVERSIONED_FIELDS
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

#: How long a process keeps its view of the stored operators before rereading it, seconds.
REFRESH_SECONDS = 5.0


@dataclass(frozen=True)
class Added:
    """What :func:`add_operator` did: the stored row's fields, and whether it is new."""

    name: str
    version: str
    created: bool
    versions: int  # versions of this name now stored
    #: The fields outside the version (description, backward) that this call replaced in the
    #: row of a version stored already; empty where it created the row or nothing differed.
    updated: tuple[str, ...] = ()


def parse_definition(data: Mapping[str, Any], where: str = "operator") -> OperatorDefinition:
    """A definition from its JSON form ``{"spec": {...}, "files": {name: text}}``.

    Raises:
        InvalidInput: what is wrong (the field and, for an expression, the part).
    """
    if not isinstance(data, Mapping) or set(data) - {"spec", "files"}:
        raise InvalidInput(f"{where}: give an object with 'spec' and 'files' only")
    return definition(data.get("spec"), data.get("files") or {}, where)


def build_spec(defn: OperatorDefinition) -> UserOperatorSpec:
    """The operator a definition describes; refuses a name already taken by an operator that
    does not come from the database (a built-in one, or one a package registers), and a
    ``[backward]`` section whose operator is not registered yet or does not fit it
    (:func:`kernels.user.backward.backward_operator`)."""
    name = defn.spec.name
    try:
        existing = registry.get_operator(name)
    except InvalidInput:
        existing = None
    if existing is not None and not getattr(existing, "stored", False):
        raise InvalidInput(
            f"operator name {name!r} is taken by a built-in or installed operator; choose another"
        )
    spec = UserOperatorSpec(defn)
    try:
        backward_operator(spec)
    except InvalidInput:
        # This process reads the stored operators at most every REFRESH_SECONDS: a backward
        # operator stored a moment ago through another API process (or a newer version of it)
        # may not be in its registry yet. Read them again before refusing.
        source = installed()
        if source is None:
            raise
        source.refresh()
        backward_operator(spec)
    spec.stored = True
    return spec


def add_operator(session: Session, defn: OperatorDefinition, token_id: str | None = None) -> Added:
    """Store ``defn`` as the newest version of its name (commits). A definition of a version
    stored already is found, not stored twice; where it differs from the stored one (in its
    description or ``[backward]`` section only: the rest is the version), it replaces it in
    that row (``Added.updated``), which stays the version it was (newest or not).

    Raises:
        InvalidInput: the name belongs to another kind of operator, or the definition is
            refused by :class:`UserOperatorSpec`.
    """
    spec = build_spec(defn)
    version = spec.version
    data = defn.model_dump(mode="json")
    row = _find(session, spec.name, version)
    created = row is None
    if row is None:
        session.add(
            UserOperator(name=spec.name, version=version, definition=data, token_id=token_id)
        )
        try:
            session.commit()
        except IntegrityError:  # the same version added at the same moment elsewhere
            session.rollback()
            created = False
            row = _find(session, spec.name, version)
    updated = () if row is None else _replace_unversioned(session, row, data)
    count = session.scalar(
        select(func.count()).select_from(UserOperator).where(UserOperator.name == spec.name)
    )
    return Added(spec.name, version, created, int(count or 0), updated)


def _replace_unversioned(
    session: Session, row: UserOperator, data: dict[str, Any]
) -> tuple[str, ...]:
    """Put ``data`` (a definition of ``row``'s version) in ``row`` where the fields outside the
    version differ (commits); those fields, by name."""
    old, new = row.definition.get("spec", {}), data["spec"]
    changed = tuple(name for name in UNVERSIONED_FIELDS if old.get(name) != new.get(name))
    if changed:
        row.definition = data
        session.commit()
    return changed


def _find(session: Session, name: str, version: str) -> UserOperator | None:
    return session.scalars(
        select(UserOperator).where(UserOperator.name == name, UserOperator.version == version)
    ).first()


def newest(session: Session) -> list[UserOperator]:
    """The newest version of every stored name, by name."""
    top = (
        select(UserOperator.name, func.max(UserOperator.id).label("id"))
        .group_by(UserOperator.name)
        .subquery()
    )
    return list(
        session.scalars(
            select(UserOperator).join(top, UserOperator.id == top.c.id).order_by(UserOperator.name)
        )
    )


def versions(session: Session, name: str) -> list[UserOperator]:
    """Every stored version of ``name``, oldest first."""
    return list(
        session.scalars(
            select(UserOperator).where(UserOperator.name == name).order_by(UserOperator.id)
        )
    )


class DatabaseOperators:
    """A :mod:`kernels.registry` source: the newest stored version of each user operator.

    Rereads the newest rows at most every ``refresh_s`` seconds and builds a spec only for a
    row it has not seen, or whose definition changed since (the same version added again with
    another description or ``[backward]`` section: :func:`add_operator`). A stored definition
    that no longer validates (a newer Kato refuses it) is logged once and left out.
    """

    def __init__(self, sessions: Callable[[], Session], refresh_s: float = REFRESH_SECONDS):
        self.sessions, self.refresh_s = sessions, refresh_s
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._specs: dict[str, UserOperatorSpec] = {}
        #: Row id -> (the definition it was built from, the spec or None where refused).
        self._built: dict[int, tuple[dict[str, Any], UserOperatorSpec | None]] = {}
        self._failing = False

    def refresh(self) -> None:
        """Reread now."""
        with self._lock:
            self._read_at = -float("inf")

    def __call__(self) -> list[UserOperatorSpec]:
        """The newest stored operators; while the database cannot be read, the last ones read
        (retried every ``refresh_s``, logged once per outage)."""
        with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                try:
                    self._read()
                    if self._failing:
                        log.info("stored operators readable again")
                    self._failing = False
                except Exception as exc:  # a database fault must not fail a lookup
                    if not self._failing:
                        log.warning("stored operators unreadable, serving the last read: %s", exc)
                    self._failing = True
                self._read_at = time.monotonic()
            return list(self._specs.values())

    def _read(self) -> None:
        with self.sessions() as session:
            rows = newest(session)
            specs: dict[str, UserOperatorSpec] = {}
            for row in rows:
                built = self._built.get(row.id)
                if built is None or built[0] != row.definition:
                    built = self._built[row.id] = (row.definition, self._build(row))
                spec = built[1]
                if spec is not None:
                    specs[row.name] = spec
        self._specs = specs

    @staticmethod
    def _build(row: UserOperator) -> UserOperatorSpec | None:
        try:
            spec = UserOperatorSpec(parse_definition(row.definition, f"stored {row.name}"))
        except InvalidInput as exc:
            log.warning("stored operator %s version %s left out: %s", row.name, row.version, exc)
            return None
        spec.stored = True
        if spec.version != row.version:
            # Kato's code changed since it was stored: the same definition, a new version.
            log.info("stored operator %s: version %s here (%s stored)", row.name, spec.version,
                     row.version)  # fmt: skip
        return spec


_installed: DatabaseOperators | None = None


def installed() -> DatabaseOperators | None:
    """The source :func:`use_database` installed in this process, if any."""
    return _installed


def use_database(sessions: Callable[[], Session]) -> DatabaseOperators:
    """Make the operators stored in this database part of this process's registry, in place
    of another database's (a process serves one database)."""
    global _installed
    if _installed is not None:
        registry.remove_source(_installed)
    _installed = DatabaseOperators(sessions)
    registry.add_source(_installed)
    return _installed
