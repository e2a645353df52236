"""The contract every journal store backend keeps, as a pytest class a backend's tests subclass.

A subclass provides two fixtures: `location`, a new, empty journal location of its backend (a
file path or a database URL), and `new_location`, a callable that makes another one each time
it is called (the race test opens twenty). `secret` is a string its locations carry that must
never be stored nor printed (a URL's password)::

    class TestMyBackend(StoreContract):
        @pytest.fixture
        def location(self, tmp_path): ...

        @pytest.fixture
        def new_location(self, tmp_path): ...

This module imports pytest only inside the tests, so that it imports where pytest is not
installed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from lifecycle.core.errors import JournalConflict, NotAJournal, SchemaMismatch
from lifecycle.core.format.checkpoint import FOLD_VERSION, restore
from lifecycle.core.format.events import ActionStarted, Heartbeat, Transition
from lifecycle.core.format.fold import RankFold
from lifecycle.store import Journal, head_revision, journal_revision
from lifecycle.store.rows import RunRow
from lifecycle.store.summaries import with_latest_heartbeat
from lifecycle.testing.journals import T0

CLI_TIMEOUT_S = 60


def run_row(run_id: str = "run-a", *, db: str = "") -> RunRow:
    """A run of two ranks whose config and command name the journal's location."""
    return RunRow(
        run_id=run_id, created_at=T0, host="h", world_size=2, config={"db": db},
        lifecycle_version="t", command=f"lifecycle boot --db {db}",
    )  # fmt: skip


def run_sql(location: str, statement: str) -> None:
    """Run one statement on the journal's database, as another program would."""
    if "://" not in location:
        with sqlite3.connect(location) as conn:
            conn.execute(statement)
        return
    from sqlalchemy import create_engine, text

    engine = create_engine(location.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(text(statement))
    engine.dispose()


def summaries_hold(location: str, run_id: str) -> None:
    """Each rank's summary row restores, with the events after its checkpoint, the view the
    full fold of the rank's events makes: what `replay runs` reads instead of every event."""
    with Journal.open_for_read(location) as journal:
        summaries = journal.summaries([run_id])
        assert summaries, f"no summary rows for {run_id}"
        for summary in summaries:
            full = RankFold(run_id=run_id, rank=summary.rank)
            for stored in journal.read(run_id=run_id, rank=summary.rank):
                full.apply(stored)
            assert summary.last_seq == full.last_seq, summary.rank
            assert summary.fold_version == FOLD_VERSION, summary.rank
            fast = restore(summary.fold)
            assert (fast.run_id, fast.rank, fast.last_seq) == (
                run_id, summary.rank, summary.fold_seq,
            )  # fmt: skip
            for stored in journal.read(
                run_id=run_id, rank=summary.rank, from_seq=fast.last_seq + 1
            ):
                fast.apply(stored)
            with_latest_heartbeat(fast, summary.last_heartbeat_wall)
            assert fast.view() == full.view(), summary.rank


def open_after(location: str, barrier: Any) -> str:
    """Open the journal for writing once every process is at the barrier; what happened."""
    barrier.wait(timeout=60)
    try:
        Journal.open_for_write(location).close()
    except Exception as exc:  # a failure is what the race test looks for
        return f"{type(exc).__name__}: {exc}"
    return "ok"


class StoreContract:
    """The store contract: subclass it with the `location` and `new_location` fixtures."""

    secret: str | None = None  # in every location, and never to be stored or printed

    def reads_the_same(self, location: str, run_id: str) -> None:
        """What a journal written through the backend must read as; a subclass may hold it
        to more (a reader of its own), calling this first."""
        summaries_hold(location, run_id)

    def test_a_new_journal_is_created_at_head_and_reads_back_what_was_written(
        self, location: str
    ) -> None:
        """Tables by the migrations; a run row (without the URL's password); two ranks' events,
        read back in order, with summaries that agree with the full fold."""
        with Journal.open_for_write(location) as journal:
            assert journal.revision == head_revision()
            journal.create_run(run_row(db=location))
            journal.create_run(run_row(db=location))  # another rank: a no-op
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
            if self.secret:
                assert self.secret not in json.dumps(run.config)
                assert self.secret not in (run.command or "")
            stored = list(journal.read(run_id="run-a"))
            assert [(e.rank, e.seq) for e in stored] == [(r, s) for r in (0, 1) for s in range(71)]
            assert {s.rank: s.last_seq for s in journal.summaries(["run-a"])} == {0: 70, 1: 70}
        self.reads_the_same(location, "run-a")

    def test_a_second_writer_for_a_rank_is_a_conflict(self, location: str) -> None:
        """Two writers of one rank: the second is refused as a conflict, by the backend's
        own code for a duplicate key, never by its wording."""
        import pytest

        with Journal.open_for_write(location) as journal:
            journal.create_run(run_row())
            first = journal.writer(run_id="run-a", rank=0)
            first.append(ActionStarted(action="x"), state="created", wall_time=T0, mono_ns=1)
            with pytest.raises(JournalConflict):
                journal.writer(run_id="run-a", rank=0)
            first.close()

    def test_a_newer_or_foreign_database_is_refused_and_left_alone(self, location: str) -> None:
        """A journal of a newer schema is refused by the library and by `lifecycle boot` (one
        line, exit 2, no password); one without the schema's table is not a journal."""
        import pytest

        with Journal.open_for_write(location) as journal:
            journal.create_run(run_row())
        run_sql(location, "UPDATE alembic_version SET version_num = '0999_future'")
        with pytest.raises(SchemaMismatch):
            Journal.open_for_write(location)
        boot = subprocess.run(
            [sys.executable, "-m", "lifecycle", "boot", "--db", location],
            capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        assert boot.returncode == 2 and len(boot.stderr.strip().splitlines()) == 1, boot.stderr
        if self.secret:
            assert self.secret not in boot.stderr + boot.stdout
        run_sql(location, "DROP TABLE alembic_version")
        with pytest.raises(NotAJournal):
            Journal.open_for_write(location)

    def test_many_processes_open_one_new_journal_at_once(
        self, new_location: Callable[[], str]
    ) -> None:
        """8 processes open one fresh journal at the same moment, 20 times over: each time the
        tables are created once and every process opens the journal."""
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager, context.Pool(8) as pool:
            barrier = manager.Barrier(8)
            for _ in range(20):
                location = new_location()
                outcomes = pool.starmap(open_after, [(location, barrier)] * 8, chunksize=1)
                assert outcomes == ["ok"] * 8, outcomes
                assert journal_revision(location) == head_revision()
