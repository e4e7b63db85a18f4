"""Alembic environment for Kato's tables.

Run two ways:

- from code, by :func:`db.session.upgrade_to_head`, which passes an open connection in
  ``config.attributes["connection"]`` (no ini file, logging left alone);
- from the command line, ``alembic -c db/alembic.ini ...``, which connects to ``sqlalchemy.url``
  from the ini file or else ``KATO_DB_URL`` / the default SQLite file.

The database may also hold Optuna's tables (``studies``, ``trials``, ``alembic_version``, ...):
autogenerate only looks at tables in our metadata, and our version table is
``kato_alembic_version``.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from kato.db.models import Base
from kato.db.session import VERSION_TABLE, default_db_url, include_name, make_engine
from sqlalchemy import Connection

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTER via table copies
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return

    if config.config_file_name is not None:
        fileConfig(config.config_file_name)
    url = config.get_main_option("sqlalchemy.url") or default_db_url()
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


def run_migrations_offline() -> None:
    url = config.get_main_option("sqlalchemy.url") or default_db_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
