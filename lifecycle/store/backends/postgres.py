"""The PostgreSQL backend: psycopg 3 (the `postgres` extra), and migrations under an advisory
lock, so that ranks and hosts opening one new database at once create its tables once."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from lifecycle.core.command import extra
from lifecycle.store.backends.dberrors import DATABASE_ERRORS, journal_error
from lifecycle.store.backends.genericdb import GenericBackend

# The driver a plain `postgresql://` URL gets: SQLAlchemy's own default is psycopg2.
DRIVER = "psycopg"
# One key for every lifecycle journal: migrations of different databases of one server wait on
# each other, which costs nothing (they are rare and short) and needs no name to hash.
MIGRATION_LOCK_KEY = 0x6C6966656379  # "lifecy"
EXTRA = extra("postgres")
# psycopg warns through logging when it drops a pipeline on a lost connection, and SQLAlchemy's
# pool logs the driver's traceback when it cannot close a cursor there; the store says what
# failed in its own one line, so neither note is printed beside it (with no handler of their
# own, Python's last-resort handler would write them to stderr).
for _library in ("psycopg", "sqlalchemy"):
    logging.getLogger(_library).addHandler(logging.NullHandler())


def is_postgres(url: URL) -> bool:
    return url.get_backend_name() == "postgresql"


def with_default_driver(url: URL) -> URL:
    """`postgresql://` and `postgres://` mean psycopg 3; a URL naming its driver keeps it."""
    if url.drivername in ("postgresql", "postgres"):
        return url.set(drivername=f"postgresql+{DRIVER}")
    return url


class PipelineAppender:
    """The hot path: the rows, the summary statements and the COMMIT sent in one psycopg
    pipeline, so an append waits for one round trip to the server, not one a statement."""

    def __init__(self, conn: Connection, sql: str) -> None:
        import psycopg  # there: the connection is one of its

        self._driver: Any = conn.connection.driver_connection
        self._errors: type[Exception] = psycopg.Error
        self._sql = sql

    def insert(self, rows: list[Any], then: list[tuple[str, Any]]) -> None:
        driver = self._driver
        try:
            with driver.pipeline(), driver.cursor() as cur:
                cur.executemany(self._sql, rows)
                for sql, params in then:
                    cur.execute(sql, params)
                driver.commit()
        except self._errors as exc:
            # Under SQLAlchemy's wrapper, as every other database error reaches the store's
            # one mapping (lifecycle.store.backends.dberrors).
            raise DBAPIError.instance(self._sql, None, exc, self._errors) from exc

    def rollback(self) -> None:
        # After a lost connection the rollback fails too; the write's own error is the one to
        # tell.
        with contextlib.suppress(Exception):
            self._driver.rollback()

    def close(self) -> None:
        """Nothing of its own: the writer closes the connection."""


class PostgresBackend(GenericBackend):
    """A journal in a PostgreSQL database."""

    def appender(self, conn: Connection, sql: str) -> PipelineAppender:  # type: ignore[override]
        return PipelineAppender(conn, sql)

    @contextlib.contextmanager
    def migration_lock(self) -> Iterator[None]:
        """A session-level advisory lock, held on a connection of its own while migrating."""
        engine = self.write_engine()
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
                conn.commit()
                try:
                    yield
                finally:
                    with contextlib.suppress(*DATABASE_ERRORS):
                        conn.execute(
                            text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY}
                        )
                        conn.commit()
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, writing=True) from None
        finally:
            engine.dispose()
