"""The journal: durable appends, reads through fresh connections, schema and bad files."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.core.errors import JournalConflict, JournalNotFound, NotAJournal, SchemaMismatch
from lifecycle.core.format.events import ActionStarted, StoredEvent, Transition
from lifecycle.core.format.fold import fold_run
from lifecycle.store import (
    Journal,
    RankWriter,
    RunRow,
    head_revision,
    journal_revision,
    known_revisions,
    script_revisions,
)
from tests.conftest import REPO, file_digest, make_newer_journal
from tests.strategies import rank_streams

START = Transition(trigger="start", source="created", dest="gate-check")


def new_run(journal: Journal, run_id: str, world_size: int = 1) -> None:
    journal.create_run(
        RunRow(
            run_id=run_id,
            created_at=time.time(),
            host="test-host",
            world_size=world_size,
            config={"model": "tiny-video"},
            lifecycle_version="0.1.0",
        )
    )


def append_all(journal: Journal, stored: list[StoredEvent]) -> None:
    writers = {}
    for item in stored:
        writer = writers.get(item.rank)
        if writer is None:
            writer = writers[item.rank] = journal.writer(run_id=item.run_id, rank=item.rank)
        writer.append(item.event, state=item.state, wall_time=item.wall_time, mono_ns=item.mono_ns)
    for writer in writers.values():
        writer.close()


def append_start(writer: RankWriter, *, mono_ns: int = 1) -> StoredEvent:
    """Append a rank's first event, `start` from created into gate-check, at wall time 1.0."""
    return writer.append(START, state="gate-check", wall_time=1.0, mono_ns=mono_ns)


def test_a_new_file_gets_the_tables_by_migration(tmp_path: Path) -> None:
    """Opening a missing file creates it at the head revision, in WAL mode."""
    path = tmp_path / "new.db"
    Journal.open_for_write(str(path)).close()
    assert journal_revision(str(path)) == head_revision()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "events", "alembic_version"} <= tables


def test_appended_events_are_read_back_through_a_fresh_connection(tmp_path: Path) -> None:
    """An append is committed when it returns: a new read-only journal sees it at once."""
    path = str(tmp_path / "j.db")
    journal = Journal.open_for_write(path)
    new_run(journal, "run-1")
    writer = journal.writer(run_id="run-1", rank=0)
    first = append_start(writer, mono_ns=10)
    reader = Journal.open_for_read(path)
    assert list(reader.read(run_id="run-1")) == [first]
    second = writer.append(
        ActionStarted(action="load-pipeline"), state="gate-check", wall_time=2.0, mono_ns=20
    )
    assert [e.seq for e in reader.read(run_id="run-1")] == [0, 1]
    assert list(reader.read(run_id="run-1", from_seq=1)) == [second]
    assert [r.run_id for r in reader.runs()] == ["run-1"]
    reader.close()
    journal.close()


@pytest.fixture(scope="module")
def shared_journal(tmp_path_factory: pytest.TempPathFactory) -> Journal:
    return Journal.open_for_write(str(tmp_path_factory.mktemp("fold") / "fold.db"))


_run_ids = iter(range(10**9))


@settings(max_examples=60, deadline=None)
@given(stream=rank_streams())
def test_fold_of_what_was_read_equals_fold_of_what_was_written(
    shared_journal: Journal, stream: list[StoredEvent]
) -> None:
    """fold(read(append(events))) == fold(events), for any events of several ranks."""
    run_id = f"run-{next(_run_ids)}"
    stream = [dataclasses.replace(s, run_id=run_id) for s in stream]
    new_run(shared_journal, run_id, world_size=2)
    append_all(shared_journal, stream)
    read_back = list(Journal.open_for_read(shared_journal.location).read(run_id=run_id))
    assert read_back == sorted(stream, key=lambda s: (s.rank, s.seq))
    assert fold_run(read_back) == fold_run(stream)


def test_a_second_writer_for_the_same_rank_is_refused(tmp_path: Path) -> None:
    """A writer for a (run, rank) that already has events fails at once."""
    journal = Journal.open_for_write(str(tmp_path / "j.db"))
    new_run(journal, "run-1")
    writer = journal.writer(run_id="run-1", rank=0)
    append_start(writer)
    with pytest.raises(JournalConflict):
        journal.writer(run_id="run-1", rank=0)


def test_two_racing_writers_fail_loudly_instead_of_interleaving(tmp_path: Path) -> None:
    """Two writers that both started before either appended collide on (run, rank, seq)."""
    path = str(tmp_path / "j.db")
    journal = Journal.open_for_write(path)
    new_run(journal, "run-1")
    first = journal.writer(run_id="run-1", rank=0)
    second = Journal.open_for_write(path).writer(run_id="run-1", rank=0)
    append_start(first)
    with pytest.raises(JournalConflict) as info:
        append_start(second)
    assert (info.value.run_id, info.value.rank, info.value.seq) == ("run-1", 0, 0)
    rows = list(Journal.open_for_read(path).read(run_id="run-1"))
    assert [r.seq for r in rows] == [0]


def test_an_event_for_an_unknown_run_is_refused(tmp_path: Path) -> None:
    """The foreign key keeps events from pointing at a run that was never recorded."""
    journal = Journal.open_for_write(str(tmp_path / "j.db"))
    writer = journal.writer(run_id="ghost", rank=0)
    with pytest.raises(Exception, match="FOREIGN KEY"):
        append_start(writer)


