"""Finding a row by its id or by a unique prefix of it, as git finds a commit: what ``kato token
revoke`` and ``kato cancel`` take, so that an id copied from a listing (cut short, or with the
listing's ellipsis) works. Ids are uuid4 hex strings of 32 characters."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from kato.errors import KatoError

#: Shortest prefix :func:`find_by_id` takes for a whole id.
MIN_ID_PREFIX = 4
#: Anything but hex matches no id (and never reaches a LIKE pattern).
_HEX = frozenset("0123456789abcdef")

_Row = TypeVar("_Row")


class UnknownId(KatoError, LookupError):
    """No row has this id, nor an id starting with it."""

    def __str__(self) -> str:
        return str(self.args[0])


class AmbiguousId(KatoError, LookupError):
    """Several rows' ids start with this prefix (``candidates``, sorted)."""

    def __init__(self, prefix: str, candidates: tuple[str, ...], what: str = "row") -> None:
        super().__init__(prefix, candidates)
        self.prefix, self.candidates, self.what = prefix, candidates, what

    def __str__(self) -> str:
        return (
            f"{self.what} id prefix {self.prefix!r} is ambiguous: it starts "
            f"{', '.join(self.candidates)}; give more of the id"
        )


def find_by_id(session: Session, model: type[_Row], given: str, *, what: str) -> _Row:
    """The ``model`` row with id ``given``, or whose id is the only one starting with it. Reads
    only. ``given`` is taken case-insensitively, without surrounding blanks or a trailing
    ellipsis (``…`` or ``...``); ``what`` names the row in messages ("token", "job").

    Raises:
        UnknownId: no such id or prefix, or a prefix shorter than :data:`MIN_ID_PREFIX`.
        AmbiguousId: the prefix starts several ids.
    """
    text = given.strip().removesuffix("…").removesuffix("...").strip().lower()
    exact = session.get(model, text) if 0 < len(text) <= 32 and "\x00" not in text else None
    if exact is not None:
        return exact
    if not text or len(text) > 32 or not set(text) <= _HEX:
        raise UnknownId(f"no {what} with id {given[:64]!r}")
    if len(text) < MIN_ID_PREFIX:
        raise UnknownId(
            f"no {what} with id {given!r}; a prefix must be at least {MIN_ID_PREFIX} characters"
        )
    column: Any = model.id  # type: ignore[attr-defined]
    found = list(
        session.scalars(select(model).where(column.startswith(text)).order_by(column).limit(11))
    )
    if not found:
        raise UnknownId(f"no {what} with id {given!r}")
    if len(found) > 1:
        raise AmbiguousId(text, tuple(row.id for row in found), what)  # type: ignore[attr-defined]
    return found[0]
