"""Store errors are mapped by the database's error code, never by the words of its message."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.pool import NullPool

from lifecycle.core.errors import (
    JournalConflict,
    JournalError,
    JournalNotFound,
    JournalWriteFailed,
    NotAJournal,
)
from lifecycle.core.format.events import ActionStarted
from lifecycle.store import Journal, RankWriter, RunRow, to_url
from lifecycle.store.backends.dberrors import append_error, is_retryable, journal_error
from tests.conftest import file_digest

EVENT_ROW = (
    "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state, data)"
    " VALUES ('run-1', 0, 0, 1.0, 1, 'action_started', 1, 'created', '{}')"
)


def journal_with_run(path: Path) -> Journal:
    journal = Journal.open_for_write(str(path))
    journal.create_run(
        RunRow(run_id="run-1", created_at=time.time(), host="h", world_size=1, config={},
               lifecycle_version="0.1.0")
    )  # fmt: skip
    return journal


def append(writer: RankWriter, action: str) -> None:
    writer.append(ActionStarted(action=action), state="created", wall_time=1.0, mono_ns=1)


def append_until_it_fails(writer: RankWriter) -> None:
    for _ in range(100):
        append(writer, "x" * 2000)


def duplicate_key_error(path: Path) -> sqlite3.IntegrityError:
    """The error SQLite raises for a second event at the same (run, rank, seq) of a journal."""
    journal_with_run(path).close()
    conn = sqlite3.connect(path)
    conn.execute(EVENT_ROW)
    with pytest.raises(sqlite3.IntegrityError) as info:
        conn.execute(EVENT_ROW)
    conn.close()
    return info.value


def reworded(exc: sqlite3.Error, message: str) -> sqlite3.Error:
    """The same SQLite error, code and all, in other words (SQLite itself speaks English only)."""
    other = type(exc)(message)
    other.sqlite_errorcode = exc.sqlite_errorcode
    other.sqlite_errorname = exc.sqlite_errorname
    return other


def test_a_duplicate_event_is_a_conflict_because_of_its_constraint_code(tmp_path: Path) -> None:
    """A real primary-key violation on a journal file is a JournalConflict, whether its
    message is SQLite's English or any other words."""
    exc = duplicate_key_error(tmp_path / "j.db")
    assert exc.sqlite_errorcode == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY
    for error in (exc, reworded(exc, "Eindeutigkeitsbedingung verletzt: events")):
        mapped = append_error(error, location="j.db", run_id="run-1", rank=0, seq=0)
        assert isinstance(mapped, JournalConflict)
        assert (mapped.run_id, mapped.rank, mapped.seq) == ("run-1", 0, 0)


def test_a_duplicate_through_sqlalchemy_is_a_conflict_too(tmp_path: Path) -> None:
    """The same violation raised through SQLAlchemy's wrapper maps the same way."""
    path = tmp_path / "j.db"
    journal_with_run(path).close()
    engine = create_engine(to_url(str(path)), poolclass=NullPool)
    with engine.connect() as conn:
        conn.execute(text(EVENT_ROW))
        with pytest.raises(IntegrityError) as info:
            conn.execute(text(EVENT_ROW))
    engine.dispose()
    mapped = append_error(info.value, location="j.db", run_id="run-1", rank=0, seq=0)
    assert isinstance(mapped, JournalConflict)


def test_a_constraint_whose_message_says_unique_is_not_a_conflict(tmp_path: Path) -> None:
    """A trigger that aborts with the words of a unique violation is a refused event, not a
    second writer: the writer says so and goes on appending."""
    path = tmp_path / "j.db"
    journal = journal_with_run(path)
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.data LIKE '%refused%'"
            " BEGIN SELECT RAISE(ABORT, 'UNIQUE constraint failed: events.seq'); END"
        )
    writer = journal.writer(run_id="run-1", rank=0)
    with pytest.raises(JournalError) as info:
        append(writer, "refused")
    assert not isinstance(info.value, JournalConflict | JournalWriteFailed)
    append(writer, "accepted")
    writer.close()
    journal.close()
    reader = Journal.open_for_read(str(path))
    assert [(e.seq, e.event) for e in reader.read()] == [(0, ActionStarted(action="accepted"))]
    reader.close()