def alembic(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO,
        env={**os.environ, "LIFECYCLE_DB": str(db)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_alembic_upgrade_downgrade_upgrade_from_the_repository_root(tmp_path: Path) -> None:
    """`alembic upgrade head`, `downgrade base`, `upgrade head` all work on a fresh file, and
    the migrated schema matches the library's table definitions (`alembic check`)."""
    db = tmp_path / "alembic.db"
    for step in (("upgrade", "head"), ("downgrade", "base"), ("upgrade", "head")):
        result = alembic(*step, db=db)
        assert result.returncode == 0, result.stderr
    check = alembic("check", db=db)
    assert check.returncode == 0, check.stderr
    assert "No new upgrade operations detected" in check.stdout + check.stderr
    assert journal_revision(str(db)) == head_revision()
    Journal.open_for_read(str(db)).close()


def test_known_revisions_match_the_migration_scripts() -> None:
    """The revisions readers accept are exactly the Alembic scripts, in order."""
    assert known_revisions() == script_revisions()


def test_one_migration_head() -> None:
    """The migrations form one line with a single head."""
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "heads"], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    assert result.stdout.strip().splitlines() == [f"{head_revision()} (head)"]


BAD_FILES = {
    "text": lambda p: p.write_text("this is not a database\n"),
    "truncated": lambda p: p.write_bytes(b"SQLite format 3\x00" + b"\x10\x00" + b"\x00" * 200),
    "foreign": lambda p: sqlite3.connect(p).executescript("CREATE TABLE photos (id INTEGER);"),
    "newer": make_newer_journal,
}  # fmt: skip


@pytest.mark.parametrize("kind", list(BAD_FILES))
@pytest.mark.parametrize("mode", ["read", "write"])
def test_bad_files_are_refused_and_left_untouched(tmp_path: Path, kind: str, mode: str) -> None:
    """Text, truncated, another program's database, or a newer schema: refused with a
    JournalError, the file's bytes unchanged."""
    path = tmp_path / f"{kind}.db"
    BAD_FILES[kind](path)
    before = file_digest(path)
    opener = Journal.open_for_read if mode == "read" else Journal.open_for_write
    expected = SchemaMismatch if kind == "newer" else NotAJournal
    with pytest.raises(expected) as info:
        opener(str(path))
    assert "\n" not in str(info.value)
    assert file_digest(path) == before


def test_a_newer_revision_says_to_upgrade_lifecycle(tmp_path: Path) -> None:
    """The refusal names the revision found and what to do."""
    path = tmp_path / "newer.db"
    make_newer_journal(path, "9999_future")
    with pytest.raises(SchemaMismatch, match=r"9999_future.*newer lifecycle"):
        Journal.open_for_write(str(path))


def test_reading_needs_an_existing_non_empty_journal(tmp_path: Path) -> None:
    """Reading a missing or empty file is refused without creating anything."""
    with pytest.raises(JournalNotFound):
        Journal.open_for_read(str(tmp_path / "missing.db"))
    assert not (tmp_path / "missing.db").exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(NotAJournal, match="empty"):
        Journal.open_for_read(str(empty))
    assert empty.stat().st_size == 0


def test_reading_never_changes_the_journal_file(tmp_path: Path) -> None:
    """A read-only open and a full read leave the main file's bytes as they were."""
    path = tmp_path / "j.db"
    journal = Journal.open_for_write(str(path))
    new_run(journal, "run-1")
    writer = journal.writer(run_id="run-1", rank=0)
    append_start(writer)
    writer.close()
    journal.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = file_digest(path)
    reader = Journal.open_for_read(str(path))
    assert len(list(reader.read())) == 1
    reader.close()
    assert file_digest(path) == before


@given(rows=st.lists(st.tuples(st.text(max_size=5), st.text(max_size=30)), max_size=5))
@settings(max_examples=20, deadline=None)
def test_garbage_rows_are_shown_as_unknown_not_fatal(
    shared_journal: Journal, rows: list[tuple[str, str]]
) -> None:
    """Rows with unknown kinds or non-JSON data are read back as UnknownEvent, in order."""
    run_id = f"garbage-{next(_run_ids)}"
    new_run(shared_journal, run_id)
    path = shared_journal.location
    with sqlite3.connect(path) as conn:
        for seq, (kind, data) in enumerate(rows):
            conn.execute(
                "INSERT INTO events"
                " (run_id, rank, seq, wall_time, mono_ns, kind, version, state, data)"
                " VALUES (?, 0, ?, 1.0, 1, ?, 1, 'created', ?)",
                (run_id, seq, kind, data),
            )
    read_back = list(Journal.open_for_read(path).read(run_id=run_id))
    assert [e.seq for e in read_back] == list(range(len(rows)))


def test_the_writer_keeps_every_summary_column_current() -> None:
    """The writer updates every column of rank_summaries but its key, with every append."""
    from lifecycle.core.format.fold import RankFold
    from lifecycle.store.backends.schema import rank_summaries
    from lifecycle.store.summaries import SUMMARY_COLUMNS, summary_values

    columns = {c.name for c in rank_summaries.columns} - {"run_id", "rank"}
    assert set(SUMMARY_COLUMNS) == columns
    assert set(summary_values(RankFold(run_id="r", rank=0))) == columns
