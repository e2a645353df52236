"""One contract for every store backend: the same tests on a SQLite file and on a real
PostgreSQL server that the tests start themselves (tests/pg.py)."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from lifecycle.core.errors import JournalConflict, NotAJournal, SchemaMismatch
from lifecycle.core.events import ActionStarted, Heartbeat, Transition
from lifecycle.store import Journal, head_revision, journal_revision
from lifecycle.store.rows import RunRow
from tests.conftest import run_cli
from tests.pg import PASSWORD
from tests.replay.test_summaries import verdicts_agree

T0 = 1_800_000_000.0
BACKENDS = ["sqlite", "postgresql"]
_names = itertools.count()


@pytest.fixture(params=BACKENDS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty journal location of each backend."""
    if request.param == "sqlite":
        return str(tmp_path / "j.db")
    server = request.getfixturevalue("postgres")
    return str(server.create_database(f"contract_{next(_names)}"))


def _sql(location: str, statement: str) -> None:
    """Run one statement on the journal's database, as another program would."""
    if "://" not in location:
        with sqlite3.connect(location) as conn:
            conn.execute(statement)
        return
    from sqlalchemy import create_engine

    engine = create_engine(location.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(text(statement))
    engine.dispose()


def _run(run_id: str = "run-a", *, db: str = "") -> RunRow:
    return RunRow(
        run_id=run_id, created_at=T0, host="h", world_size=2, config={"db": db},
        lifecycle_version="t", command=f"lifecycle boot --db {db}",
    )  # fmt: skip


def test_a_new_journal_is_created_at_head_and_reads_back_what_was_written(location: str) -> None:
    """Tables by the migrations; a run row (without the URL's password); two ranks' events,
    read back in order, with summaries that agree with the full fold."""
    with Journal.open_for_write(location) as journal:
        assert journal.revision == head_revision()
        journal.create_run(_run(db=location))
        journal.create_run(_run(db=location))  # another rank: a no-op
        for rank in (0, 1):
            writer = journal.writer(run_id="run-a", rank=rank)
            writer.append(
                Transition(trigger="start", source="created", dest="gate-check"),
                state="gate-check", wall_time=T0 + rank, mono_ns=1,
            )  # fmt: skip
            writer.append_batch(
                [(Heartbeat(uptime_s=float(i), in_state_s=0.0, pending=None), "gate-check",
                  T0 + 2 + i, 2 + i) for i in range(70)]
            )  # fmt: skip
            writer.close()
    assert journal_revision(location) == head_revision()
    with Journal.open_for_read(location) as journal:
        (run,) = journal.runs()
        assert PASSWORD not in json.dumps(run.config) and PASSWORD not in (run.command or "")
        stored = list(journal.read(run_id="run-a"))
        assert [(e.rank, e.seq) for e in stored] == [(r, s) for r in (0, 1) for s in range(71)]
        assert {s.rank: s.last_seq for s in journal.summaries(["run-a"])} == {0: 70, 1: 70}
    verdicts_agree(location)


def test_a_second_writer_for_a_rank_is_a_conflict(location: str) -> None:
    """Two writers of one rank: the second is refused as a conflict, by either backend's
    own code for a duplicate key, never by its wording."""
    with Journal.open_for_write(location) as journal:
        journal.create_run(_run())
        first = journal.writer(run_id="run-a", rank=0)
        first.append(ActionStarted(action="x"), state="created", wall_time=T0, mono_ns=1)
        with pytest.raises(JournalConflict):
            journal.writer(run_id="run-a", rank=0)
        first.close()


def test_a_newer_or_foreign_database_is_refused_and_left_alone(location: str) -> None:
    with Journal.open_for_write(location) as journal:
        journal.create_run(_run())
    _sql(location, "UPDATE alembic_version SET version_num = '0999_future'")
    with pytest.raises(SchemaMismatch):
        Journal.open_for_write(location)
    result = run_cli("lifecycle", ["boot", "--db", location], cwd=Path.cwd(), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert PASSWORD not in result.stderr + result.stdout
    _sql(location, "DROP TABLE alembic_version")
    with pytest.raises(NotAJournal):
        Journal.open_for_write(location)


def _open(location: str, barrier: Any) -> str:
    barrier.wait(timeout=60)
    try:
        Journal.open_for_write(location).close()
    except Exception as exc:  # a failure is what this test looks for
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def test_many_processes_open_one_new_journal_at_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """8 processes open one fresh journal at the same moment, 20 times over: each time the
    tables are created once and every process opens the journal."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(8) as pool:
        barrier = manager.Barrier(8)
        for attempt in range(20):
            if backend == "sqlite":
                location = str(tmp_path / f"race{attempt}.db")
            else:
                server = request.getfixturevalue("postgres")
                location = server.create_database(f"race_{next(_names)}")
            outcomes = pool.starmap(_open, [(location, barrier)] * 8, chunksize=1)
            assert outcomes == ["ok"] * 8, outcomes
            assert journal_revision(location) == head_revision()
