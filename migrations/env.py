"""Alembic environment: migrates the journal with the library's own table metadata."""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, create_engine
from sqlalchemy.pool import NullPool

from lifecycle.store.backends.schema import metadata
from lifecycle.store.location import to_url

config = context.config
target_metadata = metadata

if config.config_file_name is not None and not config.attributes.get("connection"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    """LIFECYCLE_DB (a path or a URL) when set, else alembic.ini's sqlalchemy.url."""
    from_env = os.environ.get("LIFECYCLE_DB")
    if from_env:
        return to_url(from_env)
    return config.get_main_option("sqlalchemy.url") or to_url("lifecycle.db")


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite alters tables by copy-and-move
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # The library passes its own connection so that a migration and its checks share one lock.
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = create_engine(_url(), poolclass=NullPool)
    with engine.connect() as conn:
        _configure(conn)
        conn.commit()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
