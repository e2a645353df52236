"""The generic backend: any database SQLAlchemy reaches by URL, through SQLAlchemy alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool, PoolProxiedConnection

from lifecycle.store.backends.dberrors import engine_error


class StatementAppender:
    """Appends through SQLAlchemy's connection: one driver-level INSERT, then COMMIT."""

    def __init__(self, conn: Connection, sql: str) -> None:
        self._conn = conn
        self._sql = sql

    def insert(self, rows: list[Any], then: list[tuple[str, Any]]) -> None:
        self._conn.exec_driver_sql(self._sql, rows if len(rows) > 1 else rows[0])
        for sql, params in then:
            self._conn.exec_driver_sql(sql, params)
        self._conn.commit()

    def rollback(self) -> None:
        # After a lost connection the rollback fails too; the write's own error is the one to
        # tell.
        with contextlib.suppress(SQLAlchemyError):
            self._conn.rollback()

    def close(self) -> None:
        """Nothing of its own: the writer closes the connection."""


class GenericBackend:
    """A journal in a database named by URL. Nothing is known of it before connecting, and
    its migrations are not serialised between processes (a server backend adds a lock)."""

    def __init__(self, url: URL, *, location: str) -> None:
        self._parsed = url
        self.location = location
        self.url = url.render_as_string(hide_password=False)

    def has_data(self) -> bool:
        return True

    def prepare_write(self) -> bool:
        return False

    def _engine(self) -> Engine:
        try:
            return create_engine(self._parsed, poolclass=NullPool)
        except (SQLAlchemyError, ImportError) as exc:
            raise engine_error(exc, self.location, self._parsed.drivername) from None

    def read_engine(self) -> Engine:
        return self._engine()

    def write_engine(self) -> Engine:
        return self._engine()

    @contextlib.contextmanager
    def migration_lock(self) -> Iterator[None]:
        yield

    def keeper(self, engine: Engine) -> PoolProxiedConnection | None:
        return None

    def appender(self, conn: Connection, sql: str) -> StatementAppender:
        return StatementAppender(conn, sql)