def test_a_full_database_fails_the_write_and_stops_the_writer(tmp_path: Path) -> None:
    """SQLITE_FULL on append is a JournalWriteFailed, and the writer refuses every later
    append; what was committed before reads back gapless."""
    path = tmp_path / "j.db"
    journal = journal_with_run(path)
    with sqlite3.connect(path) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]

    @event.listens_for(journal.engine, "connect")
    def _nearly_full(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count={pages + 2}")

    writer = journal.writer(run_id="run-1", rank=0)
    with pytest.raises(JournalWriteFailed) as info:
        append_until_it_fails(writer)
    assert str(info.value) == f"journal {path} could not be written: database or disk is full"
    written = writer.next_seq
    with pytest.raises(JournalWriteFailed):
        append(writer, "small")
    writer.close()
    journal.close()
    reader = Journal.open_for_read(str(path))
    assert [e.seq for e in reader.read()] == list(range(written))
    reader.close()


def test_a_real_full_database_error_is_a_write_failure_only_while_writing(tmp_path: Path) -> None:
    """SQLITE_FULL from a real file is a failed write while writing, and a plain journal
    error (bad input, exit 2) while opening or reading."""
    conn = sqlite3.connect(tmp_path / "full.db")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA max_page_count=2")
    with pytest.raises(sqlite3.OperationalError) as info:
        conn.execute("INSERT INTO t VALUES (zeroblob(100000))")
    conn.close()
    assert info.value.sqlite_errorcode == sqlite3.SQLITE_FULL
    assert isinstance(journal_error(info.value, "j.db", writing=True), JournalWriteFailed)
    assert type(journal_error(info.value, "j.db")) is JournalError


def test_a_corrupt_journal_is_not_a_journal_and_is_left_untouched(tmp_path: Path) -> None:
    """Pages of garbage under a valid header: SQLITE_CORRUPT or SQLITE_NOTADB on reading
    is NotAJournal, for a reader and a writer, and the file keeps its bytes."""
    path = tmp_path / "j.db"
    journal_with_run(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = bytes((i * 7 + 3) % 256 for i in range(page, len(data)))
    path.write_bytes(bytes(data))
    before = file_digest(path)
    for opener in (Journal.open_for_read, Journal.open_for_write):
        with pytest.raises(NotAJournal, match="corrupt"):
            opener(str(path))
    assert file_digest(path) == before


class Psycopg3Error(Exception):
    """A DB-API error shaped as psycopg 3 raises it, for a server that cannot run here."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class Psycopg2Error(Exception):
    """A DB-API error shaped as psycopg2 raises it: the SQLSTATE in `pgcode`."""

    def __init__(self, message: str, pgcode: str) -> None:
        super().__init__(message)
        self.pgcode = pgcode


def server_error(sqlstate: str, *, psycopg2: bool = False) -> DBAPIError:
    message = "Fehler: etwas ist schiefgegangen (UNIQUE constraint failed, disk is full)"
    orig = Psycopg2Error(message, sqlstate) if psycopg2 else Psycopg3Error(message, sqlstate)
    return OperationalError("INSERT INTO events ...", None, orig)


@pytest.mark.parametrize("psycopg2", [False, True])
@pytest.mark.parametrize(
    ("sqlstate", "while_writing", "expected"),
    [
        ("23505", JournalConflict, JournalError),  # unique_violation
        ("23503", JournalError, JournalError),  # foreign_key_violation
        ("53100", JournalWriteFailed, JournalError),  # disk_full
        ("08006", JournalWriteFailed, JournalError),  # connection_failure
        ("3D000", JournalWriteFailed, JournalNotFound),  # invalid_catalog_name
        ("XX001", NotAJournal, NotAJournal),  # data_corrupted
        ("28P01", JournalWriteFailed, JournalError),  # invalid_password
    ],
)
def test_a_server_error_is_mapped_by_its_sqlstate(
    sqlstate: str, while_writing: type, expected: type, psycopg2: bool
) -> None:
    """An error from a database server maps by its SQLSTATE (psycopg 3 `sqlstate` or
    psycopg2 `pgcode`), whatever its message says."""
    exc = server_error(sqlstate, psycopg2=psycopg2)
    appended = append_error(exc, location="db", run_id="run-1", rank=0, seq=3)
    assert type(appended) is while_writing
    assert type(journal_error(exc, "db")) is expected
    assert "\n" not in str(appended)


@pytest.mark.parametrize(
    ("sqlstate", "retryable"),
    [("40001", True), ("40P01", True), ("23505", False), ("53100", False)],
)
def test_serialisation_failures_and_deadlocks_are_retried(sqlstate: str, retryable: bool) -> None:
    """A serialisation failure or a deadlock may succeed when run again; nothing else is."""
    assert is_retryable(server_error(sqlstate)) is retryable


def test_a_locked_sqlite_database_is_retried(tmp_path: Path) -> None:
    """SQLITE_BUSY, as a real second connection raises it while another holds the write lock,
    may succeed when run again."""
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as info:
        other.execute("BEGIN IMMEDIATE")
    holder.execute("ROLLBACK")
    holder.close()
    other.close()
    assert info.value.sqlite_errorcode == sqlite3.SQLITE_BUSY
    assert is_retryable(info.value)
