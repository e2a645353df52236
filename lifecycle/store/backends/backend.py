"""The store interface: what a journal needs from the database that keeps it."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection

from lifecycle.store.backends.genericdb import GenericBackend
from lifecycle.store.backends.postgres import PostgresBackend, is_postgres, with_default_driver
from lifecycle.store.backends.sqlite import SqliteBackend
from lifecycle.store.location import parse_url, shown_location, sqlite_file, to_url


class Appender(Protocol):
    """Commits one writer's rows; the journal's hot path."""

    def insert(self, rows: list[Any], then: list[tuple[str, Any]]) -> None:
        """Insert the rows and run the `then` statements (SQL, parameters) in one transaction,
        committed when this returns."""

    def rollback(self) -> None:
        """End the transaction of an insert that failed; never raises."""

    def close(self) -> None: ...


class Backend(Protocol):
    """A kind of database a journal can be kept in.

    A backend raises journal errors of its own only for what it checks itself (files, paths);
    a database error reaches `lifecycle.store.backends.dberrors`, the one place that maps them.
    """

    @property
    def location(self) -> str:
        """Where the journal is, as messages show it (no password)."""

    @property
    def url(self) -> str:
        """The SQLAlchemy URL, password included: for connecting, never for showing."""

    def has_data(self) -> bool:
        """Whether there is a database to read: False for a new, empty one. Raises
        JournalNotFound where nothing is, NotAJournal where what is there cannot be one."""

    def prepare_write(self) -> bool:
        """Refuse, before a byte is written, a journal this process may not write; True when
        the journal is new (nothing to inspect before migrating)."""

    def read_engine(self) -> Engine:
        """An engine that never writes to the journal."""

    def write_engine(self) -> Engine:
        """An engine for appending and migrating."""

    def migration_lock(self) -> AbstractContextManager[None]:
        """Held while migrating, so that processes opening one new journal at once create
        its tables once (a file lock for SQLite, an advisory lock on a server)."""

    def keeper(self, engine: Engine) -> PoolProxiedConnection | None:
        """A connection to hold while a writable journal is open, where holding one saves
        work on the startup path; None where it would not."""

    def appender(self, conn: Connection, sql: str) -> Appender:
        """How a writer commits rows of `sql` (the compiled events INSERT) on `conn`."""


def backend_for(location: str) -> Backend:
    """The backend of a journal given as a file path or a URL; a location that is neither is
    refused in one line."""
    shown = shown_location(location)
    url = parse_url(to_url(location), shown)
    path = sqlite_file(url)
    if path is not None:
        return SqliteBackend(path, location=shown)
    if is_postgres(url):
        return PostgresBackend(with_default_driver(url), location=shown)
    return GenericBackend(url, location=shown)
