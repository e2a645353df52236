"""The SQLite backend: a journal file, its engines, its creation lock and its fast append."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool, PoolProxiedConnection

from lifecycle.core.errors import JournalError, JournalNotFound, NotAJournal
from lifecycle.store.location import shown_location
from lifecycle.store.regularfile import other_file_kind

SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 30.0
# A reader may hold one connection per rank at once (replay merges the streams); a small page
# cache each bounds its memory by the rank count, whatever the journal's size.
READ_CACHE_KIB = 128


def _os_reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def _stat(path: Path, location: str) -> os.stat_result | None:
    """The file's status, following links; None when there is no such file."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalError(f"{location}: cannot be opened: {_os_reason(exc)}") from None


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _check_sqlite_file(path: Path, location: str) -> bool:
    """Refuse a file that is not a SQLite database; True when it is missing or empty.

    Only a regular file can be a journal: SQLite would open a device or a FIFO and create its
    own files beside it (`/dev/null-journal`).
    """
    status = _stat(path, location)
    if status is None:
        return True
    kind = other_file_kind(status.st_mode)
    if kind is not None:
        raise NotAJournal(location=location, reason=f"not a regular file ({kind})")
    size = status.st_size
    if size == 0:
        return True
    try:
        with path.open("rb") as fh:
            header = fh.read(100)
    except OSError as exc:
        raise JournalError(f"{location}: cannot be read: {_os_reason(exc)}") from None
    if not header.startswith(SQLITE_HEADER):
        raise NotAJournal(location=location, reason="not a SQLite database")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if len(header) < 100 or page_size < 512 or size < page_size or size % page_size:
        raise NotAJournal(location=location, reason=f"truncated SQLite file ({size} bytes)")
    return False


def _check_writable(path: Path, location: str) -> None:
    """Refuse, before a byte is written, a journal this process may not write: the file, its
    directory (SQLite creates -wal and -shm there), or -wal and -shm files left read-only."""
    directory = path.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        raise JournalError(
            f"{location}: directory {shown_location(str(directory))} is not writable"
            " (a journal keeps its -wal and -shm files beside it)"
        )
    for candidate in (path, _sidecar(path, "-wal"), _sidecar(path, "-shm")):
        if candidate.exists() and not os.access(candidate, os.R_OK | os.W_OK):
            which = "" if candidate == path else f" (its {candidate.name[len(path.name) :]} file)"
            raise JournalError(f"{location}: cannot be written{which}: permission denied")


def _read_uri(path: Path) -> str:
    """How a reader opens a journal without writing anything a later writer would trip on.

    A WAL journal read with `mode=ro` needs its -wal and -shm files: SQLite creates them when
    they are missing, with the journal's permission bits, and a read-only connection leaves
    them behind. Where they would not be writable for the journal's writer (a journal whose
    owner may not write it, or one this process cannot write, or whose directory it cannot
    write) and no -wal file exists, no writer has the journal open (a writer's connection
    keeps its -wal), so nothing can be appending: the journal is opened immutable, which
    reads the main file alone and creates nothing. Where a -wal exists, a writer may be
    appending, and only `mode=ro` sees its frames.
    """
    quoted = quote(str(path))
    writable = (
        path.stat().st_mode & stat.S_IWUSR != 0
        and os.access(path, os.W_OK)
        and os.access(path.parent, os.W_OK | os.X_OK)
    )
    if writable or _sidecar(path, "-wal").exists():
        return f"file:{quoted}?mode=ro"
    return f"file:{quoted}?mode=ro&immutable=1"


def _engine(path: Path, *, write: bool) -> Engine:
    uri = f"file:{quote(str(path))}?mode=rwc" if write else _read_uri(path)

    def connect() -> sqlite3.Connection:
        # isolation_level=None: SQLAlchemy's begin hook below emits BEGIN itself, so that DDL
        # (the migrations) is transactional too.
        return sqlite3.connect(
            uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
        )

    engine = create_engine("sqlite://", creator=connect, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        if write:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
        else:
            cur.execute(f"PRAGMA cache_size=-{READ_CACHE_KIB}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front: a writer waits in the busy handler instead
        # of failing when it upgrades a read lock that another writer has overtaken.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


class SqliteAppender:
    """The hot path: one append is BEGIN IMMEDIATE, INSERT, COMMIT on the driver connection
    that SQLAlchemy opened, without the per-statement cost of its execution layer."""

    def __init__(self, conn: Connection, sql: str) -> None:
        driver = conn.connection.driver_connection
        if not isinstance(driver, sqlite3.Connection):
            raise TypeError(f"a SQLite journal's connection is {type(driver).__name__}")
        self._driver = driver
        self._cursor = driver.cursor()
        self._sql = sql

    def insert(self, rows: list[Any], then: list[tuple[str, Any]]) -> None:
        cur = self._cursor
        cur.execute("BEGIN IMMEDIATE")
        if len(rows) == 1:
            cur.execute(self._sql, rows[0])
        else:
            cur.executemany(self._sql, rows)
        for sql, params in then:
            cur.execute(sql, params)
        cur.execute("COMMIT")

    def rollback(self) -> None:
        # After a disk error the rollback may fail too; the write's own error is the one to tell.
        if self._driver.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._driver.execute("ROLLBACK")

    def close(self) -> None:
        self._cursor.close()


class SqliteBackend:
    """A journal in a SQLite file: WAL, `synchronous=NORMAL`, a busy timeout; read without
    writing a byte of it, and created under a file lock."""

    def __init__(self, path: Path, *, location: str) -> None:
        self.path = path
        self.location = location
        self.url = URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)

    def has_data(self) -> bool:
        if _stat(self.path, self.location) is None:
            raise JournalNotFound(location=self.location)
        return not _check_sqlite_file(self.path, self.location)

    def prepare_write(self) -> bool:
        parent = _stat(self.path.parent, self.location)
        if parent is None or not stat.S_ISDIR(parent.st_mode):
            raise JournalError(
                f"{self.location}: directory {shown_location(str(self.path.parent))} does not exist"
            )
        new = _check_sqlite_file(self.path, self.location)
        _check_writable(self.path, self.location)
        return new

    def read_engine(self) -> Engine:
        return _engine(self.path, write=False)

    def write_engine(self) -> Engine:
        return _engine(self.path, write=True)

    @contextlib.contextmanager
    def migration_lock(self) -> Iterator[None]:
        """Serialise journal creation between processes that open the same new file at once."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise JournalError(f"{self.location}: cannot be created: {_os_reason(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def keeper(self, engine: Engine) -> PoolProxiedConnection:
        # SQLite checkpoints and deletes the WAL when its last connection closes: short-lived
        # connections (the run row) would pay that, and the next writer would pay for a new
        # WAL, on the startup path.
        return engine.raw_connection()

    def appender(self, conn: Connection, sql: str) -> SqliteAppender:
        return SqliteAppender(conn, sql)
