"""Journal migrations: older journals with data in them upgrade without losing an event."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command

from lifecycle.store import Journal, head_revision, journal_revision, known_revisions, to_url
from lifecycle.store.backends.revisions import alembic_config
from tests.conftest import Completed, file_digest

EARLIER = known_revisions()[:-1]


def journal_at(path: Path, revision: str, *, runs: int = 2, events: int = 50) -> list[tuple]:  # type: ignore[type-arg]
    """A journal migrated to `revision` and filled through that revision's own columns."""
    command.upgrade(alembic_config(to_url(str(path))), revision)
    rows = []
    with sqlite3.connect(path) as conn:
        for r in range(runs):
            run_id = f"old-run-{r}"
            conn.execute(
                "INSERT INTO runs (run_id, created_at, host, world_size, config, lifecycle_version)"
                " VALUES (?, ?, 'h', 2, ?, '0.0.9')",
                (run_id, 1.8e9 + r, json.dumps({"calibrate": False})),
            )
            for rank in (0, 1):
                for seq in range(events):
                    row = (run_id, rank, seq, 1.8e9 + r + seq / 10, seq, "transition", 1,
                           "gate-check", json.dumps({"trigger": "start", "source": "created",
                                                     "dest": "gate-check"}))  # fmt: skip
                    conn.execute(
                        "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind,"
                        " version, state, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        row,
                    )
                    rows.append(row)
    return rows


def all_events(path: Path) -> list[tuple]:  # type: ignore[type-arg]
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT run_id, rank, seq, wall_time, mono_ns, kind, version, state, data FROM events"
            " ORDER BY run_id, rank, seq"
        ).fetchall()


@pytest.mark.parametrize("revision", EARLIER)
def test_upgrading_from_every_earlier_revision_keeps_every_event(
    tmp_path: Path, revision: str, lifecycle_cli: Callable[..., Completed]
) -> None:
    """`lifecycle db upgrade` migrates a journal with data to head; every event is there,
    unchanged, and it reads and appends again."""
    db = tmp_path / "old.db"
    rows = journal_at(db, revision)
    result = lifecycle_cli("db", "upgrade", "--db", str(db), timeout=60)
    assert result.returncode == 0, result.stderr
    assert journal_revision(str(db)) == head_revision()
    assert all_events(db) == sorted(rows)
    journal = Journal.open_for_read(str(db))
    assert [r.command for r in journal.runs()] == [None, None]
    assert len(list(journal.read())) == len(rows)


@pytest.mark.parametrize("revision", EARLIER)
def test_downgrade_then_upgrade_round_trips(tmp_path: Path, revision: str) -> None:
    """From head down to an earlier revision and back, the events are unchanged."""
    db = tmp_path / "j.db"
    rows = journal_at(db, known_revisions()[0])
    config = alembic_config(to_url(str(db)))
    command.upgrade(config, "head")
    command.downgrade(config, revision)
    assert journal_revision(str(db)) == revision
    command.upgrade(config, "head")
    assert all_events(db) == sorted(rows)


@pytest.mark.parametrize("revision", EARLIER)
def test_lifecycle_refuses_an_older_journal_until_asked_to_upgrade(
    tmp_path: Path, revision: str, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Booting onto an older journal is one line saying how to upgrade, exit 2, the file
    unchanged; replay still reads it as it is."""
    db = tmp_path / "old.db"
    journal_at(db, revision, runs=1, events=3)
    before = file_digest(db)
    result = lifecycle_cli("boot", "--model", "micro-video", "--db", str(db), timeout=60)
    assert result.returncode == 2
    assert f"lifecycle db upgrade --db {db}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert file_digest(db) == before
    journal = Journal.open_for_read(str(db))
    assert journal.revision == revision
    assert [r.run_id for r in journal.runs()] == ["old-run-0"]
    journal.close()
    assert file_digest(db) == before


def test_a_new_journal_records_the_launch_command(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The run row keeps the command line that launched it, as a shell would take it back."""
    result = lifecycle_cli("boot", "--model", "micro-video", "--db", "j.db", "--seed", "7")
    assert result.returncode == 0, result.stderr
    (run,) = Journal.open_for_read(str(tmp_path / "j.db")).runs()
    assert run.command == "lifecycle boot --model micro-video --db j.db --seed 7"
