"""The state an event carries is the state its rank's journal holds when it is appended.

The launcher and `replay` fold the `state` column: a heartbeat appended after a transition but
stamped with the state before it made a rank that had stopped read as `ready` (a boot that
exited 1 with every rank ready and stopped). These tests race heartbeats from other threads
against the main thread's transitions, on SQLite and on a real PostgreSQL server, and hold
every event to the state of the transition journaled before it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lifecycle.core.format.events import StoredEvent, Transition
from lifecycle.core.format.states import State, Trigger
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.recorder import Recorder
from lifecycle.runtime.session import RankLaunch, RankSession
from lifecycle.store.journal import Journal
from lifecycle.store.runs import new_run_id, run_row
from tests.pg import PostgresServer

# Boots of a machine, each through every transition of the bounded path and the stop.
SESSIONS = 12
PATH = (Trigger.START, Trigger.WARM, Trigger.FINISH, Trigger.STOP)
BEATING_THREADS = 2
_names = itertools.count()


def stale_stamps(events: list[StoredEvent]) -> list[str]:
    """Events whose state is not the destination of the latest transition before them."""
    held = State.CREATED.value
    stale = []
    for stored in events:
        if isinstance(stored.event, Transition):
            held = stored.event.dest
        if stored.state != held:
            stale.append(f"seq {stored.seq} {stored.kind} in {stored.state!r}, journal {held!r}")
    return stale


def race_heartbeats_against_transitions(db: str) -> list[str]:
    """Move SESSIONS machines along PATH while other threads beat as fast as they can; the
    stale stamps found, over every session."""
    args = ServerArgs(model=MODEL_PRESETS["micro-video"], db=db)
    journal = Journal.open_for_write(db)
    run_ids = []
    try:
        for _ in range(SESSIONS):
            run_id = new_run_id(time.time())
            run_ids.append(run_id)
            journal.create_run(run_row(args, run_id=run_id, created_at=time.time()))
            launch = RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False)
            session = RankSession(args, launch, Recorder(journal.writer(run_id=run_id, rank=0)))
            done = threading.Event()
            beaters = [
                threading.Thread(target=_beat_until, args=(session.heartbeat.beat, done))
                for _ in range(BEATING_THREADS)
            ]
            for thread in beaters:
                thread.start()
            try:
                for trigger in PATH:
                    time.sleep(0.002)  # let the beaters take the writer between transitions
                    assert session.fire(trigger) is not State.FAILED
            finally:
                done.set()
                for thread in beaters:
                    thread.join(timeout=30)
            session.recorder.close()
    finally:
        journal.close()
    reader = Journal.open_for_read(db)
    try:
        stale = []
        for run_id in run_ids:
            events = list(reader.read(run_id=run_id, rank=0))
            assert events[-1].state == State.STOPPED.value or stale_stamps(events)
            stale.extend(stale_stamps(events))
        return stale
    finally:
        reader.close()


def _beat_until(beat: Callable[[], None], done: threading.Event) -> None:
    while not done.is_set():
        beat()


def test_heartbeats_racing_transitions_carry_the_journaled_state_on_sqlite(
    tmp_path: Path,
) -> None:
    """On a SQLite file: no event, a heartbeat from another thread included, carries a state
    other than that of the transition journaled before it, and every rank ends `stopped`."""
    assert race_heartbeats_against_transitions(str(tmp_path / "j.db")) == []


def test_heartbeats_racing_transitions_carry_the_journaled_state_on_postgres(
    postgres: PostgresServer,
) -> None:
    """The same on a real PostgreSQL server, whose slower appends widened the window in which
    a beat stamped before a transition was appended after it."""
    url = postgres.create_database(f"stamps_{next(_names)}")
    assert race_heartbeats_against_transitions(url) == []
