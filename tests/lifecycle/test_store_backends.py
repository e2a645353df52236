"""The store contract: every backend appends gapless, reads back, and refuses a second writer."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from lifecycle.core.errors import JournalConflict, JournalError
from lifecycle.core.format.events import ActionStarted, Event, Transition
from lifecycle.store import Journal, RunRow, head_revision, to_url
from lifecycle.store.backends.backend import Backend, backend_for
from lifecycle.store.backends.genericdb import GenericBackend

# The SQLite file through its own backend, and the same file through the generic one, which
# is what a database without a backend of its own gets.
BACKENDS: dict[str, Callable[[Path], Backend]] = {
    "sqlite": lambda path: backend_for(str(path)),
    "generic": lambda path: GenericBackend(make_url(to_url(str(path))), location=str(path)),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A journal with one run, reached through the backend under test."""
    path = tmp_path / "j.db"
    with Journal.open_for_write(str(path)) as journal:
        journal.create_run(
            RunRow(run_id="run-1", created_at=time.time(), host="h", world_size=2, config={},
                   lifecycle_version="0.1.0")
        )  # fmt: skip
    return BACKENDS[request.param](path)


@pytest.fixture
def journal(backend: Backend) -> Iterator[Journal]:
    engine = backend.write_engine()
    opened = Journal(
        backend=backend,
        engine=engine,
        writable=True,
        revision=head_revision(),
        keeper=backend.keeper(engine),
    )
    yield opened
    opened.close()


def read_back(backend: Backend) -> list[tuple[int, int, Event]]:
    reader = Journal(
        backend=backend, engine=backend.read_engine(), writable=False, revision=head_revision()
    )
    rows = [(e.rank, e.seq, e.event) for e in reader.read(run_id="run-1")]
    reader.close()
    return rows


def test_appends_of_two_ranks_read_back_gapless(backend: Backend, journal: Journal) -> None:
    """Appends and batch appends of two ranks read back in (rank, seq) order, from 0."""
    start = Transition(trigger="start", source="created", dest="gate-check")
    writers = [journal.writer(run_id="run-1", rank=rank) for rank in (0, 1)]
    for rank, writer in enumerate(writers):
        writer.append(start, state="gate-check", wall_time=1.0, mono_ns=1)
        writer.append_batch(
            [(ActionStarted(action=f"load-{rank}-{i}"), "gate-check", 2.0, 2) for i in range(3)]
        )
        assert writer.next_seq == 4
        writer.close()
    assert read_back(backend) == [
        (rank, seq, start if seq == 0 else ActionStarted(action=f"load-{rank}-{seq - 1}"))
        for rank in (0, 1)
        for seq in range(4)
    ]


def test_a_racing_second_writer_is_a_conflict(backend: Backend, journal: Journal) -> None:
    """Two writers of one rank that both started before either appended: the second append
    is a JournalConflict at seq 0, and only the first event is kept."""
    first = journal.writer(run_id="run-1", rank=0)
    second = journal.writer(run_id="run-1", rank=0)
    event = ActionStarted(action="load-pipeline")
    first.append(event, state="created", wall_time=1.0, mono_ns=1)
    with pytest.raises(JournalConflict) as info:
        second.append(event, state="created", wall_time=1.0, mono_ns=1)
    assert (info.value.rank, info.value.seq) == (0, 0)
    first.close()
    second.close()
    assert read_back(backend) == [(0, 0, event)]


def test_a_refused_batch_leaves_nothing_and_the_writer_goes_on(
    backend: Backend, journal: Journal, tmp_path: Path
) -> None:
    """A batch of which one row is refused is written not at all; the writer appends the
    next batch at the same sequence number."""
    with sqlite3.connect(tmp_path / "j.db") as conn:
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.data LIKE '%refused%'"
            " BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
        )
    writer = journal.writer(run_id="run-1", rank=0)
    actions = ["a", "refused", "c"]
    with pytest.raises(JournalError, match="refused by a trigger"):
        writer.append_batch([(ActionStarted(action=a), "created", 1.0, 1) for a in actions])
    assert read_back(backend) == []
    writer.append(ActionStarted(action="d"), state="created", wall_time=1.0, mono_ns=1)
    writer.close()
    assert read_back(backend) == [(0, 0, ActionStarted(action="d"))]
