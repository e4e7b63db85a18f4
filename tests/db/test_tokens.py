"""API tokens in the database (SQLite and PostgreSQL): the admin flag and its migration, and
finding a token by a unique prefix of its id."""

from __future__ import annotations

import pytest
from alembic import command
from kato.db import tokens
from kato.db.models import ApiToken
from kato.db.session import (
    alembic_config,
    current_revision,
    head_revision,
    init_db,
    make_engine,
    session_factory,
)
from sqlalchemy import Engine, text, update
from sqlalchemy.orm import Session


def test_admin_column_migrates_existing_tokens_as_ordinary(db_url: str) -> None:
    """A database at 0003 holding a token: after the upgrade it is there, not an admin."""
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "0003")
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO kato_api_tokens (id, name, secret_sha256, created_at)"
                    " VALUES ('t1', 'old', 'digest', '2026-01-01 00:00:00')"
                )
            )
        init_db(engine)
        assert current_revision(engine) == head_revision()
        with session_factory(engine)() as session:
            (token,) = tokens.list_tokens(session)
            assert (token.id, token.admin) == ("t1", False)
            made, _ = tokens.create_token(session, "ops", admin=True)
            assert session.get(ApiToken, made.id).admin is True
    finally:
        engine.dispose()


def _with_id(session: Session, name: str, token_id: str) -> None:
    token, _ = tokens.create_token(session, name)
    session.execute(update(ApiToken).where(ApiToken.id == token.id).values(id=token_id))
    session.commit()


A, B = "abcd1111" + "0" * 24, "abcd2222" + "0" * 24


def test_find_by_id_or_unique_prefix(session: Session, engine: Engine) -> None:
    _with_id(session, "a", A)
    _with_id(session, "b", B)
    assert tokens.find_by_id(session, A).name == "a"
    assert tokens.find_by_id(session, "ABCD2").name == "b"
    assert tokens.find_by_id(session, f"  {B[:12]}…  ").name == "b"
    with pytest.raises(tokens.AmbiguousTokenId) as ambiguous:
        tokens.find_by_id(session, "abcd")
    assert ambiguous.value.candidates == (A, B)
    assert "ambiguous" in str(ambiguous.value) and A in str(ambiguous.value)
    for unknown in ("ffff", "abcd3", "ab%d", "abc_", "x" * 40, "", "\x00abc"):
        with pytest.raises(tokens.UnknownTokenId):
            tokens.find_by_id(session, unknown)
    with pytest.raises(tokens.UnknownTokenId, match="at least 4"):
        tokens.find_by_id(session, "abc")
